"""The length buckets of tuned configs: which calls an entry of each bucket serves. The one rule the store's lookup,
the API, the tuner's jobs and the CLI share.

"all" serves every length; "short" (optional) serves calls whose longer side, max(seqlen_q, seqlen_k), is at most
SHORT_SEQLEN — there a tile grid of a few programs per head and the masked diagonal tiles weigh more, and the best
config can differ from the long-sequence one (docs/TUNING.md); "medium" (optional) serves SHORT_SEQLEN < length <=
MEDIUM_SEQLEN: the "all" entry is tuned where the longest of its lengths weighs most, and at N = 2k a causal d=64
forward ran 20 % slower with it than with the best config there.
"""

from __future__ import annotations

SEQLEN_BUCKETS = ("all", "short", "medium")
SHORT_SEQLEN = 1024
MEDIUM_SEQLEN = 4096
# The lengths each bucket serves, lowest excluded: (lowest, highest].
BUCKET_RANGES = {"short": (0, SHORT_SEQLEN), "medium": (SHORT_SEQLEN, MEDIUM_SEQLEN)}
# The lengths a study of each bucket is timed at by default (`fa2tune tune --seqlens`), each one the bucket serves.
TUNING_LENGTHS = {"all": (1024, 4096, 16384), "short": (512, 1024), "medium": (2048, 4096)}
TUNING_TOKENS = 16384  # batch·N of each tuning length by default (`fa2tune tune --tokens`)


def bucket_of(seqlen: int | None) -> str:
    """The length bucket of a call whose longer side is `seqlen` (None: unknown, "all")."""
    if seqlen is not None:
        for bucket, (low, high) in BUCKET_RANGES.items():
            if low < seqlen <= high:
                return bucket
    return "all"


def buckets_for(seqlen: int | None) -> tuple[str, ...]:
    """The buckets a call of this length looks up, in order: its own, then "all"."""
    bucket = bucket_of(seqlen)
    return (bucket, "all") if bucket != "all" else ("all",)


def longest(bucket: str) -> int | None:
    """The longest length `bucket` serves (None for "all": no bound): a length whose lookup finds its entry."""
    return BUCKET_RANGES[bucket][1] if bucket in BUCKET_RANGES else None
