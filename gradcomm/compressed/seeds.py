"""The seeds of one compressed allreduce: what every stochastic draw of a call is seeded by.

A call draws from ``(seed, step, crc32(key))`` plus what tells its draws apart: the rank
(not for ``shared_seed`` codecs, whose ranks must draw alike), and for per-hop encodings
the segment's offset and length. A finished segment's seed has no rank but a fingerprint
of the segment, so ranks holding equal data produce equal bytes.

Example:
    >>> import numpy as np
    >>> s = Seeds(7, 3, "w", rank=2, shared=False)
    >>> s.whole()[:2], s.whole()[3], Seeds(7, 3, "w", 2, shared=True).partial(0, 4, 0)[3:]
    ((7, 3), 2, (0, 4))
    >>> seg = np.ones(4, np.float32)
    >>> s.final(0, 4, 1, seg) == Seeds(7, 3, "w", 5, False).final(0, 4, 1, seg)
    True
"""

from __future__ import annotations

import zlib

import numpy as np

from .. import arrays


class Seeds:
    """Seed tuples for one call: ``(seed, step, crc32(key))`` plus what tells draws apart."""

    def __init__(self, seed: int, step: int, key: str, rank: int, shared: bool) -> None:
        self.base = (seed, step, zlib.crc32(key.encode()))
        self.rank, self.shared = rank, shared

    def whole(self) -> tuple[int, ...]:
        """A rank's whole buffer, compressed once (gather routes)."""
        return self.base if self.shared else (*self.base, self.rank)

    def partial(self, off: int, n: int, hop: int) -> tuple[int, ...]:
        """A partial sum of ``n`` elements at ``off``, at reduce hop ``hop``."""
        if self.shared:
            return (*self.base, off, n)
        return (*self.base, self.rank, 1, hop, off, n)

    def final(self, off: int, n: int, hop: int, seg: np.ndarray) -> tuple[int, ...]:
        """A finished segment ``seg`` (``n`` elements at ``off``), at final hop ``hop``."""
        if self.shared:
            return (*self.base, off, n)
        stride = max(1, arrays.size(seg) // 64)
        fingerprint = zlib.crc32(np.ascontiguousarray(arrays.host(seg[::stride])).tobytes())
        return (*self.base, 2, hop, off, n, fingerprint)
