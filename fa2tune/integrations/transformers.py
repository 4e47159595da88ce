"""fa2tune as a Hugging Face transformers attention implementation, `attn_implementation="fa2tune"`:

    from fa2tune.integrations import transformers as fa2tune_hf
    fa2tune_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa2tune")

register() puts attention_forward in transformers' AttentionInterface and hf_masks.fa2tune_mask in its
AttentionMaskInterface under one name. Both are needed: for an attention name without a mask function transformers
builds no mask and hands the attention function attention_mask=None, so a padded row would attend to its padding.

Importing this module does not import transformers (fa2tune needs none of it); register() does, and says how to
install it when it is missing. docs/API.md, "Hugging Face transformers", has the exact semantics.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

import torch

from ..api.attention import attention, attention_varlen
from ..api.kvcache import flash_attn_with_kvcache
from ..api.sdpa import autocast_inputs
from ..config.inputs import check_qkv
from ..launch.launcher import is_eager, needs_grad
from ..launch.short_query import few_tokens, one_key_table
from .hf_masks import MaskPlan, Pattern, Rows, fa2tune_mask

NAME = "fa2tune"
# The oldest transformers the integration is tested with (the `hf` extra in pyproject.toml says the same).
MIN_TRANSFORMERS = (5, 17)
# sdpa_mask's arguments that fa2tune_mask reads: the mask interface's calling convention.
_MASK_ARGUMENTS = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask")
# Attention-function arguments that change the result and that fa2tune's kernels do not compute.
_UNSUPPORTED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}

__all__ = ["NAME", "attention_forward", "register"]


def register(name: str = NAME) -> str:
    """Registers fa2tune with transformers as `attn_implementation=name`, for every model loaded or switched
    (`model.set_attn_implementation(name)`) after it; calling it again changes nothing. Returns `name`.

    Raises:
        ImportError: transformers is not installed, or older than MIN_TRANSFORMERS / without the mask interface.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    attention_interface, mask_interface = _interfaces()
    _sdpa_attention()
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, fa2tune_mask)
    return name


def _interfaces() -> tuple[type, type]:
    """transformers' AttentionInterface and AttentionMaskInterface, once its version is checked."""
    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        hf = importlib.import_module("transformers")
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError as error:
        raise ImportError(
            f"fa2tune's transformers integration needs Hugging Face transformers >= {need}: "
            "pip install 'fa2tune[hf]' (or pip install transformers)"
        ) from error
    version = _version(hf.__version__)
    parameters = inspect.signature(masking.sdpa_mask).parameters
    if version < MIN_TRANSFORMERS or not all(p in parameters for p in _MASK_ARGUMENTS):
        raise ImportError(
            f"fa2tune's transformers integration needs transformers >= {need} (its mask interface), "
            f"got {hf.__version__}: pip install -U transformers"
        )
    return hf.AttentionInterface, masking.AttentionMaskInterface


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as 5.25.0 or 5.26.0.dev0."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: MaskPlan | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, run by fa2tune.

    Args:
        module: the calling attention layer (its `is_causal` is read when no mask was built).
        query: (batch, heads_q, q_length, head_dim); key, value: (batch, heads_kv, kv_length, head_dim), GQA as
            fa2tune.attention takes it.
        attention_mask: what fa2tune_mask built (a MaskPlan, or SDPA's boolean mask for a mask fa2tune does not
            run, which goes to SDPA), a 4-D mask the caller built (SDPA too), or None: no mask was built, and
            `is_causal`/`sliding_window` say the pattern, as for flash_attention_2.
        dropout, softcap, and kwargs s_aux, sinks, position_bias: NotImplementedError unless 0/None.
        scaling: the softmax scale (default 1/sqrt(head_dim)).

    Returns:
        (output (batch, q_length, heads_q, v_head_dim), None): no attention weights. Queries at padded positions
        get an output of 0, as with flash_attention_2 (SDPA computes values there that a padded loss ignores).
    """
    arguments = (module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal,
                 kwargs)
    if _traced_generation_step(query, key, value):
        # In the graph wherever the step's sizes are fixed: a 4-D mask (SDPA's path), the plan's StepKeys, or no
        # mask built; otherwise outside it.
        packed = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
        if isinstance(attention_mask, torch.Tensor) or (attention_mask is None and not packed):
            return _forward(*arguments)
        if isinstance(attention_mask, MaskPlan) and attention_mask.step is not None and not packed:
            _refuse_unsupported(dropout, softcap, kwargs)
            out = _step_in_graph(attention_mask, query, key, value, scaling)
            if out is not None:
                return out, None
        return _forward_eagerly(*arguments)
    return _forward(*arguments)


def _traced_generation_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether torch.compile traces a generation step (a few query tokens, nothing to differentiate). Traced as
    an eager step runs, its padded rows would be gathered into sizes that change every step (each a new graph, and
    under "reduce-overhead", transformers' default for a static cache, a new CUDA graph recorded). It runs in the
    graph where its sizes are fixed (the plan's StepKeys: _step_in_graph), else outside the graph
    (_forward_eagerly), reading the cache in place (_step_in_place)."""
    if not torch.compiler.is_compiling():
        return False
    return few_tokens(query.shape[2], query.shape[-1], value.shape[-1]) and not needs_grad(query, key, value)


