"""``fp16``: IEEE half precision on the wire (2 bytes per element), summable.

Rounding is to nearest even. **Overflow**: a value of magnitude >= 65520 becomes +-inf (as
IEEE and ``torch.half`` do), so a caller that sums fp16 payloads divides by the rank count
*before* reducing (``op="mean"`` does). NaN stays NaN (the canonical quiet NaN), +-inf stays
+-inf. float16 inputs travel unchanged (lossless); float64 inputs are rounded directly.

Example:
    >>> import numpy as np
    >>> c = Fp16Compressor()
    >>> p = c.compress(np.array([1.0, 2.5, 1e5], np.float32))
    >>> c.decompress(p).tolist(), p.nbytes == c.max_nbytes(3)
    ([1.0, 2.5, inf], True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ._kernels import _numpy
from ..arrays import assign, bitcast, dtype_name, is_host, size
from ._options import dtype_code
from .base import DecodesOnto, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes


class Fp16Compressor(DecodesOnto):
    """Cast to float16; decode widens back to the input's dtype."""

    name = "fp16"
    reduction = "summable"
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        n, dt = size(x), dtype_name(x)
        v = reuse(out, "v", np.float16, n, x)
        if fk is not None:
            fk.f32_to_f16_fused(x, v.view(np.uint16), residual, decoded)
        elif dt == "float16":
            assign(v, x)
        elif dt == "float32" or not is_host(x):
            _kernels.for_array(x).f32_to_f16(x, bitcast(v, "uint16"))
        else:                                   # float64: rounded once, directly to half
            _numpy.f32_to_f16(x, v.view(np.uint16))
        return Payload(self.name, {"n": n, "dt": dtype_code(dt)}, {"v": v})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt"), ("v",), out)
        dt = r.dtype()
        n = r.int("n", 0, 1 << 62)
        v = r.buffer("v", "float16", n)
        out = make_out(out, n, dt, like=r.like)
        if dt == np.float16:
            if add:
                out += v                        # IEEE addition commutes
            else:
                assign(out, v)
        else:
            k = _kernels.for_array(out)
            tmp = _kernels.f32_target(out)
            k.f16_to_f32(bitcast(v, "uint16"), tmp, add and tmp is out, base)
            _kernels.f32_finish(tmp, out, k, add)
        return out

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype)}, [("v", "float16", n)])

    def get_config(self) -> dict[str, Any]:
        return {}
