"""scaled_dot_product_attention(): PyTorch's SDPA call on fa2tune's kernels — is_causal aligned top-left as SDPA
aligns it, key-padding masks through the packed-sequence kernels, any other mask computed by PyTorch's own SDPA —
and patch_sdpa(), which puts it in place of torch.nn.functional.scaled_dot_product_attention."""

from __future__ import annotations

import logging
import math
import numbers

import torch
import torch.nn.functional as F

from ..config.inputs import (
    SCALE_MAX,
    SUPPORTED_DTYPES,
    check_flag,
    check_qkv,
    function_transform,
    interpreting,
    unit_last_stride,
)
from ..config.types import MAX_HEAD_DIM
from .attention import attention, attention_varlen

_log = logging.getLogger(__name__)

# PyTorch's own SDPA (what torch.nn.functional.scaled_dot_product_attention is until something replaces it): the
# masks the kernels do not take run on it.
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention

_PATCH_MARK = "_fa2tune_patch"  # set on the function patch_sdpa() installs
SDPA_NAMES = ("query", "key", "value")  # what PyTorch's SDPA calls its tensors, and so its errors here


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's signature and results, on fa2tune's kernels.

    Args:
        query: (batch, heads_q, seqlen_q, head_dim), float16/bfloat16/float32, on a CUDA device.
        key, value: (batch, heads_kv, seqlen_k, head_dim); value's head dim may be its own, as PyTorch's (Ev).
            heads_kv must equal heads_q unless enable_gqa=True, when it must divide heads_q (PyTorch's rule;
            fa2tune reads the shared K/V heads in place).
        attn_mask: None; or a boolean mask (True = take part) or an additive float mask (float32 or query's dtype, as
            PyTorch takes it), broadcastable to (batch, heads_q, seqlen_q, seqlen_k). A key-padding mask — the same for
            every head and query, e.g. (batch, 1, 1, seqlen_k), with float values 0, -inf or the dtype's lowest value —
            runs on the packed-sequence kernels (the kept keys gathered per batch entry; one host sync). Any other mask,
            a mask that requires grad, or a mask together with is_causal is computed by PyTorch's own SDPA (exact,
            O(seqlen_q·seqlen_k) memory; logged once).
        dropout_p: must be 0.0; fa2tune has no dropout (NotImplementedError).
        is_causal: query i sees keys j <= i, aligned TOP-LEFT as PyTorch's SDPA aligns it (fa2tune.attention's
            causal=True aligns bottom-right, as FlashAttention-2; the two agree when seqlen_q == seqlen_k).
        scale: softmax scale, default 1/sqrt(head_dim); positive.
        enable_gqa: allow heads_kv < heads_q.

    Returns:
        (batch, heads_q, seqlen_q, value's head_dim) in query's dtype, differentiable in query, key and value. A
        query whose keys are all masked gets 0 (and no gradient), as PyTorch's SDPA gives it.
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, TORCH_SDPA)


_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu")  # device types autocast always exists for


_ASK = object()  # autocast_inputs' dtype when the caller has not read autocast's state already


def autocast_inputs(query, key, value, dtype=_ASK):
    """query, key and value as PyTorch's SDPA takes them under autocast: where autocast is on for query's device
    type, each floating tensor but a float64 one in autocast's dtype (SDPA is one of autocast's lower-precision
    ops), else as they came. An attn_mask is left alone: fa2tune reads only which keys it hides, and a mask it
    leaves to PyTorch's SDPA is cast there. dtype: _autocast_dtype(query), where the caller has it."""
    if dtype is _ASK:
        dtype = _autocast_dtype(query)
    if dtype is None:
        return query, key, value
    return tuple(t.to(_autocast_dtype_of(t, dtype)) if isinstance(t, torch.Tensor) else t for t in (query, key, value))


