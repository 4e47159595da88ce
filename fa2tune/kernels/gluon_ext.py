"""Gluon operations that Triton 3.6 builds but does not expose on Hopper.

`tma_reduce_add`: a TMA bulk reduction (`cp.reduce.async.bulk.tensor ... .add`), shared memory added into global
memory by the tensor memory accelerator. Triton 3.6's Gluon IR builder has the op (`create_async_tma_reduce`, the
one `tensor_descriptor.atomic_add` lowers to) but its Hopper `tma` module offers only copies; the fused-dQ backward
(templates/bwd_ws.py.jinja, `fused_dq`) adds its fp32 dQ partials this way, as FlashAttention-3 does, instead of
per-thread atomics (those run at the L2's atomic rate). Like `tma.async_copy_shared_to_global`,
it joins the thread's bulk async-group: `tma.store_wait(n)` waits for it to have read its source.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds shared-memory tile `src` (the descriptor's block shape and layout) into `tensor_desc`'s tensor at
    `coord`, element-wise and atomically per element."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
