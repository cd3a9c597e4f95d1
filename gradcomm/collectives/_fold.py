"""The fold that lets power-of-two algorithms run on any number of ranks.

With r = p - 2^floor(log2 p) extra ranks, the first ``2r`` ranks pair up: each even one
sends its whole buffer to the odd one above it (which folds it in, the lower rank's data
first) and sits out; the other 2^k ranks continue under virtual ranks 0..2^k-1. At the
end each odd rank of a pair hands the result back to its even partner. Recursive
doubling and Rabenseifner both use it.

Example:
    >>> f = Fold(6)                 # ranks 0..3 pair up; 1, 3, 4, 5 continue
    >>> f.pof2, [f.virtual(r) for r in range(6)], [f.real(v) for v in range(4)]
    (4, [-1, 0, -1, 1, 2, 3], [1, 3, 4, 5])
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import Transport
from ._wire import Wire


class Fold:
    """The pairing of ``p`` ranks onto ``pof2`` = 2^floor(log2 p) virtual ranks."""

    __slots__ = ("pof2", "rem")

    def __init__(self, p: int) -> None:
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2

    def virtual(self, rank: int) -> int:
        """``rank``'s virtual rank, -1 for a rank that sits out."""
        if rank < 2 * self.rem:
            return -1 if rank % 2 == 0 else rank // 2
        return rank - self.rem

    def real(self, v: int) -> int:
        """The rank behind virtual rank ``v``."""
        return v * 2 + 1 if v < self.rem else v + self.rem

    def fold_in(self, t: Transport, buf: Any, w: Wire, tag: int) -> int:
        """The first step: an even rank of a pair sends ``buf`` (``w.encode``), the odd
        one folds it into its own. Returns this rank's virtual rank (-1: it sat out)."""
        rank = t.rank
        if rank < 2 * self.rem:
            if rank % 2 == 0:
                t.send(w.encode(buf), rank + 1, tag)
            else:
                tmp = w.partial_buffer(arrays.size(buf), buf)
                t.recv(tmp, rank - 1, tag)
                w.reduce(tmp, buf, True)
        return self.virtual(rank)

    def hand_back(self, t: Transport, buf: Any, w: Wire, tag: int, out: Any) -> None:
        """The last step: an odd rank of a pair sends ``out`` (its ``w.final`` of the
        result), the even one places it into ``buf``."""
        rank = t.rank
        if rank < 2 * self.rem:
            if rank % 2 == 0:
                landing = w.final_buffer(arrays.size(buf), buf)
                t.recv(landing, rank + 1, tag)
                w.place(landing, buf)
            else:
                t.send(out, rank - 1, tag)
