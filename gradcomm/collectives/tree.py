"""Binomial-tree allreduce: reduce up to rank 0, broadcast back down, pipelined in chunks.

1. Rank r's parent is r minus its lowest set bit; its children are r + 1, r + 2, r + 4...
   below that bit (every power of two for rank 0) and below p, so any p works.
2. Reduce: each rank folds in its children's partials, nearest child first, and sends the
   result to its parent. A child's subtree holds ranks above everything already folded in,
   so partials always combine in rank order (lower ranks first).
3. Rank 0 rounds the result (``final``) and broadcasts it; every rank forwards what it
   receives, unchanged, to its children, farthest (largest subtree) first.
4. The buffer moves in chunks of about ``chunk_bytes``: a chunk goes up as soon as it is
   reduced, and rank 0 starts broadcasting chunk k while chunk k+1 is still coming up.

The result is computed once (on rank 0) and copied, so every rank holds the same bytes.
Per rank: n bytes to the parent (ranks > 0) and n bytes to each child, each n in
ceil(bytes / chunk_bytes) messages; rank 0 sends ceil(log2 p)·n.

Why binomial rather than a pipelined binary tree: depth log2(p) gives 2·log2(p) hops for a
small message (one chunk), and chunking already pipelines the large ones; rank 0's
log2(p)·n bytes make ring or Rabenseifner the better choice for large messages anyway.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.ops import Reducer
    >>> def fn(t):
    ...     buf = np.array([t.rank, -t.rank]); allreduce(t, buf, Reducer("max", "int64"))
    ...     return buf.tolist()
    >>> run_ranks(5, fn)
    [[4, 0], [4, 0], [4, 0], [4, 0], [4, 0]]
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import PIPELINE_CHUNK, TAG_DATA, Request, Transport
from ..ops import Reducer
from ._segments import chunks
from ._wire import Wire, dense_wire

#: the pipeline chunk of the in-process transport (as ring's)
CHUNK_BYTES = PIPELINE_CHUNK


def parent(rank: int) -> int | None:
    """Rank's parent in the binomial tree rooted at 0 (None for the root)."""
    return rank - (rank & -rank) if rank else None


def children(rank: int, size: int) -> list[int]:
    """Rank's children, nearest first."""
    limit = rank & -rank if rank else size
    out, d = [], 1
    while d < limit and rank + d < size:
        out.append(rank + d)
        d <<= 1
    return out


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA,
              wire: Wire | None = None, chunk_bytes: int | None = None) -> None:
    """Allreduce ``buf`` (flat, contiguous) in place across all ranks of ``t``.

    ``chunk_bytes`` must be the same on every rank (it fixes the message sizes); None
    asks the transport (:meth:`~gradcomm.comm.Transport.chunk_bytes` of the buffer).
    """
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if p == 1 or n == 0:
        return
    if chunk_bytes is None:
        chunk_bytes = t.chunk_bytes(n * arrays.itemsize(buf))
    if wire is None:
        with dense_wire(t, red) as w:
            allreduce(t, buf, red, tag=tag, wire=w, chunk_bytes=chunk_bytes)
        return
    w = wire
    up, kids = parent(rank), children(rank, p)
    down = kids[::-1]                       # broadcast: largest subtree first
    pieces = chunks(0, n, max(1, chunk_bytes // arrays.itemsize(buf)))
    sends: list[Request] = []

    def reduced(lo: int, hi: int) -> None:  # chunk [lo, hi) holds this subtree's result
        seg = buf[lo:hi]
        if up is None:
            out = w.final(seg)
            sends.extend(t.isend(out, c, tag) for c in down)
        else:
            sends.append(t.isend(w.encode(seg), up, tag))

    # (is_reduce, lo, hi, peer) in the order the messages arrive from each peer
    jobs = [(True, lo, hi, c) for lo, hi in pieces for c in kids]
    if up is not None:
        jobs += [(False, lo, hi, up) for lo, hi in pieces]
    if not kids:                            # a leaf sends everything up at once
        for lo, hi in pieces:
            reduced(lo, hi)

    def post(i: int) -> tuple[Request, Any]:
        is_reduce, lo, hi, peer = jobs[i]
        if is_reduce:
            landing = w.partial_buffer(hi - lo, buf, slot=i % 2)
        else:
            if i == 0 or jobs[i - 1][0]:    # the broadcast lands in place: the sends
                t.waitall(sends)            # up must have completed (they need only
                sends.clear()               # the reduce phase, never a cycle)
            landing = w.final_buffer(hi - lo, buf[lo:hi])
        return t.irecv(landing, peer, tag), landing

    nxt = post(0) if jobs else None
    for i, (is_reduce, lo, hi, peer) in enumerate(jobs):
        assert nxt is not None
        req, landing = nxt
        turn = i + 1 < len(jobs) and is_reduce and not jobs[i + 1][0]
        if i + 1 < len(jobs) and not turn:
            nxt = post(i + 1)               # next receive in flight while we reduce
        t.waitall([req])
        seg = buf[lo:hi]
        if is_reduce:
            w.reduce(landing, seg, peer < rank)
            if peer == kids[-1]:
                reduced(lo, hi)
        else:
            w.place(landing, seg)
            sends.extend(t.isend(landing, c, tag) for c in down)
        if turn:
            nxt = post(i + 1)               # first broadcast receive, after the last send up
    t.waitall(sends)
