"""``randomk``: ``k`` elements at random positions (Stich et al., NeurIPS 2018), summable.

The positions come from the seed alone: ranks that pass the same ``seed`` pick the same
positions, so their payloads add value by value (``shared_seed = True``; a collective
passes a seed without the rank). Only the values and the 128-bit stream key travel; the
decoder regenerates the positions. ``k`` from ``k=`` or ``ratio=`` as for ``topk``. Values
are not rescaled (use error feedback). If ``x`` holds NaN or +-inf, every sent value is
NaN, so the overflow is not silently dropped.

Example:
    >>> import numpy as np
    >>> c = RandomKCompressor(k=2)
    >>> x = np.arange(1.0, 6.0, dtype=np.float32)
    >>> y = c.decompress(c.compress(x, seed=7))
    >>> int((y != 0).sum()), bool(np.all((y == 0) | (y == x)))
    (2, True)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import _kernels
from .._array import assign, dtype_name, empty_like_kind, size
from .base import (Compressor, Payload, Reader, as_input, dtype_code, fused_kernels, make_out,
                   need_out, payload_nbytes, reuse, seed_words)
from .topk import k_of, k_options
from ..errors import PayloadError

_U32 = 0xFFFFFFFF


class RandomKCompressor(Compressor):
    """Keeps ``k`` positions drawn from the (shared) seed."""

    name = "randomk"
    reduction = "summable"
    shared_seed = True

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        self.ratio, self.k = k_options(ratio, k)

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio} if self.k is None else {"k": self.k}

    def k_for(self, n: int) -> int:
        return k_of(self.ratio, self.k, n)

    def indices(self, n: int, seed: Sequence[int] | int | None) -> np.ndarray:
        """The ascending positions ``compress`` keeps for ``n`` elements and ``seed``."""
        return _kernels.for_size(n).randomk_indices(seed_words(seed), n, self.k_for(n), None)

    def compress(self, x: np.ndarray, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: np.ndarray | None = None,
                 decoded: np.ndarray | None = None) -> Payload:
        """Keep the seed's ``k`` positions; with ``residual`` e, of ``y = x + e`` (summed
        into ``e``), leaving ``e = y − decode``; with ``decoded``, leave ``decode`` there
        (may be ``x``): the bytes of :func:`~gradcomm.compressors.base.compose`."""
        x = as_input(x, self.name)
        n, dt, key = size(x), dtype_name(x), seed_words(seed)
        if residual is not None or decoded is not None:
            fused_kernels(x, residual, decoded, self.name)          # validates
        with np.errstate(invalid="ignore", over="ignore"):      # inf - inf: NaN, by design
            if residual is not None:
                residual += x                                   # IEEE addition commutes
                x = residual
            k = _kernels.for_array(x)
            idx = k.randomk_indices(key, n, self.k_for(n), x)
            m = size(idx)
            v = reuse(out, "v", dt, m, x)
            assign(v, x[idx])
            if m and not k.all_finite(x):
                assign(v, float("nan"))
            if residual is not None:
                residual[idx] = residual[idx] - v
        if decoded is not None:
            assign(decoded, 0)
            decoded[idx] = v
        return Payload(self.name, {"n": n, "dt": dtype_code(dt), "k": m,
                                   "key": [int(w) for w in key]}, {"v": v})

    def _read(self, payload: Payload, out: Any = None
              ) -> tuple[int, np.dtype, tuple[int, ...], np.ndarray]:
        r = Reader(payload, self.name, ("n", "dt", "k", "key"), ("v",), out)
        dt = r.dtype()
        n = r.int("n", 0, 1 << 62)
        k = r.int("k", 0, n)
        key = payload.header["key"]
        if not (isinstance(key, list) and len(key) == 4 and
                all(type(w) is int and 0 <= w <= _U32 for w in key)):
            raise PayloadError(f"randomk payload: key {key!r} is not four uint32 words")
        return n, dt, tuple(key), r.buffer("v", dt.name, k)

    def decompress(self, payload: Payload, out: np.ndarray | None = None,
                   add: bool = False) -> np.ndarray:
        """Decode into ``out`` (new if None); ``add``: scatter-add into ``out`` as it is."""
        need_out(add, out, self.name)
        return self._sum([payload], out, add)

    def decompress_sum(self, payloads: Sequence[Payload], out: np.ndarray | None = None
                       ) -> np.ndarray:
        """Sum of the decoded payloads; with one shared key the values are added first and
        scattered once."""
        return self._sum(payloads, out, False)

    def _sum(self, payloads: Sequence[Payload], out: np.ndarray | None, add: bool
             ) -> np.ndarray:
        if not payloads:
            raise PayloadError(f"{self.name}: no payloads to decode")
        parts = [self._read(p, out) for p in payloads]
        n, dt = parts[0][:2]
        if any(p[:2] != (n, dt) for p in parts):
            raise PayloadError(f"{self.name} payloads disagree on count or dtype: "
                               f"{sorted({(p[0], p[1].name) for p in parts})}")
        out = make_out(out, n, dt, zero=not add, like=parts[0][3])
        k = _kernels.for_array(out)
        groups: dict[tuple[tuple[int, ...], int], Any] = {}
        with np.errstate(invalid="ignore", over="ignore"):
            for _, _, key, vals in parts:   # payloads with one key and k share positions
                m = size(vals)
                if m:
                    acc = groups.get((key, m))
                    if acc is None:
                        groups[key, m] = acc = empty_like_kind(vals, m, dtype_name(vals))
                        assign(acc, vals)
                    else:
                        acc += vals
        for (key, m), vals in groups.items():
            idx = k.randomk_indices(np.array(key, np.uint32), n, m, out)
            k.scatter(out, idx, vals, True)
        return out

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        k = self.k_for(n)
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype), "k": k,
                                          "key": [_U32] * 4}, [("v", dtype, k)])
