"""Recursive-doubling allreduce: log2(p) exchanges of the whole buffer.

1. If p is not a power of two, the first ``2r`` ranks (r = p - 2^floor(log2 p)) pair up:
   each even rank sends its buffer to the odd one above it and sits out.
2. The remaining 2^k ranks exchange whole buffers with the partner at distance 1, 2, 4...,
   each time combining (lower rank's data first, so partners compute identical bytes).
   On a lossy wire each partner first rounds its own partial through the codec
   (``final``), so both combine the same decoded values.
3. Ranks that sat out receive the result.

Few rounds and no splitting make it the choice for small messages (latency-bound).
Per rank, for power-of-two p: log2(p) messages of n bytes sent.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.ops import Reducer
    >>> def fn(t):
    ...     buf = np.full(3, t.rank, np.int64); allreduce(t, buf, Reducer("sum", "int64"))
    ...     return buf.tolist()
    >>> run_ranks(3, fn)[0]
    [3, 3, 3]
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import TAG_DATA, Transport
from ._fold import Fold
from ..ops import Reducer
from ._wire import DenseWire, Wire


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
    if vrank >= 0:                          # step 2: butterfly among 2^k ranks
        mask = 1
        while mask < pof2:
            peer = fold.real(vrank ^ mask)
            tmp = w.partial_buffer(n, buf)
            t.sendrecv(w.final(buf), peer, tmp, peer, tag)
            w.reduce(tmp, buf, peer < rank)
            mask <<= 1
        out = w.final(buf)                  # every participant rounds the same result
    fold.hand_back(t, buf, w, tag, out)     # step 3: hand the result back
