"""The divergence guard: one bad step must not poison error feedback for ever.

Error feedback carries what a step's codec dropped into the next step. A non-finite
gradient on one rank (an overflowing AMP step, a bad batch) therefore stays in that
rank's residual, and in every rank's per-hop residuals and PowerSGD's warm-start ``Q``,
and every later step is non-finite too. A residual that grows without bound (a codec or
step size error feedback cannot hold) ends the same way, more slowly.

After each compressed reduction of a key, :meth:`Guard.check` looks at this rank's
residuals of the key (non-finite, or a norm above ``bound`` times the largest input
norm this rank has seen for the key in earlier steps) and at the reduced result (non-finite: the same on
every rank). The ranks then agree with one 4-byte max-allreduce, so **every rank takes
the same decision**, even when only one of them saw the NaN: the residuals of the key
(its own, its hops', and its codec state such as PowerSGD's ``Q``) are **reset to zero**
on every rank, a :class:`GuardWarning` is issued and ``stats["guard_resets"]`` counts it
(``guard_nonfinite`` / ``guard_over_bound`` say why). The step's result itself is left as
the codec produced it: a non-finite gradient gives a non-finite result, which is what
AMP's ``GradScaler`` looks for to skip the step; the next, clean steps are finite.

Resetting was chosen over redoing the step uncompressed: a dense sum of a NaN is NaN
too, and a reset costs nothing on the wire. The guard runs only where there is state to
poison (error feedback on, or a stateful codec: PowerSGD).

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     g = Guard()
    ...     e = np.array([np.nan if t.rank == 0 else 1.0], np.float32)
    ...     g.observe("w", np.ones(1, np.float32))
    ...     return g.check(t, "w", [e], np.ones(1, np.float32)), g.stats["guard_resets"]
    >>> run_ranks(2, fn)
    [('nonfinite', 1), ('nonfinite', 1)]
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from ..comm.background import Job
from ..comm.base import Transport
from ..errors import ConfigError

#: default ``bound``: a residual norm above this many times the largest gradient norm
#: seen for its key is reset. Healthy runs of bench/converge.py stay far below it (see
#: bench/RESULTS.md); random-k with error feedback at lr 0.1 passes it before it diverges.
DEFAULT_BOUND = 1000.0


#: random-k at this ratio or more is clipped at 1 (momentum corrected) or 0.1 by default
FULL_CLIP_RATIO = 0.25


def default_clip(codec: Any, corrected: bool = False) -> float | None:
    """The DDP hook's default ``clip`` for ``codec``: for random-k ``sqrt(ratio)`` below
    :data:`FULL_CLIP_RATIO` (its error feedback sends a random 1/ratio-th of the owed
    mass, many steps' worth per coordinate: unclipped, or clipped at 1, it diverges
    under momentum 0.9); from it on 1 when ``corrected`` (the hook corrects the
    optimizer's momentum, or the optimizer is not SGD: an update no longer than the
    ranks' inputs together, which a dense sum cannot exceed either; ``sqrt`` cut deeper
    and lost more), else 0.1 (an SGD momentum the hook does not correct amplifies the
    stale mass: larger clips ended above the initial loss); None for the other codecs.
    The measurements behind each choice: bench/RESULTS.md, "Convergence".

    Example:
        >>> from gradcomm import compressors
        >>> [default_clip(compressors.get("randomk", ratio=r)) for r in (0.01, 0.25)]
        [0.1, 0.1]
        >>> default_clip(compressors.get("randomk", ratio=0.25), corrected=True)
        1.0
    """
    if codec is None or codec.name != "randomk":
        return None
    ratio = codec.get_config().get("ratio")
    if not ratio:
        return 0.1
    if float(ratio) < FULL_CLIP_RATIO:
        return math.sqrt(float(ratio))
    return 1.0 if corrected else 0.1


#: how many float64 numbers the ranks sum to agree (result, residuals, bound, norm)
AGREED = 4
#: sums the guard's ``AGREED`` float64 numbers across the ranks, in place: ``agree(t, buf)``
Agreement = Callable[[Transport, np.ndarray], None]


def agreement(t: Transport) -> Agreement:
    """How the guard's decision is summed on ``t``: the dense algorithm ``auto`` picks for
    it (as ``dense_allreduce(t, buf, "sum", "float64", "auto", check=False)`` would,
    the same bytes), resolved now, so that a caller checking every step can keep it.

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     buf = np.ones(AGREED)
        ...     agreement(t)(t, buf)
        ...     return buf.tolist()
        >>> run_ranks(2, fn)[0]
        [2.0, 2.0, 2.0, 2.0]
    """
    from ..collectives import algorithm, auto
    from ..ops import reducer

    name = auto.select(t, AGREED * 8, "float64", "sum", native=t.native_bounded)
    fn, red = algorithm(name), reducer("sum", "float64")

    def agree(t: Transport, buf: np.ndarray) -> None:
        fn(t, buf, red)
    return agree


class GuardWarning(UserWarning):
    """The divergence guard reset a key's error-feedback state on every rank."""


