"""What pyproject.toml promises agrees with the code: one version, every package shipped, the license, and the
version pins that the interpreter's rule and the Gluon kernels' Triton ask for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fa2tune
from fa2tune.cli.common import INTERPRETER_NUMPY_LIMITS
from fa2tune.config import planner

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _pin(requirements: list[str], name: str) -> str:
    (spec,) = [r.removeprefix(name) for r in requirements if re.match(rf"{name}\b(?![-_])", r)]
    return spec


def test_the_version_is_written_once_and_the_changelog_has_it():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fa2tune.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", fa2tune.__version__)
    assert f"\n## {fa2tune.__version__}\n" in (ROOT / "docs" / "CHANGELOG.md").read_text()


def test_every_package_ships_and_the_license_with_them():
    packages = {".".join(p.relative_to(ROOT).parts[:-1]) for p in (ROOT / "fa2tune").rglob("__init__.py")}
    assert packages <= set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


def test_numpy_is_pinned_where_the_interpreter_needs_it_and_only_there():
    # Triton 3.6's interpreter fails on numpy 2.4 (INTERPRETER_NUMPY_LIMITS, which `--device cpu` checks): the cpu
    # and test extras pin numpy below it; the dependencies do not, so a GPU user's numpy is theirs to choose.
    below = ".".join(map(str, INTERPRETER_NUMPY_LIMITS[(3, 6)]))
    extras = PROJECT["optional-dependencies"]
    assert _pin(extras["cpu"], "numpy") == f"<{below}" and _pin(extras["test"], "numpy") == f"<{below}"
    assert not any(r.startswith("numpy") for r in PROJECT["dependencies"])


def test_the_triton_range_holds_the_one_the_gluon_kernels_need():
    spec = _pin(PROJECT["dependencies"], "triton")
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", spec).groups()
    for prefix in planner.WS_TRITONS:
        needed = tuple(int(x) for x in prefix.strip(".").split("."))
        assert tuple(map(int, low.split("."))) <= needed < tuple(map(int, high.split(".")))
