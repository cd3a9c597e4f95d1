"""Ring allreduce: a reduce-scatter, then an allgather, pipelined in chunks.

1. The buffer is cut into p segments whose sizes differ by at most one element. In step s
   of the reduce-scatter (s = 0 .. p-2) rank r sends segment r-s to rank r+1 and folds
   segment r-s-1, arriving from rank r-1, into its own copy. After p-1 steps rank r holds
   segment r+1 reduced over all ranks.
2. The allgather passes the finished segments around the same ring: rank r sends its own
   (``final``), then forwards each segment exactly as it arrived, p-1 steps in all.
3. Segments travel in chunks of about ``chunk_bytes`` (by default the transport's choice:
   512 KiB in process, a few chunks per segment where the transport may cross a network).
   A chunk moves on as soon as it has been reduced, and the receives of the next chunks
   are posted before the current one is reduced (as many as the transport's
   ``window_bytes`` allow, at least one), so transfers overlap reductions within and
   across steps, and a link never waits for a receive to be posted.

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
from ..comm.base import PIPELINE_CHUNK, TAG_DATA, Request, Transport
from ..errors import ConfigError
from ..ops import Reducer
from ._segments import ring_schedule
from ._wire import Wire, dense_wire

#: the pipeline chunk of the in-process transport (and every transport's smallest)
CHUNK_BYTES = PIPELINE_CHUNK


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA,
              wire: Wire | None = None, chunk_bytes: int | None = None,
              src: Any = None) -> None:
    """Allreduce ``buf`` (flat, contiguous) in place across all ranks of ``t``.

    ``chunk_bytes`` must be the same on every rank (it fixes the message sizes); None
    asks the transport (:meth:`~gradcomm.comm.Transport.chunk_bytes` of the segment).
    ``src`` (on a wire that ``folds_from_src``: the dense one and the compressed one):
    this rank's values, of ``buf``'s size and dtype, not modified; ``buf``'s own contents
    are then never read (out of place, with no copy: the first sends read ``src``, and
    each segment is folded from ``src`` into ``buf``).
    """
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if src is not None and wire is not None and not wire.folds_from_src:
        raise ConfigError("ring.allreduce(src=...) needs a wire that folds from src")
    if src is not None and (p == 1 or n == 0):
        arrays.assign(buf, src)
    if p == 1 or n == 0:
        return
    size = arrays.itemsize(buf)
    if chunk_bytes is None:
        chunk_bytes = t.chunk_bytes(-(-n // p) * size)
    if wire is None:
        with dense_wire(t, red) as w:
            allreduce(t, buf, red, tag=tag, wire=w, chunk_bytes=chunk_bytes, src=src)
        return
    w = wire
    right, left = (rank + 1) % p, (rank - 1) % p
    last = 2 * p - 3                        # steps 0..p-2 reduce, p-1..2p-3 gather
    first, jobs = ring_schedule(n, p, rank, max(1, chunk_bytes // size))
    # receives posted ahead of the one waited for: the transport's window, at least one
    depth = 1 + max(1, t.window_bytes // max(1, chunk_bytes))
    mine = buf if src is None else src      # this rank's own values
    sends: dict[int, list[Request]] = {0: [t.isend(w.encode(mine[lo:hi]), right, tag)
                                           for lo, hi in first]}
    done = 0                                # sends of steps < done have completed

    def settle(upto: int, block: bool = True) -> bool:
        """Wait for the sends of steps < upto (without ``block``: only if all of them
        have completed already; False otherwise)."""
        nonlocal done
        while done < upto:
            if not block and not all(r.test() for r in sends.get(done, ())):
                return False
            t.waitall(sends.pop(done, []))
            done += 1
        return True

    posted: dict[int, tuple[Request, Any]] = {}
    nxt = 0                                 # next job whose receive is not posted yet

    def fill(cur: int) -> None:
        """Post receives for jobs up to ``cur + depth - 1`` (job ``cur + 1`` always: the
        double buffer), in schedule order; a finished segment lands in place, so its
        receive waits for our reduce-scatter send of that region (ahead of need, only if
        that send has completed already)."""
        nonlocal nxt
        while nxt < len(jobs) and nxt < cur + depth:
            s, lo, hi = jobs[nxt]
            if s < p - 1:
                landing = w.partial_buffer(hi - lo, buf, slot=nxt % depth)
            else:
                need = s - p + 2            # our sends of steps < need must be complete
                if nxt > cur + 1 and (need - 1 > jobs[cur][0] or not settle(need, False)):
                    return                  # not issued yet, or still in flight
                settle(need)
                landing = w.final_buffer(hi - lo, buf[lo:hi])
            posted[nxt] = (t.irecv(landing, left, tag), landing)
            nxt += 1

    for i, (s, lo, hi) in enumerate(jobs):
        fill(i)                             # next receives in flight while we reduce
        req, landing = posted.pop(i)
        settle(s)                           # bounds the sends in flight; no cycle: our
                                            # step s-1 sends need only step s-1 work
        t.waitall([req])
        seg = buf[lo:hi]
        if s < p - 1:
            if src is None:
                w.reduce(landing, seg, left < rank)
            else:                           # each segment is folded once, from src
                w.reduce(landing, seg, left < rank, src[lo:hi])
            out = w.encode(seg) if s + 1 < p - 1 else w.final(seg)
        else:
            w.place(landing, seg)
            out = landing                   # forward the very bytes the owner produced
        if s < last:
            sends.setdefault(s + 1, []).append(t.isend(out, right, tag))
    for reqs in sends.values():
        t.waitall(reqs)
