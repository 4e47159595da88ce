"""The store's reader against malformed files: whatever `<slug>.yaml` holds or is, a lookup never raises, gives a
config the device runs (the file's well-formed entry for the key, else the planner's default) and warns once per
file and cause. Cases are generated from a valid file (every field of the schema given every wrong type and edge
value, every container replaced, truncation at every few bytes) and from seeded random bytes."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import warnings
from dataclasses import MISSING, fields, replace

import pytest
import torch
import yaml

import fa2tune
from fa2tune.api import attention_kernel, selection
from fa2tune.config import defaults, lengths, planner, schema_v1, store
from fa2tune.config.entries import is_iso_date
from fa2tune.config.schedule import Schedule
from fa2tune.config.types import DTYPE_CHOICES, KERNELS, KernelConfig
from fa2tune.kernels import codegen
from fa2tune.tune.reference import naive_attention

SLUG = selection.device_info("cpu").slug
HEAD_DIM = 16
# The file's entries, each a config other than the planner's default, so a lookup's answer says where it came from.
CONFIGS = {
    "fwd": KernelConfig(16, 16, 4, 1),
    "bwd_dq": KernelConfig(32, 16, 4, 1),
    "bwd_dkdv": KernelConfig(16, 32, 4, 1),
}
# Wrong types and edge values tried in every field (those a field takes are left out there).
BAD_VALUES = ["16", "", "fp8", 16.0, 2.5, float("inf"), float("-inf"), float("nan"), True, False, -1, 0, 3, 2**70,
              [16], [], {"a": 1}, {}, None]  # fmt: skip


def _entry(kernel: str) -> dict:
    """A well-formed entry for `kernel` as the tuner writes it."""
    key = store.EntryKey(head_dim=HEAD_DIM, dtype="fp32", causal=False, kernel=kernel)
    config = CONFIGS[kernel]
    return store.Entry(key=key, config=config, ms=1.0, tflops=None, baseline={"name": "planner-default"}, trials=3,
                       spread=0.01, triton_version="3.6.0", torch_version="2.13.0",
                       template_hash=codegen.entry_code_hash(key, config), date="2026-11-29").to_dict()  # fmt: skip


def _dump(data: object) -> str:
    return yaml.safe_dump(data, sort_keys=False)  # as the store writes: the entries last


def _document(*entries: dict) -> dict:
    return {"schema_version": store.SCHEMA_VERSION, "device": {"name": "cpu", "slug": SLUG}, "entries": list(entries)}


def _default(kernel: str) -> tuple[KernelConfig, str]:
    config = defaults.default_config(
        HEAD_DIM, torch.float32, causal=False, kernel=kernel, device=selection.device_info("cpu")
    )
    return config, "planner-default"


@pytest.fixture
def path(tmp_path, monkeypatch):
    """Where the file under test goes: the first directory of the search path; the others are empty."""
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(store, "shipped_config_dir", lambda: tmp_path / "shipped")
    (tmp_path / "env").mkdir()
    yield tmp_path / "env" / f"{SLUG}.yaml"
    attention_kernel.clear_cache()
    store._warned.clear()


@pytest.fixture(params=["c", "python"])
def loader(request, monkeypatch):
    """The store's loader, and the same on PyYAML's pure-Python parser (what runs where PyYAML lacks libyaml)."""
    if request.param == "python":
        monkeypatch.setattr(store, "_Loader", store.loader_on(yaml.SafeLoader))
        monkeypatch.setattr(store, "_parsed", {})
    return request.param


def _lookups(path) -> tuple[dict[str, tuple[KernelConfig, str]], list[str]]:
    """What each kernel resolves to from a fresh start, twice over, and the fa2tune warnings that name `path`."""
    attention_kernel.clear_cache()
    store._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = {kernel: selection.resolve(kernel, HEAD_DIM, torch.float32, False, "cpu") for kernel in CONFIGS}
        attention_kernel.clear_cache()  # the second round reads the file again and must not warn again
        again = {kernel: selection.resolve(kernel, HEAD_DIM, torch.float32, False, "cpu") for kernel in CONFIGS}
    assert again == got
    device = selection.device_info("cpu")
    for kernel, (config, _) in got.items():
        assert isinstance(config, KernelConfig)
        assert planner.check(config, device, HEAD_DIM, torch.float32, kernel) is None
    messages = [str(w.message) for w in caught if str(w.message).startswith("fa2tune")]
    return got, [m for m in messages if str(path) in m]


def _assert_falls_back(path, case: str) -> None:
    got, messages = _lookups(path)
    assert got == {kernel: _default(kernel) for kernel in CONFIGS}, case
    assert len(messages) == 1, f"{case}: {messages}"


# The schema as the test sees it: which values each field of an entry takes.
def _config_takes(name):
    def takes(value):
        if name == "schedule":  # a mapping of its own fields, each mutated below; {} is the default schedule
            return value == {} and type(value) is dict
        if type(getattr(KernelConfig(16, 16), name)) is bool:  # the switches
            return type(value) is bool
        try:
            return type(value) is int and replace(KernelConfig(16, 16), **{name: value}) is not None
        except ValueError:
            return False

    return takes


def _schedule_takes(name):
    if name == "programs_per_sm":
        return lambda v: type(v) is int and v in (1, 2)
    return lambda v: type(v) is bool


_NUMBER = lambda v: type(v) in (int, float)
_SCHEMA = {
    ("key", "head_dim"): lambda v: type(v) is int and 1 <= v <= 256,
    ("key", "dtype"): lambda v: type(v) is str and v in DTYPE_CHOICES,
    ("key", "kernel"): lambda v: type(v) is str and v in KERNELS,
    ("key", "seqlen_bucket"): lambda v: type(v) is str and v in lengths.SEQLEN_BUCKETS,
    **{("key", name): lambda v: type(v) is bool for name in ("causal", "window", "varlen")},
    **{("config", f.name): _config_takes(f.name) for f in fields(KernelConfig)},
    **{("config", "schedule", f.name): _schedule_takes(f.name) for f in fields(Schedule)},
    ("ms",): _NUMBER,
    ("tflops",): lambda v: v is None or _NUMBER(v),
    ("spread",): lambda v: v is None or _NUMBER(v),
    ("trials",): lambda v: type(v) is int,
    ("baseline",): lambda v: v is None or type(v) is dict,
    **{(name,): lambda v: type(v) is str for name in ("triton_version", "torch_version", "template_hash")},
    ("date",): lambda v: type(v) is str and is_iso_date(v),
}
_REQUIRED = {("key", f.name) for f in fields(store.EntryKey) if f.default is MISSING}
_REQUIRED |= {("config", f.name) for f in fields(KernelConfig) if f.default is MISSING}
_REQUIRED |= {(f.name,) for f in fields(store.Entry) if f.name not in ("key", "config")}


def _holder(entry: dict, where: tuple[str, ...]) -> dict:
    """The mapping of `entry` that holds the field at path `where`, made where the entry leaves it out (a config's
    schedule at its default)."""
    for name in where[:-1]:
        entry = entry.setdefault(name, {})
    return entry


def _mutations():
    """(name, entry): the bwd_dq entry with one thing wrong."""
    for where, takes in _SCHEMA.items():
        for value in BAD_VALUES:
            if not takes(value):
                entry = _entry("bwd_dq")
                _holder(entry, where)[where[-1]] = value
                yield f"{'.'.join(where)}={value!r}", entry
        if where in _REQUIRED:
            entry = _entry("bwd_dq")
            del _holder(entry, where)[where[-1]]
            yield f"{'.'.join(where)} missing", entry
    for container in ("key", "config", None):
        entry = _entry("bwd_dq")
        (entry[container] if container else entry)["unknown"] = 1
        yield f"unknown key in {container or 'entry'}", entry
        for value in BAD_VALUES:
            if container is None:
                yield f"entry={value!r}", value
            else:
                yield f"{container}={value!r}", {**_entry("bwd_dq"), container: value}
    deep = "x"
    for _ in range(store.MAX_DEPTH):
        deep = [deep]
    yield "baseline nested past MAX_DEPTH", {**_entry("bwd_dq"), "baseline": {"deep": deep}}


def test_a_malformed_entry_is_skipped_and_its_neighbours_used(path):
    cases = 0
    for case, bad in _mutations():
        path.write_text(_dump(_document(_entry("fwd"), bad, _entry("bwd_dkdv"))))
        got, messages = _lookups(path)
        expected = {**{k: (CONFIGS[k], str(path)) for k in ("fwd", "bwd_dkdv")}, "bwd_dq": _default("bwd_dq")}
        assert got == expected, case
        assert len(messages) == 1 and "skipped what is malformed (entry 1: " in messages[0], f"{case}: {messages}"
        cases += 1
    assert cases > 300


def test_a_malformed_schema_1_config_is_skipped_and_its_neighbours_used(path):
    # A schema-1 file's configs hold integer codes (config.schema_v1): every wrong type or value in any of its fields,
    # and a schema-2 field there, skips that entry alone.
    takes = lambda name, v: type(v) is int and v in (0, 1, 2) if name in ("warpspec", "persistent") else (
        _config_takes(name)(v))  # fmt: skip
    cases = [(name, value) for name in schema_v1.FIELDS for value in BAD_VALUES if not takes(name, value)]
    for name, value in [*cases, ("warp_specialized", True), ("schedule", {})]:
        bad = _entry("bwd_dq")
        bad["config"][name] = value
        path.write_text(_dump({**_document(_entry("fwd"), bad, _entry("bwd_dkdv")), "schema_version": 1}))
        got, messages = _lookups(path)
        expected = {**{k: (CONFIGS[k], str(path)) for k in ("fwd", "bwd_dkdv")}, "bwd_dq": _default("bwd_dq")}
        assert got == expected, (name, value)
        assert len(messages) == 1 and "skipped what is malformed (entry 1: " in messages[0], (name, value, messages)
    assert len(cases) > 100


def test_many_malformed_entries_make_one_warning(path):
    bad = [{**_entry("bwd_dq"), "ms": value} for value in ("x", None, [], {}, True)]
    path.write_text(_dump(_document(*bad, _entry("fwd"))))
    got, messages = _lookups(path)
    assert got["fwd"] == (CONFIGS["fwd"], str(path)) and got["bwd_dq"] == _default("bwd_dq")
    assert len(messages) == 1 and "and 2 more" in messages[0], messages


def test_a_repeated_key_keeps_the_first_entry(path):
    again = {**_entry("fwd"), "config": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1}}
    path.write_text(_dump(_document(_entry("fwd"), again)))
    got, messages = _lookups(path)
    assert got["fwd"] == (CONFIGS["fwd"], str(path))
    assert len(messages) == 1 and "entry 1: the key of entry 0 again" in messages[0], messages


@pytest.mark.parametrize("field", ["device", "x-unknown"])
def test_a_bad_top_level_field_warns_and_keeps_the_entries(path, field):
    for value in ([1], "x", 3, None) if field == "device" else (1,):
        path.write_text(_dump({**_document(_entry("fwd")), field: value}))
        got, messages = _lookups(path)
        assert got["fwd"] == (CONFIGS["fwd"], str(path)), (field, value)
        assert len(messages) == 1, (field, value, messages)


def _billion_laughs(levels: int = 9, width: int = 9, indent: str = "") -> str:
    lines = [f"{indent}l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _whole_file_cases(tmp_path) -> dict[str, str | bytes]:
    """Files that are wrong as a whole: no entry of theirs may be used."""
    good = _dump(_document(*map(_entry, CONFIGS)))
    python_tag = f"!!python/object/apply:os.mkdir ['{tmp_path / 'made-by-yaml'}']"
    cases: dict[str, str | bytes] = {
        "empty": "", "blank": "\n\n", "comment": "# nothing\n", "document marker": "---\n", "null": "null\n",
        "list": "- a\n- b\n", "scalar": "just text\n", "number": "123\n", "unparsable": "{not: [valid yaml",
        "unclosed flow": "schema_version: 1\nentries: [\n", "tab indent": "schema_version: 1\nentries:\n\t- a\n",
        "two documents": good + "---\n" + good, "trailing garbage": good + "]]]\n",
        "duplicate field": good.replace("num_stages: 1\n", "num_stages: 1\n    num_stages: 2\n", 1),
        "duplicate top-level key": good + "schema_version: 1\n",
        "5000-digit int": "schema_version: " + "1" * 5000 + "\nentries: []\n",
        "non-UTF-8": good.replace("planner-default", "caf\xe9", 1).encode("latin-1"),
        "UTF-16": good.encode("utf-16"),
        "NUL byte": good.replace("planner-default", "a\0b", 1),
        "20,000-deep flow nesting": "schema_version: 1\nentries: " + "[" * 20000 + "]" * 20000 + "\n",
        "1,100-deep block nesting": "".join(" " * i + "-\n" for i in range(1100)),
        "billion laughs": "schema_version: 1\nentries: []\n" + _billion_laughs(),
        "aliases to one entry past MAX_NODES": f"schema_version: 1\nentries:\n- &e {json.dumps(_entry('fwd'))}\n"
        + "- *e\n" * (store.MAX_NODES // 40),
        "python tag": f"{python_tag}\n", "python tag in an entry": good.replace("planner-default", python_tag, 1),
    }  # fmt: skip
    for name, version in (("string", "'2'"), ("float", "2.0"), ("bool", "true"), ("future", "3"), ("null", "null"),
                          ("list", "[2]"), ("inf", ".inf"), ("before schema 1", "0")):  # fmt: skip
        cases[f"schema_version {name}"] = good.replace("schema_version: 2", f"schema_version: {version}", 1)
    for name, entries in (("mapping", "{}"), ("string", "x"), ("number", "3"), ("bool", "true")):
        cases[f"entries {name}"] = f"schema_version: 1\nentries: {entries}\n"
    return cases


def test_a_malformed_file_falls_back_to_the_default(path, loader):
    for case, content in _whole_file_cases(path.parent.parent).items():
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        _assert_falls_back(path, f"{loader} loader, {case}")
    assert not (path.parent.parent / "made-by-yaml").exists()  # a tag never builds a Python object


def test_random_bytes_fall_back(path):
    for seed in range(40):
        rng = random.Random(seed)
        path.write_bytes(rng.randbytes(rng.randint(1, 4000)))
        _assert_falls_back(path, f"seed {seed}")


def test_random_yaml_like_text_falls_back(path):
    tokens = ["{", "}", "[", "]", ":", ", ", "- ", "\n", "  ", "&a ", "*a", "!!str ", "'", '"', "#", "|", ">", "?",
              "schema_version", "entries", "key", "config", "1", ".inf", "null", "true", "x"]  # fmt: skip
    for seed in range(200):
        rng = random.Random(seed)
        path.write_text("".join(rng.choice(tokens) for _ in range(rng.randint(1, 80))))
        _assert_falls_back(path, f"seed {seed}")


def test_a_truncated_file_gives_its_entries_or_the_default(path):
    text = _dump(_document(*map(_entry, CONFIGS)))
    for cut in range(0, len(text), 3):
        path.write_text(text[:cut])
        got, _ = _lookups(path)
        for kernel, found in got.items():
            assert found in (_default(kernel), (CONFIGS[kernel], str(path))), f"cut at {cut}: {kernel} {found}"


def _fill(path, kind: str, tmp_path):
    """Puts `kind`, something other than a readable file, at `path`; returns the path lookup tries."""
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "symlink loop":
        os.symlink(path.with_name("other.yaml"), path)
        os.symlink(path, path.with_name("other.yaml"))
    elif kind == "link to itself":
        os.symlink(path, path)
    elif kind == "dangling symlink":
        os.symlink(tmp_path / "nowhere.yaml", path)
    elif kind == "read error (EIO)":
        os.symlink("/proc/self/mem", path)  # a regular file whose read fails, for root too
    elif kind == "over MAX_FILE_BYTES":
        with open(path, "wb") as handle:
            handle.truncate(store.MAX_FILE_BYTES + 1)  # sparse: costs no disk, and is never read
    elif kind == "config dir is a file":
        path.parent.rmdir()
        path.parent.write_text(_dump(_document(_entry("fwd"))))
    elif kind == "no read permission":
        path.write_text(_dump(_document(_entry("fwd"))))
        path.chmod(0)
    return path


NOT_A_FILE = ["directory", "FIFO", "socket", "symlink loop", "link to itself", "dangling symlink",
              "read error (EIO)", "over MAX_FILE_BYTES", "config dir is a file", "no read permission"]  # fmt: skip


@pytest.mark.parametrize("kind", NOT_A_FILE)
def test_what_is_not_a_readable_file_falls_back(path, kind, tmp_path):
    if kind == "read error (EIO)" and not os.path.exists("/proc/self/mem"):
        pytest.skip("no /proc/self/mem here")
    if kind == "no read permission" and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    _fill(path, kind, tmp_path)
    # A FIFO opened for reading waits for a writer: lookup must not; the alarm turns a hang into a failure.
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"lookup blocked on a {kind}"))
    signal.alarm(20)
    try:
        _assert_falls_back(path, kind)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_bomb_or_cycle_in_one_entry_skips_that_entry(path):
    good = _dump(_document(_entry("fwd")))
    bad = _dump([_entry("bwd_dq")])
    laughs = bad.replace("baseline:\n    name: planner-default\n", "baseline:\n" + _billion_laughs(indent="    "))
    cycle = bad.replace("baseline:\n    name: planner-default\n", "baseline: &b\n    self: *b\n")
    for case, text in (("billion laughs", laughs), ("cycle", cycle)):
        assert text != bad
        path.write_text(good + text)
        got, messages = _lookups(path)
        assert got["fwd"] == (CONFIGS["fwd"], str(path)) and got["bwd_dq"] == _default("bwd_dq"), case
        assert len(messages) == 1 and "entry 1: " in messages[0], f"{case}: {messages}"


@pytest.mark.parametrize(
    "case", ["num_stages .inf", "20,000-deep nesting", "a bad entry beside good ones"]
)  # fmt: skip
def test_attention_runs_with_the_issues_files(path, loader, case):
    # The reported files: attention() raised OverflowError, RecursionError, or ignored the good entries.
    good = _dump(_document(_entry("fwd"), _entry("bwd_dkdv")))
    text = {
        "num_stages .inf": good.replace("num_stages: 1", "num_stages: .inf", 1),
        "20,000-deep nesting": good + "x: " + "[" * 20000 + "]" * 20000 + "\n",
        "a bad entry beside good ones": good + _dump([{**_entry("bwd_dq"), "config": {"block_m": 17}}]),
    }[case]
    path.write_text(text)
    attention_kernel.clear_cache()
    q, k, v = (torch.randn(1, 2, 24, HEAD_DIM, dtype=torch.float32, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fa2tune.attention(q, k, v)
        out.sum().backward()
        fa2tune.attention(q, k, v)
    assert len([w for w in caught if str(path) in str(w.message)]) == 1, [str(w.message) for w in caught]
    ref = naive_attention(q.double(), k.double(), v.double())[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    q_ref = q.detach().double().requires_grad_()
    naive_attention(q_ref, k.detach().double(), v.detach().double())[0].sum().backward()
    torch.testing.assert_close(q.grad.double(), q_ref.grad, rtol=1e-4, atol=1e-4)
    used = {kernel: selection.resolve(kernel, HEAD_DIM, torch.float32, False, "cpu")[1] for kernel in CONFIGS}
    if case == "a bad entry beside good ones":
        assert used == {"fwd": str(path), "bwd_dkdv": str(path), "bwd_dq": "planner-default"}
    elif case == "num_stages .inf":
        assert used == {"fwd": "planner-default", "bwd_dkdv": str(path), "bwd_dq": "planner-default"}
