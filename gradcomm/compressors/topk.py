"""``topk``: the ``k`` largest magnitudes, sent as values and indices (Aji & Heafield 2017;
Stich et al. 2018), meant to run with error feedback.

``k`` comes from ``k=`` (an int >= 0, capped at ``n``) or ``ratio=`` (0..1, default 0.01:
``k = round(ratio * n)``, at least 1 if ``ratio > 0``); ``k = 0`` sends nothing.
Selection is exact and canonical: the ``k`` elements of largest ``|x|``, NaN and +-inf
ranking above every finite value, ties going to the lower index; indices ascend strictly.
It guarantees
``||x - C(x)||^2 <= (1 - k/n) ||x||^2``. The fast path estimates the threshold from a
strided sample (as DGC does) and makes one pass; the result is the same exact set.
Wire: ``k`` int32 indices (int64 when ``n >= 2**31``) and ``k`` values in the input's
dtype. Decoding checks ``0 <= index < n`` and strict increase.

Example:
    >>> import numpy as np
    >>> c = TopKCompressor(k=2)
    >>> p = c.compress(np.array([0.5, -3.0, 1.0, 2.0], np.float32))
    >>> p.buffers["i"].tolist(), c.decompress(p).tolist()
    ([1, 3], [0.0, -3.0, 0.0, 2.0])
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

import numpy as np

from . import _kernels
from ..arrays import assign, cast, dtype_name, size
from ._options import dtype_code
from .base import (Compressor, add_input_tally, add_tally, as_input, fused_kernels, need_out,
                   reuse)
from .payload import Payload, Reader, make_out, payload_nbytes
from ..errors import ConfigError, PayloadError


def k_options(ratio: Any, k: Any, default_ratio: float = 0.01) -> tuple[float | None, int | None]:
    """Validate ``ratio=`` / ``k=`` (at most one; the default is ``ratio=default_ratio``)."""
    if ratio is not None and k is not None:
        raise ConfigError(f"give ratio= or k=, not both (got ratio={ratio!r}, k={k!r})")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ConfigError(f"k must be an integer >= 0, got {k!r}")
        return None, int(k)
    ratio = default_ratio if ratio is None else ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)) or \
            not 0 <= ratio <= 1:
        raise ConfigError(f"ratio must be a number in [0, 1], got {ratio!r}")
    return float(ratio), None


def k_of(ratio: float | None, k: int | None, n: int) -> int:
    """Elements kept out of ``n``: ``min(k, n)``, or ``round(ratio * n)`` but at least 1
    when ``ratio > 0`` (rounding, not ceil, so ``0.07 * 100`` keeps 7, not 8)."""
    if k is not None:
        return min(n, k)
    return min(n, max(1, round(ratio * n))) if ratio > 0 and n > 0 else 0


def index_dtype(n: int) -> str:
    return "int32" if n < 2 ** 31 else "int64"


class KeepsK(Compressor):
    """A codec that keeps ``k`` of ``n`` elements: options ``ratio=`` or ``k=``
    (:func:`k_options`). Error feedback and the round trip are applied in its own pass
    (no decoding), and decoding scatters (``add=True``: scatter-adds)."""

    options = ("ratio", "k")

    reuses_out = True
    fuses_feedback = True
    decodes_add = True

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        self.ratio, self.k = k_options(ratio, k)

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio} if self.k is None else {"k": self.k}

    def k_for(self, n: int) -> int:
        """Elements kept out of ``n``."""
        return k_of(self.ratio, self.k, n)

    def compress(self, x: Any, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: Any = None,
                 decoded: Any = None, tally: np.ndarray | None = None) -> Payload:
        """Keep ``k`` elements (:meth:`_keep` says which); with ``residual`` e, of
        ``y = x + e`` (summed into ``e``), leaving ``e = y − decode`` (y with the kept
        elements zeroed); with ``decoded``, leave ``decode`` there (may be ``x``): the
        bytes of :func:`~gradcomm.compressors.base.compose`, with no decoding pass;
        ``tally`` as for :meth:`Compressor.compress`."""
        x = as_input(x, self.name)
        fk = None
        if residual is not None or decoded is not None:
            fk = fused_kernels(x, residual, decoded, self.name)     # validates
        with np.errstate(invalid="ignore", over="ignore"):      # inf - inf: NaN, by design
            if residual is not None:
                add_input_tally(tally, x)
                idx, v, header, buffers = self._keep_added(x, residual, fk, seed, out)
                x = residual
            else:
                idx, v, header, buffers = self._keep(x, size(x), dtype_name(x), seed, out)
            if residual is not None:         # e[idx] - v as e[idx] + (-v): the same bits
                if _kernels.for_array(residual).scatter(residual, idx, -v, True):
                    residual[idx] = residual[idx] - v       # (indices out of order)
                add_tally(tally, residual)
        if decoded is not None:
            assign(decoded, 0)
            decoded[idx] = v
        return Payload(self.name, header, buffers)

    @abstractmethod
    def _keep(self, x: Any, n: int, dt: str, seed: Any, out: Payload | None
              ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """(kept indices, kept values, payload header, payload buffers) of flat ``x``."""

    def _keep_added(self, x: Any, e: Any, fk: Any, seed: Any, out: Payload | None
                    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """:meth:`_keep` of ``e += x`` (``e`` is left holding ``y = x + e``); ``fk``: the
        fused kernel path, or None."""
        e += x                                                  # IEEE addition commutes
        return self._keep(e, size(e), dtype_name(e), seed, out)


class TopKCompressor(KeepsK):
    """Keeps the ``k`` largest magnitudes."""

    name = "topk"
    reduction = "gathered"
    #: decoded output is mostly zeros (collectives may use sparse_allgather)
    sparse = True
    sparse_pairs = True

    def _keep(self, x: Any, n: int, dt: str, seed: Any, out: Payload | None
              ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        idx, vals = _kernels.for_array(x).topk_select(x, self.k_for(n))
        return self._pack(idx, vals, n, dt, out, x)

    def _keep_added(self, x: Any, e: Any, fk: Any, seed: Any, out: Payload | None
                    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """With a fused path: ``e += x`` and the candidates of the selection in one pass
        (``topk_select_add``), the same indices and values as :meth:`_keep` of ``e``."""
        if fk is None:
            return super()._keep_added(x, e, fk, seed, out)
        n = size(e)
        idx, vals = fk.topk_select_add(x, e, self.k_for(n))
        return self._pack(idx, vals, n, dtype_name(e), out, e)

    def _pack(self, idx: Any, vals: Any, n: int, dt: str, out: Payload | None, x: Any
              ) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        m = size(idx)
        i, v = reuse(out, "i", index_dtype(n), m, x), reuse(out, "v", dt, m, x)
        assign(i, cast(idx, index_dtype(n)))
        assign(v, vals)
        return idx, v, {"n": n, "dt": dtype_code(dt), "k": m}, {"i": i, "v": v}

    def to_sparse(self, payload: Payload, out: Any = None
                  ) -> tuple[int, np.dtype, np.ndarray, np.ndarray]:
        """``(n, dtype, indices, values)`` of a validated payload (indices not yet range
        checked: :meth:`decompress` and :meth:`decompress_sum` check them as they scatter);
        the buffers are where ``out`` is (default: where the payload's are)."""
        r = Reader(payload, self.name, ("n", "dt", "k"), ("i", "v"), out)
        dt = r.dtype()
        n = r.int("n", 0, 1 << 62)
        k = r.int("k", 0, n)
        return n, dt, r.buffer("i", index_dtype(n), k), r.buffer("v", dt.name, k)

    def decompress(self, payload: Payload, out: np.ndarray | None = None, *,
                   add: bool = False) -> np.ndarray:
        """Decode into ``out`` (new if None); ``add``: scatter-add into ``out`` as it is."""
        need_out(add, out, self.name)
        return self._sum([payload], out, add)

    def decompress_sum(self, payloads: Sequence[Payload], out: np.ndarray | None = None
                       ) -> np.ndarray:
        """Scatter-add of every payload into one zeroed output (in payload order)."""
        return self._sum(payloads, out, False)

    def _sum(self, payloads: Sequence[Payload], out: np.ndarray | None, add: bool
             ) -> np.ndarray:
        if not payloads:
            raise PayloadError(f"{self.name}: no payloads to decode")
        parts = [self.to_sparse(p, out) for p in payloads]
        n, dt = parts[0][:2]
        if any(p[:2] != (n, dt) for p in parts):
            raise PayloadError(f"{self.name} payloads disagree on count or dtype: "
                               f"{sorted({(p[0], p[1].name) for p in parts})}")
        out = make_out(out, n, dt, zero=not add, like=parts[0][3])
        k = _kernels.for_array(out)
        for j, (_, _, idx, vals) in enumerate(parts):
            if k.scatter(out, idx, vals, add or j > 0):
                raise PayloadError(f"{self.name} payload: indices out of 0..{n - 1} or not "
                                   "strictly increasing")
        return out

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        k = self.k_for(n)
        return payload_nbytes(self.name, {"n": n, "dt": dtype_code(dtype), "k": k},
                              [("i", index_dtype(n), k), ("v", dtype, k)])
