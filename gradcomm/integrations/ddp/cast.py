"""The DDP hook's cast route: a 16-bit cast payload summed by the library's own allreduce.

For ``fp16`` and ``bf16`` the payload is nothing but the 16-bit values, so on a transport
whose library allreduce is faster than gradcomm's own algorithms on the same bytes
(``Transport.native_preferred``: gloo) the hook sums the payload there, as PyTorch's
``fp16_compress_hook`` does: each rank encodes its unit once (its own rounding error kept
as the residual: error feedback), the library sums the 16-bit values (rounding after
each addition, in its own order, the same bytes on every rank), and the sum is widened
back into the unit. Per rank, the wire carries what gradcomm's ring would: the 16-bit
values, 2(p-1)/p of them.

**Pipelined.** A unit is cut into pieces of about :data:`PIECE` elements, each summed by
its own asynchronous library allreduce: while piece ``k`` is on the wire the next one is
encoded, and piece ``k`` is widened while the later ones travel, so the codec's passes
(error feedback included) hide behind the wire except for one piece at each end. Each
element is rounded, summed and widened alone, so the bytes do not depend on the cut at
p = 2; at p > 2 the library's order of additions may (every rank still holds the same
bytes).

**Cut where it pays, measured** (:class:`Cut`). Each piece costs a library call: on a
slow link the pipeline wins (about 9 ms a step for a 17 MB bucket at 1 Gbit/s), but where
the "wire" is CPU work on the same cores (loopback, shared memory) the calls only cost
(about 0.9 ms per piece on 2 cores). At p = 2, where the cut cannot change the bytes, a
unit's ranks time it both ways and vote, the vote riding in the payload like the guard's
flags, so every rank takes the same cut. At p > 2 the cut stays (a choice made from
timings would let two runs of the same job round differently).

**The divergence guard, without a message of its own.** Each rank's two flags (a
non-finite residual, a residual norm over the bound; zeros without a
:class:`~gradcomm.compressed.guard.Guard`, so that every rank sums the same count) travel
as 16-bit values after the last piece (with the :class:`Cut`'s vote), summed with it.
The result holds the same bytes everywhere, so each rank checks all of it for non-finite
values itself (on the summed 16-bit bits, which widen exactly) and every rank takes the
same decision without the guard's separate agreement. The norms the guard needs (the
input's, the new residual's) are taken in the codec's pass where the residual joins it.

Example (in-process ranks; their native sum adds in rank order):
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.array([0.1, 1000.3, -2.0], np.float32) * (t.rank + 1)
    ...     return allreduce(t, x, compressors.get("fp16"), None, "u")[0].tolist()
    >>> run_ranks(2, fn)[0]
    [0.2998046875, 3002.0, -6.0]
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ...compressed.guard import Guard, sq_norm
from ...compressed.state import session
from ...compressors import _kernels
from ...compressors.base import Compressor
from ...compressors.payload import Payload
from ...comm.base import Transport
from ...error_feedback import ResidualStore, contractive

#: codec name -> (the library dtype its payload sums as, the payload buffer's numpy dtype)
CAST_CODECS = {"fp16": ("float16", np.float16), "bf16": ("bfloat16", np.uint16)}
#: elements per piece of the pipeline (1 MiB of 16-bit payload: a piece's encode takes a
#: fraction of a millisecond, its wire time at 1 Gbit/s about 8 ms)
PIECE = 1 << 19
#: 16-bit values after the payload, summed with it: the guard's two flags (non-finite
#: residual, over bound) and the rank's :class:`Cut` vote, each 0 or 1
FLAGS = 3
#: timed runs per way of cutting (whole, pieces) before a :class:`Cut` votes
TRIALS = 5
_ONE = {"fp16": np.float16(1.0).view(np.uint16), "bf16": np.uint16(0x3F80)}


def wire_dtype(t: Transport, codec: Compressor | None, x: Any) -> str | None:
    """The library dtype to sum ``codec``'s payload of flat host float32 ``x`` as on
    ``t`` (None: not this route: another codec, a device or float64 unit, one rank, a
    transport that prefers gradcomm's algorithms or cannot sum the dtype)."""
    if codec is None or codec.name not in CAST_CODECS or t.size == 1:
        return None
    if not t.native_preferred or not isinstance(x, np.ndarray) or x.dtype != np.float32:
        return None
    wire = CAST_CODECS[codec.name][0]
    return wire if t.native_supports(wire, "sum") else None


def pieces(n: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """``n`` elements cut into ``ceil(n / piece)`` near-equal ``(start, stop)`` pieces
    (one, empty, for ``n = 0``).

    Example:
        >>> pieces(10, 4)
        [(0, 3), (3, 6), (6, 10)]
    """
    k = max(1, -(-n // max(1, piece)))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


class Cut:
    """Whether one unit of ``n`` elements on ``p`` ranks goes in pieces of ``piece``
    elements or whole: at p = 2 (where the bytes are the same either way) measured,
    elsewhere, or for a unit of one piece anyway, in pieces.

    Measured: run 0 is untimed (first calls compile, allocate); runs 1 .. 2 *
    :data:`TRIALS` alternate whole (odd) and pieced (even) and are timed; in the next run
    each rank votes (:meth:`vote`: 1 where its median pieced run was faster) and the
    summed votes decide on every rank alike (:meth:`record`: pieced unless fewer than
    half the ranks voted for it); ``pieced`` holds the decision (None until then).

    Example:
        >>> c = Cut(2, 10, piece=4)
        >>> [c.size() for c.runs in range(4)], c.pieced
        ([4, 10, 4, 10], None)
        >>> c.runs, c.trials = 2 * TRIALS + 1, [[1.0] * TRIALS, [2.0] * TRIALS]
        >>> c.vote(), c.record(0.0, 0.0), c.pieced, c.size()
        (0.0, None, False, 10)
    """

    def __init__(self, p: int, n: int, piece: int | None = None) -> None:
        self.n, self.runs = n, 0
        self.piece = PIECE if piece is None else piece     # the module's, read now
        #: the timed runs' seconds, whole and pieced
        self.trials: list[list[float]] = [[], []]
        self.pieced: bool | None = \
            True if p != 2 or len(pieces(n, self.piece)) == 1 else None

    def _trial(self) -> bool:
        return self.pieced is None and 1 <= self.runs <= 2 * TRIALS

    def size(self) -> int:
        """This run's piece size (``n``, at least 1: whole)."""
        whole = self.pieced is False or (self._trial() and self.runs % 2 == 1)
        return max(1, self.n) if whole else self.piece

    def vote(self) -> float:
        """This rank's vote to carry in this run (0.0 but in the voting run)."""
        if self.pieced is not None or self.runs != 2 * TRIALS + 1:
            return 0.0
        whole, cut = (sorted(s)[len(s) // 2] for s in self.trials)
        return 1.0 if cut < whole else 0.0

    def record(self, seconds: float, votes: float, p: int = 2) -> None:
        """This run took ``seconds``; ``votes``: the summed votes it carried."""
        if self._trial():
            self.trials[self.runs % 2 == 0].append(seconds)
        elif self.pieced is None and self.runs == 2 * TRIALS + 1:
            self.pieced = 2 * votes >= p
        self.runs += 1


def allreduce(t: Transport, x: np.ndarray, codec: Compressor, ef: ResidualStore | None,
              key: str, *, residual: np.ndarray | None = None, guard: Guard | None = None,
              residual_norm: Callable[[], float] | None = None, g2: float | None = None,
              piece: int = PIECE, cut: Cut | None = None) -> tuple[np.ndarray, str | None]:
    """``x = Σ_ranks decode(encode(x))`` (flat host float32, in place) and the guard's
    decision (None: no guard, or nothing wrong), the payload summed by the library's
    allreduce as its 16-bit dtype, in :func:`pieces` of ``piece`` elements.

    Error feedback, one of two ways: ``residual`` (the unit's flat float32 residual, as
    long as ``x``) is added to ``x`` and left holding what the rounding lost, in the
    codec's fused pass; else ``ef`` (enabled), whose ``key`` receives ``x - decode(encode(
    x))`` (``x`` already holds the residual: the DDP hook's
    :meth:`~.residuals.ParameterResiduals.open`). ``guard`` (without ``clip``): this
    step's input norm is observed and the decision taken on every rank alike (the flags
    summed with the last piece); ``residual_norm``: the residuals' summed ``sq_norm`` where
    ``residual`` is not given (after ``ef``'s update); ``g2``: the input's ``sq_norm``
    before the residual was added, if measured already (else measured in the codec's
    pass with the residual, or piece by piece);
    ``cut``: the unit's :class:`Cut`, which then sets the piece size (for ``piece``),
    votes and is told this run's time."""
    began = time.perf_counter()
    name, n = codec.name, x.size
    if cut is not None:
        piece = cut.size()
    wire, held = CAST_CODECS[name]
    feedback = codec.lossy and contractive(codec) and (
        residual is not None or (ef is not None and ef.enabled))
    fused = feedback and residual is not None
    measure = guard is not None and g2 is None
    # the guard's norms in the codec's pass: the new residual's, and (a tally of four)
    # the input's where it is not measured yet
    tally = np.zeros(4 if measure else 2) if fused and guard is not None else None
    cuts = pieces(n, piece)
    g2 = 0.0 if g2 is None else g2
    with session(t) as scratch:
        v = scratch.floats(0, n + FLAGS, held)
        decoded = scratch.floats(1, n, np.float32) if feedback and not fused else None
        sent: list[tuple[Payload, Any]] = []
        for a, b in cuts:
            if measure and tally is None:
                g2 += sq_norm(x[a:b])
            payload = codec.compress(
                x[a:b], out=Payload(name, {}, {"v": v[a:b]}),
                residual=residual[a:b] if fused else None,
                decoded=decoded[a:b] if decoded is not None else None, tally=tally)
            stop = b
            if b == n:                  # the last piece, with the flags (zeros unguarded:
                stop = n + FLAGS        # every rank sums the same count either way)
                if decoded is not None:
                    assert ef is not None
                    ef.update(key, x, decoded)
                flags = (False, False)
                if guard is not None:
                    e2 = float(tally[0]) if tally is not None else \
                        (residual_norm() if residual_norm is not None else 0.0)
                    flags = guard.flags(key, e2)
                vote = cut is not None and cut.vote() > 0
                v.view(np.uint16)[n:stop] = np.where((*flags, vote), _ONE[name], 0)
            sent.append((payload, t.native_allreduce_start(v[a:stop], "sum", wire)))
        finite, bits = True, v.view(np.uint16)
        for (a, b), (payload, work) in zip(cuts, sent):
            t.native_allreduce_wait(work)
            codec.decompress(payload, out=x[a:b])
            if guard is not None and finite:    # the widened sum: finite where its bits are
                finite = _kernels.for_array(bits).finite16(bits[a:b], name == "bf16")
        flags = v[n:n + FLAGS]
        counts = flags.astype(np.float32) if name == "fp16" else \
            (flags.astype(np.uint32) << 16).view(np.float32)
        if cut is not None:
            cut.record(time.perf_counter() - began, float(counts[2]), t.size)
        if guard is None:
            return x, None
        if measure and tally is not None:
            g2 = float(tally[2])
        reason = guard.settle(key, g2, finite, counts[:2])
    return x, reason


__all__ = ["CAST_CODECS", "FLAGS", "PIECE", "TRIALS", "Cut", "allreduce", "pieces",
           "wire_dtype"]
