"""The all-to-all compressed reduce-scatter (the shape of ZeRO++'s qgZ).

Rank r's shard is segment r of the buffer (:func:`~gradcomm.collectives.reduce_scatter.
shard_bounds`). Every segment is cut into chunks of ``chunk`` elements
(:func:`~gradcomm.collectives._segments.chunks`; the caller passes the compressed ring's
chunk, about 2 MiB of payload spanning at most 8 MiB of the buffer, so large messages
stream instead of travelling as one frame per peer). For chunk index j = 0, 1, ... every rank

1. encodes chunk j of each other rank's segment of its own buffer once (its
   error-feedback residual for that chunk fused into the codec's pass), into a frame
   whose size follows from the chunk's element count alone, so receivers post exact
   sizes, and sends it to that segment's owner, for d = r+1, r+2, ... (mod p);
2. waits for chunk j of its own segment from the p-1 others (receives are posted ahead,
   as many chunks per peer as the transport's ``window_bytes`` allow, at least two), and
   sums it in rank order: rank q's decoded contribution, and its own values (which never
   cross the wire) exactly, at position r.

Every rank sends its chunk j before it waits for chunk j, so the exchange cannot wait on
itself; every wait has the transport's deadline. One compression per contribution (no
re-compression of partial sums), Σ_{d≠r} chunks(m_d) messages per rank (p-1 when a
segment fits in one chunk); bytes sent per rank: the frames of the other segments'
chunks. Empty segments (n < p) send nothing.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.seeds import Seeds
    >>> def fn(t):
    ...     x = np.full(6, t.rank + 1.0, np.float32)
    ...     alltoall(t, x, compressors.get("fp16"), Seeds(0, 0, "w", t.rank, False), None,
    ...              chunk=2)
    ...     return x[3 * t.rank:3 * t.rank + 3].tolist()
    >>> run_ranks(2, fn)
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..collectives._segments import bounds, chunks
from ..comm.base import TAG_DATA, Request, Transport
from ..compressors.base import Compressor
from ..errors import PayloadError
from .frames import Frames
from .seeds import Seeds
from .state import Scratch


def alltoall(t: Transport, x: Any, codec: Compressor, seeds: Seeds, e: Any | None,
             scratch: Scratch | None = None, *, tag: int = TAG_DATA,
             chunk: int | None = None) -> None:
    """``x[own] = Σ_ranks x[own]`` (decoded contributions, own values exact) for this
    rank's segment ``own`` of flat ``x``; the rest of ``x`` is left as it was. ``e``: this
    rank's residual, a flat array like ``x`` (its own segment is not used), or None.
    ``chunk``: elements per message, the same on every rank (None: one per segment)."""
    p, r, n = t.size, t.rank, arrays.size(x)
    off = bounds(n, p)
    step = max(1, n if chunk is None else int(chunk))
    pieces = [chunks(off[d], off[d + 1], step) for d in range(p)]
    mine = pieces[r]
    f = Frames(codec, x, scratch)
    sizes = [f.bound(b - a) for a, b in mine]
    starts = [sum(sizes[:j]) * (p - 1) for j in range(len(sizes))]   # chunk-major
    landing = f.take(sum(sizes) * (p - 1)) if mine else None
    peers = [q for q in range(p) if q != r]
    depth = 1 + max(1, t.window_bytes // max(1, max(sizes, default=1)))
    posted: dict[int, tuple[Any, list[tuple[int, Request, Any]]]] = {}
    nxt = 0

    def fill(cur: int) -> None:
        """Post the receives of own chunks up to ``cur + depth - 1``, in order: chunk j
        of every peer lands in one block, rank order."""
        nonlocal nxt
        while nxt < len(mine) and nxt < cur + depth:
            assert landing is not None
            k = sizes[nxt]
            block = landing[starts[nxt]:starts[nxt] + k * (p - 1)]
            posted[nxt] = (block, [(q, t.irecv(block[i * k:(i + 1) * k], q, tag),
                                    block[i * k:(i + 1) * k]) for i, q in enumerate(peers)])
            nxt += 1

    fill(0)
    sends: list[Request] = []
    dests = [(r + k) % p for k in range(1, p)]
    for j in range(max(len(pc) for pc in pieces)):
        for d in dests:
            if j < len(pieces[d]):
                a, b = pieces[d][j]
                frame, _ = f.single(x[a:b], seeds.partial(a, b - a, 0), b - a,
                                    f.bound(b - a), residual=None if e is None else e[a:b])
                sends.append(t.isend(frame, d, tag))
        if j < len(mine):
            fill(j)
            block, got = posted.pop(j)
            t.waitall([req for _, req, _ in got])
            a, b = mine[j]
            _fold(f, block, got, x[a:b], b - a, r, p)
    t.waitall(sends)


def _fold(f: Frames, block: Any, got: list[tuple[int, Request, Any]], out: Any, m: int,
          r: int, p: int) -> None:
    """Sum the received frames of one own chunk (all in ``block``) into ``out`` (``m``
    elements) in rank order."""
    payloads = {}
    for q, _, frame in got:
        try:
            (_, _, data), = f.parts(frame, m, 1)
            payloads[q] = f.payload(data, m)
        except PayloadError as exc:
            raise PayloadError(f"rank {q}'s reduce-scatter payload: {exc}") from None
    if f.device:            # the chunk's payloads to the device in one copy (8-byte aligned)
        moved = arrays.like(block, out)
        payloads = {q: pl.rebased(block, moved) for q, pl in payloads.items()}
    _sum_in_rank_order(f, payloads, out, r, p)


def _sum_in_rank_order(f: Frames, payloads: dict[int, Any], out: Any, r: int, p: int
                       ) -> None:
    """``out = c_0 + c_1 + ... + c_{p-1}`` left to right, where ``c_r`` is ``out``'s own
    values and ``c_q`` rank q's decoded payload."""
    own = arrays.clone(out) if r else None
    for q in range(p):
        if q == r:
            if own is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    out += own                      # IEEE addition commutes
        elif q == 0:
            f.decode_payload(payloads[q], out)
        else:
            f.decode_add_payload(payloads[q], out)


__all__ = ["alltoall"]
