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
