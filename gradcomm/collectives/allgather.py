"""Allgather of variable-size byte blocks (one per rank), written once against Transport.

1. Sizes first: every rank learns every block's size through a fixed-size allgather of one
   int64 per rank (tag ``TAG_SIZES``). Sizes are validated (``0 <= size <= max_nbytes``)
   identically on every rank, so a bad size raises on every rank and no receive is posted
   for it.
2. Then the blocks, with receives of exactly the announced sizes, by one of:

   - ``"ring"``: p − 1 steps; at step s rank r forwards block (r − s) mod p to r + 1.
     Bandwidth-optimal (each rank receives every other block once), p − 1 rounds.
   - ``"recursive_doubling"`` (Bruck's algorithm, any p): ceil(log2 p) steps; at step k
     rank r sends the min(2^k, p − 2^k) blocks it holds to r − 2^k and receives as many
     from r + 2^k. Blocks stay in rotated order, so each step is one message.
   - ``"auto"``: recursive doubling when the total is below ``SMALL`` bytes, else ring.

The result is one contiguous buffer plus a view per rank, in rank order; every rank ends
with the same bytes.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     blocks = allgatherv(t, np.full(t.rank, t.rank, np.uint8))
    ...     return [b.tolist() for b in blocks]
    >>> run_ranks(3, fn)[0]
    [[], [1], [2, 2]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm.base import TAG_DATA, TAG_SIZES, Transport
from ..errors import ConfigError, PayloadError

#: total bytes below which the latency-optimal (Bruck) variant is chosen
SMALL = 64 * 1024
ALGORITHMS = ("ring", "recursive_doubling", "auto")


def allgather_sizes(t: Transport, size: int, *, tag: int = TAG_SIZES) -> np.ndarray:
    """Every rank's ``size`` (an int), as an int64 array in rank order."""
    return allgather_ints(t, [size], tag=tag)[:, 0]


def allgather_ints(t: Transport, values: Any, *, tag: int = TAG_SIZES) -> np.ndarray:
    """Every rank's int64 vector ``values`` (same length everywhere), as rows in rank order."""
    mine = np.ascontiguousarray(values, np.int64).reshape(-1)
    m = mine.size
    rotated = np.empty((t.size, m), np.int64)
    _bruck(t, mine.view(np.uint8), rotated.reshape(-1).view(np.uint8),
           np.full(t.size, 8 * m, np.int64), tag)
    return np.roll(rotated, t.rank, axis=0)


def allgatherv(t: Transport, block: Any, *, max_nbytes: int | None = None,
               algorithm: str = "auto", tag: int = TAG_DATA,
               sizes: np.ndarray | None = None,
               out: np.ndarray | None = None) -> list[np.ndarray]:
    """Gather every rank's flat uint8 ``block``; returns the blocks in rank order.

    ``max_nbytes`` bounds what a peer may announce (PayloadError on every rank beyond it).
    ``sizes`` skips the size exchange when every rank already knows every size. ``out``
    (flat uint8, at least the total size) receives the blocks instead of a new array;
    with the ring they lie in rank order, so blocks of sizes that are multiples of 8 in
    an 8-aligned ``out`` stay 8-aligned.
    """
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown allgather algorithm {algorithm!r}; known: "
                          f"{', '.join(ALGORITHMS)}")
    mine = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    if sizes is None:
        sizes = allgather_sizes(t, mine.size)
    check_sizes(sizes, max_nbytes)
    if sizes[t.rank] != mine.size:
        raise ConfigError(f"rank {t.rank}: block of {mine.size} bytes but size "
                          f"{sizes[t.rank]} announced")
    total = int(sizes.sum())
    if out is None:
        out = np.empty(total, np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.size < total:
        raise ConfigError(f"allgatherv: out must be flat uint8 of >= {total} bytes")
    out = out[:total]
    if algorithm == "auto":
        algorithm = "recursive_doubling" if total < SMALL else "ring"
    if algorithm == "ring":
        displ = np.concatenate([[0], np.cumsum(sizes)])
        out[displ[t.rank]:displ[t.rank + 1]] = mine
        _ring(t, out, displ, tag)
        return [out[displ[r]:displ[r + 1]] for r in range(t.size)]
    rotated = np.roll(sizes, -t.rank)
    _bruck(t, mine, out, rotated, tag)
    starts = np.concatenate([[0], np.cumsum(rotated)])
    return [out[starts[(r - t.rank) % t.size]:starts[(r - t.rank) % t.size + 1]]
            for r in range(t.size)]


def check_sizes(sizes: np.ndarray, max_nbytes: int | None) -> None:
    """PayloadError (raised identically on every rank) for a negative or oversized size."""
    bad = [r for r, s in enumerate(sizes.tolist())
           if s < 0 or (max_nbytes is not None and s > max_nbytes)]
    if bad:
        r = bad[0]
        raise PayloadError(f"rank {r} announced a block of {int(sizes[r])} bytes; allowed "
                           f"0..{max_nbytes if max_nbytes is not None else 'any'}")


def _ring(t: Transport, out: np.ndarray, displ: np.ndarray, tag: int) -> None:
    p, r = t.size, t.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_b, recv_b = (r - s) % p, (r - s - 1) % p
        t.sendrecv(out[displ[send_b]:displ[send_b + 1]], right,
                   out[displ[recv_b]:displ[recv_b + 1]], left, tag)


def _bruck(t: Transport, mine: np.ndarray, out: np.ndarray, rotated: np.ndarray,
           tag: int) -> None:
    """Bruck allgather into ``out`` in rotated order (block i is rank (rank + i) mod p)."""
    p, r = t.size, t.rank
    starts = np.concatenate([[0], np.cumsum(rotated)])
    out[:mine.size] = mine
    dist = 1
    while dist < p:
        cnt = min(dist, p - dist)
        t.sendrecv(out[:starts[cnt]], (r - dist) % p,
                   out[starts[dist]:starts[dist + cnt]], (r + dist) % p, tag)
        dist *= 2
