"""The autotuner: timing, the Optuna study, tuning jobs and their worker processes, verification of winners.

Importing this package imports nothing heavy: `fa2tune tune` starts its helper processes before torch is loaded.
"""
