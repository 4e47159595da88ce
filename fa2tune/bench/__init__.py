"""The side-by-side benchmark behind `fa2tune bench`: fa2tune against PyTorch's SDPA backends, FlexAttention and
flash_attn where installed, on the same inputs, each checked against a reference before it is timed.

- shapes: a Sweep of axes (flags or a preset) expanded into Shapes; torch-free, for the command line's checks;
- providers: what is compared, each import-guarded;
- measure: the rows of a list of shapes (median ms and TFLOP/s by the standard FLOP count), progress logged;
- report: CSV rows, geomean ratios, merging and medians of runs; plots: the PNGs (matplotlib, optional).

It sits on top of api and tune (timing and inputs); only cli imports it. Importing this package imports nothing.
"""

# providers.PROVIDERS' names, here so that the command line can list them without importing torch
PROVIDER_NAMES = ("fa2tune", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex", "flash_attn",
                  "flash_attn_cute")  # fmt: skip
