"""``bf16``: bfloat16 on the wire (the top 16 bits of a float32, rounded), summable.

bfloat16 keeps float32's exponent range (no overflow below 3.39e38) with 8 significant bits.
Rounding is to nearest even; NaN stays a quiet NaN, +-inf stays +-inf. float16 inputs are
widened exactly first; float64 inputs are rounded to float32 first (so a tie can round
twice). The payload buffer holds the bfloat16 bits as uint16.

Example:
    >>> import numpy as np
    >>> c = Bf16Compressor()
    >>> c.decompress(c.compress(np.array([1.0, 3.14159], np.float32))).tolist()
    [1.0, 3.140625]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ..arrays import dtype_name, size
from ._options import dtype_code
from .base import DecodesOnto, as_float32, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes


class Bf16Compressor(DecodesOnto):
    """Round to bfloat16; decode widens back to the input's dtype."""

    name = "bf16"
    reduction = "summable"
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        v = reuse(out, "v", np.uint16, size(x), x)
        if fk is not None:
            fk.f32_to_bf16_fused(x, v, residual, decoded)
        else:
            _kernels.for_array(x).f32_to_bf16(as_float32(x), v)
        return Payload(self.name, {"n": size(x), "dt": dtype_code(dtype_name(x))}, {"v": v})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt"), ("v",), out)
        dt = r.dtype()
        n = r.int("n", 0, 1 << 62)
        v = r.buffer("v", "uint16", n)
        out = make_out(out, n, dt, like=r.like)
        k = _kernels.for_array(out)
        tmp = _kernels.f32_target(out)
        k.bf16_to_f32(v, tmp, add and tmp is out, base)
        return _kernels.f32_finish(tmp, out, k, add)

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype)}, [("v", "uint16", n)])

    def get_config(self) -> dict[str, Any]:
        return {}
