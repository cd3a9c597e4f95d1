"""Ring allreduce: a reduce-scatter, then an allgather, pipelined in chunks.

1. The buffer is cut into p segments whose sizes differ by at most one element. In step s
   of the reduce-scatter (s = 0 .. p-2) rank r sends segment r-s to rank r+1 and folds
   segment r-s-1, arriving from rank r-1, into its own copy. After p-1 steps rank r holds
   segment r+1 reduced over all ranks.
2. The allgather passes the finished segments around the same ring: rank r sends its own
   (``final``), then forwards each segment exactly as it arrived, p-1 steps in all.
3. Segments travel in chunks of about ``chunk_bytes``. A chunk moves on as soon as it has
   been reduced, and the receive of the next chunk is posted before the current one is
   reduced, so transfers overlap reductions within and across steps.

Each segment is reduced along one path and then copied, so every rank holds the same bytes.
Per rank: 2(p-1)/p·n bytes in 2(p-1) messages when p divides n and a segment fits in one
chunk. In general rank r sends every segment but r+1, then every segment but r+2, each in
ceil(bytes / chunk_bytes) messages (empty segments send nothing). Bandwidth-optimal, so it
is the choice for large messages; 2(p-1) latency terms make it slow for small ones.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.ops import Reducer
    >>> def fn(t):
    ...     buf = np.arange(5.0) * (t.rank + 1); allreduce(t, buf, Reducer("sum", "float64"))
    ...     return buf.tolist()
    >>> run_ranks(3, fn)[2]
    [0.0, 6.0, 12.0, 18.0, 24.0]
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import TAG_DATA, Request, Transport
from ..ops import Reducer
from ._segments import ring_schedule
from ._wire import DenseWire, Wire

#: default pipeline chunk: large enough that per-message overhead is small, small enough
#: that a reduction overlaps the next transfer
CHUNK_BYTES = 512 * 1024


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA,
              wire: Wire | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Allreduce ``buf`` (flat, contiguous) in place across all ranks of ``t``.

    ``chunk_bytes`` must be the same on every rank (it fixes the message sizes).
    """
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if p == 1 or n == 0:
        return
    w = wire or DenseWire(red)
    right, left = (rank + 1) % p, (rank - 1) % p
    last = 2 * p - 3                        # steps 0..p-2 reduce, p-1..2p-3 gather
    first, jobs = ring_schedule(n, p, rank, max(1, chunk_bytes // arrays.itemsize(buf)))
    sends: dict[int, list[Request]] = {0: [t.isend(w.encode(buf[lo:hi]), right, tag)
                                           for lo, hi in first]}

    done = 0                                # sends of steps < done have completed

    def settle(upto: int) -> None:          # wait for the sends of steps < upto
        nonlocal done
        while done < upto:
            t.waitall(sends.pop(done, []))
            done += 1

    def post(i: int) -> tuple[Request, Any]:
        s, lo, hi = jobs[i]
        if s < p - 1:
            landing = w.partial_buffer(hi - lo, buf, slot=i % 2)
        else:                               # lands in place: our reduce-scatter send
            settle(s - p + 2)               # of this segment must have completed
            landing = w.final_buffer(hi - lo, buf[lo:hi])
        return t.irecv(landing, left, tag), landing

    nxt = post(0) if jobs else None
    for i, (s, lo, hi) in enumerate(jobs):
        assert nxt is not None
        req, landing = nxt
        if i + 1 < len(jobs):
            nxt = post(i + 1)               # next receive in flight while we reduce
        settle(s)                           # bounds the sends in flight; no cycle: our
                                            # step s-1 sends need only step s-1 work
        t.waitall([req])
        seg = buf[lo:hi]
        if s < p - 1:
            w.reduce(landing, seg, left < rank)
            out = w.encode(seg) if s + 1 < p - 1 else w.final(seg)
        else:
            w.place(landing, seg)
            out = landing                   # forward the very bytes the owner produced
        if s < last:
            sends.setdefault(s + 1, []).append(t.isend(out, right, tag))
    for reqs in sends.values():
        t.waitall(reqs)