def check_bound(bound: Any) -> float | None:
    """``bound`` validated: None (no norm bound) or a float > 0."""
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
        raise ConfigError(f"residual_bound must be a number > 0 or None, got {bound!r}")
    return float(bound)


def sq_norm(a: Any) -> float:
    """``a · a`` of a flat numpy / torch / cupy array in float64 (inf or nan if ``a`` is
    not finite): the codec kernels' ``sq_norm``, the value their fused error-feedback
    passes tally for a residual (``compress(..., tally=)``), whichever kernel path runs.

    Example:
        >>> sq_norm(np.array([3.0, 4.0], np.float32))
        25.0
    """
    from .. import arrays

    if a.shape[0] == 0 or not arrays.dtype_name(a).startswith(("float", "bfloat")):
        return 0.0                     # (16-bit floats may be held as integer storage)
    if isinstance(a, np.ndarray):      # every host path gives the same bits: by size only
        return _host_norms(a.size).sq_norm(a)
    from ..compressors._kernels import _xp
    return _xp.sq_norm(a)


def _host_norms(n: int) -> Any:
    """The kernel module that computes a host ``sq_norm`` of ``n`` elements fastest:
    numba from ``FAST_MIN`` elements where it is installed, else numpy (picked here, not
    through the kernels' per-call choice: the DDP bucket's trip stays off that file)."""
    from ..compressors._kernels import FAST_MIN, _numpy
    if n < FAST_MIN:
        return _numpy
    try:
        from ..compressors._kernels import _numba
    except ImportError:                 # pragma: no cover - numba is the fast extra
        return _numpy
    return _numba


class SqNorm(Job):
    """:func:`sq_norm` of a host float array, in slices a transport wait may run
    (:func:`~gradcomm.comm.background.background`): the same bits, the same kernel.

    Example:
        >>> a = np.arange(1000, dtype=np.float32)
        >>> job = SqNorm.over(a, slice_elements=128)
        >>> while job.step():           # what a wait would do between its tests
        ...     pass
        >>> job.value() == sq_norm(a)
        True
    """

    #: elements per slice (a multiple of 64: the lanes stay aligned), tens of µs each
    SLICE = 1 << 16

    def __init__(self, a: np.ndarray, slice_elements: int = SLICE) -> None:
        self.a, self.at = a.reshape(-1), 0
        self.size = slice_elements
        self.kernels = _host_norms(a.size)
        self.acc = np.zeros(64)

    @classmethod
    def over(cls, a: Any, slice_elements: int = SLICE) -> SqNorm | None:
        """The job for ``a``, or None where :func:`sq_norm` takes another path (not a
        contiguous float32 / float64 numpy array: a device array, 16-bit floats)."""
        if not (isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64)
                and a.flags.c_contiguous):
            return None
        assert slice_elements % 64 == 0, "slices keep element i in lane i % 64"
        return cls(a, slice_elements)

    def step(self) -> bool:
        end = min(self.at + self.size, self.a.size)
        self.acc = self.kernels.sq_lanes(self.a[self.at:end], self.acc)
        self.at = end
        return end < self.a.size

    def value(self) -> float:
        """The norm (what is left computed now)."""
        from ..compressors._kernels._numpy import fold_lanes
        self.finish()
        return fold_lanes(self.acc)


