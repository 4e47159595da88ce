"""Rendering templates into Triton modules, and the on-disk module cache."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fa2tune.config.types import Variant
from fa2tune.kernels import codegen

ROOT = Path(__file__).resolve().parent.parent
# Every variant the launcher can ask for: a banded mask carries causality itself, packed sequences are ragged.
ALL_FWD_VARIANTS = [
    v
    for v in (Variant(*flags) for flags in itertools.product([False, True], repeat=6))
    if not (v.banded and v.causal) and not (v.varlen and (v.even_m or v.even_n))
]


@pytest.mark.parametrize("variant", ALL_FWD_VARIANTS, ids=repr)
def test_every_variant_renders_valid_python(variant):
    source = codegen.render("fwd", variant)
    compile(source, f"<{variant}>", "exec")
    assert f"template_hash: {codegen.template_hash('fwd')}" in source
    assert ("Bottom-right causal" in source) == variant.causal
    assert ("lo, full_lo, full_hi, hi = _tile_ranges(" in source) == variant.banded
    assert ("q_start, N_Q = _sequence_rows(CU_Q, off_b, TOTAL_Q, N_Q)" in source) == variant.varlen
    assert ("a.to(tl.float32)" in source) == variant.dot_fp32
    assert "{{" not in source and "{%" not in source


def test_structure_switches_change_the_code():
    sources = {codegen.render("fwd", v) for v in ALL_FWD_VARIANTS}
    assert len(sources) == len(ALL_FWD_VARIANTS)
    even = codegen.render("fwd", Variant(causal=False, even_m=True, even_n=True))
    assert "MASKED=True" not in even and even.count("_attn_fwd_inner(") == 2  # definition + one loop
    banded = codegen.render("fwd", Variant(causal=False, even_m=True, even_n=True, banded=True))
    assert banded.count("_attn_fwd_inner(") == 6  # prefix (unmasked, masked) + band (masked, unmasked, masked)


@pytest.mark.parametrize("variant", [v for v in ALL_FWD_VARIANTS if not v.dot_fp32], ids=repr)
def test_every_backward_variant_renders_valid_python(variant):
    source = codegen.render("bwd", variant)
    compile(source, f"<bwd {variant}>", "exec")
    assert "{{" not in source and "{%" not in source
    # packed: both kernels bound the offsets (_sequence_rows) by the totals they take
    assert source.count("key_start, N_K = _sequence_rows(CU_K, off_b, TOTAL_K, N_K)") == 2 * variant.varlen


def test_templates_cite_no_version_log():
    # Template comments say why in the present tense; the history of a choice is in git, not in "docs/PERF.md vNN" tags.
    for path in sorted(codegen.templates_dir().glob("*.jinja")):
        assert not re.search(r"PERF\.md|\bv\d+\b", path.read_text()), path.name


def test_bad_arguments():
    expected = r"template must be one of \('fwd', 'bwd', 'fwd_ws', 'bwd_ws', 'bwd_dq_ws', 'decode'\), got 'bwdx'"
    with pytest.raises(ValueError, match=expected):
        codegen.render("bwdx", Variant(False, True, True))
    with pytest.raises(TypeError, match=r"variant must be a dataclass instance, got dict"):
        codegen.render("fwd", {"causal": True})


def test_modules_are_written_once_by_content_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CACHE_DIR", str(tmp_path))
    variant = Variant(causal=True, even_m=False, even_n=True)
    first = codegen.write_module("fwd", variant)
    assert first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert codegen.write_module("fwd", variant) == first and first.stat().st_mtime_ns == mtime
    assert first.read_text() == codegen.render("fwd", variant)
    other = codegen.write_module("fwd", Variant(causal=False, even_m=False, even_n=True))
    assert other != first


def test_a_damaged_module_file_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CACHE_DIR", str(tmp_path))
    variant = Variant(causal=True, even_m=True, even_n=False)
    path = codegen.write_module("fwd", variant)
    for damage in (path.read_bytes()[:300], b"\xff\xfe not python"):  # truncated; not text
        path.write_bytes(damage)
        assert codegen.write_module("fwd", variant) == path
        assert path.read_text() == codegen.render("fwd", variant)


def test_load_imports_a_module_with_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CACHE_DIR", str(tmp_path))
    variant = Variant(causal=False, even_m=True, even_n=False, dot_fp32=True)
    module = codegen.load("fwd", variant)
    assert hasattr(module, "_attn_fwd") and codegen.load("fwd", variant) is module


def _write_in_child(cache: str) -> str:
    import os

    os.environ["FA2TUNE_CACHE_DIR"] = cache
    from fa2tune.kernels import codegen as child_codegen

    paths = {child_codegen.write_module("fwd", v) for v in ALL_FWD_VARIANTS for _ in range(3)}
    return ",".join(sorted(map(str, paths)))


def test_processes_rendering_at_once_leave_whole_files(tmp_path):
    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(_write_in_child, [str(tmp_path)] * 4)
    assert len(set(results)) == 1
    files = sorted((tmp_path / "kernels").iterdir())
    assert len(files) == len(ALL_FWD_VARIANTS)  # no temporary files left behind
    assert all(path.name.startswith("fwd_") and path.suffix == ".py" for path in files)
    rendered = {codegen.render("fwd", v) for v in ALL_FWD_VARIANTS}
    assert {f.read_text() for f in files} == rendered


def test_non_editable_install_renders_templates(tmp_path):
    # The templates live at the top of the repo; a wheel must carry them inside the package.
    target = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = (
        "import fa2tune.kernels.codegen as c, fa2tune.config.types as t; "
        "src = c.render('fwd', t.Variant(True, False, False)); "
        "print(c.templates_dir()); print('def _attn_fwd(' in src)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.split()
    assert Path(out[0]).is_relative_to(target) and out[1] == "True"


def test_an_entry_goes_stale_only_when_its_own_code_changes(tmp_path, monkeypatch):
    # On a copy of the templates: editing bwd.py.jinja leaves forward entries fresh; a new switch that is off for
    # an entry leaves it fresh; a change to the code it runs (here, in the shared _common) stales it.
    import shutil

    copy = tmp_path / "templates"
    shutil.copytree(codegen.templates_dir(), copy)
    monkeypatch.setattr(codegen, "templates_dir", lambda: copy)

    def hashes():
        for cached in (codegen.code_hash, codegen.template_hash, codegen._environment):
            cached.cache_clear()
        codegen._modules.clear()
        return codegen.code_hash("fwd", causal=True), codegen.code_hash("bwd_dq", causal=True)

    def edit(name, old, new):
        text = (copy / name).read_text()
        assert old in text
        (copy / name).write_text(text.replace(old, new, 1))

    try:
        fwd, bwd = hashes()
        fwd_varlen = codegen.code_hash("fwd", causal=True, varlen=True)
        edit("bwd.py.jinja", "    dq = dq * scale\n", "    dq = dq * scale  # a comment: no code changes\n")
        assert hashes() == (fwd, bwd)
        edit("bwd.py.jinja", "    dq = dq * scale  # a comment: no code changes\n", "    dq = scale * dq\n")
        assert hashes()[0] == fwd and hashes()[1] != bwd
        edit(
            "fwd.py.jinja",
            "    seen = l_i > 0.0\n",
            "{%- if varlen and causal %}\n    pass\n{%- endif %}\n    seen = l_i > 0.0\n",
        )
        assert hashes()[0] == fwd  # on for causal+varlen entries only: the plain causal entry's code is the same
        assert codegen.code_hash("fwd", causal=True, varlen=True) != fwd_varlen
        edit("_common.py.jinja", "    aligned = rows + shift\n", "    aligned = shift + rows\n")
        assert hashes()[0] != fwd
    finally:
        monkeypatch.undo()
        for cached in (codegen.code_hash, codegen.template_hash, codegen._environment):
            cached.cache_clear()
        codegen._modules.clear()


_VECTOR_PROBE = """
import json, re, sys, torch
from fa2tune.tune import probe
from fa2tune.config.types import KernelConfig
out = []
for kernel, config in (("fwd", "128,64,8,3"), ("bwd_dkdv", "32,64,4,3"), ("bwd_dq", "128,64,8,3")):
    report = probe.compile_config(kernel, KernelConfig.parse(config), int(sys.argv[1]), torch.bfloat16)
    out.append(re.findall(r"\\b(?:LDG|STG)\\.E[.\\w]*", probe.cuobjdump(report.cubin, "-sass")))
print(json.dumps(out))
"""


@pytest.mark.parametrize("head_dim", [72, 40])
def test_the_triton_kernels_move_rows_of_a_head_dim_of_8_mod_16_as_16_byte_vectors(head_dim):
    # A contiguous call at d=72 has rows 72 elements apart. Triton's JIT proves an int argument's alignment only when
    # it is divisible by 16, so without the strides in units (layout.in_units, _macros.jinja's strides_in_units)
    # each thread moved its rows one 16-bit element at a time (LDG.E.U16, STG.E.U16: 8x the instructions). Compiled
    # for sm_90 as a call of that head dim passes its strides (probe.compile_config), every global load and store of
    # Q, K, V, dO and the outputs is a 128-bit one, as at d=64.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _VECTOR_PROBE, str(head_dim)], env=env, capture_output=True,
                         text=True, timeout=600, cwd=str(codegen.templates_dir().parent))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for kernel, ops in zip(("fwd", "bwd_dkdv", "bwd_dq"), json.loads(out.stdout.splitlines()[-1]), strict=True):
        assert not [op for op in ops if op.endswith(("U16", ".16"))], (kernel, sorted(set(ops)))
        assert "LDG.E.128" in ops and "STG.E.128" in ops, (kernel, sorted(set(ops)))
