"""Where a tune writes — its config file and its trials' storage — checked writable before any timing, and the line
an interrupted tune ends with, saying what was written and what the storage keeps."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

from .arguments import sqlite_path
from .common import INTERRUPTED, end_progress_line, fail


def write_problem(path: Path, created: list[Path], lock: Path | None = None) -> str | None:
    """Why the file at `path` cannot be written, or None; its directory is created if missing (each directory
    made appended to `created`). Tried, not guessed: a directory under a file, a read-only or virtual file system
    (/proc) or missing permissions show only when written to. lock: the lock file the writer opens beside it."""
    directory = path.parent
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    if missing and missing[-1].parent.exists() and not missing[-1].parent.is_dir():
        return f"{missing[-1].parent} is a file, not a directory"
    if not missing and not directory.is_dir():
        return f"{directory} is a file, not a directory"
    try:
        for made in reversed(missing):
            made.mkdir()
            created.append(made)
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".fa2tune-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot create or write in {directory} ({exc.strerror or exc})"
    if path.exists() and not path.is_file():
        return f"{path} is a {'directory' if path.is_dir() else 'special file'}, not a file"
    try:
        path.open("rb").close() if path.exists() else None
    except OSError as exc:  # a tune merges its entries into the file: one it cannot read would lose the others
        return f"cannot read {path} ({exc.strerror or exc})"
    if lock is not None and lock.exists():
        if not lock.is_file():
            return f"{lock} is a {'directory' if lock.is_dir() else 'special file'}, not the file the writer locks"
        try:
            lock.open("a").close()
        except OSError as exc:
            return f"cannot open {lock}, the file the writer locks ({exc.strerror or exc})"
    return None


def config_destination(config_dir: str | None) -> tuple[Path, str]:
    """(the directory a tune writes <gpu>.yaml to, how messages name it): --config-dir as given; without it the
    first directory calls search (store.config_dirs) — $FA2TUNE_CONFIG_DIR where it is set, whose entries would
    otherwise hide what the tune writes, else the user cache. An empty --config-dir (an unset variable) exits 2."""
    from ..config import store

    if config_dir is not None:
        if not config_dir.strip():
            fail("--config-dir: an empty path (an unset variable?); name a directory, or leave the flag out")
        return Path(config_dir), "--config-dir"
    named = store.env_config_dir()  # not config_dirs(): it warns of a directory the tune is about to create
    return (named, "$FA2TUNE_CONFIG_DIR") if named is not None else (store.user_config_dir(), "--config-dir")


def check_writable(config_dir: Path, target: Path, storage: str | None, source: str = "--config-dir") -> None:
    """Exits with a one-line reason, before any timing, if the tune could not write its entries or its trials;
    the directories the check made are removed then (nothing is left of a command that did nothing). source: where
    config_dir came from, as the message names it (the flag, or $FA2TUNE_CONFIG_DIR)."""
    from ..config import store

    created: list[Path] = []
    written = store.written_file(target)
    problem = write_problem(written, created, store.lock_path(written))
    said = f"{source} {config_dir}: {problem}" if problem else None
    local = storage_file(storage) if storage is not None and not said else None
    if local is not None and (problem := write_problem(local, created) or _storage_problem(storage, local)):
        said = f"--storage {storage}: {problem}"
    if said:
        for made in reversed(created):
            with contextlib.suppress(OSError):  # something else wrote in it meanwhile: it stays
                made.rmdir()
        fail(said)


def _storage_problem(storage: str, local: Path) -> str | None:
    from ..tune import study_storage

    return study_storage.existing_file_problem(storage, local)


def storage_file(storage: str) -> Path | None:
    """The local file a --storage value names (a journal file, a SQLite database), or None (a database server)."""
    if "://" not in storage:
        return Path(storage)
    return sqlite_path(storage) if storage.startswith("sqlite") else None


def trials_kept(storage: str | None, names: set[str]) -> int | None:
    """How many timed trials of the studies `names` the storage holds; None if it cannot say."""
    if storage is None or ((local := storage_file(storage)) is not None and not local.exists()):
        return 0  # opening a file that is not there would create it: nothing was kept
    import optuna

    from ..tune import study_storage

    try:
        opened = study_storage.open_storage(storage)
        complete = (optuna.trial.TrialState.COMPLETE,)
        return sum(
            len(optuna.load_study(study_name=s.study_name, storage=opened).get_trials(deepcopy=False, states=complete))
            for s in optuna.get_all_study_summaries(opened, include_best_trial=False)
            if s.study_name in names
        )
    except Exception:  # interrupted while it was written, a server gone: say less rather than fail here
        return None


def interrupted(entries: int, path: Path | None, storage: str | None, names: set[str]) -> int:
    """The one line Ctrl-C ends a tune with: what was written, and what its storage keeps."""
    said = [f"{entries} entr{'y' if entries == 1 else 'ies'} written to {path}" if entries else "nothing written"]
    kept = trials_kept(storage, names)
    if storage is not None and kept != 0:
        trials = f"{kept} timed trial{'' if kept == 1 else 's'}" if kept is not None else "the trials timed so far"
        said.append(f"{trials} kept in {storage} (the same command reuses them)")
    end_progress_line()
    print(f"fa2tune: interrupted; {'; '.join(said)}", file=sys.stderr)
    return INTERRUPTED
