"""The all-to-all compressed reduce-scatter (the shape of ZeRO++'s qgZ).

Rank r's shard is segment r of the buffer (:func:`~gradcomm.collectives.reduce_scatter.
shard_bounds`). Every rank

1. encodes each other rank's segment of its own buffer once (its error-feedback residual
   for that segment fused into the codec's pass), into a frame whose size follows from
   the segment's element count alone, so receivers post exact sizes;
2. sends segment d's frame to rank d, for d = r+1, r+2, ... (mod p), all at once, while
   the p-1 frames for its own segment arrive;
3. sums its segment in rank order: rank q's decoded contribution, and its own values
   (which never cross the wire) exactly, at position r.

One compression per contribution (no re-compression of partial sums), p-1 messages per
rank, all in flight together; bytes sent per rank: the frames of the p-1 other segments,
(p-1)/p of the compressed buffer when p divides n. Empty segments (n < p) send nothing.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.seeds import Seeds
    >>> def fn(t):
    ...     x = np.full(4, t.rank + 1.0, np.float32)
    ...     alltoall(t, x, compressors.get("fp16"), Seeds(0, 0, "w", t.rank, False), None)
    ...     return x[2 * t.rank:2 * t.rank + 2].tolist()
    >>> run_ranks(2, fn)
    [[3.0, 3.0], [3.0, 3.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..collectives._segments import bounds
from ..comm.base import TAG_DATA, Request, Transport
from ..compressors.base import Compressor
from ..errors import PayloadError
from .frames import Frames
from .seeds import Seeds
from .state import Scratch


def frame_bytes(codec: Compressor, n: int, p: int, dtype: str) -> list[int]:
    """The frame size of each segment's contribution (0 for an empty segment): what the
    segment's owner receives from each other rank.

    Example:
        >>> from gradcomm import compressors
        >>> frame_bytes(compressors.get("fp16"), 1, 3, "float32")[1:]
        [0, 0]
    """
    f = Frames(codec, np.empty(0, dtype))
    off = bounds(n, p)
    return [f.bound(off[d + 1] - off[d]) if off[d + 1] > off[d] else 0 for d in range(p)]


def alltoall(t: Transport, x: Any, codec: Compressor, seeds: Seeds, e: Any | None,
             scratch: Scratch | None = None, *, tag: int = TAG_DATA) -> None:
    """``x[own] = Σ_ranks x[own]`` (decoded contributions, own values exact) for this
    rank's segment ``own`` of flat ``x``; the rest of ``x`` is left as it was. ``e``: this
    rank's residual, a flat array like ``x`` (its own segment is not used), or None."""
    p, r, n = t.size, t.rank, arrays.size(x)
    off = bounds(n, p)
    lo, hi = off[r], off[r + 1]
    m = hi - lo
    f = Frames(codec, x, scratch)
    size = f.bound(m) if m else 0
    landing = f.take(size * (p - 1)) if m else None
    recvs: list[tuple[int, Request]] = []
    if m:
        assert landing is not None
        for i, q in enumerate(q for q in range(p) if q != r):
            recvs.append((q, t.irecv(landing[i * size:(i + 1) * size], q, tag)))
    sends: list[Request] = []
    for d in ((r + k) % p for k in range(1, p)):
        a, b = off[d], off[d + 1]
        if b > a:
            frame, _ = f.single(x[a:b], seeds.partial(a, b - a, 0), b - a, f.bound(b - a),
                                residual=None if e is None else e[a:b])
            sends.append(t.isend(frame, d, tag))
    t.waitall([req for _, req in recvs])
    if m:
        assert landing is not None
        payloads = {}
        for i, (q, _) in enumerate(recvs):
            try:
                (_, _, data), = f.parts(landing[i * size:(i + 1) * size], m, 1)
                payloads[q] = f.payload(data, m)
            except PayloadError as exc:
                raise PayloadError(f"rank {q}'s reduce-scatter payload: {exc}") from None
        if f.device:            # every payload to the device in one copy (8-byte aligned)
            moved = arrays.like(landing, x)
            payloads = {q: pl.rebased(landing, moved) for q, pl in payloads.items()}
        _sum_in_rank_order(f, payloads, x[lo:hi], r, p)
    t.waitall(sends)


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


__all__ = ["alltoall", "frame_bytes"]
