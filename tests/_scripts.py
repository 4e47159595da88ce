"""Loads a script of scripts/ as a module, for the tests of what it computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, imported under `name` (scripts/ is not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
