"""Where fa2tune keeps files of its own on the user's machine (torch-free: the CLI reads it before importing torch)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """fa2tune's cache folder of `kind` ("kernels": rendered modules, "configs": tuned configs):
    $XDG_CACHE_HOME/fa2tune/<kind>, else ~/.cache/fa2tune/<kind>."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fa2tune" / kind
