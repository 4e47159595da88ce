"""Loads a script of scripts/ as a module, for the tests of what it computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, imported under `name` (scripts/ is not a package).

    scripts/ goes on sys.path, as it is when a script of it runs, so that a script may import another."""
    folder = Path(__file__).resolve().parent.parent / "scripts"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module