class Guard:
    """Per-key gradient scale and the agreed reset decision; ``stats`` counts resets."""

    def __init__(self, bound: float | None = DEFAULT_BOUND,
                 stats: dict[str, Any] | None = None, clip: float | None = None) -> None:
        self.bound = check_bound(bound)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not clip > 0):
            raise ConfigError(f"clip must be a number > 0 or None, got {clip!r}")
        #: clipping that respects error feedback: a result longer than ``clip`` times the
        #: sum over ranks of the inputs' norms is scaled down to it, and what is cut off
        #: goes back into the residuals (by the caller, ``factor``)
        self.clip = None if clip is None else float(clip)
        self.factor = 1.0
        self._scale: dict[str, float] = {}       # largest ||g||² of earlier steps
        self._pending: dict[str, float] = {}
        #: counters (kept in ``stats`` if given, e.g. the DDP hook's)
        self.stats = {} if stats is None else stats
        for name in ("guard_resets", "guard_nonfinite", "guard_over_bound", "clipped"):
            self.stats.setdefault(name, 0)

    def observe(self, key: str, g: Any, g2: float | None = None) -> None:
        """Record ``||g||²`` of this step's input of ``key`` (before compensation; ``g2``:
        already computed, e.g. by :func:`~gradcomm.compressors._kernels` ``copy_sq_norm``
        while copying ``g``); it joins the key's scale after :meth:`check`, so a sudden
        spike is measured against the steps before it."""
        self._pending[key] = sq_norm(g) if g2 is None else float(g2)

    def check(self, t: Transport, key: str, residuals: Sequence[Any], out: Any, *,
              same: bool = False, agree: Agreement | None = None,
              e2: float | None = None, shown: bool = False) -> str | None:
        """Collective: whether any rank must reset ``key`` (``"nonfinite"``,
        ``"over_bound"``) or None. Counts and warns; the caller resets. With ``clip``
        set, :attr:`factor` is then the factor the caller scales ``out`` by (1.0: none).

        ``same``: ``out`` holds the same bytes on every rank (an allreduce's result, not a
        reduce-scatter's shard), so each rank looks at its own ``1/p``-th of it and the
        agreement adds up what they saw: the same decision, one pass over ``out`` shared
        by the ranks instead of one each (with ``clip``, which needs the whole norm, each
        rank looks at all of it). ``agree``: how the ranks sum the decision,
        :func:`agreement` of ``t`` resolved once by a caller that checks often (None:
        decided here, per call). ``e2``: the residuals' summed :func:`sq_norm`, if the
        caller has it (the codecs' tally of this reduction, :attr:`ResidualStore.tally`);
        None: computed here from ``residuals``. ``shown`` (with ``e2``): a non-finite
        element of ``out`` would show as a non-finite residual on some rank
        (:func:`~.routes.residuals_show_result`), so without ``clip`` ``out`` is not
        read: the same decision, a pass fewer."""
        g2 = self._pending.pop(key, 0.0)
        part = out
        if same and t.size > 1 and self.clip is None:
            n = out.shape[0]
            part = out[t.rank * n // t.size:(t.rank + 1) * n // t.size]
        out2 = 0.0 if shown and e2 is not None and self.clip is None else sq_norm(part)
        if e2 is None:
            e2 = sum(sq_norm(e) for e in residuals)
        bad_e, over = self.flags(key, e2)
        agreed = np.array([0.0 if math.isfinite(out2) else 1.0, float(bad_e), float(over),
                           math.sqrt(g2) if math.isfinite(g2) else 0.0])
        if t.size > 1:
            (agree or agreement(t))(t, agreed)
        return self._decide(key, g2, agreed, out2)

    def flags(self, key: str, e2: float) -> tuple[bool, bool]:
        """This rank's ``(non-finite residual, residual norm over the bound)`` of ``key``,
        whose residuals' summed :func:`sq_norm` is ``e2``: what the ranks sum to decide.

        Example:
            >>> g = Guard(bound=10.0)
            >>> g.flags("w", float("nan")), g.flags("w", 1e9)   # no scale yet: no bound
            ((True, False), (False, False))
        """
        bad_e = not math.isfinite(e2)
        scale = self._scale.get(key)
        return bad_e, bool(not bad_e and self.bound is not None and scale is not None
                           and e2 > self.bound ** 2 * scale)

    def settle(self, key: str, g2: float | None, finite: bool, counts: Sequence[float]
               ) -> str | None:
        """:meth:`check`'s decision where the ranks' :meth:`flags` were summed by the
        caller (``counts``: the sums, e.g. carried in the reduction's own payload) and
        this rank saw all of the reduced result, the same bytes on every rank
        (``finite``: whether all of it is); ``g2``: this step's input norm² (None: what
        :meth:`observe` recorded). Not with ``clip``, which needs the ranks' summed norms.

        Example:
            >>> g = Guard()
            >>> g.settle("w", 4.0, True, [0.0, 0.0]), g.settle("w", 4.0, True, [1.0, 0.0])
            (None, 'nonfinite')
        """
        assert self.clip is None, "settle() decides without the summed norms clip needs"
        recorded = self._pending.pop(key, 0.0)
        g2 = recorded if g2 is None else g2
        agreed = np.array([0.0 if finite else 1.0, float(counts[0]), float(counts[1]), 0.0])
        return self._decide(key, g2, agreed, 0.0)

    def _decide(self, key: str, g2: float, agreed: np.ndarray, out2: float) -> str | None:
        """The decision from the summed ``agreed`` (result non-finite, residual non-finite,
        over bound, summed input norms); counts and warns."""
        if not agreed[0] and math.isfinite(g2) and g2 > self._scale.get(key, 0.0):
            self._scale[key] = g2               # a finite result: the step joins the scale
        nonfinite, over = bool(agreed[0] or agreed[1]), bool(agreed[2])
        self.factor = 1.0
        if not nonfinite and not over:
            if self.clip is not None:
                limit = self.clip * float(agreed[3])     # sum over ranks of ||g_r||
                norm = math.sqrt(out2)          # part is out: all of it
                if norm > limit:
                    self.factor = limit / norm
                    self.stats["clipped"] += 1
            return None
        reason = "nonfinite" if nonfinite else "over_bound"
        self.stats["guard_resets"] += 1
        self.stats["guard_" + reason] += 1
        warnings.warn(f"error-feedback state of {key!r} reset on every rank: "
                      + ("a non-finite value reached it" if nonfinite else
                         f"a residual norm passed {self.bound:g} x the gradient norm"),
                      GuardWarning, stacklevel=4)
        return reason


__all__ = ["AGREED", "Agreement", "DEFAULT_BOUND", "FULL_CLIP_RATIO", "Guard", "GuardWarning",
           "SqNorm", "agreement", "check_bound", "default_clip", "sq_norm"]
