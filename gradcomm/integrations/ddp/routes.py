"""Where the DDP hook reduces a unit of parameters, and how: three routes.

1. **device** (compressed buckets whose codecs run where the bucket is: CUDA buckets with
   a gather route or a per-hop algorithm, every tensor under
   ``GRADCOMM_CODEC_PLACEMENT=array``): a float32 (float64) working copy divided by ``p``,
   the per-parameter residuals and the codecs (the device kernels, byte-identical to the
   host's) live there; only payload bytes cross to the host transport, and the result is
   written back into the bucket on the device.
2. **library** (uncompressed ``auto``/``native`` device buckets of an NCCL group): scaled
   by ``1/p`` and summed in place by NCCL's own allreduce, as DDP does.
3. **host** (the rest, PowerSGD included): staged through host memory (copied there,
   reduced, copied back before the future completes; in place for CPU buckets).
   Uncompressed, ``"auto"`` means the library's own allreduce (what DDP runs) unless it
   cannot reduce the dtype (16-bit floats under MPI). Compressed by ``fp16``/``bf16``,
   ``"auto"`` sums the 16-bit payload with the library's allreduce where the transport
   prefers it (``native_preferred``: gloo), as PyTorch's fp16 hook does (:mod:`.cast`).

A compressed unit is reduced in float32 (float64 for float64 buckets), with the
hook's :class:`~gradcomm.error_feedback.KeyedResiduals` (indexed by
:class:`~.residuals.ParameterResiduals`) as its residual store. What a bucket layout needs
is decided once, at its first reduction (:class:`Plan`: where, by which route, with which
codec); that first reduction goes through ``compressed_allreduce`` (validation, the
cross-rank check, the route); later ones run the planned route directly.

Example:
    >>> from gradcomm import arrays
    >>> from gradcomm._plan import Reduction
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     routes = Routes(t, None, Reduction.configure(algorithm="ring", compressor="topk"),
    ...                     ParameterResiduals(True))
    ...     meta = arrays.Meta("torch", "float32", (10,), "cuda:0")
    ...     return routes.route(meta, compressed=True), routes.route(meta, compressed=False)
    >>> run_ranks(1, fn)[0]
    ('device', 'host')
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import arrays
from ..._plan import Reduction
from ...collectives import DENSE, dense_allreduce
from ...collectives._check import agree_args
from ...comm.base import Transport
from ...compressed.guard import DEFAULT_BOUND, Agreement, Guard, agreement, sq_norm
from ...errors import ConfigError, UnsupportedError
from . import cast
from .momentum import MomentumCorrection
from .ramp import SparsityRamp
from .residuals import ParameterResiduals, unit_key

#: compressed algorithms the hook runs where the bucket lives (gather routes; "auto" means
#: them for device buckets); codecs always staged through the host
DEVICE_ALGORITHMS = ("auto", "allgather", "sparse_allgather", "ring", "tree",
                      "recursive_doubling", "rabenseifner")
STAGED_CODECS = ("powersgd",)
#: the plan's route of a 16-bit cast unit summed by the library (:mod:`.cast`)
CAST_ROUTE = "native cast"
#: plans kept per hook state (bucket layouts seen recently; more are re-planned)
PLAN_LIMIT = 256


@dataclass
class Plan:
    """How one bucket layout (its parameters, count, dtype, device and whether it is
    compressed) is reduced, decided at its first reduction: ``where`` (:meth:`Routes.route`),
    the unit's key, the working dtype (float64 buckets: float64, else float32) and, for
    compressed units, the ``route`` and ``codec`` the collective
    runs (None until the first reduction decided them; PowerSGD: always None, its
    rounds are planned per call), the allgather route laid out for this count
    (``gather``: :func:`~gradcomm.compressed.planned.plan_gather`, where the codec plans;
    later cut into pieces where that pays, :meth:`Routes._gathered`),
    and how the divergence guard's ranks agree
    (:func:`~gradcomm.compressed.guard.agreement`, resolved at its first check)."""

    where: str
    unit: str
    work: str                       # the working dtype of compressed units
    route: str | None = None
    codec: Any = None
    agree: Agreement | None = None
    #: whether the route applies the residuals (:func:`~gradcomm.compressed.routes.feeds_back`)
    feedback: bool | None = None
    #: the planned gathered route (:mod:`gradcomm.compressed.planned`), or None
    gather: Any = None
    #: the cast route's :class:`~.cast.Cut` (pieces or whole, measured), made at its first run
    cut: Any = None


class Routes:
    """Reduces the hook's units: the transports, the validated configuration
    (:class:`~gradcomm._plan.Reduction`: codec, algorithm, seed), the residuals, and what
    it learnt (shapes agreed across ranks, dtypes the library cannot reduce).

    ``transport`` carries gradcomm's messages (host buffers); ``library``, for a device
    process group (NCCL), is that group, whose allreduce sums uncompressed device buckets
    in place. ``stats``: ``buckets`` reduced, ``bytes_sent`` by gradcomm's own messages,
    ``native_nbytes`` handed to the library's allreduce, ``comm_seconds`` spent and
    ``pieced``, the layouts whose planned allgather was cut into pieces, and
    ``cast_whole``, the cast route's layouts its ranks found faster whole (:class:`.cast.Cut`).
    ``stateful``: keep the guard even without residuals (momentum correction may be set
    as ``momentum`` later, when the hook finds the optimizer).
    """

    def __init__(self, transport: Transport, library: Transport | None, reduction: Reduction,
                 residuals: ParameterResiduals, *, guard: bool = True,
                 residual_bound: float | None = DEFAULT_BOUND,
                 momentum: MomentumCorrection | None = None,
                 clip: float | None = None, stateful: bool = False,
                 ramp: SparsityRamp | None = None) -> None:
        self.transport, self.library = transport, library
        self.compressor, self.algorithm = reduction.compressor, reduction.algorithm
        self.seed = int(reduction.seed or 0)
        self.residuals = residuals
        self.stats = {"buckets": 0, "bytes_sent": 0, "native_nbytes": 0, "comm_seconds": 0.0,
                      "pieced": 0, "cast_whole": 0}
        stateful = stateful or residuals.enabled or momentum is not None or (
            self.compressor is not None and self.compressor.name == "powersgd")
        if clip is not None and not (guard and stateful):
            raise ConfigError("clip= needs the guard (guard=True) and error feedback: it "
                              "is decided in the guard's agreement and gives back to the "
                              "residuals")
        #: the divergence guard (:mod:`gradcomm.compressed.guard`; None: off, or no state
        #: to poison) and DGC's momentum correction (:mod:`.momentum`, or None)
        self.guard = Guard(residual_bound, self.stats, clip) if guard and stateful else None
        self.momentum = momentum
        #: (count, dtype, compressed) of the units already agreed across ranks
        self.checked: set[tuple[int, str, bool]] = set()
        self.no_native: set[str] = set()       # dtypes the library cannot reduce
        self.plans: dict[tuple[Any, ...], Plan] = {}
        #: DGC's sparsity warm-up (:mod:`.ramp`): the codec of each early iteration
        self.ramp = ramp

    def plan(self, flat: Any, keys: list[str], compressed: bool) -> Plan:
        """The :class:`Plan` of bucket (or unit) ``flat`` of parameters ``keys``, made at
        its first reduction; the layout changes the key, so a rebuilt bucket is planned
        anew. Safe from both the autograd thread and the worker (equal plans)."""
        sig = (tuple(keys), flat.numel(), flat.dtype, flat.device, compressed)
        plan = self.plans.get(sig)
        if plan is None:
            import torch

            if len(self.plans) >= PLAN_LIMIT:
                self.plans.clear()
            work = "float64" if flat.dtype == torch.float64 else "float32"
            plan = self.plans[sig] = Plan(self.route(arrays.meta_of(flat), compressed),
                                          unit_key(keys), work)
        return plan

    def reduce(self, flat: Any, keys: list[str], lengths: list[int], compressed: bool,
               step: int) -> None:
        """Average 1-D tensor ``flat`` (parameters ``keys`` of ``lengths``) across ranks,
        where :meth:`route` says; ``compressed``: whether this iteration compresses,
        ``step``: the hook's iteration (it seeds the codecs)."""
        t = self.transport
        began, sent = time.perf_counter(), t.stats.bytes_sent
        if compressed and self.ramp is not None:
            self._use(self.ramp.codec(step))
        plan = self.plan(flat, keys, compressed)
        sig = (flat.numel(), flat.dtype, compressed)
        check = sig not in self.checked    # agree on new shapes only: gloo messages cost ms
        if plan.where == "device":
            self._on_device(flat, plan, keys, lengths, check, step)
        elif plan.where == "library":
            self.library_allreduce(flat, arrays.meta_of(flat).dtype, check)
        else:
            self._on_host(flat, plan, keys, lengths, compressed, check, step)
        self.checked.add(sig)
        self.stats["buckets"] += 1
        self.stats["bytes_sent"] += t.stats.bytes_sent - sent
        self.stats["comm_seconds"] += time.perf_counter() - began

    def _use(self, codec: Any) -> None:
        """Compress with ``codec`` from now on (a ramp's next stage, on every rank at the
        same iteration): the compressed plans are made anew and their shapes agreed."""
        if codec is self.compressor:
            return
        self.compressor = codec
        for sig in [s for s in self.plans if s[-1]]:
            del self.plans[sig]
        self.checked.difference_update([s for s in self.checked if s[2]])

    def route(self, meta: arrays.Meta, compressed: bool) -> str:
        """Where a bucket described by ``meta`` is reduced: ``"device"`` (compressed,
        with codecs that run where the bucket is: CUDA buckets, or every
        tensor under ``GRADCOMM_CODEC_PLACEMENT=array``), ``"library"`` (uncompressed
        ``auto``/``native`` device buckets of a device process group: its own allreduce,
        in place) or ``"host"`` (staged through host memory: the rest)."""
        if compressed:
            assert self.compressor is not None
            gather = self.algorithm in DEVICE_ALGORITHMS and \
                self.compressor.name not in STAGED_CODECS
            return "device" if gather and arrays.placement(meta, codecs=True) == "native" \
                else "host"
        lib = self.library
        if lib is not None and meta.device != "cpu" and self.algorithm in ("auto", "native") \
                and lib.native_supports(meta.dtype, "sum"):
            return "library"
        return "host"

    def _on_device(self, flat: Any, plan: Plan, keys: list[str], lengths: list[int],
                   check: bool, step: int) -> None:
        """The compressed path where the bucket lives: a float32/float64 working copy
        divided by p, residuals on the same device, payload bytes alone crossing to the
        host; the result goes back into ``flat`` there."""
        import torch

        work = flat.double() if flat.dtype == torch.float64 else flat.float()  # flat if so
        work.mul_(1.0 / self.transport.size)
        result = self._compressed(work, plan, keys, lengths, check, step)
        if result is not work:
            arrays.assign(work, result)
        if work is not flat:
            flat.copy_(work)
        arrays.sync(flat)                   # done before the future hands it to DDP

    def library_allreduce(self, flat: Any, dtype: str, check: bool) -> None:
        """DDP's own path on a device process group: scale by 1/p and sum ``flat`` in
        place with the group's allreduce (arguments agreed over the host transport)."""
        if check:
            self.agree_library(flat, dtype)
        self.library_finish(flat, self.library_start(flat, dtype))

    def agree_library(self, flat: Any, dtype: str) -> None:
        """The host path's check fields: a rank staging instead is told, not hung."""
        from ...collectives import agree

        agree(self.transport, "allreduce", count=int(flat.numel()), dtype=dtype, op="sum",
              algorithm="native (device group)")

    def library_start(self, flat: Any, dtype: str) -> Any:
        """Scale ``flat`` by 1/p and start the device group's allreduce of it."""
        lib = self.library
        assert lib is not None
        flat.mul_(1.0 / lib.size)
        return lib.native_allreduce_start(flat, "sum", dtype)

    def library_finish(self, flat: Any, work: Any) -> None:
        """Wait for the device group's allreduce ``work`` of ``flat``."""
        assert self.library is not None
        self.library.native_allreduce_wait(work)
        arrays.sync(flat)                   # done before the future hands it to DDP
        self.stats["native_nbytes"] += flat.numel() * flat.element_size()

    def _on_host(self, flat: Any, plan: Plan, keys: list[str], lengths: list[int],
                 compressed: bool, check: bool, step: int) -> None:
        """Staged through host memory (in place for CPU buckets); a compressed unit's
        float32/float64 working copy becomes flat numpy memory once (``Tensor.numpy``)."""
        import torch

        t = self.transport
        host = flat if flat.device.type == "cpu" else flat.cpu()
        if not compressed:
            meta = arrays.meta_of(host)
            host.mul_(1.0 / t.size)
            view = arrays.host_view(host)
            algorithm = self._dense_algorithm(meta.dtype)
            try:
                dense_allreduce(t, view, "sum", meta.dtype, algorithm, check=check)
            except UnsupportedError:          # raised by every rank alike, before any data
                if self.algorithm != "auto" or algorithm != "native":
                    raise
                self.no_native.add(meta.dtype)
                algorithm = "auto"
                dense_allreduce(t, view, "sum", meta.dtype, algorithm, check=check)
            if algorithm == "native":
                self.stats["native_nbytes"] += host.numel() * host.element_size()
        else:
            work = host.double() if host.dtype == torch.float64 else host.float()
            work.mul_(1.0 / t.size)
            view = work.numpy()                     # the same memory
            result = self._compressed(view, plan, keys, lengths, check, step)
            if result is not view:
                view[...] = result
            if work is not host:
                host.copy_(work)
        if host is not flat:
            flat.copy_(host)

    def _dense_algorithm(self, dtype: str) -> str:
        """The uncompressed path's algorithm: with "auto", the library's own allreduce
        (what DDP runs; it overlaps best) unless it cannot reduce ``dtype``."""
        if self.algorithm == "auto":
            return "auto" if dtype in self.no_native else "native"
        return self.algorithm if self.algorithm in DENSE else "auto"

    def _compressed(self, x: Any, plan: Plan, keys: list[str], lengths: list[int],
                    check: bool, step: int) -> Any:
        """:meth:`_collective` of ``x`` with the convergence mechanisms around it: the
        momentum correction turns ``x`` into the velocity first and undoes the
        optimizer's momentum on the result; the guard then resets the unit's state on
        every rank after a non-finite value or a runaway residual, or clips the result
        (what it cuts off goes back into the residuals)."""
        guard, mc = self.guard, self.momentum
        if mc is not None:
            mc.before(keys, lengths, x)          # x <- the velocity
        if plan.route is None and self.algorithm == "auto" and \
                cast.wire_dtype(self.transport, self.compressor, x) is not None:
            plan.route, plan.codec = CAST_ROUTE, self.compressor
        if plan.route == CAST_ROUTE and (guard is None or guard.clip is None):
            out, reason = self._cast(x, plan, keys, lengths, check, step, guard)
            return self._settled(out, plan, keys, lengths, reason)
        if guard is not None:
            guard.observe(plan.unit, x)
        if plan.gather is not None and not check and (guard is None or guard.clip is None):
            res = self.residuals                # the guard's flags ride on the frames
            unit = res.open(keys, lengths, x, step, plan.unit, take=False)
            store, owed = res.store, None
            if plan.gather.feedback:                # the residual in the codec's pass
                owed = store.owed(unit, x)
            if owed is None:
                store.take(unit, x)
            out, reason = self._gathered(x, plan, step, guard, owed)
            return self._settled(out, plan, keys, lengths, reason)
        out = self._collective(x, plan, keys, lengths, check, step)
        reason = None
        if guard is not None:
            if plan.agree is None:
                plan.agree = agreement(self.transport)
            reason = guard.check(self.transport, plan.unit,
                                 self.residuals.unit_arrays(plan.unit), out, same=True,
                                 agree=plan.agree)
            if reason is None and guard.factor < 1.0:
                self._give_back(out, keys, lengths, guard.factor)
        return self._settled(out, plan, keys, lengths, reason)

    def _settled(self, out: Any, plan: Plan, keys: list[str], lengths: list[int],
                 reason: str | None) -> Any:
        """``out`` after the guard's decision ``reason`` (taken on every rank alike): the
        optimizer's momentum undone, the unit's state reset if ``reason`` says so."""
        mc = self.momentum
        if mc is not None:
            mc.after(keys, lengths, out)
        if reason is not None:
            self.residuals.clear_unit(plan.unit)
            if mc is not None:
                mc.reset(keys)
        return out

    def _give_back(self, out: Any, keys: list[str], lengths: list[int],
                   factor: float) -> None:
        """``out *= factor``; each rank's residuals get ``(1 - factor) / p`` of the
        original ``out``, so the ranks together still owe all of it."""
        share = (1.0 - factor) / self.transport.size
        a = 0
        for k, n in zip(keys, lengths):
            e = self.residuals.residual(k, n, arrays.dtype_name(out), like=out)
            e += share * out[a:a + n]
            a += n
        out *= factor

    def _collective(self, x: Any, plan: Plan, keys: list[str], lengths: list[int],
                    check: bool, step: int) -> Any:
        """Compressed allreduce (sum) of flat ``x`` (host numpy, or a tensor reduced where
        it lives) with the residuals of ``keys``: the planned route when there is one,
        else (the layout's first reduction, a new shape to agree on, PowerSGD) through
        ``compressed_allreduce``, whose route the plan then keeps."""
        from ...compressed import compressed_allreduce
        from ...compressed.routes import feeds_back, run

        if plan.route == CAST_ROUTE:                    # with clip: the guard checks after
            return self._cast(x, plan, keys, lengths, check, step, None)[0]
        unit = self.residuals.open(keys, lengths, x, step, plan.unit)
        store, dtype = self.residuals.store, plan.work
        if plan.route is not None and not check:
            if plan.gather is not None:
                return self._gathered(x, plan, step, None, None)[0]
            return run(self.transport, x, dtype, "sum", plan.route, plan.codec, self.seed,
                       step, store, unit, plan.feedback)
        if self.algorithm == "native":                  # PowerSGD's rounds, on the library
            self.stats["native_nbytes"] += self._native_nbytes(x, unit, step)
        first = None
        if plan.route is None and self.compressor.name not in STAGED_CODECS:
            first = self._route_of(x, dtype)
        algorithm = self.algorithm                      # "auto" as the hook resolves it
        if algorithm == "auto" and (plan.route or (first and first[0])) == "allgather":
            algorithm = "allgather"
        out = compressed_allreduce(self.transport, x, dtype, op="sum",
                                   algorithm=algorithm, compressor=self.compressor,
                                   check=check, seed=self.seed, residuals=store, key=unit)
        if first is not None:
            plan.route, plan.codec = first
            plan.feedback = feeds_back(self.transport, plan.route, plan.codec, store)
            plan.gather = self._gather_plan(x, plan, unit)
        return out

    def _cast(self, x: np.ndarray, plan: Plan, keys: list[str], lengths: list[int],
              check: bool, step: int, guard: Guard | None) -> tuple[np.ndarray, str | None]:
        """:mod:`.cast`'s route: the 16-bit payload summed by the library's allreduce
        (arguments agreed first as ``compressed_allreduce`` agrees them, this route
        named, so a rank taking another route is told, not hung); once the unit's
        residual is one flat buffer it is added in the codec's fused pass. With ``guard``
        its decision rides on the payload (:func:`.cast.allreduce`); returns it too."""
        t, codec, res = self.transport, plan.codec, self.residuals
        unit = res.open(keys, lengths, x, step, plan.unit, take=False)
        store = res.store
        if check:
            agree_args(t, "compressed allreduce", None, count=arrays.size(x),
                       dtype=plan.work, op="sum", algorithm=f"auto ({CAST_ROUTE})",
                       compressor=codec.name, config=dict(codec.get_config()),
                       seed=self.seed, key=unit, error_feedback=store.enabled)
        owed, g2 = store.owed(unit, x), None
        if owed is None:
            if guard is not None:
                g2 = sq_norm(x)                 # the input, before the residuals join it
            store.take(unit, x)
        cut = plan.cut = plan.cut or cast.Cut(t.size, arrays.size(x))
        decided = cut.pieced
        out, reason = cast.allreduce(
            t, x, codec, store, unit, residual=owed, guard=guard, g2=g2, cut=cut,
            residual_norm=lambda: sum(sq_norm(e) for e in res.unit_arrays(unit)))
        self.stats["cast_whole"] += decided is None and cut.pieced is False
        self.stats["native_nbytes"] += 2 * (arrays.size(x) + cast.FLAGS)
        return out, reason

    def _gathered(self, x: np.ndarray, plan: Plan, step: int, guard: Guard | None,
                  residual: np.ndarray | None) -> tuple[np.ndarray, str | None]:
        """``plan.gather.run``; once its ranks found that they wait on the exchange longer
        than the codec works (:attr:`~gradcomm.compressed.planned.PlannedGather.
        pieces_pay`, the same decision on every rank), the layout is cut into pieces of
        about :data:`~gradcomm.compressed.planned_pipeline.PIECE_BYTES` of payload
        (:class:`~gradcomm.compressed.planned_pipeline.PipelinedGather`: the codec works
        while earlier pieces travel; the same bytes) where the codec allows."""
        from ...compressed.planned_pipeline import pieced_if_it_pays

        g = plan.gather
        out = g.run(self.transport, x, step, self.residuals.store, guard=guard,
                    residual=residual)
        if g.pieces_pay:                            # decided at one run, alike everywhere
            plan.gather = pieced_if_it_pays(self.transport, g, self.seed)
            self.stats["pieced"] += plan.gather is not g
        return out

    def _gather_plan(self, x: Any, plan: Plan, unit: str) -> Any:
        """The layout's :class:`~gradcomm.compressed.planned.PlannedGather` (the allgather
        route of a float32 host unit, in one piece, with a codec that plans), else None;
        whether the residuals feed back is decided here, as the route decides it."""
        from ...compressed.planned import plan_gather
        from ...compressed.routes import gather_pieces

        codec, n = plan.codec, int(x.size) if isinstance(x, np.ndarray) else 0
        if plan.route != "allgather" or plan.work != "float32" or not n or \
                gather_pieces(self.transport, codec, n, "float32", 4) != 1:
            return None
        return plan_gather(self.transport, codec, n, unit, seed=self.seed,
                           feedback=bool(plan.feedback))

    def _route_of(self, x: Any, dtype: str) -> tuple[str, Any]:
        """The route and codec ``compressed_allreduce`` ran ``x`` by (``auto`` decided as
        it decides it; a per-hop route's codec keeps the fraction of each segment)."""
        from ...compressed import HOP_ALGORITHMS
        from ...compressed.auto import route_of
        from ...compressed.routes import segment_codec

        t, codec, n = self.transport, self.compressor, arrays.size(x)
        route = self.algorithm
        if route == "auto" and t.size > 1 and n:
            route = route_of(t, codec, n, dtype, device=not arrays.is_host(x))
            if route in HOP_ALGORITHMS and self._gathers_planned(x, codec, n, dtype):
                route = "allgather"
        if route in HOP_ALGORITHMS:
            codec = segment_codec(codec, n)
        return route, codec

    def _gathers_planned(self, x: Any, codec: Any, n: int, dtype: str) -> bool:
        """Whether the hook's ``auto`` takes the planned allgather
        (:mod:`~gradcomm.compressed.planned`) over the per-hop route the cost model picked:
        at p = 2, where both move one compressed copy of the unit per rank, for a float32
        host unit whose gathered codec plans. The allgather then exchanges once, with
        nothing re-compressed, through kernels planned once per layout; the per-hop ring
        runs two dependent exchanges through the generic frames (faster for the hook's
        int8 and onebit on gloo; not for ``gradcomm.allreduce`` in general, where on MPI
        the ring measured as fast: bench/RESULTS.md, issue 12)."""
        from ...compressed.routes import gather_pieces

        return self.transport.size == 2 and dtype == "float32" and \
            isinstance(x, np.ndarray) and codec.reduction == "gathered" and \
            not codec.sparse and codec.plan(n, "float32") is not None and \
            gather_pieces(self.transport, codec, n, "float32", 4) == 1

    def _native_nbytes(self, x: np.ndarray, unit: str, step: int) -> int:
        """Bytes PowerSGD will hand to the library's allreduce for ``x`` (both rounds)."""
        from ...compressed.powersgd import parts_of, wire_values

        c = self.compressor
        if self.transport.size == 1 or not x.size:
            return 0
        if step < c.start_iter:
            return x.nbytes
        return sum(wire_values(parts_of(x.size, unit, c, self.residuals.store))) * x.itemsize


__all__ = ["CAST_ROUTE", "DEVICE_ALGORITHMS", "PLAN_LIMIT", "Plan", "Routes", "STAGED_CODECS"]