def _step_in_graph(plan: MaskPlan, query, key, value, scaling) -> torch.Tensor | None:
    """(batch, q_length, heads_q, v_head_dim): a traced generation step as _step_in_place runs it, through the
    custom op fa2tune::padded_step, on the plan's StepKeys, whose sizes do not change from step to step (one graph,
    one CUDA graph, for every step); None where the call's sizes are not the plan's or its K and V give no one-key
    pages (then it runs outside the graph)."""
    batch, _, q_length, _ = query.shape
    if (plan.batch, plan.q_length, plan.kv_length) != (batch, q_length, key.shape[2]):
        return None
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return None
    query, key, value, scale = _prepared(query, key, value, scaling)  # autocast's dtype first, as SDPA takes it
    check_qkv(query, key, value)
    per_row = _rows_apart(key, value)
    if per_row is None:
        return None
    window = _binding(plan.pattern, max(q_length, plan.kv_length))
    step = plan.step.to(query.device)
    # the block table in the graph, not inside the op (opaque to the compiler, which can then neither fuse it nor
    # share it between layers whose caches have the same strides)
    table = step.positions + torch.arange(batch, device=query.device, dtype=torch.int32)[:, None] * per_row
    return torch.ops.fa2tune.padded_step(query, key, value, table, step.lengths, scale, plan.pattern.causal,
                                         list(window) if window is not None else [-1, -1])  # fmt: skip


@torch.library.custom_op("fa2tune::padded_step", mutates_args=())
def _padded_step_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, scale: float, causal: bool, window: list[int]) -> torch.Tensor:  # fmt: skip
    """A generation step on the decode kernels, K and V read in place as one-key pages: table (batch, kv_length)
    int32, each row's kept keys as pages (StepKeys' positions + b · _rows_apart), lengths how many it keeps. Its own
    op, not fa2tune::kvcache: that one declares that it writes the caches (its append), which a compiled graph would
    answer by copying them."""
    k_pages, v_pages, _ = _one_key_pages(key, value)
    return flash_attn_with_kvcache(query.transpose(1, 2), k_pages, v_pages, cache_seqlens=lengths, block_table=table,
                                   softmax_scale=scale, causal=causal, window_size=(window[0], window[1]))  # fmt: skip


@_padded_step_op.register_fake
def _(query, key, value, table, lengths, scale, causal, window):
    batch, heads, q_length, _ = query.shape
    return query.new_empty(batch, q_length, heads, value.shape[-1])


