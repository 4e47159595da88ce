"""What a transformers model's attention mask asks for, worked out once per forward as a MaskPlan that fa2tune's
attention function (fa2tune.integrations.transformers) runs in every layer.

transformers builds a model's masks through the function registered under the attention implementation's name in
its AttentionMaskInterface, from a *mask function* (q_idx, kv_idx -> visible) and the 2-D padding mask. fa2tune_mask
recognizes the mask functions fa2tune runs exactly — causal, sliding-window causal, bidirectional and bidirectional
sliding window, each alone or over packed sequences (position_ids restarting inside a row) — by their code objects,
checks once that each still means what fa2tune assumes, and works out which rows take part (Rows, for
attention_varlen). Any other mask (chunked attention, image-token overlays, a padding layout the kernels cannot align)
it materializes as SDPA's boolean mask, with a warning; the attention function hands such a mask to SDPA.

transformers is imported on first use, never with this module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config.decode_plan import SHORT_QUERY_TOKENS
from ..launch.short_query import one_key_table

FALLBACK_NOTE = "attention runs through PyTorch SDPA with a materialized mask (exact, without fa2tune's kernels)"


@dataclass(frozen=True)
class Pattern:
    """A mask function fa2tune runs: causal or bidirectional, with transformers' sliding window (a size: causal,
    key kv is seen from query q when q - sliding_window < kv <= q; bidirectional, when |q - kv| <= sliding_window)."""

    causal: bool
    sliding_window: int | None = None

    def window(self) -> tuple[int, int] | None:
        """fa2tune's window (left, right) for this pattern, over positions that run consecutively."""
        if self.sliding_window is None:
            return None
        size = self.sliding_window
        return (size - 1, 0) if self.causal else (size, size)

    def allows(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The pattern by its definition, to check transformers' mask functions against."""
        size = self.sliding_window
        if self.causal:
            seen = kv_idx <= q_idx
            return seen if size is None else seen & (kv_idx > q_idx - size)
        seen = torch.ones_like(kv_idx - q_idx, dtype=torch.bool)
        return seen if size is None else seen & ((q_idx - kv_idx).abs() <= size)


@dataclass(frozen=True, eq=False)
class Rows:
    """The query and key rows that take part, packed as attention_varlen takes them: packed row r of the queries is
    position q_pos[r] of batch row q_batch[r] (int64), likewise for the keys; cu_seqlens_* (int32) bound the
    sequences. by_row: sequence b is batch row b's kept positions, as a padding mask gives them (from_valid), so a
    row's keys can be read where they lie; False for sequences packed into a row, whose offsets the caller gave.
    derived: tensors the attention function works out from the rows, kept for the other layers of the forward."""

    q_batch: torch.Tensor
    q_pos: torch.Tensor
    k_batch: torch.Tensor
    k_pos: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    by_row: bool = False
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_valid(cls, q_valid: torch.Tensor, k_valid: torch.Tensor) -> Rows:
        """One sequence per batch row: its valid queries (batch, q_length) and keys (batch, kv_length), bool."""
        q_batch, q_pos = q_valid.nonzero(as_tuple=True)
        k_batch, k_pos = k_valid.nonzero(as_tuple=True)
        (cu_q, max_q), (cu_k, max_k) = _offsets(q_valid.sum(1)), _offsets(k_valid.sum(1))
        return cls(q_batch, q_pos, k_batch, k_pos, cu_q, cu_k, max_q, max_k, by_row=True)

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> Rows:
        """Packed sequences: segments (batch, seqlen) numbers each row's sequences 0, 1, ... in order."""
        batch, length = segments.shape
        first_of_row = torch.arange(batch, device=segments.device)[:, None] * length
        _, lengths = torch.unique_consecutive((segments + first_of_row).flatten(), return_counts=True)
        cu, longest = _offsets(lengths)
        index = torch.arange(batch * length, device=segments.device)
        row, pos = index // length, index % length
        return cls(row, pos, row, pos, cu, cu, longest, longest)

    def to(self, device: torch.device) -> Rows:
        """These rows on `device` (a model split over devices builds its masks on the first)."""
        if self.q_pos.device == device:
            return self
        moved = {name: getattr(self, name).to(device) for name in _ROW_TENSORS}
        return dataclasses.replace(self, **moved)

    @property
    def total_q(self) -> int:
        return self.q_pos.numel()

    @property
    def total_k(self) -> int:
        return self.k_pos.numel()


_ROW_TENSORS = ("q_batch", "q_pos", "k_batch", "k_pos", "cu_seqlens_q", "cu_seqlens_k")


def _offsets(lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32, starting at 0) and the longest length, from per-sequence lengths."""
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return cu, int(lengths.max()) if lengths.numel() else 0


@dataclass(frozen=True, eq=False)
class StepKeys:
    """A padded batch's generation step in tensors whose sizes do not change from step to step, for a step that
    runs inside a compiled graph (integrations.transformers._step_in_graph): positions (batch, kv_length) int32,
    row b's kept key positions in order, then positions never read; lengths (batch,) int32, how many row b keeps.
    Every query of the step takes part, and meets the last `lengths[b]` kept keys bottom-right aligned, as in
    Rows."""

    positions: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def whole(cls, batch: int, kv_length: int, device: torch.device | str) -> StepKeys:
        """Every row keeps every key."""
        positions = torch.arange(kv_length, dtype=torch.int32, device=device).expand(batch, kv_length)
        return cls(positions, torch.full((batch,), kv_length, dtype=torch.int32, device=device))

    @classmethod
    def from_rows(cls, rows: Rows, batch: int, kv_length: int) -> StepKeys:
        """The kept keys of Rows made by from_valid (one sequence a batch row)."""
        lengths = rows.cu_seqlens_k.diff()
        if not rows.total_k:  # no row keeps a key: one_key_table has no position to repeat past a row's end
            return cls(torch.zeros(batch, kv_length, dtype=torch.int32, device=rows.k_pos.device), lengths)
        return cls(one_key_table(rows.cu_seqlens_k[:-1], kv_length, rows.k_pos), lengths)

    def to(self, device: torch.device) -> StepKeys:
        if self.positions.device == device:
            return self
        return StepKeys(self.positions.to(device), self.lengths.to(device))


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """What fa2tune_mask hands the attention function for a (batch, q_length) by (batch, kv_length) attention:
    the pattern, and the rows that take part (None: every row's queries and keys, bottom-right aligned). step: the
    rows as StepKeys, where they are a padded batch's generation step whose every query takes part, else None."""

    pattern: Pattern
    batch: int
    q_length: int
    kv_length: int
    rows: Rows | None
    step: StepKeys | None = None

    # The shape of the mask it stands for. generate() with a static cache builds the masks before the forward and
    # passes them in as attention_mask; transformers' mask builders then read its ndim (a 2-D mask is a padding
    # mask) and hand it back to fa2tune_mask, which returns it as it is.
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, 1, self.q_length, self.kv_length)


@dataclass(frozen=True)
class _Known:
    """transformers' mask functions and the code objects of the closures its mask factories return."""

    masking: object
    and_masks: object
    sliding: object
    sliding_bidirectional: object
    remap: object
    packed: object


@functools.cache
def _known() -> _Known:
    mu = importlib.import_module("transformers.masking_utils")
    # Packed sequences' positions are remapped before the mask function sees them in newer transformers only.
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)
    return _Known(
        masking=mu,
        and_masks=mu.and_masks(mu.causal_mask_function).__code__,
        sliding=mu.sliding_window_overlay(1).__code__,
        sliding_bidirectional=mu.sliding_window_bidirectional_overlay(1).__code__,
        remap=remap(mu.causal_mask_function, None).__code__ if remap is not None else None,
        packed=mu.packed_sequence_mask_function(None).__code__,
    )


