"""``qsgd``: QSGD (Alistarh et al., NeurIPS 2017), unbiased stochastic quantization.

Per bucket ``v`` of ``bucket_size`` elements: ``Q(v_i) = ||v||_2 * sign(v_i) * l_i / s``
where ``l_i`` rounds ``s |v_i| / ||v||_2`` up or down at random, unbiased, so
``E[Q(v)] = v`` and ``E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2`` (d the bucket
size). Options: ``levels=s`` (1..127) or ``bits=b`` (2..8, s = 2**(b-1) - 1);
``bucket_size`` (multiple of 8). Wire: level and sign packed into ``1 + bitlen(s)`` bits
per element, plus one float32 norm per bucket. Draws come from ``compress(x, seed=...)``
(same seed, same bytes). A bucket holding NaN or +-inf decodes to NaN (so does one whose
norm overflows float32, which takes values near 1e38).

Example:
    >>> import numpy as np
    >>> c = QSGDCompressor(levels=127, bucket_size=8)
    >>> x = np.array([3.0, -4.0, 0.0], np.float32)
    >>> y = c.decompress(c.compress(x, seed=1))
    >>> bool(np.abs(y - x).max() <= 5.0 / 127), c.compress(x, seed=1).nbytes == c.max_nbytes(3)
    (True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ..arrays import dtype_name, size
from ._options import dtype_code, positive_int, seed_words
from .base import DecodesOnto, as_float32, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from .int8 import MAX_BUCKET, bucket_option
from ..errors import ConfigError, PayloadError

MAX_LEVELS = 127


def code_bits(levels: int) -> int:
    """Bits per element for ``levels``: one sign bit plus the level's bit length."""
    return 1 + int(levels).bit_length()


class QSGDCompressor(DecodesOnto):
    """Unbiased stochastic quantization to ``levels`` levels of the bucket's L2 norm."""

    options = ("levels", "bits", "bucket_size")

    name = "qsgd"
    reduction = "gathered"
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def __init__(self, levels: int | None = None, bits: int | None = None,
                 bucket_size: int = 512) -> None:
        if levels is not None and bits is not None:
            raise ConfigError(f"give levels= or bits=, not both (got levels={levels!r}, "
                              f"bits={bits!r})")
        if bits is not None:
            levels = (1 << (positive_int("bits", bits, 2, 8) - 1)) - 1
        self.levels = positive_int("levels", 127 if levels is None else levels, 1, MAX_LEVELS)
        self.bucket_size = bucket_option(bucket_size)
        #: a contraction when the variance bound min(d/s^2, sqrt(d)/s) < 1 (d = bucket size)
        d, s = self.bucket_size, self.levels
        self.contractive = min(d / s ** 2, d ** 0.5 / s) < 1

    def get_config(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket_size": self.bucket_size}

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        n, s, bs = size(x), self.levels, self.bucket_size
        bits = code_bits(s)
        norm = reuse(out, "norm", np.float32, -(-n // bs), x)
        q = reuse(out, "q", np.uint8, (n * bits + 7) // 8, x)
        args = (bs, s, bits, True, seed_words(seed), norm, q)
        if fk is not None:
            fk.signlevel_encode_fused(x, *args, residual, decoded)
        else:
            _kernels.for_array(x).signlevel_encode(as_float32(x), *args)
        return Payload(self.name, {"n": n, "dt": dtype_code(dtype_name(x)), "s": s, "bs": bs},
                       {"norm": norm, "q": q})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt", "s", "bs"), ("norm", "q"), out)
        dt, s, bs = r.dtype(), r.int("s", 1, MAX_LEVELS), r.int("bs", 8, MAX_BUCKET)
        if bs % 8:
            raise PayloadError(f"qsgd payload: bucket size {bs} is not a multiple of 8")
        n = r.int("n", 0, 1 << 62)
        bits = code_bits(s)
        q = r.buffer("q", "uint8", (n * bits + 7) // 8)
        norm = r.buffer("norm", "float32", -(-n // bs))
        out = make_out(out, n, dt, like=r.like)
        k = _kernels.for_array(out)
        tmp = _kernels.f32_target(out)
        if k.signlevel_decode(q, n, bs, s, bits, norm, tmp, add and tmp is out, base):
            raise PayloadError(f"qsgd payload: a code's level exceeds s={s}")
        return _kernels.f32_finish(tmp, out, k, add)

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        s, bs = self.levels, self.bucket_size
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype), "s": s, "bs": bs},
                              [("norm", "float32", -(-n // bs)),
                               ("q", "uint8", (n * code_bits(s) + 7) // 8)])
