"""Checks of what users pass to flash_attn_with_kvcache: every error names the argument, what was expected and what
came.

check_call checks what the tensors' shapes, dtypes, devices and strides say — no value is read, so a call stays
free of host syncs (CUDA graphs, decode loops). check_values reads the lengths and the block table back to the host
(a sync) to check that they stay inside the caches: fa2tune.check_kvcache runs it on request, and so does every call
when FA2TUNE_CHECK_KVCACHE=1 (outside CUDA graph capture). Without it the kernels still clamp every length and page
into the caches (templates/decode.py.jinja): bad values give a defined wrong answer, never a read or write outside a
tensor.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .decode_plan import MAX_SPLITS
from .inputs import SUPPORTED_DTYPES, capturing_cuda_graph, check_int, check_no_function_transform, interpreting
from .types import MAX_HEAD_DIM, integer

CHECK_ENV = "FA2TUNE_CHECK_KVCACHE"  # "1": every call checks its lengths and block table on the host (a sync)


@dataclass(frozen=True)
class KVCache:
    """A checked call's cache tensors.

    Attributes:
        k_cache, v_cache: (batch_cache, capacity, kv_heads, head_dim), or paged (num_pages, page_size, kv_heads,
            head_dim).
        block_table: int32 (batch, pages per entry) for a paged cache, else None.
        cache_seqlens: int32 (batch,) keys cached per entry before the append, or None: `seqlen` for every entry.
        seqlen: every entry's cached keys when cache_seqlens is None (the caller's int, or the capacity).
        k_new, v_new: (batch, seqlen_new, kv_heads, head_dim) keys and values to append first, or None.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor | None
    cache_seqlens: torch.Tensor | None
    seqlen: int
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        """Keys a page holds; 0 for a cache that is not paged."""
        return self.k_cache.shape[1] if self.block_table is not None else 0

    @property
    def capacity(self) -> int:
        """The most keys an entry holds: the cache's rows, or the table's pages per entry × the page size."""
        if self.block_table is None:
            return self.k_cache.shape[1]
        return self.block_table.shape[1] * self.k_cache.shape[1]

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else self.k_new.shape[1]


def check_call(q: object, k_cache: object, v_cache: object, k: object = None, v: object = None,
               cache_seqlens: object = None, block_table: object = None) -> KVCache:  # fmt: skip
    """Checks the shapes, dtypes, devices and strides of a flash_attn_with_kvcache call (reads no values) and returns
    its cache. q: (batch, seqlen_q, heads, head_dim) with a unit last stride (the caller copies one without)."""
    _check_tensor("q", q, q)
    batch, _, heads, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, q)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in head_dim (it is written in place), got strides "
                             f"{tuple(t.stride())}")  # fmt: skip
    check_no_function_transform(q, k_cache, v_cache, k, v, names=("q", "k_cache", "v_cache", "k", "v"))
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")  # fmt: skip
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head_dim (dim 3) must be q's {head_dim}, got shape {tuple(k_cache.shape)}")
    if kv_heads == 0 and heads != 0:
        raise ValueError(f"k_cache and v_cache must have at least one head (dim 2), got k_cache {tuple(k_cache.shape)} "
                         f"beside q {tuple(q.shape)}")  # fmt: skip
    if kv_heads != 0 and heads % kv_heads != 0:
        raise ValueError(f"q's heads (dim 2) must be a multiple of k_cache's heads (dim 2), got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}")  # fmt: skip
    if k_cache.shape[1] == 0:
        raise ValueError(f"k_cache must hold at least one key a row or page (dim 1), got {tuple(k_cache.shape)}")
    table = _check_table(block_table, q, k_cache)
    if table is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache must have a row (dim 0) for each of q's {batch} batch entries, got "
                         f"{tuple(k_cache.shape)}; a paged cache takes a block_table")  # fmt: skip
    k_new, v_new = _check_new(k, v, q, k_cache)
    cache = KVCache(k_cache, v_cache, table, None, 0, k_new, v_new)
    seqlens, seqlen = _check_seqlens(cache_seqlens, q, cache)
    return KVCache(k_cache, v_cache, table, seqlens, seqlen, k_new, v_new)


