"""Renders the Triton templates in templates/ for one variant, writes the source to a disk cache and imports it.

Triton's @jit reads a kernel's source from its file, so a rendered variant must live in a real ``.py`` file.
Files are named by the hash of their source: two processes rendering the same variant write the same bytes,
and each write goes to a temporary file first and is renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import io
import os
import sys
import tempfile
import threading
import tokenize
from pathlib import Path
from types import ModuleType

import jinja2

from ..config import head_chunks, paths
from ..config.decode_config import DECODE_KERNEL
from ..config.types import KERNELS

TEMPLATES = ("fwd", "bwd", "fwd_ws", "bwd_ws", "bwd_dq_ws", "decode")
_lock = threading.Lock()
_modules: dict[tuple[str, object, str], ModuleType] = {}


def templates_dir() -> Path:
    """Folder holding the ``*.py.jinja`` templates: the installed package's copy, else the source tree's."""
    here = Path(__file__).resolve().parent.parent  # the package folder
    for candidate in (here / "templates", here.parent / "templates"):  # wheel layout, then source checkout
        if (candidate / "fwd.py.jinja").is_file():
            return candidate
    raise FileNotFoundError(
        f"fa2tune's kernel templates were not found in {here / 'templates'} or {here.parent / 'templates'}; "
        "reinstall fa2tune"
    )


# The template each kernel (KERNELS) is rendered from; tuned entries go stale with their own template only. A
# warp-specialized config runs the kernel's warp-specialized template instead (template_for).
TEMPLATE_OF = dict(zip(KERNELS, ("fwd", "bwd", "bwd"), strict=True))
WARPSPEC_TEMPLATE_OF = dict(zip(KERNELS, ("fwd_ws", "bwd_ws", "bwd_dq_ws"), strict=True))


def template_for(kernel: str, warp_specialized: bool = False) -> str:
    """The template `kernel` runs with a config of this KernelConfig.warp_specialized."""
    return WARPSPEC_TEMPLATE_OF[kernel] if warp_specialized else TEMPLATE_OF[kernel]


@functools.cache
def template_hash(template: str | None = None) -> str:
    """Hash of the template files a kernel module is rendered from: `template` ("fwd", "bwd") and every file it
    includes or imports, so a tuned entry goes stale when its own kernel's source could change and not when
    another template does. None: every template file.
    """
    if template is None:
        files = sorted(path.name for path in templates_dir().glob("*.jinja"))
    else:
        files = sorted(_dependencies(f"{template}.py.jinja"))
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode())
        digest.update((templates_dir() / name).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def code_hash(
    kernel: str,
    *,
    causal: bool,
    window: bool = False,
    varlen: bool = False,
    pipeline_qk: bool = False,
    warp_specialized: bool = False,
    pingpong: bool = False,
    fused_dq: bool = False,
    persistent: bool = False,
    split_roles: bool = False,
    stage_stats: bool = False,
    drain_before_dq: bool = False,
    pad_head_dim: bool = False,
    head_dim: int | None = None,
) -> str:
    """Hash of the Triton code a tuned entry for this kernel and mask runs: the rendered modules of its variants
    (each combination of even and ragged tails), provenance comments left out. A stored entry records it and goes
    stale exactly when that code changes — not when another kernel's template does, nor when a template gains a
    switch that is off for this entry, nor when a comment changes — so performance work on one variant does not void
    every shipped config.
    pipeline_qk, warp_specialized, pingpong, fused_dq, split_roles, drain_before_dq, pad_head_dim: the entry's config
    switches of those names (KernelConfig), persistent its schedule's (Schedule), stage_stats
    KernelConfig.stages_statistics, which select other code (pad_head_dim: other chunks, only where it changes them).
    """
    from ..config.types import Variant

    template = template_for(kernel, warp_specialized)
    one_variant = varlen or template in WARPSPEC_TEMPLATE_OF.values()  # no code of their own for even tails
    tails = [(False, False)] if one_variant else [(m, n) for m in (True, False) for n in (True, False)]
    digest = hashlib.sha256(template.encode())
    for even_m, even_n in tails:
        variant = Variant.for_template(
            template, causal=causal, banded=window, varlen=varlen, even_m=even_m, even_n=even_n,
            pipeline_qk=pipeline_qk, pingpong=pingpong, persistent=persistent, fused_dq=fused_dq,
            split_roles=split_roles, stage_stats=stage_stats, drain_before_dq=drain_before_dq,
            pad_head_dim=pad_head_dim, head_dim=head_dim,
        )  # fmt: skip
        digest.update(_code_only(render(template, variant)).encode())
    return digest.hexdigest()[:16]


def _code_only(source: str) -> str:
    """The code of a rendered module without its comments, docstrings and blank lines: what a stored entry's hash
    must follow. A reworded comment, or a module moved within the package that a docstring names, leaves every
    tuned entry valid. Source text, not the syntax tree: ast.dump's output differs between Python versions (3.12
    adds fields), and a stamp made under one must hold under every other."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]) and body[0].lineno > getattr(node, "lineno", 0):
            lines[body[0].lineno - 1 : body[0].end_lineno] = [""] * (body[0].end_lineno - body[0].lineno + 1)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            lines[row - 1] = lines[row - 1][:column]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))  # fmt: skip