def _autocast_dtype(query) -> torch.dtype | None:
    """The dtype autocast gives SDPA's floating inputs on query's device type, or None where it is off."""
    if not isinstance(query, torch.Tensor):
        return None
    device_type = query.device.type
    # a device type autocast does not know (meta) is an error to ask about: nothing is cast there. CUDA and the CPU
    # always have it, and are not asked: torch.compile before PyTorch 2.12 cannot trace the question (a graph break
    # in a compiled model's attention, GPU-tested under 2.11)
    available = device_type in _AUTOCAST_DEVICE_TYPES or torch.amp.is_autocast_available(device_type)
    if not available or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast_dtype_of(t, dtype: torch.dtype | None):
    """The dtype t reaches SDPA in where autocast gives `dtype` (None: autocast off): floating tensors but float64
    ones in `dtype`; None for what is not a tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    return dtype if dtype is not None and t.is_floating_point() and t.dtype != torch.float64 else t.dtype


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, slow):
    """scaled_dot_product_attention, with `slow` the SDPA that computes the masks the kernels do not take."""
    autocast_dtype = _autocast_dtype(query)
    query, key, value = autocast_inputs(query, key, value, autocast_dtype)
    _check_dropout(dropout_p)
    is_causal, enable_gqa = check_flag("is_causal", is_causal), check_flag("enable_gqa", enable_gqa)
    query, key, value = (unit_last_stride(t) for t in (query, key, value))
    _check_heads_rule(query, key, enable_gqa)
    shape = check_qkv(query, key, value, SDPA_NAMES)
    if attn_mask is None:
        return _top_left_causal(query, key, value, scale) if is_causal else attention(query, key, value, scale=scale)
    _check_mask(attn_mask, query, (shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k), autocast_dtype)
    visible, reason = _visible_keys(attn_mask, shape.batch, shape.seqlen_k, is_causal)
    if visible is None:
        note_once(f"fa2tune: {reason}: computed by PyTorch's SDPA (exact; O(seqlen_q*seqlen_k) memory)")
        return slow(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)  # fmt: skip
    return _attend_visible_keys(query, key, value, visible, scale)


def _check_dropout(dropout_p: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: fa2tune has no attention dropout; pass dropout_p=0.0 (as in evaluation), or "
            "keep torch.nn.functional.scaled_dot_product_attention for training with dropout"
        )


def _check_heads_rule(query: object, key: object, enable_gqa: bool) -> None:
    """PyTorch's rule: K/V heads fewer than the query's only with enable_gqa=True (check_qkv checks the rest)."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 4):
        return
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: different head counts need "
            "enable_gqa=True (grouped-query attention), as in torch.nn.functional.scaled_dot_product_attention"
        )


def _mask_dtype_taken(mask_dtype: torch.dtype | None, query_dtype: torch.dtype) -> bool:
    """PyTorch's SDPA's rule for an attn_mask's dtype as SDPA receives it (after autocast): bool, float32 or the
    query's."""
    return mask_dtype in (torch.bool, torch.float32, query_dtype)


def _check_mask(mask: object, query: torch.Tensor, shape: tuple[int, int, int, int],
                autocast_dtype: torch.dtype | None) -> None:  # fmt: skip
    """PyTorch's SDPA's rules for attn_mask, so that a call this takes is one PyTorch takes. autocast_dtype: what
    autocast casts SDPA's floating inputs to (None: off), the mask's among them."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(
            f"attn_mask must be bool (True = take part) or floating (added to the scores), got {mask.dtype}"
        )
    if not _mask_dtype_taken(_autocast_dtype_of(mask, autocast_dtype), query.dtype):
        raise TypeError(
            f"attn_mask must be bool, float32 or query's dtype ({query.dtype}), as PyTorch's SDPA takes it, got "
            f"{mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(f"attn_mask must be on query's device {query.device}, got {mask.device}")
    if not mask_fits(mask, shape):
        raise ValueError(
            f"attn_mask must broadcast to (batch, heads, seqlen_q, seqlen_k) = {shape}, got shape {tuple(mask.shape)}"
        )


def mask_fits(mask: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """True when `mask` broadcasts to `shape` without growing it."""
    if mask.dim() > len(shape):
        return False
    return all(size in (1, full) for size, full in zip(reversed(mask.shape), reversed(shape), strict=False))


def _visible_keys(mask: torch.Tensor, batch: int, seqlen_k: int, is_causal: bool):
    """(visible, None): `mask` as a (batch, seqlen_k) bool of the keys each batch entry sees, when the kernels give
    PyTorch's result for it; else (None, why not)."""
    if is_causal:
        return None, "attn_mask together with is_causal=True"
    if mask.requires_grad and torch.is_grad_enabled():
        return None, "an attn_mask that requires grad"
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    corner = mask4[:, :1, :1, :]
    if not (all(mask4.shape[d] == 1 or mask4.stride(d) == 0 for d in (1, 2)) or bool((mask4 == corner).all())):
        return None, "an attn_mask that varies over heads or queries (not a key-padding mask)"
    rows = corner[:, 0, 0, :]
    if rows.dtype != torch.bool:
        rows, reason = _visible_from_additive(rows)
        if rows is None:
            return None, reason
    return rows.expand(batch, seqlen_k), None


