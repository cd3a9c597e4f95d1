"""Gather of variable-size byte blocks to one rank, written once against Transport.

Every other rank sends the root its block's size (one int64, tag ``TAG_SIZES``), then the
block (tag ``TAG_DATA``); the root receives them in rank order, checking each announced
size, and returns every rank's block in rank order. The others return ``[]``. p − 1
messages of each kind, all at the root: for rare, large gathers (checkpoints), where the
root alone needs the data.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     return [b.tolist() for b in gatherv(t, np.full(t.rank, t.rank, np.uint8))]
    >>> run_ranks(3, fn)
    [[[], [1], [2, 2]], [], []]
"""

from __future__ import annotations

import numpy as np

from ..comm.base import TAG_DATA, TAG_SIZES, Transport
from ..errors import PayloadError

#: the largest block the root accepts, in bytes
MAX_NBYTES = 1 << 40


def gatherv(t: Transport, block: np.ndarray) -> list[np.ndarray]:
    """Every rank's uint8 ``block`` at rank 0, in rank order (``[]`` on the other ranks)."""
    if t.rank != 0:
        t.send(np.array([block.size], np.int64), 0, TAG_SIZES)
        t.send(block, 0, TAG_DATA)
        return []
    blocks = [block]
    for r in range(1, t.size):
        size = np.empty(1, np.int64)
        t.recv(size, r, TAG_SIZES)
        if not 0 <= size[0] <= MAX_NBYTES:
            raise PayloadError(f"rank {r} announced a block of {size[0]} bytes")
        b = np.empty(int(size[0]), np.uint8)
        t.recv(b, r, TAG_DATA)
        blocks.append(b)
    return blocks


__all__ = ["MAX_NBYTES", "gatherv"]
