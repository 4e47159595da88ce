"""The entry audit (fa2tune.tune.audit, scripts/audit_entries.py): each entry timed against what its calls would run
without it, at its tune's lengths, the ones behind marked — here with a measure whose times the test sets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fa2tune.api import attention_kernel, selection
from fa2tune.config import defaults, store
from fa2tune.config.decode_config import DecodeConfig
from fa2tune.config.types import KernelConfig
from fa2tune.kernels import codegen
from fa2tune.tune import audit

from ._scripts import load_script

DEVICE = {"name": "Triton interpreter (CPU)", "slug": "cpu-interpreter"}
SLOW, FAST, OTHER = KernelConfig(64, 32, 4, 2), KernelConfig(16, 16, 4, 1), KernelConfig(32, 16, 4, 1)
FALLBACK = defaults.INTERPRETER_CONFIG  # the planner's default on the interpreter, what a call without an entry runs


def _entry(kernel="fwd", causal=False, cfg=SLOW, bucket="all", window=False, head_dim=64, dtype="fp32",
           template_hash=None, heads=None):  # fmt: skip
    key = store.EntryKey(head_dim=head_dim, dtype=dtype, causal=causal, kernel=kernel, seqlen_bucket=bucket,
                         window=window, gqa=heads is not None and heads[1] < heads[0])  # fmt: skip
    return store.Entry(key=key, config=cfg, ms=1.0, tflops=None, baseline={"name": "planner-default"}, trials=3,
                       spread=0.01, triton_version="3.6.0", torch_version="2.13.0",
                       template_hash=template_hash or codegen.entry_code_hash(key, cfg), date="2026-12-06",
                       heads=heads)  # fmt: skip


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    (tmp_path / "env").mkdir(exist_ok=True)  # a missing $FA2TUNE_CONFIG_DIR is warned of
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    attention_kernel.clear_cache()
    selection.clear_cache()
    store._warned.clear()
    yield tmp_path / "audited.yaml"
    attention_kernel.clear_cache()


class _Clock:
    """A measure_factory whose objective returns set times per config (ms, summed over lengths as the tuner's is),
    recording what each measure was built for; an Exception as a config's time is raised."""

    def __init__(self, times: dict, inputs_fail: Exception | None = None):
        self.times, self.built, self.timed, self.inputs_fail = times, [], [], inputs_fail

    def __call__(self, kernel, head_dim, dtype, causal, *, seqlens, device, varlen, with_forward, heads=None):
        if self.inputs_fail is not None:
            raise self.inputs_fail
        self.built.append(dict(kernel=kernel, head_dim=head_dim, dtype=dtype, causal=causal.causal, seqlens=seqlens,
                               device=device, with_forward=with_forward, heads=heads))  # fmt: skip

        def measure(cfg):
            self.timed.append(cfg)
            value = self.times[cfg]
            if isinstance(value, Exception):
                raise value
            return value

        return measure


def _by_key(rows):
    return {(r.key.head_dim, r.key.kernel, r.key.dtype, r.key.causal, r.key.window, r.key.seqlen_bucket): r
            for r in rows}  # fmt: skip


def test_an_entry_slower_than_its_fallback_is_marked_for_a_re_tune(config_file):
    # the plain forward's entry (SLOW) is 10 % behind the default; the causal one (FAST) ahead of it; a band-mask and
    # a decode entry are not timed, and a dK/dV entry of the short bucket is timed inside the training call at the
    # short lengths, as its tune times it
    decode = store.Entry(key=store.EntryKey(head_dim=64, dtype="bf16", causal=False, kernel="decode"),
                         config=DecodeConfig(), ms=0.2, tflops=None, baseline={"name": "planner-default"}, trials=3,
                         spread=0.01, triton_version="3.6.0", torch_version="2.13.0",
                         template_hash=codegen.decode_code_hash(), date="2026-12-06", gbps=1.0)  # fmt: skip
    store.write_entries(config_file, DEVICE, [
        _entry(), _entry(causal=True, cfg=FAST), _entry(window=True), _entry("bwd_dkdv", bucket="short", cfg=FAST),
        decode,
    ])  # fmt: skip
    clock = _Clock({SLOW: 1.1, FAST: 0.9, FALLBACK: 1.0})
    shown = []
    rows = audit.audit(config_file, "cpu", measure_factory=clock, on_row=shown.append, rounds=3)
    assert shown == rows and len(rows) == 5
    rows = _by_key(rows)
    plain, causal = rows[64, "fwd", "fp32", False, False, "all"], rows[64, "fwd", "fp32", True, False, "all"]
    window, short = rows[64, "fwd", "fp32", False, True, "all"], rows[64, "bwd_dkdv", "fp32", False, False, "short"]
    assert plain.fallback == FALLBACK and plain.fallback_source == selection.PLANNER_DEFAULT
    assert plain.ratio == pytest.approx(1.1) and plain.behind(0.03) and not plain.behind(0.2)
    assert causal.ratio == pytest.approx(0.9) and not causal.behind(0.0)
    assert window.ratio is None and "window" in window.note and not window.behind(0.0)
    assert rows[64, "decode", "bf16", False, False, "all"].note.startswith("skipped: a decode entry")
    assert short.ratio == pytest.approx(0.9)
    assert clock.timed.count(SLOW) == 3 and len(clock.timed) == 3 * 2 * 3  # three rows timed, both configs, 3 rounds
    built = {b["kernel"]: b for b in clock.built}
    assert sorted(b["seqlens"] for b in clock.built) == [(512, 1024), (1024, 4096, 16384), (1024, 4096, 16384)]
    assert built["bwd_dkdv"]["seqlens"] == (512, 1024) and built["bwd_dkdv"]["with_forward"]
    assert not built["fwd"]["with_forward"] and all(b["dtype"] is torch.float32 for b in clock.built)
    table = dict(zip(rows.values(), audit.report(list(rows.values()), 0.03).splitlines()[1:], strict=True))
    assert table[plain].endswith("re-tune") and table[causal].endswith(" ok")
    assert "plain+window" in table[window]


def test_the_fallback_is_what_calls_would_read_without_the_entry(config_file):
    # a bucket entry falls back to the file's "all" entry for its key; a bf16 entry to the file's fp16 entry (a call
    # with no entry of its own dtype reads the other's); the file's other keys, and the audited entry itself, do not
    # count; the search path's files do ($FA2TUNE_CONFIG_DIR's, as the GPU's own, after the audited file)
    store.write_entries(config_file, DEVICE, [
        _entry(bucket="short", cfg=FAST), _entry(cfg=SLOW), _entry(dtype="bf16", cfg=FAST, causal=True),
        _entry(dtype="fp16", cfg=OTHER, causal=True), _entry(head_dim=128, cfg=OTHER, bucket="medium"),
    ])  # fmt: skip
    env = config_file.parent / "env" / "cpu-interpreter.yaml"
    store.write_entries(env, DEVICE, [_entry(head_dim=128, cfg=FAST)])
    clock = _Clock({SLOW: 1.0, FAST: 1.0, OTHER: 1.0, FALLBACK: 1.0})
    rows = _by_key(audit.audit(config_file, "cpu", measure_factory=clock))
    short = rows[64, "fwd", "fp32", False, False, "short"]
    assert (short.fallback, short.fallback_source) == (SLOW, str(config_file))
    assert rows[64, "fwd", "fp32", False, False, "all"].fallback == FALLBACK  # the short entry serves short calls only
    bf16 = rows[64, "fwd", "bf16", True, False, "all"]
    assert (bf16.fallback, bf16.fallback_source) == (OTHER, f"{config_file} (fp16 entry)")
    assert rows[64, "fwd", "fp16", True, False, "all"].fallback == FAST  # and the reverse
    medium = rows[128, "fwd", "fp32", False, False, "medium"]
    assert (medium.fallback, medium.fallback_source) == (FAST, str(env))
    assert audit.fallback(short.key, config_file, selection.device_info("cpu")) == (SLOW, str(config_file))


def test_stale_and_failing_entries_are_said_so_and_which_config_failed(config_file):
    store.write_entries(config_file, DEVICE, [
        _entry(cfg=FALLBACK), _entry(causal=True), _entry(head_dim=128), _entry(head_dim=32, template_hash="0" * 16),
        _entry(head_dim=96),
    ])  # fmt: skip
    rows = audit.audit(config_file, "cpu", head_dims={64, 32}, measure_factory=_Clock({
        SLOW: RuntimeError("out of resource: shared memory"), FALLBACK: 1.0}))  # fmt: skip
    rows = _by_key(rows)
    assert len(rows) == 3  # d=128 and d=96 filtered out
    same, failed = rows[64, "fwd", "fp32", False, False, "all"], rows[64, "fwd", "fp32", True, False, "all"]
    assert same.ratio is None and same.note == "the fallback is the entry's config"
    assert failed.ratio is None and failed.failed
    assert failed.note.startswith("failed: the entry's config: RuntimeError: out of resource")
    stale = rows[32, "fwd", "fp32", False, False, "all"]
    assert stale.note.startswith("stale: calls pass it over") and stale.fallback is None
    # the fallback failing, and the inputs failing, are told apart from the entry failing
    rows = audit.audit(config_file, "cpu", head_dims={128}, measure_factory=_Clock({SLOW: 1.0, FALLBACK: KeyError(1)}))
    assert rows[0].note.startswith("failed: the fallback's config: KeyError")
    rows = audit.audit(config_file, "cpu", head_dims={96}, measure_factory=_Clock({}, MemoryError("inputs")))
    assert rows[0].note == "failed: the inputs: MemoryError: inputs"
    assert audit.audit(config_file, "cpu", kernels={"bwd_dq"}, measure_factory=_Clock({})) == []
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        audit.audit(config_file, "cpu", rounds=0, measure_factory=_Clock({}))


def test_the_configs_to_time_compile_first_and_a_compile_failure_names_its_config(config_file, monkeypatch):
    # compile_workers > 0: both configs of each timed row go to one pool at once (not the rows whose fallback is the
    # entry's config); a config that fails to compile is the row's note, and it is not timed
    started = []

    class Pool:
        def __init__(self, workers):
            self.workers = workers

        def start(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device, varlen, group):
            assert group == 1  # MHA entries: the group compiled as a constant
            started.append((kernel, head_dim, tuple(configs), seqlens))
            return lambda cfg: "ptxas: too many registers" if cfg == OTHER else None

        def release(self):
            raise AssertionError("released only when interrupted")

        def close(self):
            started.append("closed")

    monkeypatch.setattr(audit, "CompilePool", Pool)
    store.write_entries(config_file, DEVICE, [_entry(), _entry(cfg=FALLBACK, causal=True), _entry(head_dim=96,
                                                                                                 cfg=OTHER)])
    clock = _Clock({SLOW: 1.0, FALLBACK: 1.0})
    rows = _by_key(audit.audit(config_file, "cpu", compile_workers=4, measure_factory=clock))
    assert sorted(s[1] for s in started[:-1]) == [64, 96] and started[-1] == "closed"
    assert all(s[2][1] == FALLBACK for s in started[:-1])
    d96 = rows[96, "fwd", "fp32", False, False, "all"]
    assert d96.note == "failed: the entry's config does not compile: ptxas: too many registers"
    assert OTHER not in clock.timed and clock.timed.count(SLOW) == audit.ROUNDS


def test_the_script_refuses_bad_arguments_and_the_cpu(tmp_path, capsys):
    script = load_script("audit_entries")
    path = tmp_path / "x.yaml"
    store.write_entries(path, DEVICE, [])
    for argv, message in (([str(tmp_path / "none.yaml")], "file: no such file"),
                          ([str(path), "--device", "cpu"], "--device: a CUDA device"),
                          ([str(path), "--rounds", "0"], "--rounds: at least 1, got 0"),
                          ([str(path), "--kernel", "dq"], "--kernel: each of ('fwd', 'bwd_dkdv', 'bwd_dq'), got 'dq'"),
                          ([str(path), "--bucket", "long"], "--bucket: each of ('all', 'short', 'medium'), got 'long'"),
                          ([str(path), "--dtype", "int8"], "--dtype: each of ('bf16', 'fp16', 'fp32'), got 'int8'")):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert message in capsys.readouterr().err, argv
    bad = tmp_path / "bad.yaml"
    bad.write_text("entries: [unclosed\n")
    with pytest.raises(SystemExit):
        script.main([str(bad)])
    assert "is not a tuned-config file" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main([str(path)]) == 2


def test_an_audited_file_of_another_gpu_is_read_without_a_warning(config_file, recwarn):
    # auditing the H200's file on the interpreter (or an H100) reads it as the GPU's first file on purpose
    store.write_entries(config_file, {"name": "NVIDIA H200", "slug": "nvidia-h200"}, [_entry(bucket="short"),
                                                                                      replace(_entry(), config=FAST)])
    rows = _by_key(audit.audit(config_file, "cpu", measure_factory=_Clock({SLOW: 1.0, FAST: 1.0, FALLBACK: 1.0})))
    assert rows[64, "fwd", "fp32", False, False, "short"].fallback == FAST
    assert not [w for w in recwarn if "another GPU" in str(w.message) or "records" in str(w.message)]


def test_a_grouped_query_entry_is_timed_at_its_heads_against_what_gqa_calls_read_without_it(config_file,
                                                                                          monkeypatch):  # fmt: skip
    # its fallback is the plain entry (what a GQA call reads without a grouped one), its timing and its compiles at
    # the heads it was tuned at; a grouped entry that records no heads is not timed
    started = []

    class Pool:
        def __init__(self, workers):
            pass

        def start(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device, varlen, group):
            started.append(group)
            return lambda cfg: None

        def close(self):
            pass

    monkeypatch.setattr(audit, "CompilePool", Pool)
    headless = replace(_entry(causal=True, heads=[8, 2]), heads=None)
    store.write_entries(config_file, DEVICE, [_entry(cfg=SLOW), _entry(cfg=FAST, heads=[32, 8]), headless])
    clock = _Clock({SLOW: 1.0, FAST: 0.8, FALLBACK: 1.0})
    rows = audit.audit(config_file, "cpu", compile_workers=2, measure_factory=clock)
    grouped = next(r for r in rows if r.key.gqa and not r.key.causal)
    assert (grouped.entry, grouped.fallback, grouped.fallback_source) == (FAST, SLOW, str(config_file))
    assert grouped.ratio == pytest.approx(0.8) and started == [1, 4]
    assert [b["heads"] for b in clock.built] == [None, (32, 8)]
    assert next(r for r in rows if r.key.causal).note == "skipped: a grouped-query entry whose heads are not recorded"
    assert "plain+gqa" in audit.report(rows, 0.03)
