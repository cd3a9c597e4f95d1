"""The gathered route as a pipeline in one thread: encode piece i+1 while piece i is on
the wire, decode-and-add piece i while i+1 arrives.

The buffer is cut into ``chunks`` pieces at multiples of the codec's ``piece_quantum``
(its buckets: each piece compresses, with its slice of the residual, to the same decoded
values and residuals as the whole; :attr:`~gradcomm.compressors.base.Compressor.piece_quantum`),
so the result and the residual hold the same bytes as the one-shot route. Each piece is a
one-part frame (:class:`~gradcomm.compressed.frames.Frames`) sent straight to every other
rank (nonblocking sends, receives of the exact frame size posted ahead, as many pieces as
the transport's ``window_bytes`` allow, at least two). Between pieces the loop tests the
pending receives (which also progresses the transport) and decodes every piece whose
frames are all in, in rank order per element as the one-shot route does. Once every piece
is sent the remaining waits carry the transport's deadline. A payload that does not decode
is a PayloadError after every piece was exchanged (so no message is left in flight), on
every rank (they all decode the same frames).

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.seeds import Seeds
    >>> codec = compressors.get("onebit", bucket_size=8)
    >>> def fn(t):
    ...     x = np.arange(32, dtype=np.float32) - 4 * t.rank
    ...     allgather(t, x, Frames(codec, x), Seeds(0, 0, "w", t.rank, False), None, 4)
    ...     return x[:4].tolist()
    >>> run_ranks(2, fn)[0]
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm.base import TAG_DATA, Transport
from ..errors import PayloadError
from .frames import Frames
from .seeds import Seeds


def bounds(n: int, chunks: int, quantum: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` of at most ``chunks`` pieces of ``n`` elements, cut at multiples of
    ``quantum`` (the last piece takes the rest).

    Example:
        >>> bounds(100, 3, 8)
        [(0, 40), (40, 80), (80, 100)]
    """
    per = max(1, -(-n // max(1, chunks)))
    per = -(-per // quantum) * quantum
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def allgather(t: Transport, x: Any, f: Frames, seeds: Seeds, e: Any, chunks: int,
              tally: Any = None) -> None:
    """``x = Σ_ranks decode(encode(x + e))`` (``e``: the key's flat residual or None,
    left as ``x + e − decode``), in ``chunks`` pipelined pieces (host buffers);
    ``tally``: each piece's residual norm is added to it (:meth:`Frames.single`)."""
    n, p, me = x.size, t.size, t.rank
    pieces = bounds(n, chunks, f.codec.piece_quantum)
    sizes = [f.bound(hi - lo) for lo, hi in pieces]
    peers = [r for r in range(p) if r != me]
    slot = max(sizes)
    landing = f.take(slot * len(pieces) * len(peers))
    depth = max(2, t.window_bytes // max(1, slot * len(peers)))
    recvs: list[list[Any]] = []
    sends: list[Any] = []
    own: list[np.ndarray] = []
    error: PayloadError | None = None
    done = 0

    def post(i: int) -> None:
        at = i * len(peers) * slot
        recvs.append([t.irecv(landing[at + j * slot:at + j * slot + sizes[i]], r, TAG_DATA)
                      for j, r in enumerate(peers)])

    def decode(i: int) -> None:
        lo, hi = pieces[i]
        at = i * len(peers) * slot
        frames = [own[i] if r == me else
                  landing[at + (r - (r > me)) * slot:][:sizes[i]] for r in range(p)]
        seg = x[lo:hi]
        for r, frame in enumerate(frames):
            try:
                (_, _, data), = f.parts(frame, hi - lo, 1)
                payload = f.payload(data, hi - lo)
            except PayloadError as exc:
                raise PayloadError(f"rank {r}'s payload: {exc}") from None
            if r == 0:
                f.decode_payload(payload, seg)
            else:
                f.decode_add_payload(payload, seg)

    def settle() -> None:
        """Decode piece ``done`` (its receives are complete; after a payload error only
        the exchange goes on) and post the next piece's receives."""
        nonlocal done, error
        if error is None:
            try:
                decode(done)
            except PayloadError as exc:
                error = exc
        done += 1
        if len(recvs) < len(pieces):
            post(len(recvs))

    for i in range(min(depth, len(pieces))):
        post(i)
    for i, (lo, hi) in enumerate(pieces):
        frame, _ = f.single(x[lo:hi], seeds.whole(), hi - lo, sizes[i],
                            residual=None if e is None else e[lo:hi],
                            tally=None if e is None else tally)
        own.append(frame)
        sends.extend(t.isend(frame, r, TAG_DATA) for r in peers)
        while done < i + 1 and all(q.test() for q in recvs[done]):
            settle()                   # piece ``done`` is in: decode it while i+1 flies
    while done < len(pieces):
        t.waitall(recvs[done])
        settle()
    t.waitall(sends)
    if error is not None:
        raise error
