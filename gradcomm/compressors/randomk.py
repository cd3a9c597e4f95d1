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
from ..arrays import assign, dtype_name, empty_like_kind, size
from ._options import dtype_code, seed_words
from .base import need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from .topk import KeepsK
from ..errors import PayloadError

_U32 = 0xFFFFFFFF


class RandomKCompressor(KeepsK):
    """Keeps ``k`` positions drawn from the (shared) seed."""

    name = "randomk"
    reduction = "summable"
    shared_seed = True

    def indices(self, n: int, seed: Sequence[int] | int | None) -> np.ndarray:
        """The ascending positions ``compress`` keeps for ``n`` elements and ``seed``."""
        return _kernels.for_size(n).randomk_indices(seed_words(seed), n, self.k_for(n), None)

    def _keep(self, x: Any, n: int, dt: str, seed: Any, out: Payload | None
              ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """The seed's ``k`` positions (all NaN values if ``x`` holds a non-finite one)."""
        key = seed_words(seed)
        k = _kernels.for_array(x)
        idx = k.randomk_indices(key, n, self.k_for(n), x)
        m = size(idx)
        v = reuse(out, "v", dt, m, x)
        assign(v, x[idx])
        if m and not k.all_finite(x):
            assign(v, float("nan"))
        return idx, v, {"n": n, "dt": dtype_code(dt), "k": m,
                        "key": [int(w) for w in key]}, {"v": v}

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

    def decompress(self, payload: Payload, out: np.ndarray | None = None, *,
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
