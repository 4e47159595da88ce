"""The autotuner.

- tuner: `tune(Target, measure, Options)`, one Optuna study, in parts: search_space, strategy, cost, finish (with
  records, the types they share, and study_trials, a shared study's bookkeeping);
- job: a study on one device, from a StudySpec to a store entry; workers: one worker process per GPU;
  study_storage: the Optuna storages processes share; processes: where helper processes come from;
  compile_pool: the processes that compile configs ahead of their timing;
- timing (do_bench readings, FLOPs) and workload (inputs, runs, the objective): what is measured;
- verification and reference: a winner's check against the float64 reference; probe: a config compiled offline,
  what the compiler allocates (the planner's model checked against it).

The benchmark against other implementations is fa2tune.bench, which uses timing and workload from here.

Importing this package imports nothing heavy: `fa2tune tune` starts its helper processes before torch is loaded.
"""
