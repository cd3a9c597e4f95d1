"""How the dense algorithms cut a buffer into segments and chunks.

Every rank derives the same cuts from the element count alone, so receivers post exact
sizes. ``n`` elements in ``parts`` pieces: the first ``n % parts`` pieces get one element
more than the others. Pieces of zero elements are never sent (both sides know they are
empty), which keeps the byte and message counts a function of ``n`` and ``p`` only.

Example:
    >>> bounds(7, 3)
    [0, 3, 5, 7]
    >>> chunks(0, 10, 4)
    [(0, 4), (4, 7), (7, 10)]
    >>> chunks(5, 5, 4)
    []
    >>> ring_schedule(7, 3, 0, 2)
    ([(0, 2), (2, 3)], [(0, 5, 7), (1, 3, 5), (2, 0, 2), (2, 2, 3), (3, 5, 7)])
"""

from __future__ import annotations


def bounds(n: int, parts: int) -> list[int]:
    """Offsets ``o`` (length ``parts + 1``) so that piece ``i`` is ``[o[i], o[i+1])``."""
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def chunks(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``ceil((hi - lo) / chunk)`` near-equal ``(start, stop)`` pieces."""
    m = hi - lo
    if m <= 0:
        return []
    k = -(-m // chunk)
    o = bounds(m, k)
    return [(lo + o[i], lo + o[i + 1]) for i in range(k)]


def ring_schedule(n: int, p: int, rank: int, chunk: int
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """A ring allreduce's pieces at ``rank``: the ``(start, stop)`` chunks of its own
    segment, which it sends first, and the ``(step, start, stop)`` of every chunk it
    receives, in arrival order (steps 0..p-2 reduce, p-1..2p-3 gather).

    In step ``s`` rank r receives segment r-s-1 of the reduce-scatter, then segment
    r-s+p-1 of the allgather; each segment travels in chunks of about ``chunk`` elements.
    """
    off = bounds(n, p)

    def pieces(seg: int) -> list[tuple[int, int]]:
        return chunks(off[seg], off[seg + 1], chunk)

    def arriving(s: int) -> int:            # segment received in step s (sent in s + 1)
        return (rank - s - 1) % p if s < p - 1 else (rank - s + p - 1) % p

    jobs = [(s, lo, hi) for s in range(2 * p - 2) for lo, hi in pieces(arriving(s))]
    return pieces(rank), jobs
