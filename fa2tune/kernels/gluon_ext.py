"""The Gluon TMA operations the warp-specialized templates call, under one name whatever the Triton version.

`tma_load` (global to shared, completing on an mbarrier) and `tma_store` (shared to global, in the thread's bulk
async-group that `tma.store_wait` waits on): Triton 3.6 calls them `tma.async_copy_global_to_shared` and
`tma.async_copy_shared_to_global`; Triton 3.9 renamed them `tma.async_load` and `tma.async_store` (same arguments
in the same order) and made the old names raise. The templates call these aliases, so one rendered kernel compiles
under both.

`thread_barrier`: a barrier of the calling warps (inside a warp-specialized partition, of that partition's warps);
Triton 3.6 calls it `gl.thread_barrier`, 3.9 `gl.barrier`.

`shared_memory_descriptor._reinterpret` (a view of a shared-memory buffer's bytes as another dtype, shape and layout:
the fused-dQ backward's narrower dQ blocks in its widest block's buffer) is Triton 3.6's name; 3.9 renamed it
`reinterpret`. Importing this module gives 3.9's descriptors the 3.6 name too, so the rendered code (and the code
hash a stored entry records) is one for both.

`tma_reduce_add`: a TMA bulk reduction (`cp.reduce.async.bulk.tensor ... .add`), shared memory added into global memory
by the tensor memory accelerator. Triton 3.6's Gluon IR builder has the op (`create_async_tma_reduce`, the one
`tensor_descriptor.atomic_add` lowers to) but its Hopper `tma` module offers only copies; the fused-dQ backward
(templates/bwd_ws.py.jinja, `fused_dq`) adds its fp32 dQ partials this way, as FlashAttention-3 does, instead of
per-thread atomics (those run at the L2's atomic rate: docs/HISTORY.md, "Backward"). Like
`tma.async_copy_shared_to_global`, it joins the thread's bulk async-group: `tma.store_wait(n)` waits for it to have read
its source.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

_RENAMED = hasattr(tma, "async_load")  # Triton 3.9 on: async_load / async_store / async_atomic_add


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """Adds shared-memory tile `src` (the descriptor's block shape and layout) into `tensor_desc`'s tensor at
    `coord`, element-wise and atomically per element."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

if not hasattr(gl.shared_memory_descriptor, "_reinterpret"):  # Triton 3.9 on
    gl.shared_memory_descriptor._reinterpret = gl.shared_memory_descriptor.reinterpret

if _RENAMED:
    tma_load, tma_store, tma_reduce_add = tma.async_load, tma.async_store, tma.async_atomic_add
else:
    tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
    tma_reduce_add = _tma_reduce_add_36
