"""The gathered route planned for one buffer layout: what a caller that reduces the same
count, dtype and key again and again (the DDP hook's buckets) decides once.

:func:`plan_gather` lays out, once, the frame :mod:`~.frames` would send for ``n`` float32
host elements of a codec whose payloads of one count have one header and buffer layout
(:meth:`~gradcomm.compressors.base.Compressor.plan`): the frame's bytes up to the first
buffer (part table, lead, payload prefix and header) and where each buffer lies. Each
reduction (:meth:`PlannedGather.run`) then copies that prefix, lets the codec's plan write
the buffers in place, allgathers the frames and decodes each peer's buffers where they
lie, in rank order. A peer frame whose prefix is not byte-for-byte the planned one goes
through the validated reading of :class:`~.frames.Frames` (which decodes it if it is a
valid frame after all, else raises :class:`~gradcomm.errors.PayloadError` on every
rank). The plan checks at build time that its frame is the bytes the unplanned route
sends (:func:`plan_gather` returns None otherwise); results and residuals are the same
bytes as :func:`~.routes.run` with ``route="allgather"``.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.routes import run
    >>> def fn(t):
    ...     c = compressors.get("int8")
    ...     g = plan_gather(t, c, 5, "w", seed=0, feedback=False)
    ...     x = np.arange(5, dtype=np.float32) * (t.rank + 1)
    ...     y = run(t, x.copy(), "float32", "sum", "allgather", c, 0, 0, None, "w")
    ...     return g.run(t, x, step=0, ef=None)[0].tobytes() == y.tobytes()
    >>> run_ranks(2, fn)
    [True, True]
"""

from __future__ import annotations

import math
import time
import zlib
from contextlib import nullcontext
from typing import Any

import numpy as np

from ..collectives.allgather import allgatherv
from ..comm.background import Prefault, background
from ..comm.base import Transport
from ..compressors.base import CodecPlan, Compressor, Payload
from ..error_feedback import ResidualStore
from ..errors import PayloadError
from .frames import Frames
from .guard import Guard, sq_norm
from .state import Scratch, session

#: bytes each frame carries after the planned frame: the divergence guard's two flags and
#: this rank's vote on cutting the route into pieces (:attr:`PlannedGather.pieces_pay`)
FLAGS = 3
#: the run whose frames carry the votes; the runs before it (but the first, which may
#: compile kernels) are timed
VOTE_AT = 6


