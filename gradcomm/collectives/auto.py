"""``algorithm="auto"``: pick a dense algorithm from message size and rank count.

A first table, from the α-β model: below ``SMALL`` bytes latency dominates and recursive
doubling's log2(p) rounds win; above it bandwidth dominates and ring's 2(p-1)/p·n bytes
per rank win (Rabenseifner sends the same bytes in fewer rounds for power-of-two p).
Every rank computes the same answer from the same inputs.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: select(t, 100))[0]
    'recursive_doubling'
"""

from __future__ import annotations

from ..comm.base import Transport

#: bytes below which the latency-optimal algorithm is chosen
SMALL = 64 * 1024


def select(t: Transport, nbytes: int) -> str:
    """Name of the dense algorithm to use for ``nbytes`` bytes on ``t``."""
    p = t.size
    if p <= 2 or nbytes < SMALL:
        return "recursive_doubling" if nbytes < SMALL else "ring"
    if p & (p - 1) == 0:
        return "rabenseifner"
    return "ring"
