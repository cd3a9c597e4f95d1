"""Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

1. If p is not a power of two, the first ``2r`` ranks (r = p - 2^floor(log2 p)) pair up
   as in recursive doubling: each even one sends its whole buffer to the odd one above it
   and sits out; the other 2^k ranks continue under virtual ranks 0..2^k-1.
2. Reduce-scatter: the buffer is cut into 2^k segments. At distance 2^(k-1), 2^(k-2)...1
   each rank swaps half of its current window of segments with its partner: it sends the
   half the partner keeps and folds the half it keeps (lower rank's data first). Virtual
   rank v ends up with segment v reduced over all ranks.
3. Allgather: at distance 1, 2, 4... partners swap their finished windows (``final``),
   which double each time, until every rank holds the whole result.
4. The ranks that sat out receive the result from their partner.

Each segment is reduced by one rank and then copied, so every rank holds the same bytes.
Per rank, power-of-two p: 2·log2(p) messages and 2(p-1)/p·n bytes when p divides n
(exactly: the other half of each window, then the own window at each doubling; empty
windows send nothing). Ring's bandwidth in log2(p) rounds: large messages, power-of-two p.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.ops import Reducer
    >>> def fn(t):
    ...     buf = np.full(6, t.rank + 1, np.int32); allreduce(t, buf, Reducer("prod", "int32"))
    ...     return buf.tolist()
    >>> run_ranks(4, fn)[3]
    [24, 24, 24, 24, 24, 24]
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import TAG_DATA, Transport
from ._fold import Fold
from ..ops import Reducer
from ._segments import bounds
from ._wire import DenseWire, Wire


def _swap(t: Transport, out: Any, landing: Any, peer: int, tag: int) -> None:
    """Send ``out`` to and receive ``landing`` from ``peer``; a None side is skipped."""
    reqs = []
    if landing is not None:
        reqs.append(t.irecv(landing, peer, tag))
    if out is not None:
        reqs.append(t.isend(out, peer, tag))
    t.waitall(reqs)


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA,
              wire: Wire | None = None) -> None:
    """Allreduce ``buf`` (flat, contiguous) in place across all ranks of ``t``."""
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if p == 1 or n == 0:
        return
    w = wire or DenseWire(red)
    fold = Fold(p)
    pof2 = fold.pof2
    vrank = fold.fold_in(t, buf, w, tag)    # step 1: fold the extra ranks in
    out = None                              # what an odd rank of a pair hands back
    if vrank >= 0:
        off = bounds(n, pof2)

        def window(v: int, size: int) -> slice:   # aligned block of ``size`` segments
            first = v & ~(size - 1)
            return slice(off[first], off[first + size])

        mask = pof2 >> 1                    # step 2: recursive halving
        while mask:
            peer = fold.real(vrank ^ mask)
            keep, give = window(vrank, mask), window(vrank ^ mask, mask)
            seg, other = buf[keep], buf[give]   # empty windows send nothing
            landing = w.partial_buffer(arrays.size(seg), buf) if arrays.size(seg) else None
            _swap(t, w.encode(other) if arrays.size(other) else None, landing, peer, tag)
            if landing is not None:
                w.reduce(landing, seg, peer < rank)
            mask >>= 1
        mask = 1                            # step 3: recursive doubling
        while mask < pof2:
            peer = fold.real(vrank ^ mask)
            mine, theirs = buf[window(vrank, mask)], buf[window(vrank ^ mask, mask)]
            landing = w.final_buffer(arrays.size(theirs), theirs) if arrays.size(theirs) else None
            _swap(t, w.final(mine) if arrays.size(mine) else None, landing, peer, tag)
            if landing is not None:
                w.place(landing, theirs)
            mask <<= 1
        if fold.rem:                        # every participant rounds the same result
            out = w.final(buf)
    fold.hand_back(t, buf, w, tag, out)     # step 4: hand the result back
