"""``int8``: uniform quantization to 1..8 bits, bit-packed, in one of two modes.

**Per-bucket range** (default; ``reduction = "gathered"``): each bucket of ``bucket_size``
elements is mapped onto ``2**bits`` evenly spaced levels between its minimum and maximum
(as CGX does), so ``bits=1`` works too. Wire: ``ceil(n*bits/8)`` code bytes plus two
float32 per bucket (minimum and step). A constant bucket (all zeros included) decodes
exactly.

**Shared scale** (``scale=s``; ``reduction = "summable"``): symmetric levels
``k * s / L`` for ``|k| <= L = 2**(bits-1) - 1``, the same on every rank, so codes of
several ranks add as integers and a re-encoded sum of decoded payloads is exact. Values
beyond ``+-s`` saturate: pick ``s`` >= the largest partial sum (for example the
allreduced maximum times the rank count). Wire: the codes only.

``rounding="nearest"`` (deterministic) or ``"stochastic"`` (unbiased up to 2^-16 of a
step, seeded: ``compress(x, seed=...)``). Non-finite inputs: a bucket holding NaN or +-inf
decodes to NaN (per-bucket mode); in shared-scale mode that element decodes to NaN.

Example:
    >>> import numpy as np
    >>> c = Int8Compressor(bits=8, bucket_size=8)
    >>> x = np.array([0.0, 1.0, 2.0, 5.1], np.float32)
    >>> [round(float(v), 2) for v in c.decompress(c.compress(x))]
    [0.0, 1.0, 2.0, 5.1]
    >>> c.compress(x).nbytes == c.max_nbytes(4), c.reduction, Int8Compressor(scale=4.0).reduction
    (True, 'gathered', 'summable')
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _kernels
from ..arrays import dtype_name, size
from ._options import dtype_code, one_of, positive_int, seed_words
from .base import Compressor, DecodesOnto, as_float32, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from ..errors import ConfigError, PayloadError

#: largest bucket a payload may announce (also the option's upper bound)
MAX_BUCKET = 1 << 30


def bucket_option(value: Any, name: str = "bucket_size") -> int:
    """Validate a bucket size: a multiple of 8 in 8 .. 2**30."""
    v = positive_int(name, value, 8, MAX_BUCKET)
    if v % 8:
        raise ConfigError(f"{name} must be a multiple of 8 in 8..{MAX_BUCKET}, got {value!r}")
    return v


class Bucketed(Compressor):
    """A codec whose one option is ``bucket_size`` (a multiple of 8; each subclass names
    its default in ``__init__``)."""

    options = ("bucket_size",)

    def __init__(self, bucket_size: int) -> None:
        self.bucket_size = bucket_option(bucket_size)

    def get_config(self) -> dict[str, Any]:
        return {"bucket_size": self.bucket_size}


class Int8Compressor(DecodesOnto):
    """Uniform quantizer: per-bucket min/max levels, or symmetric levels of a shared scale."""

    options = ("bits", "bucket_size", "rounding", "scale")

    name = "int8"
    reduction = "gathered"
    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def __init__(self, bits: int = 8, bucket_size: int = 1024, rounding: str = "nearest",
                 scale: float | None = None) -> None:
        self.bits = positive_int("bits", bits, 1, 8)
        self.bucket_size = bucket_option(bucket_size)
        self.rounding = one_of("rounding", rounding, ("nearest", "stochastic"))
        #: error <= one level of the bucket's range from 2 bits up; 1 bit is not a contraction
        self.contractive = self.bits >= 2
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) \
                    or not math.isfinite(scale) or scale <= 0:
                raise ConfigError(f"scale must be None or a finite number > 0, got {scale!r}")
            if self.bits < 2:
                raise ConfigError(f"bits must be in 2..8 with scale=, got {bits!r}")
            scale = float(scale)
            self.reduction = "summable"
        self.scale = scale
        #: per-bucket nearest rounding is deterministic, bucket by bucket
        self.piece_quantum = self.bucket_size if scale is None and \
            self.rounding == "nearest" else 0

    def get_config(self) -> dict[str, Any]:
        return {"bits": self.bits, "bucket_size": self.bucket_size, "rounding": self.rounding,
                "scale": self.scale}

    def _header(self, n: int, dt: int) -> dict[str, Any]:
        if self.scale is None:
            return {"n": n, "dt": dt, "bits": self.bits, "bs": self.bucket_size}
        return {"n": n, "dt": dt, "bits": self.bits, "sc": self.scale}

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        x32, n, k = as_float32(x), size(x), _kernels.for_array(x)
        stochastic = self.rounding == "stochastic"
        key = seed_words(seed) if stochastic else np.zeros(4, np.uint32)
        q = reuse(out, "q", np.uint8, (n * self.bits + 7) // 8, x)
        header = self._header(n, dtype_code(dtype_name(x)))
        if self.scale is not None:
            if fk is not None:
                fk.fixed_encode_fused(x32, self.bits, self.scale, stochastic, key, q, residual,
                                      decoded)
            else:
                k.fixed_encode(x32, self.bits, self.scale, stochastic, key, q)
            return Payload(self.name, header, {"q": q})
        nb = -(-n // self.bucket_size)
        lo, unit = reuse(out, "lo", np.float32, nb, x), reuse(out, "unit", np.float32, nb, x)
        args = (self.bucket_size, self.bits, stochastic, key, lo, unit, q)
        if fk is not None:
            fk.minmax_encode_fused(x32, *args, residual, decoded)
        else:
            k.minmax_encode(x32, *args)
        return Payload(self.name, header, {"lo": lo, "unit": unit, "q": q})

    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        need_out(add, out, self.name)
        shared = isinstance(payload, Payload) and isinstance(payload.header, dict) and \
            "sc" in payload.header
        keys = ("n", "dt", "bits", "sc") if shared else ("n", "dt", "bits", "bs")
        r = Reader(payload, self.name, keys, ("q",) if shared else ("lo", "unit", "q"), out)
        dt, bits = r.dtype(), r.int("bits", 2 if shared else 1, 8)
        n = r.int("n", 0, 1 << 62)
        q = r.buffer("q", "uint8", (n * bits + 7) // 8)
        out = make_out(out, n, dt, like=r.like)
        k = _kernels.for_array(out)
        tmp = _kernels.f32_target(out)
        if shared:
            k.fixed_decode(q, n, bits, r.float("sc"), tmp, add and tmp is out, base)
        else:
            bs = r.int("bs", 8, MAX_BUCKET)
            if bs % 8:
                raise PayloadError(f"int8 payload: bucket size {bs} is not a multiple of 8")
            nb = -(-n // bs)
            k.minmax_decode(q, n, bs, bits, r.buffer("lo", "float32", nb),
                            r.buffer("unit", "float32", nb), tmp, add and tmp is out, base)
        return _kernels.f32_finish(tmp, out, k, add)

    def plan(self, n: int, dtype: str) -> _MinMaxPlan | None:
        """Per-bucket mode on float32: the kernels for ``n`` elements, chosen once.

        Example:
            >>> import numpy as np
            >>> c = Int8Compressor(bucket_size=8); x = np.linspace(-1, 1, 12, dtype=np.float32)
            >>> p = c.compress(x); plan = c.plan(12, "float32")
            >>> views = {k: np.empty_like(v) for k, v in p.buffers.items()}
            >>> plan.encode(x, None, views)
            >>> all(np.array_equal(views[k], p.buffers[k]) for k in views)
            True
            >>> out = np.empty(12, np.float32); plan.decode(views, out, False)
            >>> bool(np.array_equal(out, c.decompress(p)))
            True
        """
        if self.scale is not None or dtype != "float32":
            return None
        return _MinMaxPlan(self, n)

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        h = self._header(n, dtype_code(dtype))
        bufs = [("q", "uint8", (n * self.bits + 7) // 8)]
        if self.scale is None:
            nb = -(-n // self.bucket_size)
            bufs = [("lo", "float32", nb), ("unit", "float32", nb)] + bufs
        return payload_nbytes(self.name, h, bufs)


class _MinMaxPlan:
    """:meth:`Int8Compressor.plan`: per-bucket encode and decode of ``n`` float32 values
    with the kernel module :func:`~._kernels.for_size` picks for ``n`` (the one
    ``compress`` and ``decompress`` use)."""

    def __init__(self, c: Int8Compressor, n: int) -> None:
        self.n, self.bits, self.bs = n, c.bits, c.bucket_size
        self.seeded = c.rounding == "stochastic"
        self.k = _kernels.for_size(n)
        self.fuses = self.k.FUSED
        self._key = np.zeros(4, np.uint32)

    def encode(self, x: np.ndarray, seed: Any, views: Any, residual: Any = None,
               tally: Any = None) -> None:
        key = seed_words(seed) if self.seeded else self._key
        args = (x, self.bs, self.bits, self.seeded, key, views["lo"], views["unit"],
                views["q"])
        if residual is None:
            self.k.minmax_encode(*args)
        else:
            self.k.minmax_encode_fused(*args, residual=residual, tally=tally)

    def decode(self, views: Any, out: np.ndarray, add: bool) -> None:
        self.k.minmax_decode(views["q"], self.n, self.bs, self.bits, views["lo"],
                             views["unit"], out, add)