def _forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal,
             kwargs: dict) -> tuple[torch.Tensor, None]:  # fmt: skip
    """attention_forward's work, its arguments as there (kwargs a dict)."""
    _refuse_unsupported(dropout, softcap, kwargs)
    if isinstance(attention_mask, torch.Tensor):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    batch, _, q_length, _ = query.shape
    kv_length = key.shape[2]
    if attention_mask is None:
        plan = MaskPlan(_pattern(module, is_causal, sliding_window), batch, q_length, kv_length, None)
    elif isinstance(attention_mask, MaskPlan):
        plan = attention_mask
        if (plan.batch, plan.q_length, plan.kv_length) != (batch, q_length, kv_length):
            raise ValueError(
                f"attention_mask was built for batch {plan.batch}, {plan.q_length} queries and {plan.kv_length} keys, "
                f"but the attention got batch {batch}, {q_length} queries and {kv_length} keys"
            )
    else:
        raise TypeError(
            "attention_mask must be what fa2tune's mask function built, a 4-D torch.Tensor or None, got "
            f"{type(attention_mask).__name__}"
        )
    rows = plan.rows if plan.rows is not None else _packed_by_arguments(kwargs, batch, q_length, kv_length)
    return _run(plan.pattern, rows, query, key, value, scaling), None


# A generation step's attention under torch.compile, run eagerly: dynamo breaks the graph around it
_forward_eagerly = torch.compiler.disable(_forward)


def _refuse_unsupported(dropout: object, softcap: object, kwargs: dict) -> None:
    if dropout:
        raise NotImplementedError(
            f"fa2tune has no attention dropout, but the model passes dropout={dropout} (in training, its "
            "config.attention_dropout): set config.attention_dropout = 0.0, or use attn_implementation='sdpa'"
        )
    given = {"softcap": softcap, **{name: kwargs[name] for name in _UNSUPPORTED if name in kwargs}}
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(
                f"fa2tune does not compute {_UNSUPPORTED[name]} ({name}), which this model uses: use "
                "attn_implementation='sdpa' or 'eager' for it"
            )
    if kwargs.get("output_attentions"):
        warnings.warn("fa2tune returns no attention weights (output_attentions=True gives None)",
                      stacklevel=_callers_level())  # fmt: skip


def _callers_level() -> int:
    """warnings.warn's stacklevel, from its caller, of the user's frame that asked: the one that called the model
    (the outermost torch.nn.Module call) or, where that was transformers (generate()), the first frame above it
    outside transformers and torch. The frames between vary by model and version, and other libraries (the kernels
    hub) may sit among them."""
    frames = []
    frame = sys._getframe(2)  # stacklevel 2: the frame that calls warn is 1
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    calls = [i for i, f in enumerate(frames) if f.f_code in _MODULE_CALLS]
    i = calls[-1] + 1 if calls else 0
    while i < len(frames) - 1 and _in_libraries(frames[i].f_code.co_filename):
        i += 1
    return i + 2


# The code of torch.nn.Module's call, whose frames mark where a model's forward was entered.
_MODULE_CALLS = frozenset(getattr(torch.nn.Module, name).__code__ for name in ("_call_impl", "_wrapped_call_impl")
                          if hasattr(torch.nn.Module, name))  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _in_libraries(filename: str) -> bool:
    """Whether a frame's file is transformers' or torch's. Kept per file: every layer of every call with
    output_attentions=True asks for the same few files, and resolving a path is file-system calls."""
    return str(Path(filename).resolve()).startswith(_library_dirs())


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    return tuple(str(Path(m.__file__).resolve().parent) for m in (importlib.import_module("transformers"), torch))


def _pattern(module: torch.nn.Module, is_causal: bool | None, sliding_window: object) -> Pattern:
    """The pattern when no mask was built: the arguments' (the layer's is_causal when the call gives none)."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window is not None and (type(sliding_window) is not int or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return Pattern(causal=causal, sliding_window=sliding_window)


def _packed_by_arguments(kwargs: dict, batch: int, q_length: int, kv_length: int) -> Rows | None:
    """Rows from flash_attention_2's packed-sequence arguments (cu_seq_lens_q/k, max_length_q/k), when given."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        return None
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q/k describe sequences packed into one batch row, got a batch of {batch}")
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
    max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
    zeros_q = torch.zeros(q_length, dtype=torch.long, device=cu_q.device)
    zeros_k = torch.zeros(kv_length, dtype=torch.long, device=cu_k.device)
    positions_q, positions_k = torch.arange(q_length, device=cu_q.device), torch.arange(kv_length, device=cu_k.device)
    return Rows(zeros_q, positions_q, zeros_k, positions_k, cu_q, cu_k, max_q, max_k)


