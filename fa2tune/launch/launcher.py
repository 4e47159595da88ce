"""The launch layer's interface for the layers above it (the API, the tuner, scripts): what they import from here.

forward() and backward() launch the generated kernels with the configs they are handed; fa2tune.api.ops.forward
and .backward resolve the configs a caller leaves out, as attention() does. decode() runs a decode step over a KV
cache (fa2tune.flash_attn_with_kvcache). Packing describes packed sequences;
EagerAttention is the eager autograd path; clear_plans forgets the kept launch plans.

Importing fa2tune does not import triton: the kernels' modules are rendered and imported on first use, so a
program (or `fa2tune --device cpu`) can still choose Triton's interpreter (TRITON_INTERPRET=1) after importing us.

Inside the layer: grid (grid maths, launch constants), layout (a call's tensors, mask bounds, kernel variant),
plans (the plan cache), fallback (configs a call cannot run), forward, backward (the launchers), autograd (the
eager autograd.Function, the second-order refusal), warpspec and fastlaunch (warp-specialized and direct launches),
decode (the decode kernels' launches).
"""

from __future__ import annotations

from .autograd import SECOND_ORDER_ERROR, EagerAttention, is_eager, needs_grad, refuse_second_order
from .backward import backward
from .decode import decode
from .forward import checked_forward, forward
from .layout import Packing
from .plans import clear_plans

__all__ = [
    "SECOND_ORDER_ERROR",
    "EagerAttention",
    "Packing",
    "backward",
    "checked_forward",
    "clear_plans",
    "decode",
    "forward",
    "is_eager",
    "needs_grad",
    "refuse_second_order",
]

