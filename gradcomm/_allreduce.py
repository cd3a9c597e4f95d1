"""``gradcomm.allreduce``: one call for numpy, torch and cupy arrays, any algorithm,
any compressor.

Example:
    >>> import numpy as np, gradcomm
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: gradcomm.allreduce(np.arange(3.0), t).tolist())[1]
    [0.0, 2.0, 4.0]
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np

from . import arrays
from ._plan import Reduction
from .collectives import small
from .compressors import _kernels
from .comm import get_transport
from .comm.background import background
from .compressed.auto import auto_route
from .compressed.guard import DEFAULT_BOUND, Guard, SqNorm
from .compressed.routes import reads_src, residuals_show_result
from .errors import ConfigError


def allreduce(x: Any, comm: Any = None, *, op: str = "sum", algorithm: str = "auto",
              compressor: Any = None, check: bool | str = True, out: Any = None,
              **options: Any) -> Any:
    """Reduce ``x`` across the ranks of ``comm``; every rank gets the same bytes.

    Args:
        x: numpy array, torch tensor or cupy array, any shape, contiguous or not. Not
            modified; a new array of the same kind, device, dtype and shape is returned.
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport, or None.
        op: "sum", "mean", "max", "min" or "prod" (only sum/mean with a compressor).
        algorithm: "ring", "tree", "recursive_doubling", "rabenseifner",
            "sparse_allgather", "native" or "auto".
        compressor: None, a codec name (options in ``**options``) or a Compressor.
        check: first verify that all ranks passed the same count, dtype, op, algorithm
            and compressor (one tiny exchange); a difference raises MismatchError on
            every rank instead of hanging or returning garbage. ``"first"`` (dense sums):
            only the first call with these arguments on this transport checks; a later
            disagreement is then caught only by message sizes or the deadline (see
            :func:`gradcomm.collectives.dense_allreduce`). ``False``: no check.
        out: an array like ``x`` (kind, dtype, shape and device; writable) that receives
            the result and is returned, as ``recvbuf`` in mpi4py's ``comm.Allreduce``;
            ``out=x`` is :func:`allreduce_`. See :meth:`Allreduce.__call__`.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(3, lambda t: allreduce(np.ones(2), t, op="mean").tolist())[2]
        [1.0, 1.0]
    """
    if out is x:
        return allreduce_(x, comm, op=op, algorithm=algorithm, compressor=compressor,
                          check=check, **options)
    problem = None if out is None else _out_problem(x, out)
    return _reduce(x, comm, problem, op=op, algorithm=algorithm, compressor=compressor,
                   check=check, out=None if problem else out, **options)


def _reduce(x: Any, comm: Any, problem: Exception | None, *, op: str = "sum",
            algorithm: str = "auto", compressor: Any = None, check: bool | str = True,
            in_place: bool = False, out: Any = None, **options: Any) -> Any:
    """:func:`allreduce`; ``problem``: this rank's objection to the call, raised here
    before data moves (the other ranks learn of it from the check). ``in_place``
    (:func:`allreduce_`): reduce in ``x``'s own memory where :meth:`Reduction.views`
    allows it, and return ``x`` then (else the result, as without it). ``out`` (checked
    by :func:`_out_problem`, not ``x``): the result goes there, which is returned."""
    t = get_transport(comm)
    v = small.view(t, x) if check is True and compressor is None and problem is None \
        and not options else None                # numpy or a CPU tensor, small
    if v is not None and (call := small.lookup(t, v, op, algorithm)) is not None:
        if in_place:                            # resolved by an earlier call
            call.run(t, v)
            return x
        if out is not None and (o := small.view(t, out)) is not None:
            call.run(t, o, v)
            return out
        return arrays.from_small(call.run(t, v.copy()), x)
    plan = _plan_of(op, algorithm, compressor, check) if not options else None
    if plan is None:
        plan = Reduction(op, algorithm, compressor, options, None, check)
    into = None if out is None else _into(plan, t, x, out)
    got = plan.views(x, t, in_place, result=into)
    src, buf, meta = (None, *plan.flat(x, t)) if got is None else got
    y = plan.run(t, buf, meta.dtype, meta=meta, problem=problem, src=src,
                 kept=into is not None and buf is into)
    if v is not None:
        small.install(t, v.size, v.dtype, op, algorithm)
    if in_place and got is not None:            # buf is x's own memory
        if y is not buf:
            np.copyto(buf, y)
        return x
    return _deliver(y, meta, out, into if got is not None else None)


#: the option-free Reductions of earlier calls, by (op, algorithm, compressor, check)
_PLANS: dict[Any, Reduction] = {}


def _plan_of(op: Any, algorithm: Any, compressor: Any, check: Any) -> Reduction | None:
    """The (frozen, shareable) Reduction of a call without codec options whose compressor
    is None or a name, made once (None for other calls: they build their own)."""
    if compressor is not None and type(compressor) is not str:
        return None
    key = (op, algorithm, compressor, check)
    try:
        plan = _PLANS.get(key)
    except TypeError:                       # an unhashable argument: reported later
        return None
    if plan is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        plan = _PLANS[key] = Reduction(op, algorithm, compressor, {}, None, check)
    return plan


def allreduce_(x: Any, comm: Any = None, **kwargs: Any) -> Any:
    """In-place :func:`allreduce`: the result is written into ``x``, which is returned.

    Takes the same arguments. ``x`` must be writable (a read-only numpy array is a
    ConfigError on its rank before any data moves, a MismatchError on the others); a
    non-contiguous ``x`` is updated through its strides. A C-contiguous host array
    (numpy in native byte order, CPU tensor) is reduced in its own memory, with no copy;
    as with ``MPI_IN_PLACE``, its contents are then undefined if the call raises after
    data moved (DeadlineError, TransportError; a MismatchError comes before).

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     x = np.ones(2); allreduce_(x, t); return x.tolist()
        >>> run_ranks(2, fn)[0]
        [2.0, 2.0]
    """
    problem = None
    if arrays.kind(x) == "numpy" and not x.flags.writeable:
        problem = ConfigError("allreduce_ writes the result into x, a read-only numpy array "
                              "(use y = allreduce(x, ...), or a writable copy)")
    y = _reduce(x, comm, problem, in_place=problem is None, **kwargs)
    if y is x:                                 # reduced in x's own memory
        return x
    if arrays.kind(x) == "numpy":
        x[...] = y
    else:
        x.copy_(y) if arrays.kind(x) == "torch" else x.__setitem__(Ellipsis, y)
    return x


def _out_problem(x: Any, out: Any) -> ConfigError | None:
    """Why ``out`` cannot receive the reduction of ``x`` (None: it can): it must be an
    array of ``x``'s kind, dtype, shape and device, and writable.

    Example:
        >>> import numpy as np
        >>> x = np.zeros(4)
        >>> _out_problem(x, x), _out_problem(x, np.zeros(4))
        (None, None)
        >>> print(_out_problem(x, np.zeros(3, np.float32)))
        out must be an array like x (numpy float64 (4,) on cpu), got numpy float32 (3,) on cpu
    """
    try:
        want, got = arrays.meta_of(x), arrays.meta_of(out)
    except ConfigError as e:
        return ConfigError(f"out: {e}")

    def says(m: arrays.Meta) -> str:
        return f"{m.kind} {m.dtype} {m.shape} on {m.device}"
    if got != want:
        return ConfigError(f"out must be an array like x ({says(want)}), got {says(got)}")
    if type(out) is np.ndarray and not out.flags.writeable:
        return ConfigError("out is a read-only numpy array")
    return None


def _apart(x: Any, into: np.ndarray) -> bool:
    """Whether host buffer ``into`` (an ``out``'s flat view) shares no byte with ``x``,
    which the reduction reads while it writes ``into`` (a strided ``x`` is copied first,
    so only a contiguous one can collide)."""
    if not arrays.is_contiguous(x) or not arrays.is_host(x):
        return True
    lo, hi = arrays.data_ptr(x), into.ctypes.data
    return not (lo < hi + into.nbytes and hi < lo + arrays.nbytes(x))


def _into(plan: Reduction, t: Any, x: Any, out: Any) -> np.ndarray | None:
    """``out``'s own memory as the flat host buffer the reduction of ``x`` may work in
    (:meth:`Reduction.views` of ``out``, in place), or None where it cannot: ``out`` is
    not such an array, or overlaps ``x`` without being it (the result is then copied in
    at the end, :func:`_deliver`)."""
    got = plan.views(out, t, in_place=True)
    if got is None or (out is not x and not _apart(x, got[1])):
        return None
    return got[1]


def _deliver(y: Any, meta: arrays.Meta, out: Any, into: np.ndarray | None) -> Any:
    """The result ``y`` (a flat buffer described by ``meta``) as the caller gets it: a
    new array (no ``out``), or ``out`` holding it (``into``: ``out``'s memory the
    reduction worked in, where it did; a route that gave a buffer of its own is copied
    there)."""
    if out is None:
        return arrays.from_flat(y, meta)
    if into is None:
        arrays.assign(out, arrays.from_flat(y, meta))
    elif y is not into:
        np.copyto(into, y)
    return out


class Allreduce:
    """A configured allreduce that keeps error-feedback state per key, checkpointable.

    Args:
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport or None
            (resolved at the first call).
        op: "mean" (default) or "sum"; without a compressor also "max", "min", "prod".
        algorithm: as for :func:`allreduce`; with a compressor also "allgather".
        compressor: None, a codec name (options in ``**options``) or a Compressor.
        error_feedback: keep a residual per key (and per re-compressing hop) and add it
            back at the next call with that key. Ignored without a lossy compressor, and
            (with an ErrorFeedbackWarning) for codecs that are not contractions (TernGrad,
            QSGD with few levels: residuals would diverge).
        seed: seeds the stochastic codecs with ``(seed, step, crc32(key), rank)``.
        check: verify the arguments agree across ranks at every call (``"first"``:
            dense sums check only the first call with given arguments, see
            :func:`allreduce`).
        guard: the divergence guard (:mod:`gradcomm.compressed.guard`): after a call
            that left a non-finite value, or a residual norm above ``residual_bound``
            times the largest input norm seen for the key, on any rank, every rank resets
            the key's residuals and codec state (``self.guard.stats`` counts it, with a
            GuardWarning). One 4-byte allreduce per compressed call; only where there is
            state (error feedback on, or PowerSGD).
        residual_bound: see ``guard`` (None: only non-finite values reset).

    Codecs that view their input by its shape (``uses_shape``: powersgd) get ``x``'s
    shape when ``x`` has two or more dimensions (PowerSGD: the ``(shape[0], rest)``
    matrix, as PyTorch's hook); flat arrays keep the codec's flat layout. PowerSGD's
    warm-start ``Q`` is kept per key in the error-feedback state and checkpointed.

    ``state_dict()`` returns every residual and step counter as numpy arrays and ints
    (``numpy.savez(path, **sd)`` or ``torch.save``); ``load_state_dict`` restores them, and
    the continuation is bitwise equal to a run that never stopped.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     ar = Allreduce(t, compressor="none")
        ...     return ar(np.full(2, t.rank, np.float32), key="w").tolist()
        >>> run_ranks(2, fn)[0]
        [0.5, 0.5]
    """

    def __init__(self, comm: Any = None, *, op: str = "mean", algorithm: str = "auto",
                 compressor: Any = None, error_feedback: bool = True, seed: int = 0,
                 check: bool | str = True, guard: bool = True,
                 residual_bound: float | None = DEFAULT_BOUND, **options: Any) -> None:
        from .error_feedback import ErrorFeedback, ErrorFeedbackWarning, contractive

        check = check if check == "first" else bool(check)
        self.plan = Reduction.configure(op=op, algorithm=algorithm, compressor=compressor,
                                        options=options, seed=seed, check=check)
        self.comm, self.op, self.algorithm, self.seed, self.check = (
            comm, op, algorithm, seed, check)
        self.compressor = self.plan.compressor
        lossy = self.compressor is not None and self.compressor.lossy
        stable = lossy and contractive(self.compressor)
        if error_feedback and lossy and not stable:
            warnings.warn(f"error_feedback=True is not applied with {self.compressor!r}: "
                          "its error can exceed its input, so residuals would grow without "
                          "bound (see gradcomm.error_feedback.contractive); pass "
                          "error_feedback=False to silence this", ErrorFeedbackWarning,
                          stacklevel=2)
        self.error_feedback = ErrorFeedback(enabled=bool(error_feedback) and stable)
        #: the divergence guard (None if off, or if there is no state to poison)
        self.guard = Guard(residual_bound) if guard and lossy and (
            self.error_feedback.enabled or self.compressor.name == "powersgd") else None
        self._transport: Any = None
        #: (count, ranks, dtype) -> the route a compressed call takes (_route)
        self._routes: dict[tuple[int, int, str], str] = {}

    @property
    def transport(self) -> Any:
        """The :class:`~gradcomm.comm.Transport` behind ``comm``."""
        if self._transport is None:
            self._transport = get_transport(self.comm)
        return self._transport

    def __call__(self, x: Any, key: str = "default", *, out: Any = None) -> Any:
        """Reduce ``x`` (not modified, unless it is ``out``); the residual and step of
        ``key`` are used. Returns the result: a new array, or ``out``.

        ``out``: an array like ``x`` (same kind, dtype, shape and device, writable) that
        receives the result, as ``recvbuf`` does in mpi4py's ``comm.Allreduce`` and
        ``out=`` in numpy; ``out=x`` reduces in place. One ``out`` kept across calls
        saves allocating the result: a fresh 100 MB result costs 3-6 ms of page faults
        per call on the machine of bench/RESULTS.md. An ``out`` that does not match
        ``x`` is a ConfigError on this rank, raised before any data moves; the other
        ranks get a MismatchError from the argument check (or, with ``check=False``, a
        DeadlineError). An ``out`` that overlaps ``x`` without being ``x`` gets the
        result copied in at the end.

        Example:
            >>> import numpy as np
            >>> from gradcomm.comm import run_ranks
            >>> def fn(t):
            ...     ar, y = Allreduce(t, op="sum"), np.empty(2)
            ...     return ar(np.full(2, t.rank + 1.0), out=y) is y and y.tolist()
            >>> run_ranks(2, fn)[0]
            [3.0, 3.0]
        """
        t = self.transport
        ef = self.error_feedback
        problem = None if out is None else _out_problem(x, out)
        g2 = src = None
        # where the result goes: out's own memory where it can (its flat host view)
        into = None if out is None or problem is not None else _into(self.plan, t, x, out)
        if into is not None and out is x:               # in place: no copy in, none out
            buf, meta = into, arrays.meta_of(x)
        elif self.guard is not None and type(x) is np.ndarray and \
                x.dtype == np.float32 and x.flags.c_contiguous and \
                not self._reads(t, x.size):
            buf = np.empty(x.size, np.float32) if into is None else into  # the copy and
            g2 = _kernels.for_size(x.size).copy_sq_norm(x.reshape(-1), buf)  # the guard's
            meta = arrays.backend(x).meta(x)                         # input norm in one pass
        elif (got := self.plan.views(x, t, result=into)) is not None:   # read where it
            src, buf, meta = got                    # lies (the route copies it if it must)
        else:
            buf, meta = self.plan.flat(x, t)
            into = None
        compressed = self.plan.compresses(meta.dtype)  # (a sparse gradient may go
        guard = self.guard if compressed else None      # uncompressed through
        norm = None                                     # sparse_allgather)
        if guard is not None:
            if src is not None:         # the input stays as it is: its norm may be taken
                norm = SqNorm.over(src)                 # while the ranks wait
            if norm is None:
                guard.observe(key, buf if src is None else src, g2)
            ef.tally = np.zeros(2)      # the codecs add their residuals' norms in their pass
        try:
            with background(norm):
                y = self.plan.run(t, buf, meta.dtype, meta=meta,
                                  residuals=ef if compressed else None,
                                  key=key if compressed else None, src=src, problem=problem,
                                  kept=into is not None and buf is into)
            tally, ef.tally = ef.tally, None
        finally:
            ef.tally = None
        if into is not None and y is not into:          # the route gave a buffer of its own
            np.copyto(into, y)
            y = into
        buf = y
        if norm is not None and guard is not None:
            guard.observe(key, src, norm.value())
        if not compressed:
            ef.advance(key)
        elif guard is not None:
            residuals = ef.residuals_of(key)
            # the tally is the residuals' norm if it saw every one of their elements once
            e2 = float(tally[0]) if tally is not None and \
                tally[1] == sum(arrays.size(e) for e in residuals) else None
            shown = e2 is not None and tally[1] > 0 and ef.enabled and \
                residuals_show_result(self._route(t, arrays.size(buf), meta.dtype))
            if guard.check(t, key, residuals, buf, same=True, e2=e2, shown=shown):
                ef.clear(key)
        return _deliver(buf, meta, out, into)

    def _reads(self, t: Any, n: int) -> bool:
        """Whether a float32 host call of ``n`` elements takes a route that reads its
        input where it lies (:func:`~gradcomm.compressed.routes.reads_src`): then the
        guard's input norm is a pass of its own, in the ranks' waits; else the copy
        takes it."""
        c = self.compressor
        return c is not None and t.size > 1 and \
            reads_src(c, self.op, self._route(t, n, "float32"))

    def _route(self, t: Any, n: int, dtype: str) -> str:
        """The route of a compressed call of ``n`` elements of ``dtype`` (``auto``
        resolved as it will be, once per count, rank count and dtype)."""
        got = self._routes.get((n, t.size, dtype))
        if got is None:
            c, got = self.compressor, self.algorithm
            if c is not None and got == "auto" and t.size > 1:
                got = auto_route(t, c, n, dtype)
            if len(self._routes) >= 64:
                self._routes.clear()
            self._routes[(n, t.size, dtype)] = got
        return got

    def _signature(self) -> str:
        c = self.compressor
        return "none" if c is None else f"{c.name}{sorted(c.get_config().items())!r}"

    def state_dict(self) -> dict[str, Any]:
        """Residuals (``residual/<key>``), steps (``step/<key>``) and what they belong to."""
        sd = self.error_feedback.state_dict()
        sd["allreduce/compressor"] = self._signature()
        sd["allreduce/seed"] = self.seed
        return sd

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output (also as read back by ``numpy.load``).

        ConfigError if it was saved by an Allreduce with another compressor or seed.
        """
        import numpy as np

        if not isinstance(state, Mapping):
            raise ConfigError(f"load_state_dict takes what state_dict() returned (a mapping, "
                              f"also as read back by numpy.load), got {type(state).__name__}")
        state = dict(state)
        saved = str(np.asarray(state.pop("allreduce/compressor", self._signature())))
        seed = int(np.asarray(state.pop("allreduce/seed", self.seed)))
        if saved != self._signature() or seed != self.seed:
            raise ConfigError(f"state saved with compressor {saved} and seed {seed}; this "
                              f"Allreduce has {self._signature()} and seed {self.seed}")
        self.error_feedback.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"Allreduce(op={self.op!r}, algorithm={self.algorithm!r}, "
                f"compressor={self.compressor!r}, error_feedback="
                f"{self.error_feedback.enabled}, seed={self.seed})")
