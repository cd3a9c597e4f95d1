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

from typing import Any, Sequence

import numpy as np

from . import _kernels
from ._kernels import _numpy
from .base import (Compressor, Payload, Reader, as_input, compose, dtype_code, fused_kernels,
                   make_out, need_out, payload_nbytes, reuse)


class Fp16Compressor(Compressor):
    """Cast to float16; decode widens back to the input's dtype."""

    name = "fp16"
    reduction = "summable"

    def compress(self, x: np.ndarray, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: np.ndarray | None = None,
                 decoded: np.ndarray | None = None) -> Payload:
        """Encode ``x``; with ``residual`` e, encode ``y = x + e`` and leave ``e = y −
        decode``; with ``decoded``, leave ``decode`` there (may be ``x``): one fused pass
        (:func:`~gradcomm.compressors.base.compose` defines the bytes)."""
        x = as_input(x, self.name)
        fk = None
        if residual is not None or decoded is not None:
            fk = fused_kernels(x, residual, decoded, self.name)
            if fk is None:
                return compose(self, x, seed, out, residual, decoded)
        v = reuse(out, "v", np.float16, x.size)
        if fk is not None:
            fk.fused("f16", x, (v.view(np.uint16),), residual, decoded)
        elif x.dtype == np.float16:
            v[...] = x
        elif x.dtype == np.float32:
            _kernels.for_size(x.size).f32_to_f16(x, v.view(np.uint16))
        else:                                   # float64: rounded once, directly to half
            _numpy.f32_to_f16(x, v.view(np.uint16))
        return Payload(self.name, {"n": x.size, "dt": dtype_code(x.dtype)}, {"v": v})

    def decompress(self, payload: Payload, out: np.ndarray | None = None,
                   add: bool = False) -> np.ndarray:
        """Decode into ``out`` (new if None); ``add``: ``out = decoded + out``."""
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt"), ("v",))
        dt = r.dtype()
        n = r.int("n", 0, 1 << 62)
        v = r.buffer("v", "float16", n)
        out = make_out(out, n, dt)
        if dt == np.float16:
            if add:
                np.add(v, out, out=out)
            else:
                out[...] = v
        else:
            k = _kernels.for_size(n)
            tmp = _kernels.f32_target(out)
            k.f16_to_f32(v.view(np.uint16), tmp, add and tmp is out)
            _kernels.f32_finish(tmp, out, k, add)
        return out

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype)}, [("v", "float16", n)])

    def get_config(self) -> dict[str, Any]:
        return {}