def _visible_from_additive(rows: torch.Tensor):
    """An additive key-padding mask as visible keys (0: seen; -inf or the dtype's lowest value: not), or (None, why
    not). The lowest finite value hides a key exactly as -inf does while its row keeps one key at 0 (its exp
    underflows to 0); a row of nothing else PyTorch averages over every key instead, so that goes to PyTorch."""
    seen = rows == 0
    lowest = rows == torch.finfo(rows.dtype).min
    hidden = lowest | (rows == -math.inf)
    exact, lowest_only = torch.stack([(seen | hidden).all(), (lowest.any(-1) & ~seen.any(-1)).any()]).tolist()
    if not exact:
        return None, "an additive attn_mask with values other than 0, -inf and its dtype's lowest value"
    if lowest_only:
        return None, "an additive attn_mask hiding every key of a row with a finite value"
    return seen, None


def _attend_visible_keys(query, key, value, visible: torch.Tensor, scale):
    """Attention over the keys `visible` (batch, seqlen_k) keeps, by the packed-sequence kernels: each batch entry's
    kept keys gathered into one packed sequence, its queries another; a query with no key gets 0."""
    batch, heads_q, seqlen_q, _ = query.shape
    counts = visible.sum(1, dtype=torch.int32)
    counts_host = counts.tolist()  # the launch needs the longest sequence on the host
    if all(count == key.shape[2] for count in counts_host):
        return attention(query, key, value, scale=scale)

    def packed(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seqlen, d) -> (batch * seqlen, heads, d)
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], t.shape[3])

    rows = visible.reshape(-1).nonzero().squeeze(1)
    k_rows, v_rows = packed(key).index_select(0, rows), packed(value).index_select(0, rows)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=query.device)
    cu_k[1:] = counts.cumsum(0)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * seqlen_q
    out = attention_varlen(packed(query), k_rows, v_rows, cu_q, cu_k, seqlen_q, max(counts_host), scale=scale)
    return out.view(batch, seqlen_q, heads_q, value.shape[-1]).transpose(1, 2)


def _top_left_causal(query, key, value, scale):
    """SDPA's is_causal (key j seen by query i when j <= i) through fa2tune's bottom-right aligned masks."""
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if seqlen_q <= seqlen_k:  # keys from seqlen_q on are seen by no query: the rest is square, where both agree
        return attention(query, key[:, :, :seqlen_q], value[:, :, :seqlen_q], causal=True, scale=scale)
    # Bottom-right, query i sits at key position i + seqlen_k - seqlen_q: a right window of seqlen_q - seqlen_k
    # reaches key i again, and no left bound keeps every earlier key.
    return attention(query, key, value, window=(-1, seqlen_q - seqlen_k), scale=scale)


_noted: set[str] = set()


def note_once(message: str) -> None:
    """Logs `message` as a warning the first time, at debug level after that."""
    if message in _noted:
        _log.debug(message)
        return
    _noted.add(message)
    _log.warning(message)


# ---- patch_sdpa: fa2tune in place of torch.nn.functional.scaled_dot_product_attention ---------------------------


class SdpaPatch:
    """What patch_sdpa() returns: undo() (or the end of its `with` block) puts back the function it replaced."""

    def __init__(self, installed=None, replaced=None):
        self._installed, self._replaced = installed, replaced

    def undo(self) -> None:
        """Puts back what patch_sdpa() replaced; a second undo(), or one of a patch already in place, does nothing."""
        if self._installed is None:
            return
        if F.scaled_dot_product_attention is not self._installed:
            raise RuntimeError(
                "torch.nn.functional.scaled_dot_product_attention was replaced again after fa2tune.patch_sdpa(); "
                "undo that replacement first"
            )
        F.scaled_dot_product_attention = self._replaced
        self._installed = None

    def __enter__(self) -> SdpaPatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()


