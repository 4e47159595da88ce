"""The values the command's options take, each checked as argparse parses it: a bad one is a one-line usage error."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

# The shortest --timeout a study can use: its first config takes seconds to build and time on a GPU (~2 s to
# compile, 1-2 s to time at the default lengths), so below this a study would time nothing but its default.
MIN_TIMEOUT_S = 10.0
# A tune without --timeout shares this many seconds among its studies (at least MIN_TIMEOUT_S each), so `fa2tune
# tune --kernel all` — six studies — finishes in about five minutes on one GPU; the finish of each study (its best
# configs re-timed, the float64 check) runs past its share.
RUN_BUDGET_S = 240.0

# --storage: an Optuna database URL of one of these SQLAlchemy dialects (dialect+driver allowed), or a journal
# file named by one of these suffixes. A bare word is neither: taken for a journal file, `--storage foo` would
# silently make ./foo.
STORAGE_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
JOURNAL_SUFFIXES = (".journal", ".log")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_name(text: str) -> str:
    """--device of check and show: cpu, cuda or cuda:N (whether it exists is common.resolve_device's to say)."""
    name = text.strip()
    if not _DEVICE.fullmatch(name):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return name


def device_names(text: str) -> list[str]:
    """--device of tune: 'all', or one device or several, comma-separated. Several are one worker each on one
    study: the same GPU twice would time two configs at once on it (each reading slowed by the other), and cpu
    beside a GPU would share one study between the interpreter's timings and the GPU's."""
    if text.strip() == "all":
        return ["all"]
    names = [device_name(part) for part in text.split(",")]
    gpus = [int(name.partition(":")[2] or 0) for name in names if name != "cpu"]
    if gpus and len(gpus) != len(names):
        raise argparse.ArgumentTypeError(f"cpu and CUDA devices cannot share a tune, got {text!r}")
    if len(set(gpus)) != len(gpus):
        why = "two workers on one GPU slow each other's timings"
        raise argparse.ArgumentTypeError(f"each GPU at most once ({why}), got {text!r}")
    return names


def positive_int(text: str) -> int:
    """--trials, --tokens, --jobs: a count, at least one."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """--seqlen of bench: comma-separated counts, each at least one."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def head_dims(text: str) -> tuple[int, ...]:
    """--head-dim of bench: comma-separated head dims, each as head_dim takes it."""
    return tuple(head_dim(part) for part in text.split(","))


def modes(text: str) -> tuple[str, ...]:
    """--mode of bench: fwd, fwd+bwd, or both comma-separated."""
    from ..bench.shapes import MODES

    values = tuple(part.strip() for part in text.split(","))
    if not all(value in MODES for value in values):
        raise argparse.ArgumentTypeError(f"expected {' or '.join(MODES)} (comma-separated for both), got {text!r}")
    return values


def provider_names(text: str) -> tuple[str, ...]:
    """--providers of bench: names of fa2tune.bench's providers, comma-separated."""
    from ..bench import PROVIDER_NAMES

    values = tuple(part.strip() for part in text.split(","))
    unknown = [value for value in values if value not in PROVIDER_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(PROVIDER_NAMES)}, got {', '.join(unknown)}")
    return values


def timeout(text: str) -> float:
    """--timeout: seconds per study, finite and at least MIN_TIMEOUT_S."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected seconds >= {MIN_TIMEOUT_S:g} (a study's first config takes seconds to build and time), "
            f"got {text!r}"
        )
    return value


def storage(text: str) -> str:
    """--storage: a database URL (STORAGE_DIALECTS) or a journal file path (JOURNAL_SUFFIXES), nothing else."""
    expected = (f"expected a database URL (sqlite:///PATH, postgresql://..., mysql://..., ...) or a journal file "
                f"path ending in {' or '.join(JOURNAL_SUFFIXES)}, got {text!r}")  # fmt: skip
    scheme, url, _ = text.partition("://")
    if url:
        if scheme.split("+")[0].lower() not in STORAGE_DIALECTS:
            raise argparse.ArgumentTypeError(f"{expected}: unknown scheme {scheme!r}")
        if scheme.startswith("sqlite") and sqlite_path(text) is None:
            raise argparse.ArgumentTypeError(f"{text!r} is an in-memory database, which keeps nothing: name a file")
        return text
    if re.match(r"[A-Za-z][\w+.-]+:", text):  # sqlite:/t.db: a URL without its "//" (a drive letter C: is a path)
        raise argparse.ArgumentTypeError(f"{expected}: a URL needs '://'")
    if not text.endswith(JOURNAL_SUFFIXES):
        raise argparse.ArgumentTypeError(expected)
    return text


def sqlite_path(url: str) -> Path | None:
    """The file of a sqlite:///PATH URL (sqlite:////abs for an absolute one); None for an in-memory database."""
    path = url.partition("://")[2][1:].partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


def window(text: str) -> tuple[int, int]:
    from ..config.inputs import check_window

    try:
        return check_window(tuple(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT with ints >= -1, got {text!r} ({exc})") from None


def head_dim(text: str) -> int:
    from ..config.types import MAX_HEAD_DIM

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..{MAX_HEAD_DIM}, got {text!r}") from None
    if not 1 <= value <= MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_HEAD_DIM}, got {value}")
    return value


def known_gpus() -> list[str]:
    from ..config.device import KNOWN_GPUS

    return sorted(KNOWN_GPUS)


def study_timeout(timeout: float | None, studies: int) -> float:
    """Seconds each of `studies` studies may time configs in: --timeout if given, else its share of RUN_BUDGET_S."""
    if timeout is not None:
        return timeout
    return max(MIN_TIMEOUT_S, RUN_BUDGET_S / max(1, studies))