def _cells(function: object) -> dict[str, object]:
    """A closure's variables by name ({} for anything else)."""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or closure is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure, strict=True)}


def _parts(function: object) -> tuple[object, ...]:
    """The mask functions that transformers' and_masks combined into `function` (() when it is not one)."""
    if getattr(function, "__code__", None) is not _known().and_masks:
        return ()
    parts = _cells(function).get("mask_functions")
    return parts if isinstance(parts, tuple) else ()


def _base_pattern(function: object) -> Pattern | None:
    known = _known()
    if function is known.masking.causal_mask_function:
        return _checked(Pattern(causal=True))
    if function is known.masking.bidirectional_mask_function:
        return _checked(Pattern(causal=False))
    parts = _parts(function)
    if len(parts) != 2:
        return None
    overlay, base = parts
    size = _cells(overlay).get("sliding_window")
    if type(size) is not int or size < 1:
        return None
    code = getattr(overlay, "__code__", None)
    if code is known.sliding and base is known.masking.causal_mask_function:
        return _checked(Pattern(causal=True, sliding_window=size))
    if code is known.sliding_bidirectional and base is known.masking.bidirectional_mask_function:
        return _checked(Pattern(causal=False, sliding_window=size))
    return None


def recognize(function: object) -> tuple[Pattern, torch.Tensor | None] | None:
    """(pattern, packed sequences' segments or None) for a mask function fa2tune runs exactly, else None.

    Packed sequences are and_masks(base, packed(segments)), the base over positions remapped to each sequence's
    (remap(base, position_ids)) in newer transformers: either way, the base inside one sequence, whose positions
    run consecutively."""
    pattern = _base_pattern(function)
    if pattern is not None:
        return pattern, None
    parts = _parts(function)
    if len(parts) != 2 or getattr(parts[1], "__code__", None) is not _known().packed:
        return None
    base = parts[0]
    if _known().remap is not None and getattr(base, "__code__", None) is _known().remap:
        base = _cells(base).get("mask_function")
    pattern = _base_pattern(base)
    segments = _cells(parts[1]).get("packed_sequence_mask")
    return (pattern, segments) if pattern is not None and isinstance(segments, torch.Tensor) else None