def patch_sdpa() -> SdpaPatch:
    """Replaces torch.nn.functional.scaled_dot_product_attention with fa2tune's, for every model that calls it
    through torch.nn.functional (as Hugging Face's "sdpa" attention and torch.nn.MultiheadAttention do); code that
    imported the function by name before the patch keeps the original.

    `fa2tune.patch_sdpa()` patches until `.undo()`; `with fa2tune.patch_sdpa(): ...` for a block. A call fa2tune
    cannot serve (dropout_p > 0, float64, CPU tensors without Triton's interpreter, differing Q/K head dims, ...)
    runs on the replaced function, logged once per reason (logger "fa2tune.api.sdpa"); masks other than key
    padding are computed by it too. Patching while a patch is in place returns a handle that undoes nothing.
    """
    current = F.scaled_dot_product_attention
    if getattr(current, _PATCH_MARK, False):
        return SdpaPatch()
    installed = _patched(current)
    F.scaled_dot_product_attention = installed
    return SdpaPatch(installed, current)


def _patched(replaced):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):  # fmt: skip
        # what the replaced SDPA would run on, and the dtype it would see the mask in
        autocast_dtype = _autocast_dtype(query)
        mask_dtype = _autocast_dtype_of(attn_mask, autocast_dtype)
        query, key, value = autocast_inputs(query, key, value, autocast_dtype)
        reason = _unsupported(query, key, value, attn_mask, mask_dtype, dropout_p, is_causal, scale, enable_gqa)
        if reason is not None:
            note_once(f"fa2tune.patch_sdpa: calls with {reason} run on the SDPA it replaced")
            return replaced(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, replaced)

    scaled_dot_product_attention.__doc__ = f"fa2tune.patch_sdpa()'s stand-in for:\n\n{replaced.__doc__}"
    setattr(scaled_dot_product_attention, _PATCH_MARK, True)
    return scaled_dot_product_attention


def _unsupported(query, key, value, attn_mask, mask_dtype, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    """Why the patched SDPA leaves this call to the SDPA it replaced, as a short reason, or None: fa2tune's
    scaled_dot_product_attention would refuse it, or PyTorch's may (a mask neither bool, float32 nor in query's
    dtype as autocast hands them over — mask_dtype —, which it refuses; one of fewer than two dimensions, which its
    default CPU backend refuses and others may broadcast): PyTorch's result or error is then the call's."""
    tensors = (query, key, value)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        return "dropout_p > 0"
    if not (isinstance(is_causal, bool) and isinstance(enable_gqa, bool)):
        return "non-bool is_causal or enable_gqa"
    if any(type(t) is not torch.Tensor or t.dim() != 4 for t in tensors):  # nested tensors, DTensors, 3-D inputs
        return "inputs that are not plain 4-D tensors"
    transform = function_transform(query, key, value, names=SDPA_NAMES)
    if transform is not None:
        return transform
    if not query.dtype == key.dtype == value.dtype:
        return "query, key and value of different dtypes"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"{query.dtype} inputs"
    runs_here = query.device.type == "cuda" or (query.device.type == "cpu" and interpreting())
    if not (runs_here and query.device == key.device == value.device):
        return f"inputs on {query.device.type}"
    if not (1 <= query.shape[3] == key.shape[3] <= MAX_HEAD_DIM and 1 <= value.shape[3] <= MAX_HEAD_DIM):
        return f"query and key head dims that differ, or head dims outside 1..{MAX_HEAD_DIM}"
    (batch, heads_q, _, _), (_, heads_kv, seqlen_k, _) = query.shape, key.shape
    if (value.shape[:3] != key.shape[:3] or key.shape[0] != batch or heads_kv == 0 or heads_q % heads_kv != 0
            or (heads_kv != heads_q and not enable_gqa)):  # fmt: skip
        return "shapes of query, key and value that PyTorch broadcasts or refuses"
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale <= SCALE_MAX
    ):
        return "a scale that is not a positive finite float"
    if attn_mask is not None and not (
        type(attn_mask) is torch.Tensor
        and _mask_dtype_taken(mask_dtype, query.dtype)
        and attn_mask.dim() >= 2
        and attn_mask.device == query.device
        and mask_fits(attn_mask, (batch, heads_q, query.shape[2], seqlen_k))
    ):
        return "an attn_mask of another type, dtype, device or shape"
    return None
