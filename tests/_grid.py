"""A deterministic lossy test codec (nearest multiple of ``step``), for exact references.

It is a real Compressor (payloads serialise, validate and decode like any codec's); its
rounding is simple enough that tests can bound or predict every result exactly.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gradcomm.compressors.base import Compressor, Payload
from gradcomm.errors import PayloadError


class Grid(Compressor):
    """Rounds to the nearest multiple of ``step``; int32 multiples on the wire."""

    name = "grid"
    reduction = "gathered"

    def __init__(self, step: float = 0.25) -> None:
        self.step = step

    def get_config(self) -> dict[str, Any]:
        return {"step": self.step}

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return Payload(self.name, {"n": n}, {"q": np.zeros(n, np.int32)}).nbytes

    def compress(self, x: np.ndarray, *, seed: Sequence[int] | int | None = None) -> Payload:
        q = np.rint(np.asarray(x, np.float64) / self.step).astype(np.int32)
        return Payload(self.name, {"n": int(q.size)}, {"q": q})

    def decompress(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        q = payload.buffers.get("q")
        if q is None or payload.header.get("n") != q.size:
            raise PayloadError("grid: payload lacks 'q' or has the wrong length")
        return (q * self.step).astype(np.float32)