def _run(pattern: Pattern, rows: Rows | None, query, key, value, scaling) -> torch.Tensor:
    """(batch, q_length, heads_q, v_head_dim): fa2tune.attention over whole rows, else attention_varlen over Rows."""
    query, key, value, scale = _prepared(query, key, value, scaling)
    if rows is None:
        longest = max(query.shape[2], key.shape[2])
    else:
        rows = rows.to(query.device)
        longest = max(rows.max_seqlen_q, rows.max_seqlen_k)
    options = dict(causal=pattern.causal, scale=scale, window=_binding(pattern, longest))
    if rows is None:
        out = attention(query, key, value, **options).transpose(1, 2)
    else:
        out = _run_rows(rows, query, key, value, options)
    return out


def _binding(pattern: Pattern, longest: int) -> tuple[int, int] | None:
    """The pattern's window, or None where it cannot hide a key: in sequences of at most `longest` queries and keys
    no key is further than longest - 1 from a query's aligned position (a window the kernels need not apply)."""
    window, reach = pattern.window(), longest - 1
    if window is None or (window[0] >= reach and (pattern.causal or window[1] >= reach)):
        return None
    return window


def _run_rows(rows: Rows, query, key, value, options: dict) -> torch.Tensor:
    """attention_varlen over the rows that take part, scattered back to (batch, q_length, heads_q, v_head_dim); a
    padded batch's generation step reads K and V where they are (_step_in_place)."""
    batch, heads, q_length, _ = query.shape
    if not (rows.total_q and rows.total_k):
        return query.new_zeros(batch, q_length, heads, value.shape[-1])
    if _generation_step(rows, query, key, value):
        pages = _one_key_pages(key, value)
        if pages is not None:
            return _step_in_place(rows, query, pages, options)
    out = query.new_zeros(batch, q_length, heads, value.shape[-1])  # padded queries' output: 0
    q = query.transpose(1, 2)[rows.q_batch, rows.q_pos]
    k = key.transpose(1, 2)[rows.k_batch, rows.k_pos]
    v = value.transpose(1, 2)[rows.k_batch, rows.k_pos]
    packed = attention_varlen(q, k, v, rows.cu_seqlens_q, rows.cu_seqlens_k, rows.max_seqlen_q, rows.max_seqlen_k,
                              **options)  # fmt: skip
    return out.index_put((rows.q_batch, rows.q_pos), packed)


def _generation_step(rows: Rows, query, key, value) -> bool:
    """Whether the call is a padded batch's generation step that the decode kernels run as it stands: each batch
    row its sequence (a padding mask's rows, not packed sequences), every query taking part (the padding is among
    the keys), a decode step by its tokens and head dims (short_query.few_tokens), nothing to differentiate and
    nothing tracing it, unit last strides (a cache read in place has them; others are gathered). Such a call's q, k
    and v are checked as attention() checks them, so a bad one is named as there rather than as a cache's."""
    batch, _, q_length, head_dim = query.shape
    if not rows.by_row or rows.total_q != batch * q_length or not few_tokens(q_length, head_dim, value.shape[-1]):
        return False
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    check_qkv(query, key, value)
    return not needs_grad(query, key, value) and is_eager(query, key, value)


# The decode kernels' block table holds int32 page numbers.
_MAX_PAGES = 2**31 - 1


