"""The DDP comm hook and its state: config, parameter names, buckets in, futures out.

:func:`~.make.make_comm_hook` validates the configuration and returns ``(state, comm_hook)``.
:func:`comm_hook` runs on the autograd thread: it names the bucket's parameters, starts
an NCCL group's own allreduce where that is the route, and queues the bucket on the
state's :class:`~.worker.Worker` (the last bucket, if none is queued, runs right there).
On either thread, :class:`CommHookState` reduces the bucket (:class:`~.routes.Routes`), or regroups
it into the saved layout in the first iteration after a load (:class:`~.replay.Replay`),
and completes its future; at the last bucket of an iteration, the hop residuals of
units not reduced are folded.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.integrations.ddp import make_comm_hook
    >>> def fn(t):
    ...     state, hook = make_comm_hook("int8", bits=4, transport=t)
    ...     state.close()
    ...     return hook is comm_hook, state.routes.algorithm, state.iter
    >>> run_ranks(1, fn)[0]
    (True, 'auto', 0)
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

from ... import arrays
from ..._plan import Reduction
from ...comm.base import Transport
from ...compressed.guard import DEFAULT_BOUND, check_bound, default_clip
from ...errors import ConfigError, GradcommError
from . import checkpoint
from . import lifecycle
from .adam import AdamSlot, adam_codec, is_adam
from .groups import resolve_transports
from .defaults import default_options, default_ramp, default_start_iter
from .momentum import (CORRECTED_CODECS, MASKED_CODECS, SGD_FEEDBACK_CODECS, OptimizerWatch, feedback_with,
                       found_momentum, momentum_correction, restored, momentum_safe)
from .ramp import SparsityRamp
from .replay import Replay
from .residuals import ParameterResiduals
from .routes import Routes
from .worker import Worker


class UnboundModelWarning(UserWarning):
    """The hook names parameters by position because no model was bound."""


class CommHookState:
    """Everything the hook keeps between buckets: config, residuals, the worker thread.

    Build it with :func:`make_comm_hook`. Attributes worth reading: ``iter`` (completed
    backward passes), ``transport`` (gradcomm's messages), ``library`` (the transport of
    an NCCL DDP group, which sums uncompressed device buckets itself; else None) and
    ``stats``: ``buckets`` reduced, ``bytes_sent`` by gradcomm's own messages,
    ``native_nbytes`` handed to the library's allreduce (``algorithm="native"``, or an
    NCCL group's; what that puts on the wire is the library's business) and
    ``comm_seconds`` the worker spent reducing.
    """

    def __init__(self, compressor: Any = None, *, algorithm: str = "auto",
                 error_feedback: bool = True, process_group: Any = None,
                 transport: Any = None, start_iter: int | str = "auto", model: Any = None,
                 seed: int = 0, timeout: float | None = None, guard: bool = True,
                 residual_bound: float | None = DEFAULT_BOUND, momentum: float | None = None,
                 optimizer: Any = "auto", clip: float | None | str = "auto",
                 ramp: int | None | str = "auto", **options: Any) -> None:
        options = default_options(compressor, options)
        #: the validated configuration (the same checks and words as Allreduce and wrap)
        self.reduction = Reduction.configure(
            algorithm=algorithm, compressor=compressor, options=options, seed=seed,
            check_algorithm=True, lossless_dense=True)
        self.compressor = self.reduction.compressor
        if ramp == "auto":
            ramp = default_ramp(self.compressor)
        auto_start = start_iter == "auto"
        if auto_start:
            start_iter = default_start_iter(self.compressor)
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ConfigError(f"start_iter must be an int >= 0 or 'auto', got {start_iter!r}")
        self.algorithm, self.start_iter = algorithm, start_iter
        #: the Adam route (:mod:`.adam`), its warm-up (``start_iter`` if given)
        self.adam = AdamSlot(None if auto_start else max(1, start_iter))
        self.seed = int(self.reduction.seed or 0)
        self.error_feedback = bool(error_feedback)
        self._transports = resolve_transports(transport, process_group, timeout)
        messages = self._transports.messages
        self.residuals = ParameterResiduals(self.error_feedback)
        c = self.compressor
        #: finds the optimizer for momentum correction (``optimizer="auto"``), or None
        self._watch: OptimizerWatch | None = None
        if isinstance(optimizer, str):
            if optimizer != "auto":
                raise ConfigError(f"optimizer must be an optimizer, None or 'auto', got "
                                  f"{optimizer!r}")
            optimizer = None
            if c is not None and c.lossy and (c.name in SGD_FEEDBACK_CODECS or (
                    momentum is None and c.name in CORRECTED_CODECS)):
                self._watch = OptimizerWatch(self, CommHookState._found_optimizer)
        adam = optimizer is not None and adam_codec(c) and is_adam(optimizer)
        mc = None if adam else momentum_correction(c, momentum, optimizer)
        #: ``clip="auto"``: the clip follows the momentum correction the hook finds
        self._auto_clip = clip == "auto" and guard and self.error_feedback
        self._guard = bool(guard)
        if clip == "auto":
            clip = default_clip(c, momentum_safe(mc, optimizer)) if self._auto_clip else None
        self.routes = Routes(messages, self._transports.library, self.reduction,
                             self.residuals, guard=guard,
                             residual_bound=check_bound(residual_bound),
                             momentum=mc, clip=clip,
                             stateful=self._watch is not None,
                             ramp=None if ramp is None else SparsityRamp(c, ramp, start_iter))
        self.iter = 0
        self._names: dict[int, str] | None = None
        self._position: dict[int, str] = {}
        self._warned_unbound = False
        self._layout: list[list[str]] = []      # units of the last completed iteration
        self._current: list[list[str]] = []     # units of the iteration in progress
        self._replay: list[list[str]] | None = None
        self._pending: Replay | None = None
        self._failure: BaseException | None = None
        self._raised = False                    # the failure reached backward() once
        self._closed = False
        self._worker = Worker(messages.timeout)
        self._finalizer = weakref.finalize(self, self._worker.queue.put, None)
        if adam:
            self._adam_start(optimizer)
        lifecycle.register(self)
        if model is not None:
            self.bind(model)

    @property
    def transport(self) -> Transport:
        """The transport of gradcomm's messages (host buffers)."""
        return self.routes.transport

    @property
    def library(self) -> Transport | None:
        """An NCCL DDP group's transport (it sums uncompressed device buckets), or None."""
        return self.routes.library

    @property
    def stats(self) -> dict[str, Any]:
        """``buckets``, ``bytes_sent``, ``native_nbytes``, ``comm_seconds`` so far."""
        return self.routes.stats

    # -- parameter names -------------------------------------------------------------------
    def bind(self, model: Any) -> CommHookState:
        """Name residuals after ``model``'s parameters (a DDP model or the module it wraps).

        Returns the state, so ``make_comm_hook(...)[0].bind(model)`` chains.
        """
        module = getattr(model, "module", model)
        try:
            named = list(module.named_parameters())
        except AttributeError:
            raise ConfigError(f"bind() needs a torch.nn.Module or DDP model, got "
                              f"{type(model).__qualname__}") from None
        self._names = {id(p): name for name, p in named}
        return self

    def _keys(self, params: Sequence[Any]) -> list[str]:
        if self._names is not None:
            try:
                return [self._names[id(p)] for p in params]
            except KeyError:
                raise ConfigError("a bucket holds a parameter that is not in the bound "
                                  "model; bind the model that DDP wraps") from None
        if not self._warned_unbound:
            self._warned_unbound = True
            warnings.warn("make_comm_hook: no model bound; residuals are keyed by parameter "
                          "position ('param.<i>'). Pass model= (or state.bind(model)) so that "
                          "checkpoints name parameters", UnboundModelWarning, stacklevel=3)
        keys = []
        for p in params:
            k = self._position.get(id(p))
            if k is None:
                k = self._position[id(p)] = f"param.{len(self._position)}"
            keys.append(k)
        return keys

    def _adam_start(self, optimizer: Any) -> None:
        """Take the Adam route for ``optimizer`` (on the worker: the gradient route's
        residuals of the backward passes before it are dropped)."""
        def start() -> None:
            self.residuals.clear()
            self.adam.start(optimizer, self.transport, self.compressor, self.seed,
                            self._guard, self._call, self.stats)
        self._call(start)

    def _found_optimizer(self, optimizer: Any) -> None:
        """The watch's callback (in ``optimizer.step()``, between iterations): take the
        Adam route (:mod:`.adam`) for Adam/AdamW, or turn on momentum correction for
        ``optimizer`` unless a checkpoint already restored it, or turn error feedback off
        (:data:`~.momentum.SGD_FEEDBACK_CODECS`)."""
        c = self.compressor
        if adam_codec(c) and is_adam(optimizer):
            return self._adam_start(optimizer)
        mc = found_momentum(c, None, optimizer) if c.name in CORRECTED_CODECS else None
        feedback = feedback_with(c, optimizer)

        def apply() -> None:
            if self.routes.momentum is None and mc is not None:
                self.routes.momentum = mc
            if not feedback:
                self._feedback_off()
            self._clip_for(momentum_safe(self.routes.momentum, optimizer))
        self._call(apply)

    def _clip_for(self, corrected: bool) -> None:
        """On the worker: ``clip="auto"``'s value once the optimizer is known."""
        if self._auto_clip and self.routes.guard is not None:
            self.routes.guard.clip = default_clip(self.compressor, corrected)

    def _feedback_off(self) -> None:
        """On the worker: stop error feedback and drop the residuals held so far."""
        self.residuals.store.enabled = False
        self.residuals.clear()

    # -- the worker --------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread (after every queued bucket) and return its value."""
        return self._worker.call(fn)

    def flush(self) -> None:
        """Wait until every queued bucket has been reduced."""
        self._worker.wait()

    def close(self) -> None:
        """Release what the hook holds, once (idempotent): the worker thread stops after
        the queued buckets and is joined, a gloo group it made beside an NCCL group is
        destroyed, a duplicated MPI communicator freed. Also run at interpreter exit and
        by ``torch.distributed.destroy_process_group`` (before torch destroys the group:
        :mod:`~.lifecycle`); ``with state:`` closes on leaving the block."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.remove()
        self.adam.remove()
        lifecycle.forget(self)
        self._worker.close()
        for t in self._transports.own_transports:
            t.close()
        for group in self._transports.own_groups:
            import torch.distributed as dist

            if dist.is_initialized():
                lifecycle.destroy_group(group)
        self._transports.own_groups.clear()

    def uses(self, group: Any) -> bool:
        """Whether the hook talks over torch process group ``group`` (None: over any)."""
        groups = self._transports.groups
        return bool(groups) if group is None else any(g is group for g in groups)

    def __enter__(self) -> CommHookState:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_iteration(self) -> None:
        """On the autograd thread, at the last bucket: wait for the queued buckets and
        raise a failure here, where DDP passes it on to ``backward()`` with its type (an
        exception set on a hook's future reaches the user as DDP's "Unable to cast"
        RuntimeError)."""
        self._worker.wait()
        failure = self._failure
        if failure is None:
            return
        if not self._raised:
            self._raised = True
            raise failure
        raise GradcommError(f"an earlier bucket failed: {failure}") from failure

    # -- one bucket ----------------------------------------------------------------------
    def _bucket(self, buf: Any, keys: list[str], lengths: list[int], last: bool,
                fut: Any, event: Any, work: Any = None) -> None:
        """Worker side of the hook: reduce one DDP bucket (or collect it for a replay);
        ``work``: the device group's allreduce the hook already started on it."""
        try:
            if self._failure is not None:
                raise GradcommError(f"an earlier bucket failed: {self._failure}")
            if event is not None:
                event.synchronize()        # the gradients were written on another stream
            if work is not None:
                self.routes.library_finish(buf, work)
                self.stats["buckets"] += 1
                self._current.append(keys)
                ready = [(fut, buf)]
            elif self.adam.active and self.adam.local():
                self._current.append(keys)     # Adam's route: the optimizer communicates
                ready = [(fut, buf)]
            elif self._replay is not None or self._pending is not None:
                ready = self._replay_bucket(buf, keys, lengths, fut, last)
            else:
                self._reduce(buf, keys, lengths)
                self._current.append(keys)
                ready = [(fut, buf)]
            if last:
                self._end_iteration()     # before the futures: backward returns after them
            for f, b in ready:
                f.set_result(b)
        except BaseException as exc:
            self._failure = self._failure or exc
            if not fut.done():
                fut.set_exception(exc)
            if self._pending is not None:
                self._pending.fail(exc)
                self._pending = None

    def _end_iteration(self) -> None:
        if self._pending is not None:
            left = self._pending.left()
            self._pending = None
            if left:
                raise GradcommError(f"replayed bucket layout never received {left}")
        self.residuals.fold_unused(self.transport)
        self._layout, self._current = self._current, []
        self.iter += 1

    def _replay_bucket(self, buf: Any, keys: list[str], lengths: list[int], fut: Any,
                       last: bool) -> list[tuple[Any, Any]]:
        """Collect a bucket; reduce the saved units now complete (at the last bucket: all
        the rest); return the (future, buffer) of the buckets finished."""
        import torch

        if self._pending is None:
            assert self._replay is not None
            self._pending, self._replay = Replay(self._replay), None
        pending = self._pending
        pending.add(buf, keys, lengths, fut)
        finished = []
        units = list(pending.ready())
        if last:
            units += pending.finish()
        for unit_keys, views in units:
            flat = torch.cat([v.reshape(-1) for v in views])
            self._reduce(flat, unit_keys, [v.numel() for v in views])
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()])
                offset += v.numel()
            self._current.append(unit_keys)
            finished += pending.done(unit_keys)
        return finished

    def _reduce(self, flat: Any, keys: list[str], lengths: list[int]) -> None:
        """Average unit ``flat`` (parameters ``keys`` of ``lengths``) across the ranks."""
        self.routes.reduce(flat, keys, lengths, self._compressing(), self.iter)

    def _compressing(self) -> bool:
        """Whether this iteration's buckets are compressed (a lossy codec, past
        ``start_iter``)."""
        return (self.compressor is not None and self.compressor.lossy
                and not self.adam.active and self.iter >= self.start_iter)

    def _hook_library(self, buf: Any) -> Any:
        """On the autograd thread: start the device group's allreduce of bucket ``buf`` if
        it takes the library route (else None; the worker reduces it). Issued here, the
        device collectives keep the order DDP issues its own in (the unused-parameter map
        with ``find_unused_parameters``, ...) on every rank; issued from the worker they
        could interleave differently on different ranks and hang NCCL. A new shape is
        first agreed on the worker (after the buckets queued before it)."""
        if self.library is None or self._replay is not None or self._pending is not None or \
                (self.adam.active and self.adam.local()):
            return None          # a replayed layout (the worker groups units), or local
        meta = arrays.meta_of(buf)
        compressed = self._compressing()
        if self.routes.route(meta, compressed) != "library":
            return None
        sig = (buf.numel(), meta.dtype, False)
        if sig not in self.routes.checked:
            def agree() -> None:
                self.routes.agree_library(buf, meta.dtype)
                self.routes.checked.add(sig)
            self._call(agree)
        return self.routes.library_start(buf, meta.dtype)

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """Config, counters, layout and EVERY rank's residuals. Collective: call on all ranks.

        Values are tensors, ints, floats, strings, lists and dicts, so ``torch.save`` /
        ``torch.load`` (``weights_only=True``) round-trip it. With ``rank0_only`` the
        residuals are gathered to rank 0 only; other ranks return ``{}``.
        """
        return self._call(lambda: checkpoint.state_dict(
            self.transport, self.residuals, rank0_only, self.config(), self.iter,
            self._layout, self.routes.momentum, self.adam))

    def config(self) -> dict[str, Any]:
        """What the hook was configured with, as ``state_dict()["config"]`` holds it."""
        c = self.compressor
        return {"compressor": None if c is None else c.name,
                "compressor_options": {} if c is None else dict(c.get_config()),
                "algorithm": self.algorithm, "error_feedback": self.error_feedback,
                "start_iter": self.start_iter, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters, layout and this rank's share of the residuals (any rank count).

        ConfigError for a state of another format or version, or saved by a hook with
        another configuration (compressor and its options, algorithm, error feedback,
        start_iter, seed), as ``Allreduce.load_state_dict`` refuses one.

        New rank ``r'`` of ``p'`` receives ``sum(e_r for r in range(p) if r % p' == r')``,
        summed in rank order (hop residuals folded first), which keeps the total error
        mass up to float rounding.
        """
        checkpoint.check_config(state, self.config())
        restored = checkpoint.restore(state, self.transport.size, self.transport.rank)
        velocity = checkpoint.restore_momentum(state, self.transport.size,
                                               self.transport.rank)
        adam = checkpoint.restore_adam(state, self.transport.size, self.transport.rank)
        layout = [list(map(str, u)) for u in state.get("layout", [])]

        def apply() -> None:
            self.residuals.restore(restored)
            if velocity is not None:
                self._restore_momentum(*velocity)
            self.adam.load(adam, state.get("adam"))
            if not state.get("feedback", True) and self._watch is not None and \
                    self.compressor.name in SGD_FEEDBACK_CODECS:
                self._watch.remove()         # the saved run had found its optimizer
                self._feedback_off()
            self.iter = int(state["iter"])
            self.routes.checked.clear()
            self._replay = None
            if layout and self._names is not None:
                if {k for u in layout for k in u} <= set(self._names.values()):
                    self._replay = layout
                else:
                    warnings.warn("the checkpoint's bucket layout names parameters the bound "
                                  "model does not have; not replaying it", stacklevel=3)
        self._call(apply)

    def _restore_momentum(self, factors: Mapping[str, Any], velocity: Any,
                          previous: Any) -> None:
        """On the worker: a checkpoint's momentum correction into this hook."""
        if self.routes.momentum is None and self._watch is not None:
            self._watch.remove()             # the saved run had found its optimizer
        self.routes.momentum = restored(self.routes.momentum, self._watch is not None,
                                        factors, velocity, previous)
        if self.routes.momentum is not None:
            self._clip_for(True)

    def __repr__(self) -> str:
        return (f"CommHookState(compressor={self.compressor!r}, algorithm={self.algorithm!r}, "
                f"transport={self.transport.name}, rank={self.transport.rank}/"
                f"{self.transport.size}, iter={self.iter})")


def comm_hook(state: CommHookState, bucket):  # type: ignore[no-untyped-def]
    """The DDP hook: queue ``bucket`` on ``state``'s worker; return its future.

    Errors are raised here, on the autograd thread, where DDP passes them on to
    ``backward()`` with their type (``except GradcommError`` catches them): a bad bucket at
    once, a failed reduction at the iteration's last bucket, which waits for the queued
    ones (DDP waits for them right after it anyway).

    (Unannotated on purpose: DDP rejects any annotation but the real types, and this
    module's annotations are strings.)
    """
    import torch

    fut: Any = torch.futures.Future()
    params = bucket.parameters()
    keys = state._keys(params)
    if state._watch is not None and state._watch.watching:
        state._watch.params.update(id(p) for p in params)
    lengths = [int(p.numel()) for p in params]
    shapes = state.residuals.shapes              # matrix views for PowerSGD
    for k, p in zip(keys, params):
        if k not in shapes:
            shapes[k] = tuple(p.shape)
    buf = bucket.buffer()
    if buf.layout != torch.strided or sum(lengths) != buf.numel():
        raise ConfigError(f"bucket {bucket.index()} holds a {buf.layout} buffer of "
                          f"{buf.numel()} elements for parameters of {sum(lengths)}: sparse "
                          "gradients are unsupported (use a dense nn.Embedding, or leave "
                          "sparse parameters out of the DDP model)")
    last, event = bucket.is_last(), None
    work = state._hook_library(buf)     # a device group's own allreduce starts here
    if buf.is_cuda and work is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buf.device))   # buf's device's stream
    task = functools.partial(state._bucket, buf, keys, lengths, last, fut, event, work)
    if not (last and state._worker.run_here(task)):     # nothing queued: nothing to overlap
        state._worker.submit(task)
    if last:
        state._check_iteration()
    return fut


__all__ = ["CommHookState", "UnboundModelWarning", "comm_hook"]