@functools.cache
def _means(pattern: Pattern) -> bool:
    """Whether transformers' mask function for `pattern` is the pattern: evaluated on either side of each edge."""
    masking = _known().masking
    if pattern.sliding_window is None:
        function = masking.causal_mask_function if pattern.causal else masking.bidirectional_mask_function
    elif pattern.causal:
        function = masking.sliding_window_causal_mask_function(pattern.sliding_window)
    else:
        function = masking.sliding_window_bidirectional_mask_function(pattern.sliding_window)
    size = pattern.sliding_window or 1
    q_idx = torch.tensor([0, 1, size, size + 1, 2 * size + 3])[:, None]
    kv_idx = q_idx + torch.arange(-size - 2, size + 3)[None, :]
    zero = torch.tensor(0)
    got = torch.as_tensor(function(zero, zero, q_idx, kv_idx)).expand(kv_idx.shape)
    return bool(torch.equal(got, pattern.allows(q_idx, kv_idx)))


def _checked(pattern: Pattern) -> Pattern | None:
    return pattern if _means(pattern) else None


def _key_padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """The 2-D padding mask over the keys' positions kv_offset.. (bool; positions past its end are padding)."""
    if attention_mask is None:
        return None
    short = kv_offset + kv_length - attention_mask.shape[-1]
    if short > 0:
        attention_mask = F.pad(attention_mask, (0, short))
    return attention_mask[:, kv_offset : kv_offset + kv_length].bool()


def _contiguous(valid: torch.Tensor) -> bool:
    """Whether each row's True entries form one run."""
    count = valid.sum(1)
    first = valid.int().argmax(1)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)
    return bool(((count == 0) | (last - first + 1 == count)).all())


def _padded_rows(pattern: Pattern, padding: torch.Tensor | None, batch: int, q_length: int, kv_length: int,
                q_start: int, device: torch.device | str = "cpu") -> Rows | str | None:  # fmt: skip
    """The rows for a padded batch: None when every row takes part whole, else Rows, else why fa2tune cannot run
    it. The queries sit at key positions q_start..q_start + q_length - 1.

    Unpadded, sequence b's i-th query meets its keys bottom-right aligned (fa2tune's causal and window). That is the
    position-based mask when the valid queries are the last valid keys — under causality keys past the last query
    are never seen, so they are dropped first — and, for a window, when no padding sits between valid keys."""
    if not pattern.causal and pattern.sliding_window is None:
        if padding is None or bool(padding.all()):
            return None
        return Rows.from_valid(padding.new_ones(batch, q_length), padding)
    q_end = q_start + q_length
    if q_start < 0 or q_end > kv_length:
        return "queries at positions outside the keys'"
    all_valid = padding is None or bool(padding[:, :q_end].all())
    if not pattern.causal:
        if all_valid and (padding is None or bool(padding.all())) and q_end == kv_length:
            return None
        return "a bidirectional sliding window over padding or a cache"
    if all_valid and q_end == kv_length:
        return None
    keys = padding[:, :q_end] if padding is not None else torch.ones(batch, q_end, dtype=torch.bool, device=device)
    if pattern.sliding_window is not None and not _contiguous(keys):
        return "padding between a row's tokens under a sliding window"
    return Rows.from_valid(keys[:, q_start:], F.pad(keys, (0, kv_length - q_end)))


