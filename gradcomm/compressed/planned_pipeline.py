"""The planned gathered route in pieces: the codec works on piece i+1 while piece i is on
the wire, and decodes the pieces that arrived while later ones are still travelling.

:func:`plan_pipeline` cuts ``n`` float32 host elements into pieces of about ``piece``
elements at multiples of the codec's
:attr:`~gradcomm.compressors.base.Compressor.piece_quantum` (its buckets: a piece
compresses, with its slice of the residual, to the same decoded values and residual as the
whole) and plans each distinct piece count once (:func:`~.planned.plan_gather`).
:meth:`PipelinedGather.run` posts every receive first, then encodes piece by piece, sending
each piece's frame to every peer as soon as it is written (nonblocking), and between pieces
decodes every piece whose frames are all in, in rank order per element. The result and the
residual hold the same bytes as the one-piece planned route (and so as
:func:`~.routes.run` with ``route="allgather"``); the divergence guard's flags ride on the
last piece's frames. A peer frame that is not laid out as planned is read through the
validated path; a payload that does not decode is a PayloadError raised after every piece
was exchanged, on every rank (they all decode the same frames).

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.planned import plan_gather
    >>> def fn(t):
    ...     c = compressors.get("int8", bucket_size=8)
    ...     whole = plan_gather(t, c, 50, "w", seed=0, feedback=False)
    ...     cut = plan_pipeline(t, c, 50, "w", seed=0, feedback=False, piece=16)
    ...     x = np.arange(50, dtype=np.float32) * (t.rank + 1) - 7
    ...     y = whole.run(t, x.copy(), step=0, ef=None)[0]
    ...     return len(cut.pieces), cut.run(t, x, step=0, ef=None)[0].tobytes() == y.tobytes()
    >>> run_ranks(2, fn)
    [(4, True), (4, True)]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..comm.base import TAG_DATA, Transport
from ..compressors.base import Compressor
from ..error_feedback import ResidualStore
from ..errors import PayloadError
from .guard import Guard, sq_norm
from .planned import FLAGS, PlannedGather, flag_counts, guard_flags, plan_gather, update_tallied
from .state import session

#: elements per piece by default (2 MiB of float32; the DDP cast route's size)
PIECE = 1 << 19
#: payload bytes per piece that :func:`piece_of` aims at
PIECE_BYTES = 1 << 19


class PipelinedGather:
    """The planned gathered route of one layout in ``pieces``: ``(lo, hi, plan)``, each
    ``plan`` the one-piece :class:`~.planned.PlannedGather` of ``hi - lo`` elements."""

    def __init__(self, pieces: list[tuple[int, int, PlannedGather]], key: str,
                 feedback: bool) -> None:
        self.pieces, self.key, self.feedback = pieces, key, feedback
        self.n = pieces[-1][1]
        #: (:attr:`PlannedGather.pieces_pay`: cut already, nothing to decide)
        self.pieces_pay: bool | None = False

    def run(self, t: Transport, x: np.ndarray, step: int, ef: ResidualStore | None, *,
            guard: Guard | None = None, residual: np.ndarray | None = None,
            tally: np.ndarray | None = None, src: np.ndarray | None = None
            ) -> tuple[np.ndarray, str | None]:
        """:meth:`PlannedGather.run <gradcomm.compressed.planned.PlannedGather.run>`, piece
        by piece (same arguments, same bytes; each piece of ``src`` is encoded where it
        lies and the sum decoded into ``x``). Without ``residual`` but with ``ef`` (its
        update needs all of the input) the pieces are still sent as they are encoded, and
        decoded once the last one is."""
        ef = ef if self.feedback and ef is not None and ef.enabled else None
        assert residual is None or self.feedback, "a residual for a plan without feedback"
        update = ef is not None and residual is None
        if src is not None and update:
            np.copyto(x, src)                       # the store compensates x in place
            src = None
        values = x if src is None else src
        p, me, n = t.size, t.rank, self.n
        peers = [r for r in range(p) if r != me]
        sizes = [g.size + (FLAGS if i == len(self.pieces) - 1 else 0)
                 for i, (_, _, g) in enumerate(self.pieces)]
        slot = max(sizes)
        if tally is None and guard is not None:
            tally = np.zeros(2)
        with session(t) as scratch:
            if update:
                ef.compensate(self.key, x)
            own = scratch.arena.take(slot * len(sizes))
            landing = scratch.arena.take(slot * len(sizes) * len(peers))
            dec = scratch.floats(0, n, np.float32) if update else None

            def frame(i: int, r: int) -> np.ndarray:
                at = i * slot if r == me else (i * len(peers) + r - (r > me)) * slot
                return (own if r == me else landing)[at:at + sizes[i]]

            recvs = [[t.irecv(frame(i, r), r, TAG_DATA) for r in peers]
                     for i in range(len(sizes))]
            sends: list[Any] = []
            done, error = 0, None

            def settle() -> None:
                """Decode piece ``done``, whose frames are all in (after a payload error
                only the exchange goes on)."""
                nonlocal done, error
                lo, hi, g = self.pieces[done]
                if error is None:
                    blocks = [frame(done, r)[:g.size] for r in range(p)]
                    try:
                        g.sum_frames(blocks, x[lo:hi], scratch)
                    except PayloadError as exc:
                        error = exc
                done += 1

            for i, (lo, hi, g) in enumerate(self.pieces):
                mine = frame(i, me)
                views = g.write(mine[:g.size], values[lo:hi], step,
                                None if residual is None else residual[lo:hi], tally,
                                scratch=x[lo:hi])
                if update:
                    g.cplan.decode(views, dec[lo:hi], False)
                if i == len(self.pieces) - 1:
                    if update:
                        update_tallied(ef, self.key, x, dec, tally)
                    mine[g.size:] = (*guard_flags(guard, self.key, tally), False)  # no vote
                sends.extend(t.isend(mine, r, TAG_DATA) for r in peers)
                while not update and done <= i and all(q.test() for q in recvs[done]):
                    settle()            # piece ``done`` is in: decode it while i+1 flies
            while done < len(sizes):
                t.waitall(recvs[done])
                settle()
            t.waitall(sends)
            if error is not None:
                raise error
            if guard is None:
                return x, None
            last = len(sizes) - 1
            counts = flag_counts([frame(last, r)[sizes[last] - FLAGS:] for r in range(p)])
            reason = guard.settle(self.key, None, math.isfinite(sq_norm(x)), counts)
        return x, reason


def pieced_if_it_pays(t: Transport, g: PlannedGather | PipelinedGather, seed: int
                      ) -> PlannedGather | PipelinedGather:
    """``g``, or its pieced twin (:func:`plan_pipeline`, pieces of :func:`piece_of`) once
    ``g``'s ranks decided that pieces pay (:attr:`PlannedGather.pieces_pay
    <gradcomm.compressed.planned.PlannedGather.pieces_pay>`, the same on every rank;
    asked once). ``seed``: the plan's seed."""
    if not g.pieces_pay or not isinstance(g, PlannedGather):
        return g
    g.pieces_pay = False
    return plan_pipeline(t, g.codec, g.n, g.key, seed=seed, feedback=g.feedback,
                         piece=piece_of(g.codec, g.n)) or g


def piece_of(codec: Compressor, n: int, nbytes: int = PIECE_BYTES) -> int:
    """Elements per piece so that each piece's payload is about ``nbytes`` (``n``
    float32 elements through ``codec``): int8 about ``nbytes`` elements, onebit about 8
    times more, so that every message is large enough to keep its cost per byte low.

    Example:
        >>> from gradcomm import compressors
        >>> [piece_of(compressors.get(c), 10**7) // 1000 for c in ("int8", "onebit")]
        [520, 4066]
    """
    return max(1, nbytes * n // max(1, codec.max_nbytes(n, "float32")))


def plan_pipeline(t: Transport, codec: Compressor, n: int, key: str, *, seed: int,
                  feedback: bool, piece: int = PIECE) -> PipelinedGather | None:
    """The :class:`PipelinedGather` of ``n`` float32 host elements of ``key`` in pieces of
    about ``piece`` elements, or None: one piece would do (``n <= piece``), the codec
    has no ``piece_quantum``, or a piece does not plan (:func:`~.planned.plan_gather`)."""
    q = codec.piece_quantum
    if not q or n <= piece or t.size < 2:
        return None
    per = -(-piece // q) * q
    cuts = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
    plans: dict[int, PlannedGather] = {}
    for lo, hi in cuts:
        if hi - lo not in plans:
            g = plan_gather(t, codec, hi - lo, key, seed=seed, feedback=feedback)
            if g is None:
                return None
            plans[hi - lo] = g
    return PipelinedGather([(lo, hi, plans[hi - lo]) for lo, hi in cuts], key, feedback)


__all__ = ["PIECE", "PIECE_BYTES", "PipelinedGather", "piece_of", "pieced_if_it_pays",
           "plan_pipeline"]