class PlannedGather:
    """The planned gathered route of one layout (see the module docstring): frames of
    ``size`` bytes whose first ``head`` bytes are ``prefix``, buffers at ``bufs``
    ``(name, dtype, offset, count)``, zeros from ``end``."""

    def __init__(self, codec: Compressor, cplan: CodecPlan, n: int, key: str, seed: int,
                 rank: int, feedback: bool, frame: np.ndarray, data: np.ndarray) -> None:
        self.codec, self.cplan, self.n, self.key = codec, cplan, n, key
        self.feedback = feedback
        #: the seed tuple of Seeds.whole() but the step: (seed, crc32(key)), rank or ()
        self._seed = ((seed, zlib.crc32(key.encode())), () if codec.shared_seed else (rank,))
        self.size = int(frame.size)
        at = frame.ctypes.data
        bufs = [(name, b.dtype, b.ctypes.data - at, int(b.size))
                for name, b in Payload.from_bytes(data).buffers.items()]
        self.bufs = bufs
        self.head = min(o for _, _, o, _ in bufs)
        self.end = max(o + c * dt.itemsize for _, dt, o, c in bufs)
        self.prefix = frame[:self.head].copy()
        self.frames = Frames(codec, np.zeros(0, np.float32))    # the validated reading
        #: runs so far, and the seconds runs 1 .. VOTE_AT-1 spent in the exchange and in
        #: the codec (encode, decodes)
        self.runs, self.spent = 0, [0.0, 0.0]
        #: decided at run VOTE_AT, the same on every rank (the votes travel in the
        #: frames): whether every rank waited on the exchange longer than its codec
        #: worked, so that a caller with a pieced route (:mod:`.planned_pipeline`, which
        #: encodes while earlier pieces travel) should take it; None before
        self.pieces_pay: bool | None = None

    def _views(self, frame: np.ndarray) -> dict[str, np.ndarray]:
        return {name: frame[o:o + c * dt.itemsize].view(dt) for name, dt, o, c in self.bufs}

    def write(self, frame: np.ndarray, x: np.ndarray, step: int,
              residual: np.ndarray | None = None, tally: np.ndarray | None = None,
              scratch: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Frame ``x`` (seeded by ``step``) into ``frame``; returns its buffers' views.
        With ``residual``, ``x + residual`` is framed and ``residual`` left holding what
        the codec lost, its norm added to ``tally``: in the codec's fused pass where the
        plan :attr:`~CodecPlan.fuses`, else step by step here (the same bytes, as
        :func:`~gradcomm.compressors.base.compose`, decoding into ``scratch``, default
        ``x``, which is scratch afterwards). ``x`` is only read otherwise."""
        frame[:self.head] = self.prefix
        frame[self.end:] = 0
        views = self._views(frame)
        seed = None
        if self.cplan.seeded:
            (s, crc), tail = self._seed
            seed = (s, step, crc, *tail)
        if residual is None or self.cplan.fuses:
            self.cplan.encode(x, seed, views, residual, tally)
            return views
        out = x if scratch is None else scratch
        with np.errstate(invalid="ignore", over="ignore"):   # the fused pass's steps:
            residual += x                                   # (compressors.base.compose)
            self.cplan.encode(residual, seed, views)
            self.cplan.decode(views, out, False)            # out is scratch now
            residual -= out
        if tally is not None:
            tally[0] += sq_norm(residual)
            tally[1] += residual.size
        return views

    def run(self, t: Transport, x: np.ndarray, step: int, ef: ResidualStore | None, *,
            guard: Guard | None = None, residual: np.ndarray | None = None,
            tally: np.ndarray | None = None, src: np.ndarray | None = None
            ) -> tuple[np.ndarray, str | None]:
        """``x = Σ_ranks x`` (flat float32 host ``x`` of the planned count, in place)
        through the codec, with ``ef``'s residual of the key when the plan feeds back;
        returns ``x`` and the divergence guard's decision (None: no ``guard``, or nothing
        wrong). ``residual``: the key's residual as one flat float32 array as long as
        ``x`` (the owner's, e.g. ``KeyedResiduals.owed``, not yet added to ``x``): added
        and updated in the codec's fused pass instead of ``ef``'s compensate and update,
        with the same bytes (given only when the plan feeds back). ``tally``: the new
        residual's ``(sq_norm, size)`` is added to it (:attr:`ResidualStore.tally`; the
        guard's flags read it too).

        Each frame carries :data:`FLAGS` more bytes: this rank's guard flags (a
        non-finite residual, a residual norm over the bound: ``guard.flags`` of the norm
        the store tallies as it keeps the new residual, :attr:`ResidualStore.tally`;
        zeros without a guard). Every rank receives every frame and
        decodes all of them in rank order, so it holds the same flags and the same result
        as the others: ``guard`` (without ``clip``) decides on every rank alike with no
        message of its own (``guard.settle``; the input's norm is what ``guard.observe``
        recorded).

        ``src``: the values, read where they lie (not modified; ``x``'s contents are then
        ignored: a fresh buffer's pages are mapped in while the frames travel)."""
        ef = ef if self.feedback and ef is not None and ef.enabled else None
        assert residual is None or self.feedback, "a residual for a plan without feedback"
        n, size, run = self.n, self.size, self.runs
        if tally is None and guard is not None:
            tally = np.zeros(2)
        with session(t) as scratch:
            if src is not None and ef is not None and residual is None:
                np.copyto(x, src)                   # the store compensates x in place
                src = None
            if ef is not None and residual is None:
                ef.compensate(self.key, x)
            frame = scratch.arena.take(size + FLAGS)
            began = time.perf_counter()
            views = self.write(frame, x if src is None else src, step, residual, tally,
                               scratch=x)
            if ef is not None and residual is None:
                dec = scratch.floats(0, n, np.float32)
                self.cplan.decode(views, dec, False)
                update_tallied(ef, self.key, x, dec, tally)
            frame[size:] = (*guard_flags(guard, self.key, tally),
                            run == VOTE_AT and self.spent[0] > self.spent[1])
            landing = scratch.arena.take((size + FLAGS) * t.size)
            sent = time.perf_counter()
            with background(Prefault(x)) if src is not None else nullcontext():
                blocks = allgatherv(t, frame, sizes=np.full(t.size, size + FLAGS, np.int64),
                                    out=landing)
            arrived = time.perf_counter()
            self.sum_frames([b[:size] for b in blocks], x, scratch)
            if 0 < run < VOTE_AT:
                self.spent[0] += arrived - sent
                self.spent[1] += sent - began + time.perf_counter() - arrived
            elif run == VOTE_AT:
                self.pieces_pay = all(b[size + 2] for b in blocks)
            self.runs += 1
            if guard is None:
                return x, None
            reason = guard.settle(self.key, None, math.isfinite(sq_norm(x)),
                                  flag_counts([b[size:] for b in blocks]))
        return x, reason

    def sum_frames(self, blocks: list[np.ndarray], x: np.ndarray, scratch: Scratch) -> None:
        """``x = Σ decode(blocks)`` in rank order (every rank's frame of this plan's size):
        in place where each block's prefix is the planned one, else through
        :class:`~.frames.Frames`' validated reading (PayloadError if one does not decode)."""
        if all(np.array_equal(b[:self.head], self.prefix) for b in blocks):
            for r, b in enumerate(blocks):
                self.cplan.decode(self._views(b), x, r > 0)
        else:
            self._checked_sum(blocks, x, scratch)

    def _checked_sum(self, blocks: list[np.ndarray], x: np.ndarray, scratch: Scratch
                     ) -> None:
        """``x = Σ decode(blocks)`` through :class:`~.frames.Frames`' validated reading
        (some peer's frame is not laid out as planned)."""
        f, n = self.frames, self.n
        f.scratch = scratch
        payloads = []
        for r, b in enumerate(blocks):
            try:
                (_, _, data), = f.parts(b, n, 1)
                payloads.append(f.payload(data, n))
            except PayloadError as exc:
                raise PayloadError(f"rank {r}'s payload: {exc}") from None
        f.base = x
        f.decode_payload(payloads[0], x)
        for p in payloads[1:]:
            f.decode_add_payload(p, x)


def update_tallied(ef: ResidualStore, key: str, x: np.ndarray, dec: np.ndarray,
                   tally: np.ndarray | None) -> None:
    """``ef.update(key, x, dec)`` with the new residual's norm added to ``tally``."""
    ef.tally = tally
    try:
        ef.update(key, x, dec)
    finally:
        ef.tally = None


def guard_flags(guard: Guard | None, key: str, tally: np.ndarray | None
                ) -> tuple[bool, bool]:
    """This rank's two guard flags for its frames: ``guard.flags`` of the residual norm
    in ``tally`` (zeros without a guard, so every rank sends the same bytes' count)."""
    if guard is None or tally is None:
        return False, False
    return guard.flags(key, float(tally[0]))


def flag_counts(tails: list[np.ndarray]) -> np.ndarray:
    """How many ranks raised each guard flag: the sums over every rank's frame tail (its
    last :data:`FLAGS` bytes)."""
    return np.sum([tail[:2] != 0 for tail in tails], axis=0)


def plan_gather(t: Transport, codec: Compressor, n: int, key: str, *, seed: int,
                feedback: bool) -> PlannedGather | None:
    """The :class:`PlannedGather` of ``n`` float32 host elements of ``key`` on ``t`` (seed
    ``seed``; ``feedback``: the route applies the store's residual), or None where the
    codec does not plan, ``n`` or ``p`` leave nothing to gather, or the planned frame
    differs from the one :class:`~.frames.Frames` sends for the same input."""
    cplan = codec.plan(n, "float32") if n and t.size > 1 else None
    if cplan is None:
        return None
    # the frame Frames sends in the steady state (its layout learned by a first call),
    # for an input that is not periodic
    x = ((np.arange(n) * 7919 % 1031).astype(np.float32) - 515.0) / 97.0
    f = Frames(codec, x, Scratch())
    size, seed0 = f.bound(n), (seed, 0, zlib.crc32(key.encode()))
    seed0 = seed0 if codec.shared_seed else (*seed0, t.rank)
    f.single(x, seed0, n, size)
    frame, data = f.single(x, seed0, n, size)
    planned = PlannedGather(codec, cplan, n, key, seed, t.rank, feedback, frame, data)
    mine = np.empty(size, np.uint8)
    planned.write(mine, x, 0)
    return planned if np.array_equal(mine, frame) else None


__all__ = ["FLAGS", "VOTE_AT", "PlannedGather", "flag_counts", "guard_flags", "plan_gather",
           "update_tallied"]