def check_writable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What PyTorch checks before an in-place write, for the caches an eager append writes into: their memory
    (check_unshared), and that autograd and inference mode allow the write — not a leaf that requires grad, nor a
    view of one, under grad mode; not an inference tensor outside inference mode. A traced call goes through the
    custom op, whose declared writes PyTorch's autograd and functionalization see, and which checks the memory."""
    check_unshared(k_cache, v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        leaf = t.is_leaf or (t._is_view() and t._base.is_leaf)
        if t.requires_grad and leaf and torch.is_grad_enabled():
            raise RuntimeError(f"{name} is a leaf tensor that requires grad (or a view of one), and the append writes "
                               f"into it in place (no gradient flows through it): pass {name}.detach(), or call "
                               f"under torch.no_grad()")  # fmt: skip
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{name} is an inference tensor (made under torch.inference_mode), and the append "
                               f"writes into it in place, which PyTorch allows only inside inference mode: call "
                               f"under torch.inference_mode(), or pass {name}.clone()")  # fmt: skip


def check_unshared(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches an append writes into, as PyTorch's in-place overlap rule sees them and beyond it: no element
    shares memory with another (a stride-0 dimension, as expand() makes, or strides that fold a tensor onto itself:
    entries or heads would overwrite each other's new keys), and k_cache and v_cache share none (one tensor as both
    would get the new values over the new keys). Views of one buffer that interleave, as k and v of a
    (…, 2, heads, head_dim) one, share none and pass."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        shared = [dim for dim in range(t.dim()) if t.stride(dim) == 0 and t.shape[dim] > 1]
        if shared:
            raise ValueError(f"{name} is written in place by the append, but its elements share memory (stride 0 in "
                             f"dim {shared[0]}, as expand() makes; strides {tuple(t.stride())}): pass a cache with "
                             f"memory of its own (.contiguous())")  # fmt: skip
        folds = _folds_onto_itself(t)
        if folds is not False:
            how = "reaches one element by two indices" if folds else "may reach one element by two indices (too many " \
                "index combinations to rule it out)"
            raise ValueError(f"{name} is written in place by the append, but its elements share memory (shape "
                             f"{tuple(t.shape)} with strides {tuple(t.stride())} {how}): pass a cache with memory of "
                             f"its own (.contiguous())")  # fmt: skip
    overlap = _overlap(k_cache, v_cache)
    if overlap is not False:
        how = "share memory" if overlap else "may share memory (too many index combinations to rule it out)"
        raise ValueError(f"k_cache and v_cache {how}, and the append writes new keys into one and new values into "
                         f"the other: pass two caches")  # fmt: skip


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two tensors share a byte (None: not ruled out, _reachable's "unknown"): the same first element, or
    byte ranges that intersect and an element of each at the same address (_geometries_meet). Addresses, not
    storages, decide: tensors of two storage objects can view one buffer (DLPack, CuPy), and the caches share q's
    device, whose addresses are unique."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.data_ptr() == b.data_ptr():
        return True
    ga, gb = _geometry(a), _geometry(b)
    (a_lo, a_hi), (b_lo, b_hi) = _byte_span(a.data_ptr(), ga), _byte_span(b.data_ptr(), gb)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    return _geometries_meet(ga, gb, b_lo - a_lo)


def _folds_onto_itself(t: torch.Tensor) -> bool | None:
    """Whether two indices of t reach one element (None: not ruled out), stride-0 dimensions aside, which
    check_unshared names first."""
    return t.numel() > 1 and _geometry_folds(_geometry(t))


# (shape, strides, element size): all that decides which bytes a tensor's elements reach relative to its first
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), t.stride(), t.element_size()


def _byte_span(first: int, geometry: Geometry) -> tuple[int, int]:
    """[first byte, one past the last byte) that a tensor's elements reach."""
    shape, strides, size = geometry
    return first, first + (sum(stride * (n - 1) for n, stride in zip(shape, strides, strict=True)) + 1) * size


# An append checks its caches at every decode step: the searches are cached by geometry (a model's caches keep theirs).
@functools.lru_cache(maxsize=256)
def _geometries_meet(a: Geometry, b: Geometry, offset: int) -> bool | None:
    """Whether a byte of a tensor of geometry a, and one of a tensor of geometry b starting `offset` bytes after it,
    share an address: Σ s·x − Σ t·y + (e − f) = offset over their indices x, y and bytes e, f within an element."""
    if _dense(a) and _dense(b):
        return True  # two blocks without gaps, their ranges intersecting (the caller's check)
    return _reachable([*_byte_terms(a, sign=1), *_byte_terms(b, sign=-1)], offset, nonzero=False)


@functools.lru_cache(maxsize=256)
def _geometry_folds(geometry: Geometry) -> bool | None:
    """Whether two indices reach one element: Σ stride·(x − y) = 0 with x ≠ y."""
    if _dense(geometry):
        return False
    shape, strides, _ = geometry
    terms = [(stride, 1 - n, n - 1) for n, stride in zip(shape, strides, strict=True) if n > 1 and stride > 0]
    return _reachable(terms, 0, nonzero=True)


def _byte_terms(geometry: Geometry, sign: int) -> list[tuple[int, int, int]]:
    """(bytes a step, lowest, highest index) for each dimension, and one for the byte within an element; sign −1
    negates the indices' range."""
    shape, strides, size = geometry
    ranges = [(stride * size, n - 1) for n, stride in zip(shape, strides, strict=True) if n > 1 and stride > 0]
    ranges.append((1, size - 1))
    return [(step, 0, top) if sign > 0 else (step, -top, 0) for step, top in ranges]


# The most search nodes _reachable visits before it answers "unknown": views' strides nest (each larger than what
# the smaller ones reach), which leaves one or two choices a dimension, so real caches need a handful.
_SEARCH_NODES = 100_000


class _GaveUp(Exception):
    """The search passed _SEARCH_NODES."""


def _reachable(terms: list[tuple[int, int, int]], target: int, *, nonzero: bool) -> bool | None:
    """Whether Σ coef·x = target has an integer solution with lo <= x <= hi for every (coef > 0, lo, hi) term — with
    some x ≠ 0, where nonzero — by a depth-first search over the terms, largest coefficient first, each x bounded
    by what the terms after it can reach; None where the search passes _SEARCH_NODES (unknown).

    Terms of one coefficient (two views with the same strides) add up to one term over the sum of their ranges;
    with nonzero, two of them (each range holding −1 … 1) already give x = 1, x' = −1."""
    merged: dict[int, tuple[int, int]] = {}
    for coef, lo, hi in terms:
        if coef in merged and nonzero:
            return True
        low_sum, high_sum = merged.get(coef, (0, 0))
        merged[coef] = (low_sum + lo, high_sum + hi)
    terms = sorted(((coef, lo, hi) for coef, (lo, hi) in merged.items()), reverse=True)
    low, high = [0] * (len(terms) + 1), [0] * (len(terms) + 1)
    for i in range(len(terms) - 1, -1, -1):
        coef, lo, hi = terms[i]
        low[i], high[i] = low[i + 1] + coef * lo, high[i + 1] + coef * hi
    visited = 0

    def search(i: int, rest: int, moved: bool) -> bool:
        nonlocal visited
        visited += 1
        if visited > _SEARCH_NODES:
            raise _GaveUp
        if i == len(terms):
            return rest == 0 and (moved or not nonzero)
        if not low[i] <= rest <= high[i]:
            return False
        coef, lo, hi = terms[i]
        first = max(lo, -((high[i + 1] - rest) // coef))  # ceil((rest − high) / coef)
        last = min(hi, (rest - low[i + 1]) // coef)
        return any(search(i + 1, rest - coef * x, moved or x != 0) for x in range(first, last + 1))

    try:
        return search(0, target, False)
    except _GaveUp:
        return None


def _dense(geometry: Geometry) -> bool:
    """Whether a tensor's elements fill a block of memory without gaps or repeats, its dimensions in some order."""
    shape, strides, _ = geometry
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_tensor(name: str, t: object, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        layout = "(batch, seqlen, heads, head_dim)" if name in ("q", "k", "v") else (
            "(batch, seqlen_cache, kv_heads, head_dim) or paged (num_pages, page_size, kv_heads, head_dim)")
        raise ValueError(f"{name} must be 4-D {layout} as in flash_attn_with_kvcache, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(f"{name} is on the CPU, but fa2tune's kernels run on CUDA devices; move the tensors to a GPU "
                         "(or set TRITON_INTERPRET=1 before importing triton, for tests)")  # fmt: skip
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def _check_table(table: object, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
    if table is None:
        return None
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2:
        raise TypeError(f"block_table must be a 2-D torch.int32 tensor (batch, pages per entry), got {_got(table)}")
    if table.shape[0] != q.shape[0] or table.shape[1] == 0:
        raise ValueError(f"block_table must be (batch={q.shape[0]}, pages per entry >= 1), got {tuple(table.shape)}")
    if table.device != q.device:
        raise ValueError(f"block_table must be on q's device {q.device}, got {table.device}")
    if k_cache.shape[0] == 0:
        raise ValueError(f"a paged k_cache must hold at least one page (dim 0), got {tuple(k_cache.shape)}")
    return table if table.stride(1) == 1 else table.contiguous()  # the kernels read an entry's pages in a row


def _check_new(k: object, v: object, q: torch.Tensor, k_cache: torch.Tensor):
    """The keys and values to append: both or neither, (batch, seqlen_new, kv_heads, head_dim) in the cache's
    dtype, each with a unit last stride (copied otherwise: they are small)."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v (new keys and values to append) must be passed together, got k={_got(k)}, "
                         f"v={_got(v)}")  # fmt: skip
    if k is None:
        return None, None
    expected = (q.shape[0], k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1, *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, q)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be (batch, seqlen_new, kv_heads, head_dim) = {expected} with k's "
                             f"seqlen_new, got {tuple(t.shape)}")  # fmt: skip
    return (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))


def _check_seqlens(seqlens: object, q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor | None, int]:
    """(tensor or None, int): an int32 (batch,) tensor of lengths, or every entry's length as an int — the caller's,
    or with None the capacity (every key). Appending needs lengths; an int must leave room for the new keys."""
    capacity, new = cache.capacity, cache.seqlen_new
    if new > capacity:
        raise ValueError(f"k and v append {new} keys, more than the cache holds per entry ({capacity})")
    if seqlens is None:
        if new:
            raise ValueError("cache_seqlens must be given with k and v: the new keys are written at each entry's "
                             "length")  # fmt: skip
        return None, capacity
    if integer(seqlens) is not None:
        return None, check_int("cache_seqlens", seqlens, 0, capacity - new)
    if not isinstance(seqlens, torch.Tensor) or seqlens.dtype != torch.int32 or seqlens.shape != (q.shape[0],):
        raise TypeError(f"cache_seqlens must be an int or a torch.int32 tensor of shape (batch={q.shape[0]},), got "
                        f"{_got(seqlens)}")  # fmt: skip
    if seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device {q.device}, got {seqlens.device}")
    return (seqlens if seqlens.stride(0) == 1 else seqlens.contiguous()), 0


def _got(value: object) -> str:
    """What came, for an error: a tensor's dtype and shape, else the value's type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__


def check_splits(num_splits: object) -> int:
    return check_int("num_splits", num_splits, 0, MAX_SPLITS)


def check_values(cache: KVCache) -> None:
    """Reads the lengths and the block table back to the host (a sync) and checks that they stay in the caches:
    each entry's cached keys in 0 … capacity − seqlen_new, each page it uses (the first ⌈(length + seqlen_new) /
    page_size⌉ of its table row; later ones are never read) in 0 … num_pages − 1."""
    new, capacity = cache.seqlen_new, cache.capacity
    if cache.cache_seqlens is not None:
        lengths = cache.cache_seqlens.tolist()
        for b, length in enumerate(lengths):
            if not 0 <= length <= capacity - new:
                raise ValueError(f"cache_seqlens[{b}] = {length} is outside 0..{capacity - new}: the cache holds "
                                 f"{capacity} keys per entry and {new} are appended")  # fmt: skip
    else:
        lengths = [cache.seqlen] * (cache.block_table.shape[0] if cache.block_table is not None else 0)
    if cache.block_table is None:
        return
    pages = cache.k_cache.shape[0]
    rows = cache.block_table.tolist()
    for b, (length, row) in enumerate(zip(lengths, rows, strict=True)):
        used = row[: -(-(length + new) // cache.page_size)]
        bad = [(i, page) for i, page in enumerate(used) if not 0 <= page < pages]
        if bad:
            i, page = bad[0]
            raise ValueError(f"block_table[{b}, {i}] = {page} points outside the cache's {pages} pages "
                             f"(k_cache dim 0); entry {b} uses its first {len(used)} pages")  # fmt: skip


def values_checked_per_call() -> bool:
    """Whether every call checks its values (FA2TUNE_CHECK_KVCACHE=1), and can: not while a CUDA graph is captured,
    where reading a tensor back is an error."""
    if os.environ.get(CHECK_ENV, "0") in ("", "0"):
        return False
    return not capturing_cuda_graph()