def fa2tune_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: object = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> MaskPlan | torch.Tensor:
    """fa2tune's entry in transformers' AttentionMaskInterface (its arguments are sdpa_mask's): a MaskPlan for a mask
    fa2tune runs exactly, else SDPA's (batch, 1, q_length, kv_length) boolean mask."""
    # A generation step under torch.compile: its rows, whose sizes change every step, are built outside the graph
    # (integrations.transformers._traced_generation_step). A plan built before the forward (generate() with a
    # static cache builds its masks so) is returned as it is, in the graph.
    traced_step = (torch.compiler.is_compiling() and q_length <= SHORT_QUERY_TOKENS
                   and not isinstance(attention_mask, MaskPlan))  # fmt: skip
    return (_plan_eagerly if traced_step else _plan)(batch_size, q_length, kv_length, q_offset, kv_offset,
                                                     mask_function, attention_mask, **kwargs)  # fmt: skip


def _plan(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0, kv_offset: int = 0,
          mask_function: object = None, attention_mask: torch.Tensor | None = None,
          **kwargs) -> MaskPlan | torch.Tensor:  # fmt: skip
    """fa2tune_mask's work, its arguments as there."""
    arguments = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     **kwargs)  # fmt: skip
    if isinstance(attention_mask, MaskPlan):  # built before the forward (generate() with a static cache)
        if attention_mask.shape != (batch_size, 1, q_length, kv_length):
            raise ValueError(
                f"attention_mask is fa2tune's mask for shape {attention_mask.shape}, but this forward needs "
                f"{(batch_size, 1, q_length, kv_length)}"
            )
        return attention_mask
    found = recognize(mask_function)
    if found is None:
        return _dense(f"the mask function {getattr(mask_function, '__qualname__', mask_function)!r}", arguments)
    pattern, segments = found
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if segments is not None:
        packed = attention_mask is None and q_offset == kv_offset == 0 and q_length == kv_length
        if not packed or tuple(segments.shape) != (batch_size, q_length):
            return _dense("packed sequences with a padding mask or a cache", arguments)
        return MaskPlan(pattern, batch_size, q_length, kv_length, Rows.from_segments(segments))
    padding = _key_padding(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding.expand(batch_size, kv_length)
    rows = _padded_rows(
        pattern, padding, batch_size, q_length, kv_length, q_offset - kv_offset, kwargs.get("device", "cpu")
    )
    if isinstance(rows, str):
        return _dense(rows, arguments)
    step = _step_keys(rows, batch_size, q_length, kv_length, kwargs.get("device", "cpu"))
    return MaskPlan(pattern, batch_size, q_length, kv_length, rows, step)


def _step_keys(rows: Rows | None, batch: int, q_length: int, kv_length: int,
               device: torch.device | str) -> StepKeys | None:  # fmt: skip
    """The rows as StepKeys where they are a generation step whose every query takes part (whole rows too, so that
    a compiled step's plan keeps its form while padding leaves a sliding window: one graph for both)."""
    if q_length > SHORT_QUERY_TOKENS:
        return None
    if rows is None:
        return StepKeys.whole(batch, kv_length, device)
    if not rows.by_row or rows.total_q != batch * q_length:
        return None
    return StepKeys.from_rows(rows, batch, kv_length)


def _dense(reason: str, arguments: dict) -> torch.Tensor:
    warnings.warn(f"fa2tune: {reason} is not a mask fa2tune runs; {FALLBACK_NOTE}", RuntimeWarning, stacklevel=4)
    arguments.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return _known().masking.sdpa_mask(**arguments)


# the traced generation step's plan, built eagerly: dynamo breaks the graph around it
_plan_eagerly = torch.compiler.disable(_plan)
