"""``terngrad``: TernGrad (Wen et al., NeurIPS 2017), unbiased ternary quantization.

Per bucket ``v``: ``Q(v_i) = s * sign(v_i) * b_i`` with ``s = max |v|`` and ``b_i`` a
Bernoulli draw of probability ``|v_i| / s``, so ``E[Q(v)] = v``. Wire: 2 bits per element
(0, +1, -1) plus one float32 scale per bucket. Draws come from ``compress(x, seed=...)``.
Error feedback applies (``feedback_stable``; it is not a contraction in norm: the error's
expected square ``s·|v|_1 - |v|²`` exceeds ``|v|²`` for Gaussian buckets), because every
element's error ``|Q(v)_i - v_i|`` is below ``s`` and the largest element is sent
exactly. It is what trains SGD + momentum: without it TernGrad's variance
(``s·|v_i|`` per element) diverged or fell far short of uncompressed training; with it,
it came within a point (bench/RESULTS.md, "Convergence"). The DDP hook turns it off when
the optimizer it finds is not SGD (Adam's per-coordinate steps lose points to the released
residual: :mod:`gradcomm.integrations.ddp.momentum`).
A bucket holding NaN or +-inf decodes to NaN. (TernGrad's gradient clipping is left to the
caller.)

Example:
    >>> import numpy as np
    >>> c = TernGradCompressor(bucket_size=8)
    >>> y = c.decompress(c.compress(np.array([2.0, -2.0, 0.0], np.float32), seed=0))
    >>> y.tolist()
    [2.0, -2.0, 0.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ..arrays import dtype_name, size
from ._options import dtype_code, seed_words
from .base import DecodesOnto, as_float32, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from .int8 import MAX_BUCKET, Bucketed
from ..errors import PayloadError


class TernGradCompressor(DecodesOnto, Bucketed):
    """Stochastic ternary {-1, 0, +1} times the bucket's largest magnitude."""

    name = "terngrad"
    reduction = "gathered"
    #: an element's error reaches the bucket's largest magnitude: not a contraction...
    contractive = False
    #: ...but each stays below it and the largest is exact: error feedback applies
    feedback_stable = True
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def __init__(self, bucket_size: int = 512) -> None:
        super().__init__(bucket_size)

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        n, bs = size(x), self.bucket_size
        scale = reuse(out, "scale", np.float32, -(-n // bs), x)
        q = reuse(out, "q", np.uint8, (n * 2 + 7) // 8, x)
        args = (bs, 1, 2, False, seed_words(seed), scale, q)
        if fk is not None:
            fk.signlevel_encode_fused(x, *args, residual, decoded)
        else:
            _kernels.for_array(x).signlevel_encode(as_float32(x), *args)
        return Payload(self.name, {"n": n, "dt": dtype_code(dtype_name(x)), "bs": bs},
                       {"scale": scale, "q": q})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt", "bs"), ("scale", "q"), out)
        dt, bs = r.dtype(), r.int("bs", 8, MAX_BUCKET)
        if bs % 8:
            raise PayloadError(f"terngrad payload: bucket size {bs} is not a multiple of 8")
        n = r.int("n", 0, 1 << 62)
        q = r.buffer("q", "uint8", (n * 2 + 7) // 8)
        scale = r.buffer("scale", "float32", -(-n // bs))
        out = make_out(out, n, dt, like=r.like)
        k = _kernels.for_array(out)
        tmp = _kernels.f32_target(out)
        k.signlevel_decode(q, n, bs, 1, 2, scale, tmp,     # every 2-bit code is valid
                           add and tmp is out, base)
        return _kernels.f32_finish(tmp, out, k, add)

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        bs = self.bucket_size
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype), "bs": bs},
                              [("scale", "float32", -(-n // bs)), ("q", "uint8", (n * 2 + 7) // 8)])