@functools.cache
def decode_code_hash() -> str:
    """Hash of the Triton code a tuned decode entry runs: templates/decode.py.jinja rendered for a contiguous and a
    paged cache (one entry serves both), provenance comments left out, as code_hash does for the other kernels."""
    from ..config.decode_plan import DecodeVariant

    digest = hashlib.sha256(DECODE_KERNEL.encode())
    for paged in (False, True):
        digest.update(_code_only(render("decode", DecodeVariant(paged=paged))).encode())
    return digest.hexdigest()[:16]


def entry_code_hash(key, config) -> str:
    """code_hash of the code a stored entry runs: its key (store.EntryKey: kernel, causal, window, varlen) and the
    switches of its config that select other code; decode_code_hash for a decode entry. The one rule the store's
    writer, its reader and the shipped-file test share."""
    if key.kernel == DECODE_KERNEL:
        return decode_code_hash()
    return code_hash(key.kernel, causal=key.causal, window=key.window, varlen=key.varlen,
                     warp_specialized=config.warp_specialized, head_dim=key.head_dim,
                     **config.template_switches(key.kernel))  # fmt: skip


def _dependencies(name: str) -> set[str]:
    """`name` and the templates it includes or imports, recursively."""
    from jinja2 import meta

    found, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        source = (templates_dir() / current).read_text()
        todo.extend(ref for ref in meta.find_referenced_templates(_environment().parse(source)) if ref)
    return found


@functools.cache
def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,  # a misspelt switch is an error, not an empty string
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["offsets"] = head_chunks.offsets  # the first column of each of a list of chunks
    # the fused-dQ backward's column blocks, their widths and their shares among consumers
    environment.globals.update(dq_blocks=head_chunks.dq_blocks, dq_widths=head_chunks.dq_widths,
                               dq_shares=head_chunks.dq_shares)  # fmt: skip
    return environment


def render(template: str, variant: object) -> str:
    """Returns the Triton (or, for the warp-specialized *_ws templates, Gluon) source of
    templates/<template>.py.jinja for a Variant."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if not dataclasses.is_dataclass(variant):
        raise TypeError(f"variant must be a dataclass instance, got {type(variant).__name__}")
    fields = dataclasses.asdict(variant)
    source = _environment().get_template(f"{template}.py.jinja")
    return source.render(**fields, variant=repr(variant), template_hash=template_hash(template))


def cache_dir() -> Path:
    """Where rendered modules live: $FA2TUNE_CACHE_DIR/kernels, else fa2tune's user cache (paths.cache_dir)."""
    if os.environ.get("FA2TUNE_CACHE_DIR"):
        return Path(os.environ["FA2TUNE_CACHE_DIR"]) / "kernels"
    return paths.cache_dir("kernels")


def _write_once(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    if path.is_file():
        # The name is the content's hash, but a file can be damaged after it was written (a full disk, an interrupted
        # copy of the cache): one comparison a variant a process, so a damaged file is written again rather than
        # failing every import after it.
        try:
            if path.read_text() == source:
                return path
        except (OSError, UnicodeDecodeError):
            pass
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(source)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)  # atomic on POSIX: readers see the old state or the whole file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_module(template: str, variant: object) -> Path:
    """Renders and writes one variant's module to the disk cache; returns its path."""
    source = render(template, variant)
    name = f"{template}_{hashlib.sha256(source.encode()).hexdigest()[:20]}.py"
    try:
        return _write_once(cache_dir(), name, source)
    except OSError:
        # A read-only home (some clusters) must not stop attention(): fall back to a private temp folder.
        return _write_once(Path(tempfile.gettempdir()) / f"fa2tune-{os.getuid()}" / "kernels", name, source)


def load(template: str, variant: object) -> ModuleType:
    """Imports the rendered module of one variant (rendered and written on first use, then cached per process).

    The Triton interpreter decides at import time whether @jit builds a GPU or an interpreted function,
    so the in-memory cache is keyed on TRITON_INTERPRET too.
    """
    key = (template, variant, os.environ.get("TRITON_INTERPRET", "0"))
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is None:
            path = write_module(template, variant)
            name = f"fa2tune._generated.{path.stem}_{len(_modules)}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            _modules[key] = module
    return module
