"""Recursive-doubling allreduce: log2(p) exchanges of the whole buffer.

1. If p is not a power of two, the first ``2r`` ranks (r = p - 2^floor(log2 p)) pair up:
   each even rank sends its buffer to the odd one above it and sits out.
2. The remaining 2^k ranks exchange whole buffers with the partner at distance 1, 2, 4...,
   each time combining (lower rank's data first, so partners compute identical bytes).
3. Ranks that sat out receive the result.

Few rounds and no splitting make it the choice for small messages (latency-bound).
Per rank, for power-of-two p: log2(p) messages of n bytes sent.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.collectives._reduce import Reducer
    >>> def fn(t):
    ...     buf = np.full(3, t.rank, np.int64); allreduce(t, buf, Reducer("sum", "int64"))
    ...     return buf.tolist()
    >>> run_ranks(3, fn)[0]
    [3, 3, 3]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm.base import TAG_DATA, Transport
from ._reduce import Reducer


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA) -> None:
    """Allreduce ``buf`` (flat, contiguous) in place across all ranks of ``t``."""
    p, rank = t.size, t.rank
    if p == 1 or buf.size == 0:
        return
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    tmp = np.empty_like(buf)
    if rank < 2 * rem:                      # step 1: fold the extra ranks in
        if rank % 2 == 0:
            t.send(buf, rank + 1, tag)
            vrank = -1
        else:
            t.recv(tmp, rank - 1, tag)
            red.combine(tmp, buf, buf)
            vrank = rank // 2
    else:
        vrank = rank - rem
    if vrank >= 0:                          # step 2: butterfly among 2^k ranks
        mask = 1
        while mask < pof2:
            vpeer = vrank ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            t.sendrecv(buf, peer, tmp, peer, tag)
            if peer < rank:
                red.combine(tmp, buf, buf)
            else:
                red.combine(buf, tmp, buf)
            mask <<= 1
    if rank < 2 * rem:                      # step 3: hand the result back
        if rank % 2 == 0:
            t.recv(buf, rank + 1, tag)
        else:
            t.send(buf, rank - 1, tag)
