"""``onebit``: 1-bit SGD (Seide et al., Interspeech 2014), meant to run with error feedback.

Each element is sent as one bit, ``x >= 0``; each bucket of ``bucket_size`` elements also
sends two float32 reconstruction values, the mean of its non-negative elements and the mean
of its negative ones (the values that minimise the squared error given the signs). Wire:
``ceil(n/8)`` bytes plus 8 bytes per bucket plus the header. Deterministic. A bucket
holding NaN or +-inf decodes to NaN.

Example:
    >>> import numpy as np
    >>> c = OneBitCompressor(bucket_size=8)
    >>> c.decompress(c.compress(np.array([1.0, 3.0, -2.0, 0.0], np.float32))).tolist()
    [1.3333333730697632, 1.3333333730697632, -2.0, 1.3333333730697632]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ..arrays import dtype_name, size
from ._options import dtype_code
from .base import DecodesOnto, as_float32, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from .int8 import MAX_BUCKET, Bucketed
from ..errors import PayloadError


class OneBitCompressor(DecodesOnto, Bucketed):
    """Sign bits with per-bucket means of the two sign groups."""

    name = "onebit"
    reduction = "gathered"
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def __init__(self, bucket_size: int = 2048) -> None:
        super().__init__(bucket_size)
        self.piece_quantum = self.bucket_size       # deterministic, bucket by bucket

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        n, bs = size(x), self.bucket_size
        nb = -(-n // bs)
        pos, neg = reuse(out, "pos", np.float32, nb, x), reuse(out, "neg", np.float32, nb, x)
        q = reuse(out, "q", np.uint8, (n + 7) // 8, x)
        if fk is not None:
            fk.onebit_encode_fused(x, bs, pos, neg, q, residual, decoded)
        else:
            _kernels.for_array(x).onebit_encode(as_float32(x), bs, pos, neg, q)
        return Payload(self.name, {"n": n, "dt": dtype_code(dtype_name(x)), "bs": bs},
                       {"pos": pos, "neg": neg, "q": q})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        r = Reader(payload, self.name, ("n", "dt", "bs"), ("pos", "neg", "q"), out)
        dt, bs = r.dtype(), r.int("bs", 8, MAX_BUCKET)
        if bs % 8:
            raise PayloadError(f"onebit payload: bucket size {bs} is not a multiple of 8")
        n = r.int("n", 0, 1 << 62)
        q = r.buffer("q", "uint8", (n + 7) // 8)
        nb = -(-n // bs)
        pos, neg = r.buffer("pos", "float32", nb), r.buffer("neg", "float32", nb)
        out = make_out(out, n, dt, like=r.like)
        k = _kernels.for_array(out)
        tmp = _kernels.f32_target(out)
        k.onebit_decode(q, n, bs, pos, neg, tmp, add and tmp is out, base)
        return _kernels.f32_finish(tmp, out, k, add)

    def plan(self, n: int, dtype: str) -> _OneBitPlan | None:
        """float32: the kernels for ``n`` elements, chosen once.

        Example:
            >>> x = np.linspace(-1, 1, 20, dtype=np.float32); c = OneBitCompressor(8)
            >>> views = {k: np.empty_like(v) for k, v in c.compress(x).buffers.items()}
            >>> c.plan(20, "float32").encode(x, None, views); out = np.empty(20, np.float32)
            >>> c.plan(20, "float32").decode(views, out, False)
            >>> bool(np.array_equal(out, c.decompress(c.compress(x))))
            True
        """
        return _OneBitPlan(n, self.bucket_size) if dtype == "float32" else None

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        bs = self.bucket_size
        nb = -(-n // bs)
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype), "bs": bs},
                              [("pos", "float32", nb), ("neg", "float32", nb),
                               ("q", "uint8", (n + 7) // 8)])


class _OneBitPlan:
    """:meth:`OneBitCompressor.plan`: encode and decode of ``n`` float32 values with the
    kernel module :func:`~._kernels.for_size` picks for ``n`` (as ``compress`` does)."""

    seeded = False

    def __init__(self, n: int, bs: int) -> None:
        self.n, self.bs, self.k = n, bs, _kernels.for_size(n)
        self.fuses = self.k.FUSED

    def encode(self, x: np.ndarray, seed: Any, views: Any, residual: Any = None,
               tally: Any = None) -> None:
        args = (x, self.bs, views["pos"], views["neg"], views["q"])
        if residual is None:
            self.k.onebit_encode(*args)
        else:
            self.k.onebit_encode_fused(*args, residual=residual, tally=tally)

    def decode(self, views: Any, out: np.ndarray, add: bool) -> None:
        self.k.onebit_decode(views["q"], self.n, self.bs, views["pos"], views["neg"], out,
                             add)
