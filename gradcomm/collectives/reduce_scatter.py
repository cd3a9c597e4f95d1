"""Ring reduce-scatter: rank r ends with segment r of the sum, pipelined in chunks.

1. The buffer is cut into p segments whose sizes differ by at most one element
   (:func:`~gradcomm.collectives._segments.bounds`: the first ``n % p`` segments get one
   element more). When p divides n, rank r's segment is ``[r·n/p, (r+1)·n/p)``, the shard
   FSDP2 expects of its padded flat gradient.
2. In step s (s = 0 .. p-2) rank r sends segment r-s-1 to rank r+1 and folds segment
   r-s-2, arriving from rank r-1, into its own copy; that segment moves on in step s+1.
   Segment j thus starts at rank j+1 and collects one rank per step until, after p-1
   steps, it arrives complete at rank j.
3. Segments travel in chunks of about ``chunk_bytes``; the receive of the next chunk is
   posted before the current one is reduced, and a chunk moves on as soon as it has been
   reduced.

Written against :class:`~gradcomm.collectives._wire.Wire`, so the same code carries dense
values (:class:`~gradcomm.collectives._wire.DenseWire`) and codec payloads (a compressed
wire re-encodes each partial sum once per hop). Per rank: (p-1)/p·n elements in p-1
messages when p divides n and a segment fits in one chunk; in general every segment but
r, each in ceil(bytes / chunk_bytes) messages (empty segments send nothing).

:func:`dense_reduce_scatter` checks that the ranks agree and returns this rank's shard.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(3, lambda t: dense_reduce_scatter(t, np.arange(7.0), "sum", "float64")
    ...           .tolist())
    [[0.0, 3.0, 6.0], [9.0, 12.0], [15.0, 18.0]]
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..comm.base import TAG_DATA, Request, Transport
from ..errors import ConfigError, GradcommError
from ..ops import Reducer, reducer
from ._check import agree
from ._segments import bounds, chunks
from ._wire import DenseWire, Wire
from .ring import CHUNK_BYTES

#: reduce-scatter algorithms of the dense and compressed collectives
ALGORITHMS = ("ring",)


def shard_bounds(n: int, p: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s shard of ``n`` elements on ``p`` ranks.

    Example:
        >>> [shard_bounds(5, 3, r) for r in range(3)]
        [(0, 2), (2, 4), (4, 5)]
    """
    off = bounds(n, p)
    return off[rank], off[rank + 1]


def schedule(n: int, p: int, rank: int, chunk: int
             ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The ``(start, stop)`` chunks rank ``rank`` sends first (segment rank-1, its own
    values) and the ``(step, start, stop)`` of every chunk it receives, in arrival order
    (segment rank-s-2 in step s).

    Example:
        >>> schedule(6, 3, 0, 2)
        ([(4, 6)], [(0, 2, 4), (1, 0, 2)])
    """
    off = bounds(n, p)

    def pieces(seg: int) -> list[tuple[int, int]]:
        return chunks(off[seg], off[seg + 1], chunk)

    jobs = [(s, lo, hi) for s in range(p - 1) for lo, hi in pieces((rank - s - 2) % p)]
    return pieces((rank - 1) % p), jobs


def ring(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA,
         wire: Wire | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Reduce-scatter flat contiguous ``buf`` in place: afterwards this rank's segment
    (:func:`shard_bounds`) holds the reduction over all ranks; the rest of ``buf`` holds
    partial sums. ``chunk_bytes`` must be the same on every rank."""
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if p == 1 or n == 0:
        return
    w = wire or DenseWire(red)
    right, left = (rank + 1) % p, (rank - 1) % p
    first, jobs = schedule(n, p, rank, max(1, chunk_bytes // arrays.itemsize(buf)))
    sends: list[Request] = [t.isend(w.encode(buf[lo:hi]), right, tag) for lo, hi in first]

    def post(i: int) -> tuple[Request, Any]:
        _, lo, hi = jobs[i]
        landing = w.partial_buffer(hi - lo, buf, slot=i % 2)
        return t.irecv(landing, left, tag), landing

    nxt = post(0) if jobs else None
    for i, (s, lo, hi) in enumerate(jobs):
        assert nxt is not None
        req, landing = nxt
        if i + 1 < len(jobs):
            nxt = post(i + 1)               # next receive in flight while we reduce
        t.waitall([req])
        seg = buf[lo:hi]
        w.reduce(landing, seg, left < rank)
        if s < p - 2:                       # the segment moves on; ours stays
            sends.append(t.isend(w.encode(seg), right, tag))
    t.waitall(sends)


def dense_reduce_scatter(t: Transport, buf: Any, op: str, dtype: str,
                         algorithm_name: str = "ring", *, check: bool = True) -> Any:
    """Reduce-scatter flat ``buf`` (logical ``dtype``, overwritten) by ``op``; returns
    this rank's shard, a view of ``buf`` (:func:`shard_bounds`). Ops sum, mean, max, min,
    prod. ``check``: the ranks first agree on count, dtype, op and algorithm (a
    difference is a MismatchError on every rank)."""
    problem: Exception | None = None
    red: Reducer | None = None
    try:
        red = reducer(op, dtype)
        if algorithm_name not in (*ALGORITHMS, "auto"):
            raise ConfigError(f"unknown reduce-scatter algorithm {algorithm_name!r}; "
                              f"known: {', '.join((*ALGORITHMS, 'auto'))}")
    except GradcommError as exc:
        problem = exc
    if check:
        agree(t, "reduce_scatter", count=int(arrays.size(buf)), dtype=dtype, op=op,
              algorithm=algorithm_name)
    if problem is not None:
        raise problem
    assert red is not None
    ring(t, buf, red)
    lo, hi = shard_bounds(arrays.size(buf), t.size, t.rank)
    shard = buf[lo:hi]
    if red.op == "mean":
        red.finalize(shard, t.size)
    return shard


__all__ = ["ALGORITHMS", "dense_reduce_scatter", "ring", "schedule", "shard_bounds"]