def _rows_apart(key: torch.Tensor, value: torch.Tensor) -> int | None:
    """Positions from one batch row of K and V to the next (0 for one row), where K and V (batch, kv_heads,
    kv_length, head_dim) can be seen as one-key pages (_one_key_pages); None where their strides give no such view
    (a row's stride not a whole number of positions', or K's and V's rows differing) or the pages outnumber an
    int32. Strides alone: a traced call decides with it."""
    batch, length = key.shape[0], key.shape[2]
    per_row = []
    for t in (key, value):
        step = t.stride(2)
        if step <= 0 or (batch > 1 and t.stride(0) % step):
            return None
        per_row.append(t.stride(0) // step if batch > 1 else 0)
    if per_row[0] != per_row[1] or (batch - 1) * per_row[0] + length > _MAX_PAGES:
        return None
    return per_row[0]


def _one_key_pages(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """K and V (batch, kv_heads, kv_length, head_dim), unit last stride, seen as paged caches of one key a page,
    (pages, 1, kv_heads, head_dim) views of the same memory: key position p of batch row b is page b · per_row + p,
    per_row = _rows_apart(key, value). None where there is no such view. Pages overlap in memory; the kernels only
    read them."""
    batch, kv_heads, length, head_dim = key.shape
    per_row = _rows_apart(key, value)
    if per_row is None:
        return None
    pages = (batch - 1) * per_row + length  # the last row's last key is the last page: no view leaves the tensor
    k_pages, v_pages = (t.as_strided((pages, 1, kv_heads, head_dim), (t.stride(2), t.stride(2), t.stride(1), 1))
                        for t in (key, value))  # fmt: skip
    return k_pages, v_pages, per_row


def _step_in_place(rows: Rows, query, pages: tuple[torch.Tensor, torch.Tensor, int], options: dict) -> torch.Tensor:
    """(batch, q_length, heads_q, head_dim): a generation step on the decode kernels, each row's kept keys its
    pages — no copy of K and V (a gather reads and writes every kept key, twice the bytes the attention reads)."""
    k_pages, v_pages, per_row = pages
    table, lengths = _kept_pages(rows, per_row)
    window = options["window"] if options["window"] is not None else (-1, -1)
    return flash_attn_with_kvcache(query.transpose(1, 2), k_pages, v_pages, cache_seqlens=lengths, block_table=table,
                                   softmax_scale=options["scale"], causal=options["causal"],
                                   window_size=window)  # fmt: skip


def _kept_pages(rows: Rows, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, cache_seqlens) of the rows' kept keys as one-key pages numbered per_row a batch row: made by the
    forward's first layer, read by the others (their caches are laid out alike)."""
    key = ("one_key_pages", per_row)
    if key not in rows.derived:
        pages = rows.k_batch * per_row + rows.k_pos
        rows.derived[key] = (one_key_table(rows.cu_seqlens_k[:-1], rows.max_seqlen_k, pages), rows.cu_seqlens_k.diff())
    return rows.derived[key]


def _prepared(query, key, value, scaling):
    """q, k, v in autocast's dtype when autocast is on (as SDPA under autocast), and the scale. Value keeps its own
    head dim (MLA-style models: 192 for q·k, 128 for v): the kernels take it as it is, with no padding to compute."""
    query, key, value = autocast_inputs(query, key, value)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return query, key, value, scale


def _sdpa(module, query, key, value, mask: torch.Tensor, dropout, scaling, is_causal, kwargs: dict):
    """A materialized mask goes to transformers' own SDPA path (a mask fa2tune does not run, or the caller's)."""
    if mask.dim() != 4:
        raise ValueError(
            "attention_mask as a tensor must be 4-D (batch, 1 or heads, q_length, kv_length), got shape "
            f"{tuple(mask.shape)}; pass the 2-D padding mask to the model, which builds the attention's mask"
        )
    return _sdpa_attention()(module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                             **kwargs)  # fmt: skip


# transformers' SDPA attention function, imported by register(): torch.compile cannot trace an import, so a traced
# call that runs it (a 4-D mask) finds it here
_imported: dict[str, object] = {}


def _sdpa_attention():
    if "sdpa" not in _imported:
        _imported["sdpa"] = importlib.import_module("transformers.integrations.sdpa_attention").sdpa_attention_forward
    return _imported["sdpa"]
