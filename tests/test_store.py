"""The YAML store: round trip, merge, concurrent writers, corrupt and stale files, and the lookup order."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from dataclasses import replace

import pytest
import torch
import yaml

import fa2tune
from fa2tune.api import attention_kernel, selection
from fa2tune.config import defaults, lengths, store
from fa2tune.config.decode_config import DecodeConfig
from fa2tune.config.schedule import PERSISTENT, TWO_AN_SM
from fa2tune.config.types import KERNELS, KernelConfig
from fa2tune.kernels import codegen

DEVICE = {"name": "Triton interpreter (CPU)", "slug": "cpu-interpreter"}


_CFG = KernelConfig(64, 32, 4, 2)


def _entry(head_dim=64, causal=False, kernel="fwd", cfg=_CFG, template_hash=None, ms=1.0, window=False, bucket="all",
           gqa=False, heads=None):  # fmt: skip
    template_hash = template_hash or codegen.code_hash(kernel, causal=causal, window=window)
    return store.Entry(
        key=store.EntryKey(head_dim=head_dim, dtype="fp32", causal=causal, kernel=kernel, seqlen_bucket=bucket,
                           window=window, gqa=gqa),
        config=cfg, ms=ms, tflops=None, baseline={"name": "planner-default"}, trials=7, spread=0.01,
        triton_version="3.6.0", torch_version="2.13.0", template_hash=template_hash,
        date="2026-11-29", heads=heads,
    )  # fmt: skip


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    attention_kernel.clear_cache()
    store._warned.clear()
    yield tmp_path
    attention_kernel.clear_cache()


def test_round_trip_and_merge_keep_every_key(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _entry(128, cfg=KernelConfig(16, 16, 4, 1))])
    store.write_entries(path, DEVICE, [_entry(64, cfg=KernelConfig(32, 32, 8, 3)), _entry(64, causal=True)])
    data, entries = store.read_file(path)
    assert data["schema_version"] == 2 and data["device"] == DEVICE
    by_key = {(e.key.head_dim, e.key.causal): e.config for e in entries}
    assert by_key == {(64, False): KernelConfig(32, 32, 8, 3), (128, False): KernelConfig(16, 16, 4, 1),
                      (64, True): KernelConfig(64, 32, 4, 2)}  # fmt: skip
    assert store.Entry.from_dict(entries[0].to_dict()) == entries[0]


_DECODE = DecodeConfig(block_n=32, num_warps=8, num_stages=2, max_block_m=16, programs_per_sm=4, min_split_keys=256)


def _decode_entry(head_dim=64, cfg=_DECODE, template_hash=None, gbps=3900.5):
    return store.Entry(
        key=store.EntryKey(head_dim=head_dim, dtype="bf16", causal=False, kernel="decode"),
        config=cfg, ms=0.2, tflops=None, baseline={"name": "planner-default", "config": DecodeConfig().to_dict()},
        trials=9, spread=0.01, triton_version="3.6.0", torch_version="2.13.0",
        template_hash=template_hash or codegen.decode_code_hash(), date="2026-11-29", gbps=gbps,
    )  # fmt: skip


def test_a_decode_entry_round_trips_beside_the_others(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _decode_entry(64), _decode_entry(128, DecodeConfig())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in it is malformed
        _, entries = store.read_file(path)
    by_kernel = {(e.key.kernel, e.key.head_dim): e for e in entries}
    assert set(by_kernel) == {("fwd", 64), ("decode", 64), ("decode", 128)}
    decode = by_kernel["decode", 64]
    assert decode == _decode_entry(64) and decode.config.programs_per_sm == 4 and decode.gbps == 3900.5
    assert by_kernel["fwd", 64].config == _CFG  # the same head dim's attention entry is a key of its own
    assert store.Entry.from_dict(decode.to_dict()) == decode
    # The other entries are written as before: no gbps key, which an older fa2tune would refuse
    data = yaml.safe_load(path.read_text())
    fwd = next(e for e in data["entries"] if e["key"]["kernel"] == "fwd")
    assert "gbps" not in fwd and set(fwd) == set(_entry().to_dict())
    assert next(e for e in data["entries"] if e["key"]["kernel"] == "decode")["config"] == _DECODE.to_dict()


@pytest.mark.parametrize(
    "edit, words",
    [
        (("min_split_keys: 256", "min_split_keys: 256\n    splits: 4"), "config has unknown keys ['splits']"),
        (("programs_per_sm: 4", "programs_per_sm: 0"), "config DecodeConfig.programs_per_sm must be in 1..32, got 0"),
        (("block_n: 32", "block_n: 32.0"), "config block_n must be an integer, got 32.0"),
        (("causal: false", "causal: true"), "key a decode entry is keyed by head_dim and dtype alone"),
    ],
)
def test_a_malformed_decode_entry_is_skipped_with_a_warning_naming_it(config_dir, edit, words):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_decode_entry(64), _entry(64)])
    path.write_text(path.read_text().replace(*edit, 1))  # the decode entry (the file sorts it first)
    with pytest.warns(RuntimeWarning, match="skipped what is malformed") as caught:
        _, entries = store.read_file(path)
    assert words in str(caught[0].message)
    assert [e.key.kernel for e in entries] == ["fwd"]  # the file's other entries are used


@pytest.mark.parametrize("field, value", [("ms", ".nan"), ("ms", "0"), ("trials", "-1"), ("spread", ".inf")])
def test_an_entry_with_a_measure_no_tune_gives_is_skipped_with_a_warning(config_dir, field, value):
    # a tune compares its candidates with the stored entry's time: a NaN or negative one would decide wrongly
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _entry(128)])
    text = path.read_text()
    start = text.index(f"{field}:", text.index("head_dim: 128"))  # the second entry's field
    end = text.index("\n", start)
    path.write_text(text[:start] + f"{field}: {value}" + text[end:])
    with pytest.warns(RuntimeWarning, match=rf"{field} must be a finite number [>]"):
        _, entries = store.read_file(path)
    assert [e.key.head_dim for e in entries] == [64]


@pytest.mark.parametrize("date", ["2026-13-45", "'2026-02-30'", "yesterday"])
def test_an_entry_with_a_bad_date_is_skipped_alone(config_dir, date):
    # unquoted, 2026-13-45 is a YAML timestamp PyYAML cannot build: read as text, it fails its own entry, not the file
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _entry(128)])
    text = path.read_text()
    start = text.index("date:", text.index("head_dim: 128"))
    path.write_text(text[:start] + f"date: {date}" + text[text.index("\n", start):])
    with pytest.warns(RuntimeWarning, match="date must be a date as YYYY-MM-DD"):
        _, entries = store.read_file(path)
    assert [e.key.head_dim for e in entries] == [64]


def test_an_unquoted_date_reads_as_its_text(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64)])
    path.write_text(path.read_text().replace("date: '2026-11-29'", "date: 2026-11-29"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [e.date for e in store.read_file(path)[1]] == ["2026-11-29"]


def test_a_schema_1_file_has_no_decode_entries(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    entry = _decode_entry().to_dict()
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({"schema_version": 1, "device": DEVICE, "entries": [entry]}))
    with pytest.warns(RuntimeWarning, match="entry 0: config: schema 1 has no decode entries"):
        assert store.read_file(path)[1] == []


def _write_many(args):
    path, head_dims = args
    for d in head_dims:
        store.write_entries(path, DEVICE, [_entry(d)])


def test_processes_writing_different_keys_at_once_lose_nothing(tmp_path):
    path = tmp_path / "shared.yaml"
    jobs = [(path, list(range(start, 256, 4))[:12]) for start in (1, 2, 3, 4)]
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_write_many, jobs)
    _, entries = store.read_file(path)
    assert sorted(e.key.head_dim for e in entries) == sorted(d for _, ds in jobs for d in ds)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".shared.yaml.*"))


_BACKUP = r"cpu-interpreter\.yaml\.corrupt-\d{8}T\d{6}Z"  # store._keep_aside's names


def test_each_corrupt_file_is_kept_aside_under_its_own_name(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    path.parent.mkdir()
    contents = ["{first: [", "{second: ["]
    for text in contents:
        path.write_text(text)
        with pytest.warns(
            RuntimeWarning, match=rf"{path} is not a file this fa2tune reads .*; kept aside as {_BACKUP}"
        ):
            store.write_entries(path, DEVICE, [_entry(64)])
    backups = sorted(path.parent.glob("cpu-interpreter.yaml.corrupt-*"))
    assert sorted(b.read_text() for b in backups) == contents  # the first is not overwritten by the second
    assert [e.key.head_dim for e in store.read_file(path)[1]] == [64]


@pytest.mark.parametrize("edit", [("num_stages: 2", "num_stages: .inf"), ("block_m: 64", "block_m: 17")])
def test_a_rewrite_keeps_the_well_formed_entries_and_the_original_aside(config_dir, edit):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _entry(128)])
    text = path.read_text().replace(*edit, 1)  # the head_dim 64 entry's config
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match=rf"had malformed parts \(entry 0: config .*kept aside as {_BACKUP}"):
        store.write_entries(path, DEVICE, [_entry(32)])
    assert sorted(e.key.head_dim for e in store.read_file(path)[1]) == [32, 128]
    (backup,) = path.parent.glob("cpu-interpreter.yaml.corrupt-*")
    assert backup.read_text() == text


def test_a_write_reaches_the_disk_before_it_replaces_the_file(config_dir, monkeypatch):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64)])
    before = path.read_text()
    events = []
    for name in ("fsync", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, real=real, name=name: events.append(name) or real(*a))
    store.write_entries(path, DEVICE, [_entry(128)])
    assert events == ["fsync", "replace"]  # else a crash can leave an empty file where the entries were
    # A failed write leaves the old file whole and no temporary file behind.
    monkeypatch.setattr(store.yaml, "safe_dump", lambda *a, **k: 1 / 0)
    after = path.read_text()
    with pytest.raises(ZeroDivisionError):
        store.write_entries(path, DEVICE, [_entry(32)])
    assert path.read_text() == after != before and sorted(p.name for p in path.parent.iterdir()) == [
        "cpu-interpreter.yaml", "cpu-interpreter.yaml.lock"]  # fmt: skip


def test_a_write_over_a_directory_or_an_unreadable_file_fails_and_moves_nothing(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    (path / "inside").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"cannot write tuned configs to {path}: not a regular file: a directory"):
        store.write_entries(path, DEVICE, [_entry(64)])
    assert (path / "inside").is_dir()
    if os.path.exists("/proc/self/mem"):  # a regular file whose read fails (EIO), for root too
        path = path.with_name("unreadable.yaml")
        path.symlink_to("/proc/self/mem")
        with pytest.raises(OSError):  # merging nothing into it would drop its entries
            store.write_entries(path, DEVICE, [_entry(64)])
        assert path.is_symlink() and not list(path.parent.glob("unreadable.yaml.corrupt*"))


def test_a_file_is_parsed_once_per_content(config_dir, monkeypatch):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(64), _entry(64, kernel="bwd_dq")])
    parses = []
    real_load = yaml.load
    mine = lambda text: "slug: cpu-interpreter" in text  # not the shipped files, which lookups of misses also read
    monkeypatch.setattr(yaml, "load", lambda *a, **k: (mine(a[0]) and parses.append(a)) or real_load(*a, **k))

    def resolve_many():  # shapes a model could call with, each a new lookup
        attention_kernel.clear_cache()
        return {(kernel, head_dim, causal, n): selection.resolve(kernel, head_dim, torch.float32, causal, "cpu",
                                                                 seqlen=n)
                for kernel in KERNELS for head_dim in (16, 32, 64, 128) for causal in (False, True)
                for n in (100, 2000, None)}  # fmt: skip

    assert resolve_many()[("fwd", 64, False, None)] == (_CFG, str(path))
    assert len(parses) == 1
    os.utime(path)  # touched: the same bytes, nothing to parse again
    resolve_many()
    assert len(parses) == 1
    store.write_entries(path, DEVICE, [_entry(128)])  # rewritten: parsed once more
    assert resolve_many()[("fwd", 128, False, None)] == (_CFG, str(path))
    assert len(parses) == 2
    # Edited in place to the same size, inode and mtime: a cache keyed on stat() alone would keep the old parse.
    stat, text = path.stat(), path.read_text()
    path.write_text(text.replace("num_stages: 2", "num_stages: 1", 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_ino == stat.st_ino
    changed = resolve_many()
    assert len(parses) == 3 and any(c.num_stages == 1 for c, source in changed.values() if source == str(path))
    # What read_file hands out is the caller's to change; the cached parse stays whole.
    data, entries = store.read_file(path)
    data.clear()
    entries.clear()
    assert len(store.read_file(path)[1]) == 3 and store.read_file(path)[0]["schema_version"] == 2


def test_the_store_parses_with_a_safe_loader_in_c_where_pyyaml_has_it():
    assert issubclass(store._Loader, yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    assert issubclass(store._Loader, yaml.constructor.SafeConstructor)


def test_lookup_order_env_then_user_then_shipped(config_dir, monkeypatch):
    key = store.EntryKey(head_dim=64, dtype="fp32", causal=False, kernel="fwd")
    user = store.user_config_dir() / "cpu-interpreter.yaml"
    assert user.is_relative_to(config_dir / "xdg")
    store.write_entries(user, DEVICE, [_entry(cfg=KernelConfig(16, 16, 4, 1))])
    found, path = store.lookup("cpu-interpreter", key, template_hash=codegen.code_hash("fwd", causal=False))
    assert found.config == KernelConfig(16, 16, 4, 1) and path == user
    store.write_entries(config_dir / "env" / "cpu-interpreter.yaml", DEVICE, [_entry(cfg=KernelConfig(32, 16, 4, 1))])
    found, path = store.lookup("cpu-interpreter", key, template_hash=codegen.code_hash("fwd", causal=False))
    assert found.config == KernelConfig(32, 16, 4, 1) and path.parent == config_dir / "env"
    assert store.config_dirs()[-1] == store.shipped_config_dir()
    # Last, the shipped folder (patched here: the repository's own must stay untouched).
    shipped = config_dir / "shipped"
    monkeypatch.setattr(store, "shipped_config_dir", lambda: shipped)
    monkeypatch.delenv("FA2TUNE_CONFIG_DIR")
    user.unlink()
    assert store.lookup("cpu-interpreter", key, template_hash=codegen.code_hash("fwd", causal=False)) is None
    store.write_entries(shipped / "cpu-interpreter.yaml", DEVICE, [_entry(cfg=KernelConfig(64, 64, 4, 1))])
    found, path = store.lookup("cpu-interpreter", key, template_hash=codegen.code_hash("fwd", causal=False))
    assert found.config == KernelConfig(64, 64, 4, 1) and path.parent == shipped


def test_a_call_without_an_entry_runs_its_length_bucket_s_default(config_dir, monkeypatch):
    # resolve() hands the call's length bucket to the planner's default: a short causal forward at a head dim with
    # no entry runs the short form, a long one the long form (defaults._WS_ORDER_BY_BUCKET)
    from fa2tune.config.device import known_gpu

    h200 = replace(known_gpu("h200"), triton_version="3.6.0")
    monkeypatch.setattr(selection, "device_info", lambda device: h200)
    monkeypatch.setattr(store, "shipped_config_dir", lambda: config_dir / "shipped")
    resolve = lambda seqlen: selection.resolve("fwd", 72, torch.bfloat16, True, "cuda", seqlen=seqlen)
    want = lambda bucket: defaults.default_config(72, torch.bfloat16, causal=True, device=h200, seqlen_bucket=bucket)
    assert resolve(512) == (want("short"), "planner-default")
    assert resolve(8192) == (want("all"), "planner-default")
    assert resolve(None) == (want("all"), "planner-default")
    assert want("short") != want("all")
    # without the mask too, where a head dim up to 64 takes another tile at short lengths
    plain = lambda seqlen: selection.resolve("fwd", 48, torch.bfloat16, False, "cuda", seqlen=seqlen)[0]
    plain_want = lambda bucket: defaults.default_config(48, torch.bfloat16, device=h200, seqlen_bucket=bucket)
    assert plain(700) == plain_want("short") != plain(8192) == plain_want("all")
    # and a short study with nothing stored starts from the short form: what its calls ran without it
    from fa2tune.tune import job

    spec = lambda bucket: job.StudySpec(kernel="fwd", head_dim=72, dtype="bf16", causal=True, seqlen_bucket=bucket)
    assert job.baseline(spec("short"), "cuda", h200) == (want("short"), "planner-default")
    assert job.baseline(spec("all"), "cuda", h200) == (want("all"), "planner-default")


def test_a_16_bit_dtype_without_an_entry_of_its_own_reads_the_other_s(config_dir, monkeypatch, device):
    # bf16 and fp16 cost the same (store.SAME_COST_DTYPES): an fp16 call with no fp16 entry runs the bf16 one, and
    # its source says which; an entry of the call's own dtype wins wherever it is on the search path (here the
    # shipped folder, after the bf16 entry's); fp32 reads neither.
    from dataclasses import replace

    slug = selection.device_info(device).slug
    shipped = config_dir / "shipped"
    monkeypatch.setattr(store, "shipped_config_dir", lambda: shipped)
    as_dtype = lambda entry, dtype: replace(entry, key=replace(entry.key, dtype=dtype))
    bf16 = config_dir / "env" / f"{slug}.yaml"
    store.write_entries(bf16, DEVICE, [as_dtype(_entry(cfg=KernelConfig(32, 16, 4, 1)), "bf16")])
    resolve = lambda dtype: selection.resolve("fwd", 64, dtype, False, device)
    assert resolve(torch.float16) == (KernelConfig(32, 16, 4, 1), f"{bf16} (bf16 entry)")
    assert resolve(torch.bfloat16) == (KernelConfig(32, 16, 4, 1), str(bf16))
    assert resolve(torch.float32)[1] == "planner-default"
    attention_kernel.clear_cache()
    store.write_entries(shipped / f"{slug}.yaml", DEVICE, [as_dtype(_entry(cfg=KernelConfig(16, 16, 4, 1)), "fp16")])
    assert resolve(torch.float16) == (KernelConfig(16, 16, 4, 1), str(shipped / f"{slug}.yaml"))
    q = torch.randn(1, 2, 40, 64, device=device, dtype=torch.float16)
    assert fa2tune.get_kernel(64, device=device, dtype=torch.float16).source == str(shipped / f"{slug}.yaml")
    torch.testing.assert_close(fa2tune.attention(q, q, q).float(), fa2tune.attention(q.float(), q.float(), q.float()),
                               atol=2e-3, rtol=2e-3)  # fmt: skip


_IGNORED = r"ignoring tuned configs in .*; using the next source"  # the file as a whole
_SKIPPED = r"skipped what is malformed \(entry 0: .*\); using its other entries"  # one entry


@pytest.mark.parametrize(
    "content, warning",
    [("{not: [valid yaml", _IGNORED), ("- just\n- a list\n", _IGNORED), ("schema_version: 99\nentries: []\n", _IGNORED),
     ("schema_version: 1\nentries:\n- key: {head_dim: 64}\n", _SKIPPED),
     ("schema_version: 1\nentries:\n- {key: {head_dim: 64, dtype: fp8, causal: false, kernel: fwd}, config: {}}\n",
      _SKIPPED)],
    ids=["unparsable", "not-a-mapping", "future-schema", "malformed-entry", "unknown-dtype"],
)  # fmt: skip
def test_a_bad_file_warns_once_and_falls_back(config_dir, content, warning, device):
    bad = config_dir / "env" / f"{selection.device_info(device).slug}.yaml"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    q = torch.randn(1, 2, 40, 64, device=device)
    with pytest.warns(RuntimeWarning, match=warning):
        out = fa2tune.attention(q, q, q)
    kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32)
    assert kernel.source == "planner-default"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention_kernel.clear_cache()
        torch.testing.assert_close(fa2tune.attention(q, q, q), out)
    assert not [w for w in caught if "fa2tune" in str(w.message)]  # the second call says nothing: once is enough


def test_stale_entry_is_skipped_with_a_warning(config_dir, device):
    slug = selection.device_info(device).slug
    store.write_entries(config_dir / "env" / f"{slug}.yaml", DEVICE, [_entry(template_hash="0123456789abcdef")])
    with pytest.warns(RuntimeWarning, match=r"tuned for kernel templates 0123456789abcdef.*\(stale\)"):
        kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32)
    assert kernel.source == "planner-default"


def test_a_file_of_stale_entries_warns_once_and_where_warnings_are_errors_every_time(config_dir, device):
    slug = selection.device_info(device).slug
    stale = "0123456789abcdef"
    store.write_entries(config_dir / "env" / f"{slug}.yaml", DEVICE, [
        _entry(head_dim=d, causal=c, kernel=k, template_hash=stale)
        for d in (32, 64) for c in (False, True) for k in ("fwd", "bwd_dkdv", "bwd_dq")])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for d in (32, 64):
            for causal in (False, True):
                kernel = fa2tune.get_kernel(d, device=device, dtype=torch.float32, causal=causal)
                assert (kernel.source, kernel.bwd_source) == ("planner-default", "planner-default")
    said = [str(w.message) for w in caught if "fa2tune" in str(w.message)]
    assert len(said) == 1 and "stale" in said[0] and stale in said[0], said
    store._warned.clear()
    attention_kernel.clear_cache()
    for _ in range(2):  # under -W error each call that meets the file raises, not only the first
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="stale"):
                fa2tune.get_kernel(64, device=device, dtype=torch.float32)
        attention_kernel.clear_cache()


def test_a_config_dir_that_does_not_exist_is_said_once(config_dir, device, monkeypatch):
    missing = config_dir / "deploy" / "configs-misspelt"
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(missing))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for causal in (False, True):
            assert fa2tune.get_kernel(64, device=device, dtype=torch.float32, causal=causal).source == "planner-default"
    said = [str(w.message) for w in caught if "fa2tune" in str(w.message)]
    assert len(said) == 1 and "FA2TUNE_CONFIG_DIR" in said[0] and str(missing) in said[0], said


def test_get_kernel_uses_a_tuned_entry_for_fwd_and_bwd(config_dir, device):
    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    fwd, dkdv, dq = KernelConfig(16, 32, 4, 1), KernelConfig(16, 16, 4, 1), KernelConfig(32, 16, 4, 1)
    store.write_entries(path, DEVICE, [_entry(causal=True, cfg=fwd), _entry(causal=True, kernel="bwd_dkdv", cfg=dkdv),
                                       _entry(causal=True, kernel="bwd_dq", cfg=dq)])  # fmt: skip
    kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32, causal=True)
    assert (kernel.config, kernel.bwd_dkdv_config, kernel.bwd_dq_config) == (fwd, dkdv, dq)
    assert kernel.source == str(path) and kernel.bwd_source == str(path)
    q = torch.randn(1, 2, 50, 64, device=device, requires_grad=True)
    out = kernel(q, q, q)
    out.sum().backward()
    from fa2tune.tune.reference import naive_attention

    ref = naive_attention(q.detach().double(), q.detach().double(), q.detach().double(), causal=True)[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert selection.resolve("bwd_dq", 64, torch.float32, True, device) == (dq, str(path))
    with pytest.raises(ValueError, match=r"resolved for head_dim=64, head_dim_v=64, dtype=torch.float32; got q with "
                                         r"head_dim=32, v with 32"):
        kernel(q[..., :32], q[..., :32], q[..., :32])


def test_an_entry_that_does_not_fit_the_device_is_ignored(config_dir, monkeypatch):
    # An H200-sized tile in an L4's file (99 KiB per block): resolved as the planner's L4 default, with a warning.
    from fa2tune.config.device import known_gpu

    l4 = known_gpu("l4")
    monkeypatch.setattr(selection, "device_info", lambda device: l4)
    too_big = KernelConfig(256, 64, 8, 4)
    entry = store.Entry(
        **{
            **_entry(head_dim=128, cfg=too_big).__dict__,
            "key": store.EntryKey(head_dim=128, dtype="bf16", causal=False, kernel="fwd"),
        }
    )
    store.write_entries(config_dir / "env" / "nvidia-l4.yaml", {"slug": "nvidia-l4"}, [entry])
    with pytest.warns(RuntimeWarning, match=r"does not fit NVIDIA L4: shared memory: needs 196,608 B") as caught:
        cfg, source = selection.resolve("fwd", 128, torch.bfloat16, False, "cuda:0")
        # an fp16 call reaches the same bf16 entry (store.dtype_twins): the same entry, the same one warning
        assert selection.resolve("fwd", 128, torch.float16, False, "cuda:0")[1] == "planner-default"
    assert source == "planner-default" and cfg != too_big
    assert [str(w.message).count("(bf16 entry) does not fit") for w in caught] == [1]


def _bf16(entry):
    return store.Entry(**{**entry.__dict__, "key": store.EntryKey(**{**entry.key.__dict__, "dtype": "bf16"})})


def _fp16(entry):
    return replace(entry, key=replace(entry.key, dtype="fp16"))


def _write_for(path, gpu, entries):
    from fa2tune.tune.job import device_summary

    store.write_entries(path, device_summary(gpu), entries)
    return path


@pytest.fixture
def gpus():
    from fa2tune.config.device import known_gpu

    return known_gpu("h100-sxm"), known_gpu("h200"), known_gpu("h100-pcie"), known_gpu("a100-80gb")


def test_a_gpu_without_an_entry_of_its_own_reads_the_entry_of_a_gpu_of_the_same_chip(config_dir, monkeypatch, gpus):
    # An H100 SXM and an H200 record the same capability, SM count and shared memory a program: the H100 reads the
    # H200's entry for a key it has none for, in either dtype; an H100 PCIe (114 SMs) does not.
    h100, h200, pcie, _ = gpus
    tuned, own = KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 3)
    h200_file = _write_for(config_dir / "env" / "nvidia-h200.yaml", h200,
                           [_bf16(_entry(112, cfg=tuned)), _bf16(_entry(112, causal=True, cfg=tuned))])  # fmt: skip
    (config_dir / "env" / "broken.yaml").write_text("device: [unclosed")  # passed over, not fatal
    store.write_entries(config_dir / "env" / "nameless.yaml", {"sm_count": 132}, [])  # no chip fields: not a match
    device = h100
    monkeypatch.setattr(selection, "device_info", lambda _: device)
    resolve = lambda causal, dtype=torch.bfloat16: selection.resolve("fwd", 112, dtype, causal, "cuda:0")  # none ships
    assert resolve(False) == (tuned, f"{h200_file} (tuned on NVIDIA H200, the same chip)")
    assert resolve(False, torch.float16) == (tuned, f"{h200_file} (bf16 entry) (tuned on NVIDIA H200, the same chip)")
    # the GPU's own entries win wherever they are along the path (here the user cache dir, after $FA2TUNE_CONFIG_DIR)
    # and in the other dtype: a bf16 entry of its own serves an fp16 call before the H200's fp16 entry
    h100_file = _write_for(config_dir / "xdg" / "fa2tune" / "configs" / "nvidia-h100-80gb-hbm3.yaml", h100,
                           [_bf16(_entry(112, causal=True, cfg=own))])  # fmt: skip
    assert h100_file in store.own_files(h100.slug)
    _write_for(h200_file, h200, [_fp16(_bf16(_entry(112, causal=True)))])
    selection.clear_cache()
    assert resolve(True) == (own, str(h100_file)) and resolve(False)[0] == tuned
    assert resolve(True, torch.float16) == (own, f"{h100_file} (bf16 entry)")
    shipped = store.shipped_config_dir() / "nvidia-h200.yaml"
    assert store.same_chip_gpus(h100) == [store.SameChipGPU("NVIDIA H200", (h200_file, shipped))]
    shipped_h100 = store.shipped_config_dir() / "nvidia-h100-80gb-hbm3.yaml"
    assert store.same_chip_gpus(h200) == [store.SameChipGPU("NVIDIA H100 80GB HBM3", (h100_file, shipped_h100))]
    device = pcie
    selection.clear_cache()
    assert store.same_chip_gpus(pcie) == [] and resolve(False)[1] == "planner-default"


def test_a_same_chip_gpus_bucket_entry_comes_before_the_gpus_own_all_entry(config_dir, monkeypatch, gpus):
    # An H100 tuned its own "all" entry; the H200's file has a short one. A call of the short bucket's lengths reads
    # the H200's short entry, tuned at them on the same chip, and longer calls the H100's own; an entry of the H100's
    # own short bucket, in either dtype, comes first. The H100's "all" study is tuned at the lengths the H200's bucket
    # entries leave it, as beside its own (store.find_for_device, job.unserved_lengths).
    from fa2tune.tune import job

    h100, h200, _, _ = gpus
    monkeypatch.setattr(selection, "device_info", lambda _: h100)
    env = config_dir / "env"
    short_cfg, own_all, own_short = KernelConfig(64, 64, 4, 3), KernelConfig(128, 64, 4, 2), KernelConfig(64, 32, 4, 2)
    h200_file = _write_for(env / "nvidia-h200.yaml", h200, [_bf16(_entry(112, bucket="short", cfg=short_cfg))])
    h100_file = _write_for(env / "nvidia-h100-80gb-hbm3.yaml", h100, [_bf16(_entry(112, cfg=own_all))])
    resolve = lambda seqlen, dtype=torch.bfloat16: selection.resolve("fwd", 112, dtype, False, "cuda:0", seqlen=seqlen)
    assert resolve(1024) == (short_cfg, f"{h200_file} (tuned on NVIDIA H200, the same chip)")
    assert resolve(8192) == resolve(None) == (own_all, str(h100_file))
    assert resolve(1024, torch.float16)[0] == short_cfg  # the other dtype's call, the same bucket-first order
    spec = job.StudySpec(kernel="fwd", head_dim=112, dtype="bf16", causal=False)
    assert job.unserved_lengths(spec, h100_file, h100) == (4096, 16384)  # 1k is the H200's short entry's
    assert job.unserved_lengths(spec, h100_file) == (1024, 4096, 16384)  # the same-chip files read only with info
    # the H100's short study must beat what its calls read without an entry of its own: the H200's short entry
    short_study = replace(spec, seqlen_bucket="short")
    assert job.baseline(short_study, "cuda:0", h100) == (short_cfg, "seqlen_bucket short (NVIDIA H200)")
    # a stale entry is no entry: calls pass it over, so it serves no length and is no baseline
    _write_for(h200_file, h200, [_bf16(_entry(112, bucket="short", cfg=short_cfg, template_hash="0" * 16))])
    selection.clear_cache()
    assert resolve(1024) == (own_all, str(h100_file))
    assert job.unserved_lengths(spec, h100_file, h100) == (1024, 4096, 16384)
    assert job.baseline(short_study, "cuda:0", h100) == (own_all, "seqlen_bucket all")
    _write_for(h100_file, h100, [_bf16(_entry(112, cfg=own_all)), _fp16(_bf16(_entry(112, bucket="short",
                                                                                        cfg=own_short)))])  # fmt: skip
    selection.clear_cache()
    assert resolve(1024) == (own_short, f"{h100_file} (fp16 entry)")  # its own bucket's, of the same-cost dtype
    assert job.baseline(short_study, "cuda:0", h100) == (own_short, "seqlen_bucket short (fp16)")
    # the study's own entry, which the tune replaces, is no baseline
    assert job.baseline(replace(short_study, dtype="fp16"), "cuda:0", h100) == (own_all, "seqlen_bucket all (bf16)")


def test_only_the_files_that_record_the_chip_are_read_and_the_gpus_own_copies_are_not(config_dir, monkeypatch, gpus):
    from fa2tune.tune.job import device_summary

    h100, h200, _, a100 = gpus
    monkeypatch.setattr(selection, "device_info", lambda _: h100)
    env, xdg = config_dir / "env", config_dir / "xdg" / "fa2tune" / "configs"
    # another GPU's file under the H200's name (an A100's) is not read, though the real H200 file matches
    _write_for(env / "nvidia-h200.yaml", a100, [_bf16(_entry(112, cfg=KernelConfig(32, 32, 4, 2)))])
    real = _write_for(xdg / "nvidia-h200.yaml", h200, [_bf16(_entry(112, cfg=KernelConfig(128, 64, 4, 2)))])
    # a copy of the H100's own file under another name is not "another GPU"; an odd device name shows the file's stem
    _write_for(env / "nvidia-h100-80gb-hbm3.bak.yaml", h100, [_bf16(_entry(112))])
    store.write_entries(env / "odd.yaml", {**device_summary(h100), "name": "x\n" * 50, "slug": "odd"}, [])
    shipped = store.shipped_config_dir() / "nvidia-h200.yaml"
    assert store.same_chip_gpus(h100) == [store.SameChipGPU("odd", (env / "odd.yaml",)),
                                          store.SameChipGPU("NVIDIA H200", (real, shipped))]  # fmt: skip
    assert selection.resolve("fwd", 112, torch.bfloat16, False, "cuda:0") == (
        KernelConfig(128, 64, 4, 2), f"{real} (tuned on NVIDIA H200, the same chip)")  # fmt: skip
    # a file that appears later is seen: the scan's answer is kept only while the directories' listing holds
    late = env / "nvidia-gh200.yaml"
    store.write_entries(late, {**device_summary(h200), "name": "NVIDIA GH200", "slug": "nvidia-gh200"}, [])
    assert store.same_chip_gpus(h100)[0] == store.SameChipGPU("NVIDIA GH200", (late,))


def test_a_gpus_own_file_that_records_another_gpu_is_used_with_one_warning(config_dir, monkeypatch, gpus):
    # An A100's file copied under the H200's name: the H200 reads it as its own (whoever put it there may mean it),
    # and says once which GPU the file records; a file that records the H200 itself, or no device, says nothing.
    _, h200, _, a100 = gpus
    monkeypatch.setattr(selection, "device_info", lambda _: h200)
    copied = _write_for(config_dir / "env" / "nvidia-h200.yaml", a100,
                        [_bf16(_entry(112, cfg=KernelConfig(64, 64, 4, 2)))])  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"nvidia-h200.yaml is read as NVIDIA H200's .* records another GPU, "
                      r"'NVIDIA A100-SXM4-80GB'") as caught:  # fmt: skip
        cfg, source = selection.resolve("fwd", 112, torch.bfloat16, False, "cuda:0")
        assert (cfg, source) == (KernelConfig(64, 64, 4, 2), str(copied))
        selection.clear_cache()
        selection.resolve("fwd", 112, torch.bfloat16, False, "cuda:0")
    assert sum("records another GPU" in str(w.message) for w in caught) == 1
    from fa2tune.tune.job import device_summary

    for recorded in (device_summary(h200), {}):
        store.write_entries(copied, recorded, [_bf16(_entry(112, cfg=KernelConfig(64, 64, 4, 2)))])
        store._warned.clear()
        selection.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert selection.resolve("fwd", 112, torch.bfloat16, False, "cuda:0")[1] == str(copied)


def test_decode_entries_stay_the_gpus_own_and_show_says_which_entry_calls_read(config_dir, monkeypatch, gpus):
    # The decode kernel is bound by memory bandwidth, where an H100 and an H200 differ: the H200's decode entry is
    # not read on an H100. show marks each row as calls would read it, the other dtype and the same chip included.
    from fa2tune.cli import commands

    h100, h200, _, _ = gpus
    monkeypatch.setattr(selection, "device_info", lambda _: h100)
    h200_file = _write_for(config_dir / "env" / "nvidia-h200.yaml", h200, [_decode_entry(128), _bf16(_entry(112))])
    assert selection.resolve_decode("cuda:0", 128, torch.bfloat16)[1] == "planner-default"
    h100_file = _write_for(config_dir / "env" / "nvidia-h100-80gb-hbm3.yaml", h100, [])
    _write_for(h200_file, h200, [_fp16(_bf16(_entry(112, causal=True)))])
    _write_for(h100_file, h100, [_bf16(_entry(112, causal=True, cfg=KernelConfig(64, 64, 4, 3)))])
    rows = {(r["file"], r["kernel"], r["dtype"], r["causal"]): r
            for r in commands._stored_rows(h100.slug, h100) if r["file"].startswith(str(config_dir))}  # fmt: skip
    assert [r.get("tuned_on") for r in rows.values()] == [None, "NVIDIA H200", "NVIDIA H200", "NVIDIA H200"]
    assert rows[str(h100_file), "fwd", "bf16", True]["used"]
    assert rows[str(h200_file), "fwd", "bf16", False]["used"]  # the H100 has no entry for it in either dtype
    assert rows[str(h200_file), "fwd", "fp16", True]["why_not"] == f"calls of this key read {h100_file} (bf16 entry)"
    # the H100's own entry for a key that it cannot run is passed over: calls read the H200's, and show says so
    _write_for(h100_file, h100, [_bf16(_entry(112, causal=True, cfg=KernelConfig(64, 64, 4, 3))),
                                 _bf16(_entry(112, cfg=KernelConfig(256, 256, 8, 4)))])  # fmt: skip
    rows2 = {(r["file"], r["kernel"], r["dtype"], r["causal"]): r
             for r in commands._stored_rows(h100.slug, h100) if r["file"].startswith(str(config_dir))}  # fmt: skip
    assert rows2[str(h100_file), "fwd", "bf16", False]["why_not"].startswith("the planner rejects it here")
    assert rows2[str(h200_file), "fwd", "bf16", False]["used"]
    assert selection.resolve("fwd", 112, torch.bfloat16, False, "cuda:0")[1].startswith(f"{h200_file} (tuned on")
    decode = rows[str(h200_file), "decode", "bf16", False]
    assert decode["why_not"].startswith("decode entries are read from the GPU's own files only")


def test_a_tune_starts_from_what_calls_read_its_own_entries_first_then_a_same_chip_gpus(config_dir, gpus):
    # What calls read until the tune writes its own entry is its incumbent, so a tune keeps it unless it finds better.
    from fa2tune.tune import job

    h100, h200, pcie, _ = gpus
    spec = job.StudySpec(kernel="fwd", head_dim=112, dtype="fp16", causal=False)
    tuned, own, held = KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 3), KernelConfig(32, 64, 4, 2)
    _write_for(config_dir / "env" / "nvidia-h200.yaml", h200, [_bf16(_entry(112, cfg=tuned))])
    target = config_dir / "elsewhere" / "nvidia-h100-80gb-hbm3.yaml"  # a --config-dir off the search path
    assert job.incumbent(spec, target) is None  # without the device: the target file alone
    found = job.incumbent(spec, target, h100)
    assert found.config == tuned and found.origin == "the config calls read now"
    assert found.source.endswith("nvidia-h200.yaml (bf16 entry) (tuned on NVIDIA H200, the same chip)")
    # the tune's note says where the incumbent came from, not "the stored config" of a file that holds none
    assert job.with_incumbent(spec, target, h100).incumbent_origin == f"the config calls read now (from {found.source})"
    assert job.incumbent(spec, target, pcie) is None
    _write_for(config_dir / "xdg" / "fa2tune" / "configs" / "nvidia-h100-80gb-hbm3.yaml", h100,
               [_bf16(_entry(112, cfg=own, template_hash="stale"))])  # fmt: skip
    assert job.incumbent(spec, target, h100).config == own  # the GPU's own entry along the path, stale or not
    _write_for(target, h100, [_bf16(_entry(112, cfg=held))])
    assert job.incumbent(spec, target, h100).config == own  # calls read the GPU's own files before another dtype's
    _write_for(target, h100, [_fp16(_bf16(_entry(112, cfg=held)))])
    assert job.incumbent(spec, target, h100) == (held, "the stored config", None)  # the target file's key first
    # an entry of the GPU's own that it cannot run is passed over, as calls pass it over
    _write_for(config_dir / "xdg" / "fa2tune" / "configs" / "nvidia-h100-80gb-hbm3.yaml", h100,
               [_bf16(_entry(112, cfg=KernelConfig(256, 256, 8, 4)))])  # fmt: skip
    assert job.incumbent(spec, config_dir / "elsewhere" / "none.yaml", h100).config == tuned  # the H200's: calls run it


def test_get_kernel_argument_errors():
    with pytest.raises(ValueError, match=r"head_dim must be an int in 1..256, got 0"):
        fa2tune.get_kernel(0)
    with pytest.raises(TypeError, match=r"dtype must be torch.bfloat16, torch.float16 or torch.float32"):
        fa2tune.get_kernel(64, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"causal must be True or False"):
        fa2tune.get_kernel(64, causal="yes")


def test_window_and_varlen_entries_are_their_own_keys(config_dir, device):
    # A file written before these keys existed reads them as False; a window/varlen entry is used only there.
    path = config_dir / "env" / "cpu-interpreter.yaml"
    plain, windowed = _entry(64), _entry(64, window=True, cfg=KernelConfig(16, 16, 4, 1))
    store.write_entries(path, DEVICE, [plain, windowed])
    text = path.read_text()
    path.write_text(text.replace("    window: false\n", "", 1))  # the plain entry as an older file wrote it
    _, entries = store.read_file(path)
    assert {e.key.window for e in entries} == {False, True}
    resolve = lambda **kw: selection.resolve("fwd", 64, torch.float32, False, "cpu", **kw)[0]
    assert resolve() == _CFG
    assert resolve(window=True) == KernelConfig(16, 16, 4, 1)
    assert resolve(varlen=True) != KernelConfig(16, 16, 4, 1)  # no varlen entry: the planner's default


def test_get_kernel_for_a_window_and_for_packed_sequences(config_dir, device):
    from fa2tune.tune.reference import naive_attention, naive_attention_varlen

    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    windowed_cfg = KernelConfig(16, 16, 4, 1)
    store.write_entries(path, DEVICE, [_entry(causal=True, window=True, cfg=windowed_cfg)])
    windowed = fa2tune.get_kernel(64, device=device, dtype=torch.float32, causal=True, window=(8, -1))
    assert windowed.config == windowed_cfg and windowed.source == str(path)
    q = torch.randn(1, 2, 40, 64, device=device)
    ref = naive_attention(q.double(), q.double(), q.double(), causal=True, window=(8, -1))[0]
    torch.testing.assert_close(windowed(q, q, q).double(), ref, rtol=1e-5, atol=1e-5)

    packed = fa2tune.get_kernel(64, device=device, dtype=torch.float32, varlen=True)
    assert packed.source == "planner-default"  # no varlen entry stored
    cu = torch.tensor([0, 7, 40], dtype=torch.int32, device=device)
    x = torch.randn(40, 2, 64, device=device)
    ref = naive_attention_varlen(x.double(), x.double(), x.double(), cu, cu)[0]
    torch.testing.assert_close(packed(x, x, x, cu, cu, 33, 33).double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="this kernel takes cu_seqlens_q, cu_seqlens_k"):
        packed(x, x, x)
    with pytest.raises(TypeError, match=r"this kernel takes only q, k, v"):
        windowed(q, q, q, cu)
    with pytest.raises(ValueError, match="window sides must be >= -1"):
        fa2tune.get_kernel(64, window=(-3, 0))


def test_a_pipelined_entry_is_fresh_with_the_code_it_runs_and_stale_with_the_plain_code(config_dir):
    # pipeline_qk selects other kernel code: the entry records that code's hash, and an entry whose switch and
    # hash disagree (hand-edited, or tuned by an older fa2tune) falls back with one warning.
    path = config_dir / "env" / "cpu-interpreter.yaml"
    pipelined = KernelConfig(16, 16, 4, 1, pipeline_qk=1)
    pipelined_hash = codegen.code_hash("fwd", causal=False, pipeline_qk=True)
    assert pipelined_hash != codegen.code_hash("fwd", causal=False)
    store.write_entries(path, DEVICE, [_entry(64, cfg=pipelined, template_hash=pipelined_hash)])
    assert "pipeline_qk: 1" in path.read_text()
    assert selection.resolve("fwd", 64, torch.float32, False, "cpu") == (pipelined, str(path))
    attention_kernel.clear_cache()
    store.write_entries(path, DEVICE, [_entry(64, cfg=pipelined)])  # plain code's hash, switch on: stale
    with pytest.warns(RuntimeWarning, match="stale"):
        config, source = selection.resolve("fwd", 64, torch.float32, False, "cpu")
    assert source == "planner-default" and config != pipelined


def test_a_short_entry_serves_calls_up_to_1024_and_the_all_entry_the_rest(config_dir, device):
    from fa2tune.config.types import Mask
    from fa2tune.launch import launcher

    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    short_cfg, long_cfg, dq_short = KernelConfig(16, 16, 4, 1), KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1)
    store.write_entries(path, DEVICE, [_entry(cfg=long_cfg), _entry(cfg=short_cfg, bucket="short"),
                                       _entry(kernel="bwd_dq", cfg=dq_short, bucket="short")])  # fmt: skip
    assert lengths.buckets_for(1024) == ("short", "all") and lengths.buckets_for(4097) == lengths.buckets_for(None)
    resolve = lambda kernel, n: selection.resolve(kernel, 64, torch.float32, False, device, seqlen=n)
    assert resolve("fwd", 1) == resolve("fwd", 1024) == (short_cfg, str(path))
    assert resolve("fwd", 1025) == resolve("fwd", None) == (long_cfg, str(path))
    assert resolve("bwd_dq", 512) == (dq_short, str(path))
    assert resolve("bwd_dq", 4096)[1] == "planner-default"  # no "all" entry for dq: the default, not the short one
    # A call's longer side picks the bucket: 64 queries against 2048 keys is not short.
    q, k = torch.empty(1, 2, 64, 64, device=device), torch.empty(1, 2, 2048, 64, device=device)
    assert selection.config_for(None, "fwd", q, q, q, Mask(), None) == short_cfg
    assert selection.config_for(None, "fwd", q, k, k, Mask(), None) == long_cfg
    # V's head dim of its own: the call resolves at the larger head dim (planner.config_head_dim), the 64 stored
    narrow = torch.empty(1, 2, 64, 32, device=device)
    assert selection.config_for(None, "fwd", narrow, narrow, q, Mask(), None) == short_cfg
    assert selection.config_for(None, "fwd", q, q, narrow, Mask(), None) == short_cfg
    assert selection.config_for(None, "fwd", narrow, narrow, narrow, Mask(), None) != short_cfg  # nothing at 32
    # Packed sequences: the longest sequence of either side.
    seen = []
    real_resolve = selection.resolve
    packing = launcher.Packing(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 64, 1500)
    try:
        selection.resolve = lambda *args, seqlen=None, **kw: seen.append(seqlen) or real_resolve(*args, **kw)
        selection.config_for(None, "fwd", *[q[0].transpose(0, 1)] * 3, Mask(), packing)
    finally:
        selection.resolve = real_resolve
    assert seen == [1500]

    # get_kernel shows both forward configs and launches the one for the call's length.
    kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32)
    assert (kernel.config, kernel.short_config, kernel.short_source) == (long_cfg, short_cfg, str(path))
    x = torch.randn(1, 2, 40, 64, device=device)
    from fa2tune.tune.reference import naive_attention

    torch.testing.assert_close(kernel(x, x, x).double(), naive_attention(x.double(), x.double(), x.double())[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    launched = []
    real = attention_kernel.checked_apply
    try:
        attention_kernel.checked_apply = lambda q, k, v, causal, scale, window, prefix, lse, config, packing, chosen: (
            launched.append(config))  # fmt: skip
        kernel(x, x, x)
        kernel(x, torch.empty(1, 2, 1100, 64), torch.empty(1, 2, 1100, 64))
    finally:
        attention_kernel.checked_apply = real
    assert launched == [short_cfg, long_cfg]


def test_a_short_entry_key_round_trips_and_a_bad_bucket_is_refused(config_dir):
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(bucket="short"), _entry()])
    assert sorted(e.key.seqlen_bucket for e in store.read_file(path)[1]) == ["all", "short"]
    with pytest.raises(ValueError, match="seqlen_bucket must be one of"):
        store.EntryKey(head_dim=64, dtype="bf16", causal=False, kernel="fwd", seqlen_bucket="long")


def test_a_medium_entry_serves_calls_past_1024_up_to_4096(config_dir, device):
    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    short_cfg, medium_cfg, long_cfg = KernelConfig(16, 16, 4, 1), KernelConfig(16, 32, 4, 2), KernelConfig(32, 16, 4, 1)
    store.write_entries(path, DEVICE, [_entry(cfg=long_cfg), _entry(cfg=short_cfg, bucket="short"),
                                       _entry(cfg=medium_cfg, bucket="medium")])  # fmt: skip
    assert [lengths.bucket_of(n) for n in (None, 1, 1024, 1025, 4096, 4097)] == [
        "all", "short", "short", "medium", "medium", "all"]  # fmt: skip
    assert lengths.buckets_for(2048) == ("medium", "all")
    resolve = lambda n: selection.resolve("fwd", 64, torch.float32, False, device, seqlen=n)[0]
    assert [resolve(n) for n in (1024, 1025, 4096, 4097)] == [short_cfg, medium_cfg, medium_cfg, long_cfg]
    # With no medium entry for a kernel, its medium-length calls run the "all" one.
    assert selection.resolve("bwd_dq", 64, torch.float32, False, device, seqlen=2048)[1] == "planner-default"

    kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32)
    assert (kernel.short_config, kernel.medium_config, kernel.config) == (short_cfg, medium_cfg, long_cfg)
    assert kernel.medium_source == str(path)
    launched = []
    real = attention_kernel.checked_apply
    x = torch.empty(1, 1, 8, 64)
    try:
        attention_kernel.checked_apply = lambda q, k, v, causal, scale, window, prefix, lse, config, packing, chosen: (
            launched.append(config))  # fmt: skip
        for n in (1000, 1025, 4096, 4097):
            kernel(x, torch.empty(1, 1, n, 64), torch.empty(1, 1, n, 64))
    finally:
        attention_kernel.checked_apply = real
    assert launched == [short_cfg, medium_cfg, medium_cfg, long_cfg]


def test_a_short_study_must_beat_what_short_calls_run_without_it(config_dir, device):
    from fa2tune.tune import job

    slug = selection.device_info(device).slug
    long_cfg = KernelConfig(32, 16, 4, 1)
    spec = lambda bucket, kernel="fwd": job.StudySpec(kernel=kernel, head_dim=64, dtype="fp32", causal=False,
                                                           seqlen_bucket=bucket)  # fmt: skip
    default = lambda kernel="fwd": defaults.default_config(64, torch.float32, causal=False, kernel=kernel,
                                                          device=selection.device_info(device))  # fmt: skip
    assert job.baseline(spec("short"), device) == (default(), "planner-default")  # nothing stored yet
    store.write_entries(config_dir / "env" / f"{slug}.yaml", DEVICE, [_entry(cfg=long_cfg)])
    attention_kernel.clear_cache()
    assert job.baseline(spec("short"), device) == (long_cfg, "seqlen_bucket all")  # the "all" entry
    assert job.baseline(spec("medium"), device) == (long_cfg, "seqlen_bucket all")
    assert job.baseline(spec("all"), device) == (default(), "planner-default")
    assert job.baseline(spec("short", "bwd_dq"), device) == (default("bwd_dq"), "planner-default")


def test_every_shipped_entry_runs_the_current_kernel_code():
    # A template change without a re-tune would turn shipped entries stale: every user falls back to the default.
    paths = sorted(store.shipped_config_dir().glob("*.yaml"))
    assert paths, "tuned_configs/ ships no YAML"
    for path in paths:
        _, entries = store.read_file(path)
        stale = [e.key for e in entries if e.template_hash != codegen.entry_code_hash(e.key, e.config)]
        assert not stale, f"{path.name}: stale entries {stale}; re-run scripts/gpu-tune-h200.sh"


# Schema-1 configs (integer codes): each kernel with every code its configs took, and the config each reads as.
_WS = dict(warp_specialized=True)
_SCHEMA_1 = [
    ("fwd", "128,64,8,3", {}, KernelConfig(128, 64, 8, 3)),
    ("fwd", "128,128,4,2", {"warpspec": 1}, KernelConfig(128, 128, 4, 2, **_WS)),
    ("fwd", "128,128,4,2", {"warpspec": 1, "persistent": 1}, KernelConfig(128, 128, 4, 2, **_WS, schedule=PERSISTENT)),
    ("fwd", "64,128,4,2", {"warpspec": 1, "persistent": 2}, KernelConfig(64, 128, 4, 2, **_WS, schedule=TWO_AN_SM)),
    ("fwd", "128,128,4,2", {"warpspec": 2}, KernelConfig(128, 128, 4, 2, **_WS, pingpong=True)),
    ("fwd", "128,128,4,2", {"warpspec": 2, "persistent": 1},
     KernelConfig(128, 128, 4, 2, **_WS, pingpong=True, schedule=PERSISTENT)),
    ("bwd_dkdv", "32,64,4,3", {"warpspec": 0, "persistent": 0}, KernelConfig(32, 64, 4, 3)),
    ("bwd_dkdv", "64,128,4,2", {"warpspec": 1}, KernelConfig(64, 128, 4, 2, **_WS)),
    ("bwd_dkdv", "64,128,4,2", {"warpspec": 1, "persistent": 1},
     KernelConfig(64, 128, 4, 2, **_WS, schedule=PERSISTENT)),
    ("bwd_dkdv", "64,64,4,3", {"warpspec": 1, "persistent": 2}, KernelConfig(64, 64, 4, 3, **_WS, schedule=TWO_AN_SM)),
    ("bwd_dkdv", "64,128,4,3", {"warpspec": 2}, KernelConfig(64, 128, 4, 3, **_WS, fused_dq=True)),
    ("bwd_dkdv", "64,128,4,3", {"warpspec": 2, "persistent": 1},
     KernelConfig(64, 128, 4, 3, **_WS, fused_dq=True, schedule=PERSISTENT)),
    ("bwd_dkdv", "64,64,4,3", {"warpspec": 2, "persistent": 2},
     KernelConfig(64, 64, 4, 3, **_WS, fused_dq=True, schedule=TWO_AN_SM)),
    ("bwd_dq", "128,64,8,3", {"pipeline_qk": 0}, KernelConfig(128, 64, 8, 3)),
    ("bwd_dq", "128,64,4,3", {"warpspec": 1}, KernelConfig(128, 64, 4, 3, **_WS)),
    ("bwd_dq", "128,64,4,3", {"warpspec": 1, "persistent": 1}, KernelConfig(128, 64, 4, 3, **_WS, schedule=PERSISTENT)),
    ("bwd_dq", "64,64,4,2", {"warpspec": 1, "persistent": 2}, KernelConfig(64, 64, 4, 2, **_WS, schedule=TWO_AN_SM)),
]  # fmt: skip


def _schema_1_file(path) -> None:
    """A schema-1 file of _SCHEMA_1's configs, one entry each (head dims 1, 2, ... keep their keys apart), as that
    schema's writer laid them out: the codes beside the tile fields, the baseline's config in codes too."""
    entries = []
    for i, (kernel, tiles, codes, _) in enumerate(_SCHEMA_1):
        tile_fields = ("block_m", "block_n", "num_warps", "num_stages")
        config = dict(zip(tile_fields, map(int, tiles.split(",")), strict=True), **codes)
        entries.append({"key": {"head_dim": i + 1, "dtype": "bf16", "causal": i % 2 == 0, "kernel": kernel},
                        "config": config, "ms": 1.0, "tflops": 100.0, "trials": 8, "spread": 0.01,
                        "baseline": {"name": "planner-default", "config": config, "ms": 1.5},
                        "triton_version": "3.6.0", "torch_version": "2.11.0", "template_hash": "0" * 16,
                        "date": "2026-11-30"})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"schema_version": 1, "device": DEVICE, "entries": entries}, sort_keys=False))


def test_a_schema_1_file_reads_as_the_same_configs_and_is_rewritten_in_schema_2(config_dir):
    # Schema 1 spelled the template and schedule as codes whose meaning depended on the kernel (warpspec 2: the
    # forward's ping-pong, the dK/dV kernel's fused dQ; persistent 2: two programs an SM). Each reads as one config of
    # the named flags, with the split tail at its default (what schema-1 configs ran).
    path = config_dir / "env" / "cpu-interpreter.yaml"
    _schema_1_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in it is malformed
        data, entries = store.read_file(path)
    assert data["schema_version"] == 1
    expected = [config for _, _, _, config in _SCHEMA_1]
    for config in expected:
        assert config.schedule.split_tail
    assert [e.config for e in entries] == expected
    assert all(e.config.combination_error(e.key.kernel) is None for e in entries)
    assert [e.baseline["config"] for e in entries] == [e.config.to_dict() for e in entries]  # the record too
    # Any write rewrites the file in schema 2, every entry kept with its config.
    store.write_entries(path, DEVICE, [])
    text = path.read_text()
    assert text.startswith("schema_version: 2") and "warpspec" not in text and "persistent: true" in text
    again = store.read_file(path)[1]
    assert sorted((e.key.head_dim, e.config) for e in again) == sorted((e.key.head_dim, e.config) for e in entries)


def test_an_entry_with_the_retired_causal_tail_switch_loads_and_never_breaks_a_model(config_dir, device):
    # A file written while schedules had causal_tail (schedule.RETIRED_FIELDS) reads without malformed entries: the
    # field is read as absent. An entry tuned with it on recorded the hash of the tail's code too (bd9016cf…: this
    # config's, as that fa2tune computed it), which nothing runs now, so it is stale: one warning, the next source.
    # One with it off is the config it always was, and is used. A model's forward and backward run as without them.
    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    tail_on = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "warp_specialized": True,
               "schedule": {"persistent": True, "causal_tail": True}}  # fmt: skip
    dq = KernelConfig(16, 32, 4, 1)
    record = {"ms": 1.0, "tflops": None, "baseline": {"name": "planner-default"}, "trials": 7, "spread": None,
              "triton_version": "3.6.0", "torch_version": "2.11.0", "date": "2026-11-29"}  # fmt: skip
    key = {"head_dim": 64, "dtype": "fp32", "causal": True}
    entries = [{"key": {**key, "kernel": "fwd"}, "config": tail_on, "template_hash": "bd9016cf4f61ea04", **record},
               {"key": {**key, "kernel": "bwd_dq"}, "config": {**dq.to_dict(), "schedule": {"causal_tail": False}},
                "template_hash": codegen.code_hash("bwd_dq", causal=True), **record}]  # fmt: skip
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({"schema_version": 2, "device": DEVICE, "entries": entries}, sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in it is malformed
        _, read = store.read_file(path)
    assert [e.config for e in read] == [KernelConfig(64, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT), dq]
    q, k, v = (torch.randn(1, 2, 40, 64, device=device, requires_grad=True) for _ in range(3))
    with pytest.warns(RuntimeWarning, match=r"tuned for kernel templates bd9016cf4f61ea04.*\(stale\)") as caught:
        out = fa2tune.attention(q, k, v, causal=True)
        out.sum().backward()
    assert not [w for w in caught if "malformed" in str(w.message)]
    assert selection.resolve("fwd", 64, torch.float32, True, device)[1] == "planner-default"
    assert selection.resolve("bwd_dq", 64, torch.float32, True, device) == (dq, str(path))
    from fa2tune.tune.reference import naive_attention

    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = naive_attention(*ref, causal=True)[0]
    ref_out.sum().backward()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # A write keeps both entries, without the field, and sets nothing aside (none was malformed).
    store.write_entries(path, DEVICE, [])
    assert "causal_tail" not in path.read_text() and not list(path.parent.glob("*.corrupt-*"))
    assert {(e.key, e.config) for e in store.read_file(path)[1]} == {(e.key, e.config) for e in read}


def test_grouped_query_calls_read_a_buckets_grouped_entry_first_and_mha_calls_never(config_dir, device):
    from fa2tune.config.types import Mask
    from fa2tune.launch import launcher

    slug = selection.device_info(device).slug
    path = config_dir / "env" / f"{slug}.yaml"
    long_cfg, short_cfg, gqa_cfg, dq_cfg, gqa_medium = (
        KernelConfig(32, 16, 4, 1), KernelConfig(16, 16, 4, 1), KernelConfig(16, 32, 4, 2), KernelConfig(32, 32, 4, 1),
        KernelConfig(64, 16, 4, 1))  # fmt: skip
    store.write_entries(path, DEVICE, [_entry(cfg=long_cfg), _entry(cfg=short_cfg, bucket="short"),
                                       _entry(cfg=gqa_cfg, gqa=True, heads=[32, 8]),
                                       _entry(cfg=gqa_medium, gqa=True, heads=[32, 8], bucket="medium"),
                                       _entry(kernel="bwd_dq", cfg=dq_cfg)])  # fmt: skip
    resolve = lambda n, gqa, kernel="fwd": selection.resolve(kernel, 64, torch.float32, False, device, seqlen=n,
                                                             gqa=gqa)[0]  # fmt: skip
    # A GQA call: its length bucket's grouped entry, then its plain one, then "all"'s grouped and plain ones
    assert [resolve(n, True) for n in (512, 2048, None)] == [short_cfg, gqa_medium, gqa_cfg]
    assert [resolve(n, False) for n in (512, 2048, None)] == [short_cfg, long_cfg, long_cfg]  # MHA: never grouped
    assert resolve(None, True, "bwd_dq") == dq_cfg  # no grouped entry: what MHA calls read
    assert selection.resolve("fwd", 64, torch.float32, False, device, gqa=True)[1] == str(path)
    # What a call is: fewer K/V heads than query heads, in SDPA's layout and packed
    q, k = torch.empty(1, 4, 5000, 64, device=device), torch.empty(1, 2, 5000, 64, device=device)
    assert selection.config_for(None, "fwd", q, k, k, Mask(), None) == gqa_cfg
    assert selection.config_for(None, "fwd", q, q, q, Mask(), None) == long_cfg
    packing = launcher.Packing(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 64, 64)
    packed_q, packed_k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # (tokens, heads, d)
    seen, real_resolve = [], selection.resolve
    try:
        selection.resolve = lambda *args, gqa=False, **kw: seen.append(gqa) or real_resolve(*args, gqa=gqa, **kw)
        for keys in (packed_k, packed_q):
            selection.config_for(None, "fwd", packed_q, keys, keys, Mask(), packing)
    finally:
        selection.resolve = real_resolve
    assert seen == [True, False]
    assert fa2tune.get_kernel(64, device=device, dtype=torch.float32, gqa=True).config == gqa_cfg
    assert fa2tune.get_kernel(64, device=device, dtype=torch.float32).config == long_cfg
    # Either kernel runs each call's own grouping's forward config, as the backward (resolved per call) does
    launched, real = [], attention_kernel.checked_apply
    long_q, long_k = torch.empty(1, 4, 5000, 64, device=device), torch.empty(1, 2, 5000, 64, device=device)
    try:
        attention_kernel.checked_apply = lambda q, k, v, causal, scale, window, prefix, lse, config, packing, chosen: (
            launched.append(config))  # fmt: skip
        medium_q, medium_k = long_q[:, :, :2048], long_k[:, :, :2048]
        for gqa in (False, True):
            kernel = fa2tune.get_kernel(64, device=device, dtype=torch.float32, gqa=gqa)
            for q_, k_ in ((long_q, long_k), (long_q, long_q), (medium_q, medium_k), (medium_q, medium_q)):
                kernel(q_, k_, k_)
    finally:
        attention_kernel.checked_apply = real
    assert launched == [gqa_cfg, long_cfg, gqa_medium, long_cfg] * 2
    # A grouped study's incumbent where its file holds none is what its calls read now from its bucket: the grouped
    # entry, else the plain one ("all"'s is a bucket study's baseline)
    from fa2tune.tune import job

    spec = lambda bucket: job.StudySpec(kernel="fwd", head_dim=64, dtype="fp32", causal=False, seqlen_bucket=bucket,
                                        heads=32, kv_heads=8)  # fmt: skip
    info, target = selection.device_info(device), config_dir / "target.yaml"
    assert job.incumbent(spec("medium"), target, info) == (gqa_medium, "the config calls read now", str(path))
    assert job.incumbent(spec("short"), target, info).config == short_cfg
    assert job.incumbent(spec("all"), target, info).config == gqa_cfg
    assert job.incumbent(replace(spec("medium"), heads=None, kv_heads=None), target, info) is None
    # A grouped "all" study is tuned at the lengths bucket entries, grouped or plain, leave it: in the file it writes
    # or in the GPU's own files, which its calls read first
    assert job.unserved_lengths(spec("all"), path) == job.LONG_LENGTHS  # 16k alone is left: 8k joins it
    assert job.unserved_lengths(spec("all"), target) == (1024, 4096, 16384)  # no file there
    assert job.unserved_lengths(spec("all"), target, info) == job.LONG_LENGTHS
    # A grouped bucket study must beat what its calls ran without it: the bucket's plain entry, else "all"'s
    assert job.baseline(spec("short"), device, info) == (short_cfg, "seqlen_bucket short (plain)")
    assert job.baseline(spec("medium"), device, info) == (gqa_cfg, "seqlen_bucket all")
    assert job.baseline(replace(spec("short"), heads=None, kv_heads=None), device, info) == (long_cfg,
                                                                                            "seqlen_bucket all")
    with pytest.raises(TypeError, match="gqa must be True or False"):
        fa2tune.get_kernel(64, device=device, dtype=torch.float32, gqa="yes")
    # On disk: `gqa` and `heads` only where they say something, so files without grouped entries read as before
    raw = yaml.safe_load(path.read_text())["entries"]
    assert sorted(("gqa" in e["key"], e.get("heads", [])) for e in raw) == [(False, [])] * 3 + [(True, [32, 8])] * 2
    grouped = next(e for e in store.read_file(path)[1] if e.key.gqa)
    assert store.Entry.from_dict(grouped.to_dict()) == grouped and grouped.heads == [32, 8]


def test_a_grouped_key_and_its_heads_are_checked(config_dir):
    with pytest.raises(ValueError, match="gqa must be true or false"):
        store.EntryKey(head_dim=64, dtype="bf16", causal=False, kernel="fwd", gqa=1)
    with pytest.raises(ValueError, match="gqa must be false"):
        store.EntryKey(head_dim=64, dtype="bf16", causal=False, kernel="decode", gqa=True)
    for heads, says in (([32, 5], "K/V heads dividing"), ([32], "heads must be"), ([0, 8], "ints in 1..65535"),
                        ([8, 8], "do not group query heads, and the key's gqa is true")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            _entry(gqa=True, heads=heads)
    with pytest.raises(ValueError, match="group query heads, and the key's gqa is false"):
        _entry(heads=[32, 8])
    # In a file: the malformed entries are skipped with one warning, the others used
    path = config_dir / "env" / "cpu-interpreter.yaml"
    store.write_entries(path, DEVICE, [_entry(), _entry(causal=True)])
    data = yaml.safe_load(path.read_text())
    data["entries"][0]["heads"], data["entries"][1]["key"]["gqa"] = "32/8", "yes"
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(RuntimeWarning, match="heads must be list or null.*gqa must be true or false"):
        assert store.read_file(path)[1] == []
