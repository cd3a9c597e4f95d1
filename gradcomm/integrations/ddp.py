"""PyTorch DDP communication hook: any gradcomm compressor with any collective.

``make_comm_hook(...)`` returns ``(state, hook)`` for
``ddp_model.register_comm_hook(state, hook)``. For every gradient bucket DDP hands over:

1. The hook (on the autograd thread) only queues the bucket and returns a
   ``torch.futures.Future``; a single worker thread per state takes buckets in order, so
   every rank issues its collectives in the same order and the next buckets' backward
   compute overlaps this bucket's communication. Callbacks never ``.wait()``.
2. The gradients are multiplied by ``1/p`` before the reduction (exactly as DDP's built-in
   reducer does, so fp16 sums cannot overflow).
3. Without a compressor (or before ``start_iter``) the bucket is summed in its own dtype by
   the chosen dense algorithm; ``"auto"`` there means the library's own allreduce (what
   DDP runs, and what overlaps best on gloo), or gradcomm's choice for dtypes the
   library cannot reduce (16-bit floats under MPI). ``make_comm_hook(None)`` gives the
   gradients of DDP's built-in allreduce bit for bit (see "Parity" below).
4. With a compressor the bucket is reduced in float32 (float64 for float64 buckets): the
   error-feedback residual of every parameter is added to its slice, the compressed
   collective runs, and each parameter's residual keeps what its slice lost (on the
   bucket's device for CUDA buckets; see "GPU" below).
5. The future completes with the reduced bucket; DDP copies it into ``.grad``.

**Residuals are keyed by parameter name**, not by bucket: a bucket is cut into its
parameters (``bucket.parameters()`` and their sizes), so residuals survive DDP's bucket
rebuild after the first iteration and a change of ``bucket_cap_mb``. Names come from
``model=`` (or ``state.bind(model)``): ``named_parameters()`` of the module DDP wraps,
e.g. ``"0.weight"``. Unbound, the hook names parameters ``"param.<i>"`` in the order DDP
first hands them over (deterministic for a given model and ``bucket_cap_mb``) and warns
once: bind the model to make checkpoints robust to layout changes and resumes bitwise.
Collectives that re-compress at every hop (ring, tree, recursive doubling, Rabenseifner)
also keep one residual per hop of a *unit* (the parameters reduced together); when a
unit is not reduced again (bucket rebuild, another ``bucket_cap_mb``, another rank
count), its hop residuals are folded into the residuals of the parameters they cover. A
hop residual that several ranks hold identically (recursive doubling rounds a replicated
partial sum on every rank of a group; detected by comparing bytes across ranks) is owed
once, so each copy contributes ``1/copies``. No error mass is dropped.

**PowerSGD** (``make_comm_hook("powersgd", rank=r)``) compresses each parameter on its
own: the hook records every parameter's shape (``state.residuals.shapes``; a name mapped
to ``None`` there keeps the flat near-square layout), so a weight is viewed as
``(shape[0], rest)`` as PyTorch's hook does, and 1-D parameters go uncompressed. Its
warm-start ``Q`` is kept per parameter (``"<name>#q"``) and checkpointed. Its two
rounds are dense sums, so it runs on every dense algorithm, ``"native"`` included (the
process group's own allreduce; counted in ``stats["native_nbytes"]``); other lossy
codecs refuse ``"native"``.

**Checkpoints.** ``state.state_dict()`` is collective: call it on every rank (like a
barrier); every rank then holds every rank's residuals (``rank0_only=True``: only rank 0
does, the others get ``{}``), so a single ``torch.save`` on rank 0 is a complete
checkpoint that loads with ``torch.load(path)`` (tensors, ints and strings only).
``load_state_dict`` is local and accepts a checkpoint taken at any rank count ``p``.
At ``p' == p`` each rank takes its own residuals back unchanged. At ``p' != p`` every
old rank's hop residuals are folded into its per-parameter residuals, and new rank
``r'`` takes the sum of those of the old ranks ``r`` with ``r mod p' == r'``. Residuals
are in units of the reduced sum (gradients are divided by ``p`` before they are
added), so the total error mass ``sum_r e_r`` — what the ranks together still owe the
model — is preserved whatever ``p'`` is (up to one float rounding per added element;
DeepSpeed drops it). Codec state kept per parameter (PowerSGD's warm-start ``Q``,
``ranks[r]["extra"]``) is saved too; it is identical on every rank, so at ``p' != p``
every new rank takes old rank 0's copy. The state also stores the bucket layout of the
last iteration and replays it in the first iteration after a load (DDP starts a new
process with its initial layout and rebuilds only after one iteration), so a resumed run
reduces the same groups as the unbroken one and, on CPU, ends with bitwise the same
parameters.

**Parity.** Gloo sums in its own order; ``make_comm_hook(None)`` (``"auto"``) and
``algorithm="native"`` run gloo's allreduce on the same scaled bucket, hence are bitwise
equal to DDP's built-in path at any rank count (the scaling is DDP's too: a multiply
by ``1/p``, which differs from a division at p = 3). Any other algorithm at two ranks
computes ``fl(a + b)`` per element, which does not depend on the order either, so it is
bitwise equal too; at more ranks only the order of summation differs.

**Join** (``with ddp_model.join():``): a rank that ran out of data runs the hook on zero
buckets, so collectives still match; gradients are divided by the full ``p``.

**GPU.** The hook records a CUDA event on the autograd stream and the worker waits for
it before touching a CUDA bucket. A compressed CUDA bucket stays on its device
(``"auto"`` means the gather routes there; per-hop algorithms keep their hop residuals
there too): the float32 (float64) working copy divided by ``p``, the per-parameter
residuals and the codecs (the device kernels, byte-identical to the host's) live there,
only payload bytes cross to the host transport, and the result is written back into the
bucket on the device. Uncompressed buckets (except on NCCL, below) and PowerSGD are
staged through host memory (copied there, reduced, copied back before the future
completes). ``state_dict`` brings device residuals to the host; after a load they move
to the device at their next bucket. ``GRADCOMM_CODEC_PLACEMENT=array`` sends CPU buckets
down the device path too (how the tests cover it without a GPU; same bytes).

**NCCL.** With an NCCL process group (its point-to-point moves only device buffers),
``make_comm_hook`` creates a gloo group over the same ranks, in the same order, for the
hook's messages: call it on every rank of the group (it is collective, like DDP's
construction). A group smaller than the world is made with group-local synchronisation,
which torch names after the ranks and the number of groups each process knows: its
members must have created the same groups before. Uncompressed buckets with ``"auto"``
or ``"native"`` are summed in place by NCCL's own allreduce, as DDP does, started on the
autograd thread (where DDP issues its own collectives, so every rank issues them in one
order; the worker only waits for them, within the deadline). Other
transports that move only device buffers are refused: pass a gloo group
(``process_group=dist.new_group(backend="gloo")``) or ``transport="mpi"``.

Tuning: ``start_iter`` of a few hundred steps lets the model leave the first,
fast-changing phase uncompressed (PowerSGD does the same); on gloo every message costs
milliseconds, so prefer few, large buckets (``bucket_cap_mb``) and an algorithm with few
rounds; under ``mpirun`` pass ``transport="mpi"`` (microseconds per message).

Example:
    >>> import torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(4, 2))
    >>> state, hook = make_comm_hook("int8", bits=4, model=model)
    >>> model.register_comm_hook(state, hook)
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> state.iter, sorted(state.state_dict()["ranks"][0]["residuals"])
    (1, ['bias', 'weight'])
    >>> state.close(); dist.destroy_process_group()
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import msgpack
import numpy as np

from .. import arrays
from ..collectives import ALGORITHMS, DENSE, dense_allreduce
from ..comm import get_transport
from ..comm.base import Transport
from ..error_feedback import HOP_SEP, checked_extra, held_residual
from ..errors import ConfigError, GradcommError, PayloadError, UnsupportedError

#: ``state_dict()["format"]`` and its version
STATE_FORMAT, STATE_VERSION = "gradcomm.ddp_comm_hook", 1


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
                 transport: Any = None, start_iter: int = 0, model: Any = None,
                 seed: int = 0, timeout: float | None = None, **options: Any) -> None:
        from .. import compressors

        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ConfigError(f"start_iter must be an int >= 0, got {start_iter!r}")
        if compressor is None and options:
            raise ConfigError(f"unknown options {sorted(options)} (compressor options need "
                              "a compressor)")
        self.compressor = None if compressor is None else compressors.get(compressor, **options)
        lossy = self.compressor is not None and self.compressor.lossy
        known = _codec_algorithms(self.compressor) if lossy else ALGORITHMS
        if algorithm not in known:
            if algorithm == "native" and lossy:
                raise UnsupportedError(f"algorithm='native' cannot carry {self.compressor.name!r}"
                                       " payloads (only codecs whose rounds are dense sums "
                                       "can: powersgd); with this compressor use one of "
                                       f"{', '.join(known)}")
            raise ConfigError(f"unknown algorithm {algorithm!r}; known: {', '.join(known)}")
        self.algorithm, self.start_iter, self.seed = algorithm, start_iter, int(seed)
        self.error_feedback = bool(error_feedback)
        #: ``transport`` carries gradcomm's messages (host buffers); ``library``, for a
        #: device process group (NCCL), is that group, whose allreduce sums uncompressed
        #: device buckets in place
        self.transport: Transport
        self.library: Transport | None
        self.transport, self.library = _resolve_transport(transport, process_group, timeout)
        if "cpu" not in self.transport.devices:
            raise ConfigError(f"the {self.transport.name} transport moves only "
                              f"{'/'.join(sorted(self.transport.devices))} buffers, and the "
                              "hook's messages are host buffers: pass "
                              "process_group=dist.new_group(backend='gloo') or "
                              "transport='mpi'")
        self.residuals = _Residuals(self.error_feedback)
        self.iter = 0
        self.stats = {"buckets": 0, "bytes_sent": 0, "native_nbytes": 0, "comm_seconds": 0.0}
        self._names: dict[int, str] | None = None
        self._position: dict[int, str] = {}
        self._warned_unbound = False
        self._layout: list[list[str]] = []      # units of the last completed iteration
        self._current: list[list[str]] = []     # units of the iteration in progress
        self._replay: list[list[str]] | None = None
        self._pending: _Replay | None = None
        self._checked: set[tuple[int, str, bool]] = set()
        self._no_native: set[str] = set()       # dtypes the library cannot reduce
        self._failure: BaseException | None = None
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=_work, args=(self._queue,), daemon=True,
                                        name="gradcomm-ddp-hook")
        self._worker.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        if model is not None:
            self.bind(model)

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

    # -- the worker --------------------------------------------------------------------------
    def _submit(self, task: Callable[[], None]) -> None:
        if not self._worker.is_alive():
            raise GradcommError("the comm hook's worker thread was closed")
        self._queue.put(task)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread (after every queued bucket) and return its value."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def task() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:   # re-raised in the caller
                box["error"] = exc
            finally:
                done.set()

        self._submit(task)
        deadline = self.transport.timeout * 4
        if not done.wait(deadline):
            raise GradcommError(f"the comm hook's worker did not finish within {deadline:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def flush(self) -> None:
        """Wait until every queued bucket has been reduced."""
        self._call(lambda: None)

    def close(self) -> None:
        """Stop the worker thread (after the queued buckets). Idempotent."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join(self.transport.timeout)

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
                self._library_finish(buf, work)
                self.stats["buckets"] += 1
                self._current.append(keys)
                ready = [(fut, buf)]
            elif self._replay is not None or self._pending is not None:
                ready = self._replay_bucket(buf, keys, lengths, fut, last)
            else:
                self._reduce_unit(buf, keys, lengths)
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
            self._pending, self._replay = _Replay(self._replay), None
        pending = self._pending
        pending.add(buf, keys, lengths, fut)
        finished = []
        units = list(pending.ready())
        if last:
            units += pending.finish()
        for unit_keys, views in units:
            flat = torch.cat([v.reshape(-1) for v in views])
            self._reduce_unit(flat, unit_keys, [v.numel() for v in views])
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()])
                offset += v.numel()
            self._current.append(unit_keys)
            finished += pending.done(unit_keys)
        return finished

    def _reduce_unit(self, flat: Any, keys: list[str], lengths: list[int]) -> None:
        """Average 1-D tensor ``flat`` (parameters ``keys`` of ``lengths``) across ranks,
        where :meth:`_route` says."""
        t = self.transport
        began, sent = time.perf_counter(), t.stats.bytes_sent
        meta = arrays.meta_of(flat)
        compressed = self._compressing()
        sig = (flat.numel(), meta.dtype, compressed)
        check = sig not in self._checked    # agree on new shapes only: gloo messages cost ms
        route = self._route(meta, compressed)
        if route == "device":
            self._reduce_on_device(flat, meta.dtype, keys, lengths, check)
        elif route == "library":
            self._library_allreduce(flat, meta.dtype, check)
        else:
            self._reduce_on_host(flat, keys, lengths, compressed, check)
        self._checked.add(sig)
        self.stats["buckets"] += 1
        self.stats["bytes_sent"] += t.stats.bytes_sent - sent
        self.stats["comm_seconds"] += time.perf_counter() - began

    def _compressing(self) -> bool:
        """Whether this iteration's buckets are compressed (a lossy codec, past
        ``start_iter``)."""
        return (self.compressor is not None and self.compressor.lossy
                and self.iter >= self.start_iter)

    def _route(self, meta: arrays.Meta, compressed: bool) -> str:
        """Where a bucket described by ``meta`` is reduced: ``"device"`` (compressed,
        with codecs that run where the bucket is: CUDA buckets, or every
        tensor under ``GRADCOMM_CODEC_PLACEMENT=array``), ``"library"`` (uncompressed
        ``auto``/``native`` device buckets of a device process group: its own allreduce,
        in place) or ``"host"`` (staged through host memory: the rest)."""
        if compressed:
            assert self.compressor is not None
            gather = self.algorithm in _DEVICE_ALGORITHMS and \
                self.compressor.name not in _STAGED_CODECS
            return "device" if gather and arrays.codec_placement(meta) == "device" else "host"
        lib = self.library
        if lib is not None and meta.device != "cpu" and self.algorithm in ("auto", "native") \
                and lib.native_supports(meta.dtype, "sum"):
            return "library"
        return "host"

    def _reduce_on_device(self, flat: Any, dtype: str, keys: list[str], lengths: list[int],
                          check: bool) -> None:
        """The compressed path where the bucket lives: a float32/float64 working copy
        divided by p, residuals on the same device, payload bytes alone crossing to the
        host; the result goes back into ``flat`` there."""
        work = flat.double() if dtype == "float64" else flat.float()   # flat itself if so
        work.mul_(1.0 / self.transport.size)
        result = self._compressed(work, keys, lengths, check)
        if result is not work:
            arrays.assign(work, result)
        if work is not flat:
            flat.copy_(work)
        arrays.sync(flat)                   # done before the future hands it to DDP

    def _library_allreduce(self, flat: Any, dtype: str, check: bool) -> None:
        """DDP's own path on a device process group: scale by 1/p and sum ``flat`` in
        place with the group's allreduce (arguments agreed over the host transport)."""
        if check:
            self._agree_library(flat, dtype)
        self._library_finish(flat, self._library_start(flat, dtype))

    def _agree_library(self, flat: Any, dtype: str) -> None:
        """The host path's check fields: a rank staging instead is told, not hung."""
        from ..collectives import agree

        agree(self.transport, "allreduce", count=int(flat.numel()), dtype=dtype, op="sum",
              algorithm="native (device group)")

    def _library_start(self, flat: Any, dtype: str) -> Any:
        lib = self.library
        assert lib is not None
        flat.mul_(1.0 / lib.size)
        return lib.native_allreduce_start(flat, "sum", dtype)   # type: ignore[attr-defined]

    def _library_finish(self, flat: Any, work: Any) -> None:
        assert self.library is not None
        self.library.native_allreduce_wait(work)               # type: ignore[attr-defined]
        arrays.sync(flat)                   # done before the future hands it to DDP
        self.stats["native_nbytes"] += flat.numel() * flat.element_size()

    def _hook_library(self, buf: Any) -> Any:
        """On the autograd thread: start the device group's allreduce of bucket ``buf`` if
        it takes the library route (else None; the worker reduces it). Issued here, the
        device collectives keep the order DDP issues its own in (the unused-parameter map
        with ``find_unused_parameters``, ...) on every rank; issued from the worker they
        could interleave differently on different ranks and hang NCCL. A new shape is
        first agreed on the worker (after the buckets queued before it)."""
        if self.library is None or self._replay is not None or self._pending is not None:
            return None                     # a replayed layout: the worker groups units
        meta = arrays.meta_of(buf)
        compressed = self._compressing()
        if self._route(meta, compressed) != "library":
            return None
        sig = (buf.numel(), meta.dtype, False)
        if sig not in self._checked:
            def agree() -> None:
                self._agree_library(buf, meta.dtype)
                self._checked.add(sig)
            self._call(agree)
        return self._library_start(buf, meta.dtype)

    def _reduce_on_host(self, flat: Any, keys: list[str], lengths: list[int],
                        compressed: bool, check: bool) -> None:
        """Staged through host memory (in place for CPU buckets)."""
        t = self.transport
        host = flat if flat.device.type == "cpu" else flat.cpu()
        meta = arrays.meta_of(host)
        if not compressed:
            host.mul_(1.0 / t.size)
            view = arrays.host_view(host)
            algorithm = self._dense_algorithm(meta.dtype)
            try:
                dense_allreduce(t, view, "sum", meta.dtype, algorithm, check=check)
            except UnsupportedError:          # raised by every rank alike, before any data
                if self.algorithm != "auto" or algorithm != "native":
                    raise
                self._no_native.add(meta.dtype)
                algorithm = "auto"
                dense_allreduce(t, view, "sum", meta.dtype, algorithm, check=check)
            if algorithm == "native":
                self.stats["native_nbytes"] += host.numel() * host.element_size()
        else:
            work = host.double() if meta.dtype == "float64" else host.float()
            work.mul_(1.0 / t.size)
            view = arrays.host_view(work)
            result = self._compressed(view, keys, lengths, check)
            host.copy_(arrays.from_flat(result, arrays.meta_of(work)))
        if host is not flat:
            flat.copy_(host)

    def _dense_algorithm(self, dtype: str) -> str:
        """The uncompressed path's algorithm: with "auto", the library's own allreduce
        (what DDP runs; it overlaps best) unless it cannot reduce ``dtype``."""
        if self.algorithm == "auto":
            return "auto" if dtype in self._no_native else "native"
        return self.algorithm if self.algorithm in DENSE else "auto"

    def _compressed(self, x: Any, keys: list[str], lengths: list[int], check: bool) -> Any:
        """Compressed allreduce (sum) of flat ``x`` (host numpy, or a tensor reduced where
        it lives) with the residuals of ``keys``."""
        from ..collectives.compressed import compressed_allreduce

        unit = self.residuals.open(keys, lengths, x, self.iter)
        if self.algorithm == "native":                  # PowerSGD's rounds, on the library
            self.stats["native_nbytes"] += self._native_nbytes(x, unit)
        return compressed_allreduce(self.transport, x, arrays.meta_of(x).dtype, op="sum",
                                    algorithm=self.algorithm, compressor=self.compressor,
                                    check=check, seed=self.seed, residuals=unit,
                                    key=unit.key)

    def _native_nbytes(self, x: np.ndarray, unit: _UnitResiduals) -> int:
        """Bytes PowerSGD will hand to the library's allreduce for ``x`` (both rounds)."""
        from ..collectives.powersgd import parts_of, wire_values

        c = self.compressor
        if self.transport.size == 1 or not x.size:
            return 0
        if self.iter < c.start_iter:
            return x.nbytes
        return sum(wire_values(parts_of(x.size, unit.key, c, unit))) * x.itemsize

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """Config, counters, layout and EVERY rank's residuals. Collective: call on all ranks.

        Values are tensors, ints, floats, strings, lists and dicts, so ``torch.save`` /
        ``torch.load`` (``weights_only=True``) round-trip it. With ``rank0_only`` the
        residuals are gathered to rank 0 only; other ranks return ``{}``.
        """
        return self._call(lambda: self._state_dict(rank0_only))

    def _state_dict(self, rank0_only: bool) -> dict[str, Any]:
        from ..collectives import agree
        from ..collectives.allgather import allgatherv

        t = self.transport
        agree(t, "ddp_state_dict", rank0_only=rank0_only)
        block = _pack_local(*self.residuals.local_state())
        if t.size == 1:
            blocks = [block]
        elif rank0_only:
            blocks = _gather_to_root(t, block)
        else:
            blocks = allgatherv(t, block)
        if rank0_only and t.rank != 0:
            return {}
        import torch

        ranks = []
        for r, b in enumerate(blocks):
            groups, meta = _unpack_local(b, r)
            ranks.append({**{g: {k: torch.from_numpy(v) for k, v in arrays.items()}
                             for g, arrays in groups.items()},
                          "units": meta["units"], "offsets": meta["offsets"]})
        c = self.compressor
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION,
            "config": {"compressor": None if c is None else c.name,
                       "compressor_options": {} if c is None else dict(c.get_config()),
                       "algorithm": self.algorithm, "error_feedback": self.error_feedback,
                       "start_iter": self.start_iter, "seed": self.seed},
            "iter": self.iter, "world_size": t.size,
            "layout": [list(u) for u in self._layout],
            "ranks": ranks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters, layout and this rank's share of the residuals (any rank count).

        New rank ``r'`` of ``p'`` receives ``sum(e_r for r in range(p) if r % p' == r')``,
        summed in rank order (hop residuals folded first), which keeps the total error
        mass up to float rounding.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ConfigError("not a gradcomm DDP comm-hook state dict (format "
                              f"{state.get('format') if isinstance(state, Mapping) else None!r}); "
                              "state_dict(rank0_only=True) returns {} on ranks other than 0")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"DDP comm-hook state version {state.get('version')!r}, this "
                              f"gradcomm reads {STATE_VERSION}")
        ranks = state["ranks"]
        if not isinstance(ranks, list) or len(ranks) != state["world_size"]:
            raise ConfigError(f"state holds {len(ranks)} ranks' residuals for world size "
                              f"{state['world_size']}: it was saved incompletely")
        p_old, p_new, me = len(ranks), self.transport.size, self.transport.rank
        saved = [_Residuals.from_entry(entry, r) for r, entry in enumerate(ranks)]
        if p_old == p_new:
            restored = saved[me]
        else:                              # hops differ at another p: fold them first
            restored = _Residuals.redistribute(saved, p_new, me)
        layout = [list(map(str, u)) for u in state.get("layout", [])]

        def apply() -> None:
            self.residuals.restore(restored)
            self.iter = int(state["iter"])
            self._checked.clear()
            self._replay = None
            if layout and self._names is not None:
                if {k for u in layout for k in u} <= set(self._names.values()):
                    self._replay = layout
                else:
                    warnings.warn("the checkpoint's bucket layout names parameters the bound "
                                  "model does not have; not replaying it", stacklevel=3)
        self._call(apply)

    def __repr__(self) -> str:
        return (f"CommHookState(compressor={self.compressor!r}, algorithm={self.algorithm!r}, "
                f"transport={self.transport.name}, rank={self.transport.rank}/"
                f"{self.transport.size}, iter={self.iter})")


def make_comm_hook(compressor: Any = None, *, algorithm: str = "auto",
                   error_feedback: bool = True, process_group: Any = None,
                   transport: Any = None, start_iter: int = 0, model: Any = None,
                   **options: Any) -> tuple[CommHookState, Callable[..., Any]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        compressor: None (plain averaging), a codec name with its options in
            ``**options`` (e.g. ``ratio=0.01``), or a Compressor.
        algorithm: any gradcomm allreduce algorithm the compressor composes with.
        error_feedback: keep per-parameter residuals of the compression error.
        process_group: DDP's process group (default: the default group). For an NCCL
            group a gloo group over its ranks is created here for the hook's messages
            (collective: every rank of the group calls ``make_comm_hook``).
        transport: None (point-to-point over ``process_group``), ``"mpi"``
            (``MPI.COMM_WORLD``, for jobs started with mpirun), an mpi4py communicator or a
            gradcomm Transport.
        start_iter: backward passes to run uncompressed first.
        model: the DDP model (or its module), to name residuals after its parameters.
        options: codec options, plus ``seed`` (stochastic codecs) and ``timeout``
            (seconds per blocking wait).

    See the module docstring for the steps, checkpoints and parity.
    """
    state = CommHookState(compressor, algorithm=algorithm, error_feedback=error_feedback,
                          process_group=process_group, transport=transport,
                          start_iter=start_iter, model=model, **options)
    return state, comm_hook


def comm_hook(state: CommHookState, bucket):  # type: ignore[no-untyped-def]
    """The DDP hook: queue ``bucket`` on ``state``'s worker; return its future.

    (Unannotated on purpose: DDP rejects any annotation but the real types, and this
    module's annotations are strings.)
    """
    import torch

    fut: Any = torch.futures.Future()
    try:
        params = bucket.parameters()
        keys = state._keys(params)
        lengths = [int(p.numel()) for p in params]
        shapes = state.residuals.shapes              # matrix views for PowerSGD
        for k, p in zip(keys, params):
            if k not in shapes:
                shapes[k] = tuple(p.shape)
        buf = bucket.buffer()
        if sum(lengths) != buf.numel():
            raise ConfigError(f"bucket {bucket.index()} holds {buf.numel()} elements but its "
                              f"parameters {sum(lengths)} (sparse gradients are unsupported)")
        last, event = bucket.is_last(), None
        work = state._hook_library(buf)     # a device group's own allreduce starts here
        if buf.is_cuda and work is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buf.device))   # buf's device's stream
        state._submit(lambda: state._bucket(buf, keys, lengths, last, fut, event, work))
    except BaseException as exc:
        fut.set_exception(exc)
    return fut


# -- residuals ----------------------------------------------------------------------------
class _Residuals:
    """Residuals by parameter name, the per-hop residuals of the units reduced, codec state.

    The hook reduces *units* (the parameters reduced together). :meth:`open` adds each
    parameter's residual to its slice of the unit's flat buffer and returns the unit's
    :class:`_UnitResiduals`, the :class:`~gradcomm.error_feedback.ResidualStore` handed to
    ``compressed_allreduce``: its ``update`` cuts ``x - decoded`` back into per-parameter
    residuals, and collectives that re-compress per hop keep ``"<unit>#<hop>"`` residuals
    here with the offset where each lies in its unit, so that when the unit disappears
    (bucket rebuild, another rank count) its hop residuals are folded into the
    parameters' residuals, losing nothing. Stateful codecs keep per-parameter *extra*
    state here too (PowerSGD's warm-start ``"<name>#q"``, the same bytes on every rank),
    checkpointed with the residuals. ``shapes`` maps parameter names to their shapes (the
    hook records them), so that PowerSGD views each parameter as PyTorch's hook does.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self._residuals: dict[str, Any] = {}
        self._extras: dict[str, np.ndarray] = {}
        self.units: dict[str, tuple[list[str], list[int]]] = {}
        self.offsets: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...] | None] = {}
        self._used: set[str] = set()

    def residual(self, name: str, n: int, dtype: Any, like: Any = None) -> Any:
        """The residual ``name`` (a parameter, or a hop of a unit) as a flat array of ``n``
        elements of ``dtype`` where ``like`` lives, as
        :meth:`~gradcomm.error_feedback.ErrorFeedback.residual` keeps it."""
        return held_residual(self._residuals, name, n, dtype, like)

    def names(self) -> Iterator[str]:
        """Names of the stored residuals (parameters and ``unit#hop`` entries)."""
        return iter(sorted(self._residuals))

    def extra(self, name: str) -> np.ndarray | None:
        """The codec state stored under ``name``, or None."""
        return self._extras.get(name)

    def set_extra(self, name: str, value: np.ndarray) -> None:
        """Store flat numeric codec state ``value`` (not copied) under ``name``."""
        self._extras[name] = checked_extra(name, value)

    def extra_names(self) -> Iterator[str]:
        """Names of the stored codec state arrays."""
        return iter(sorted(self._extras))

    def open(self, keys: list[str], lengths: list[int], x: Any, step: int) -> _UnitResiduals:
        """Add each parameter's residual to its slice of flat ``x`` (any array kind; a
        residual held elsewhere, e.g. loaded on the host, moves to ``x``'s device); the
        unit's residual store for this reduction, at the hook's iteration ``step``."""
        import hashlib

        unit = "unit:" + hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]
        self.units[unit] = (list(keys), list(lengths))
        self._used.add(unit)
        segments = []
        a, dtype = 0, arrays.dtype_name(x)
        for name, n in zip(keys, lengths):
            segments.append((name, a, a + n))
            e = self._residuals.get(name) if self.enabled else None
            if e is not None:
                if tuple(e.shape) == (n,) and arrays.dtype_name(e) == dtype:
                    e = self.residual(name, n, dtype, like=x)    # where x is
                    x[a:a + n] += e
                    arrays.assign(e, 0.0)
                else:
                    self.residual(name, n, dtype, like=x)       # warns and resets
            a += n
        return _UnitResiduals(self, unit, segments, step)

    def fold_unused(self, t: Transport | None = None) -> None:
        """Fold the hop residuals of units not reduced since the last call.

        Collective over ``t`` when there is something to fold (every rank has the same
        units): a hop residual that several ranks hold identically (recursive doubling
        rounds a replicated partial sum on every rank of a group) is owed once, not once
        per copy, so the ranks first count the copies of each (name, offset, bytes).
        """
        stale = [u for u in self.units if u not in self._used]
        self._used = set()
        if not stale:
            return
        mine = self.digests(stale)
        if t is not None and t.size > 1:
            from ..collectives.allgather import allgatherv

            blocks = allgatherv(t, np.frombuffer(msgpack.packb(mine), np.uint8))
            every = [msgpack.unpackb(b.tobytes(), raw=False) for b in blocks]
        else:
            every = [mine]
        copies = _count_copies(every)[0 if t is None else t.rank]
        for unit in stale:
            self.fold(unit, copies)

    def digests(self, units: Sequence[str]) -> dict[str, list[int]]:
        """``{hop name: [offset, size, crc32]}`` of the hop residuals of ``units``."""
        import zlib

        out = {}
        for unit in units:
            prefix = unit + HOP_SEP
            for hop, e in self._residuals.items():
                if hop.startswith(prefix):
                    out[hop] = [self.offsets.get(hop, -1), arrays.size(e),
                                zlib.crc32(arrays.host(e).tobytes())]
        return out

    def fold(self, unit: str, copies: Mapping[str, int] | None = None) -> None:
        """Move unit ``unit``'s hop residuals, each divided by its number of ``copies``
        across the ranks, into its parameters' residuals (which move to the hop
        residual's device if they are elsewhere)."""
        names, lengths = self.units.pop(unit)
        starts = [0, *itertools.accumulate(int(n) for n in lengths)]
        prefix = unit + HOP_SEP
        for hop in [h for h in self._residuals if h.startswith(prefix)]:
            e = self._residuals.pop(hop)
            off = self.offsets.pop(hop, None)
            if off is None:
                if np.any(arrays.host(e)):
                    warnings.warn(f"hop residual {hop!r} has no recorded offset; its error "
                                  "mass is dropped", stacklevel=2)
                continue
            c = (copies or {}).get(hop, 1)
            if c > 1:
                arrays.divide_(e, c)                 # popped: no one else holds it
            size, dtype = arrays.size(e), arrays.dtype_name(e)
            for i, name in enumerate(names):
                lo, hi = max(off, starts[i]), min(off + size, starts[i + 1])
                if lo < hi:
                    dst = self.residual(name, int(lengths[i]), dtype, like=e)
                    dst[lo - starts[i]:hi - starts[i]] += e[lo - off:hi - off]

    def local_state(self) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
        """``({"residuals": ..., "extra": ...}, {"units": ..., "offsets": ...})``, the
        arrays on the host (device residuals are copied there)."""
        units = {u: {"names": n, "lengths": ls} for u, (n, ls) in self.units.items()}
        residuals = {k: arrays.host(v) for k, v in self._residuals.items()}
        return ({"residuals": residuals, "extra": dict(self._extras)},
                {"units": units, "offsets": dict(self.offsets)})

    def restore(self, other: _Residuals) -> None:
        """Take ``other``'s residuals, extra state, units and offsets (not its shapes)."""
        self._residuals, self.units, self.offsets = other._residuals, other.units, other.offsets
        self._extras = other._extras
        self._used = set(self.units)     # the replayed first iteration uses them again

    def copy(self) -> _Residuals:
        """An independent copy (arrays, extra state, units, offsets, shapes)."""
        out = type(self)(self.enabled)
        out._residuals = {k: arrays.clone(v) for k, v in self._residuals.items()}
        out._extras = {k: v.copy() for k, v in self._extras.items()}
        out.units = {k: (list(n), list(ls)) for k, (n, ls) in self.units.items()}
        out.offsets = dict(self.offsets)
        out.shapes = dict(self.shapes)
        return out

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], rank: int) -> _Residuals:
        """One saved rank's residuals (``state_dict()["ranks"][rank]``)."""
        r = cls(True)
        try:
            for k, v in entry["residuals"].items():
                arr = np.array(_numpy(v), copy=True)
                if arr.dtype.kind != "f":
                    raise ConfigError(f"residual {k!r} of rank {rank} is not floating")
                r._residuals[str(k)] = arr
            for k, v in entry.get("extra", {}).items():      # absent in older checkpoints
                arr = np.array(_numpy(v), copy=True)
                if arr.dtype.kind not in "fiu":
                    raise ConfigError(f"extra state {k!r} of rank {rank} is not numeric")
                r._extras[str(k)] = arr
            for u, d in entry["units"].items():
                r.units[str(u)] = ([str(n) for n in d["names"]], [int(n) for n in d["lengths"]])
            r.offsets = {str(k): int(v) for k, v in entry["offsets"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed residuals of rank {rank} in the state: {exc}") from None
        return r

    @classmethod
    def redistribute(cls, saved: list[_Residuals], p_new: int, rank: int) -> _Residuals:
        """This rank's residuals at ``p_new`` ranks from every saved rank's residuals.

        Hop residuals are folded into per-parameter residuals (divided by their number of
        identical copies among the saved ranks), then new rank ``rank`` sums the residuals
        of the saved ranks ``r`` with ``r % p_new == rank``, in rank order. Extra state
        (PowerSGD's warm-start ``Q``) is the same on every saved rank: every new rank
        takes saved rank 0's copy, so the new ranks agree too.
        """
        copies = _count_copies([part.digests(list(part.units)) for part in saved])
        out = cls(True)
        if saved:
            out._extras = {k: v.copy() for k, v in saved[0]._extras.items()}
        for r, original in enumerate(saved):
            if r % p_new != rank:
                continue
            part = original.copy()
            for unit in list(part.units):
                part.fold(unit, copies[r])
            for name, e in part._residuals.items():
                if HOP_SEP in name:
                    continue                 # a hop of an unknown unit: nothing to map
                mine = out._residuals.get(name)
                if mine is None:
                    out._residuals[name] = arrays.clone(e)
                elif tuple(mine.shape) == tuple(e.shape):
                    mine += e
                else:
                    raise ConfigError(f"residual {name!r} has {arrays.size(e)} elements on "
                                      f"one saved rank and {arrays.size(mine)} on another")
        return out


class _UnitResiduals:
    """One unit's reduction as a :class:`~gradcomm.error_feedback.ResidualStore`.

    ``key`` names the unit. Its residual is kept in pieces, one per parameter: the hook
    added them to the buffer when it opened the unit (:meth:`_Residuals.open`), so
    :meth:`compensate` has nothing left to add, and :meth:`update` cuts ``x - decoded``
    back into the parameters' residuals. Hop residuals are kept with their offset in the
    unit. The step is the hook's iteration, identical on every rank; the hook advances it.
    """

    def __init__(self, store: _Residuals, key: str, segments: list[tuple[str, int, int]],
                 step: int) -> None:
        self.store, self.key, self.segments, self._step = store, key, segments, int(step)

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    def step(self, key: str) -> int:
        return self._step

    def advance(self, key: str) -> None:
        """Nothing to count: the step is the hook's iteration."""

    def flat_residual(self, key: str, n: int, dtype: Any, like: Any = None) -> None:
        """None: the unit's residual is kept per parameter."""
        return None

    def compensate(self, key: str, x: Any) -> Any:
        """``x`` as it is: the parameters' residuals were added when the unit was opened."""
        return x

    def update(self, key: str, x: Any, decoded: Any) -> None:
        if self.store.enabled:
            dtype = arrays.dtype_name(x)
            for name, a, b in self.segments:
                arrays.subtract(x[a:b], decoded[a:b],
                                self.store.residual(name, b - a, dtype, like=x))

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        """The hop's residual; ``offset`` is recorded, to fold it into the parameters."""
        self.store.offsets[name] = int(offset)
        return self.store.residual(name, n, dtype, like=like)

    def extra(self, name: str) -> np.ndarray | None:
        return self.store.extra(name)

    def set_extra(self, name: str, value: np.ndarray) -> None:
        self.store.set_extra(name, value)

    def parts(self, key: str) -> list[tuple[str, int, Any]] | None:
        """The unit's parameters: names, sizes and the shapes the hook recorded."""
        entry = self.store.units.get(key)
        if entry is None:
            return None
        return [(name, int(n), self.store.shapes.get(name)) for name, n in zip(*entry)]


def _count_copies(every: list[Mapping[str, list[int]]]) -> list[dict[str, int]]:
    """For each rank's digests, how many ranks hold each of its hop residuals identically."""
    from collections import Counter

    seen = Counter((name, *map(int, d)) for digests in every for name, d in digests.items())
    return [{name: seen[(name, *map(int, d))] for name, d in digests.items()}
            for digests in every]


# -- helpers ------------------------------------------------------------------------------
class _Replay:
    """Regroups the buckets of one iteration into a saved layout of parameter units.

    Units are reduced in the saved order as soon as all their parameters have arrived.
    At the last bucket the rest goes in a fixed order, so that every rank does the same
    even if the layout does not fit the model exactly: unfinished saved units (without
    the parameters that never came), then parameters outside the layout, per bucket.
    """

    def __init__(self, layout: list[list[str]]) -> None:
        self.units = layout
        self.next = 0
        self.views: dict[str, Any] = {}
        self.order: list[list[str]] = []                     # keys of each bucket
        self.buckets: list[tuple[Any, Any, set[str]]] = []   # (fut, buf, keys left)

    def add(self, buf: Any, keys: list[str], lengths: list[int], fut: Any) -> None:
        offset = 0
        for k, n in zip(keys, lengths):
            self.views[k] = buf[offset:offset + n]
            offset += n
        self.order.append(list(keys))
        self.buckets.append((fut, buf, set(keys)))

    def ready(self) -> Any:
        while self.next < len(self.units) and all(k in self.views for k in
                                                  self.units[self.next]):
            unit = self.units[self.next]
            self.next += 1
            yield unit, [self.views[k] for k in unit]

    def finish(self) -> list[tuple[list[str], list[Any]]]:
        """Everything not yet reduced, once the last bucket has arrived."""
        rest = [[k for k in u if k in self.views] for u in self.units[self.next:]]
        self.next = len(self.units)
        saved = {k for u in self.units for k in u}
        rest += [[k for k in keys if k not in saved] for keys in self.order]
        return [(u, [self.views[k] for k in u]) for u in rest if u]

    def done(self, keys: list[str]) -> list[tuple[Any, Any]]:
        """Mark ``keys`` reduced; the (future, buffer) of buckets now complete."""
        complete = []
        for entry in self.buckets:
            fut, buf, left = entry
            if left:
                left.difference_update(keys)
                if not left:
                    complete.append((fut, buf))
        return complete

    def left(self) -> list[str]:
        return [k for u in self.units[self.next:] for k in u] + \
            [k for _, _, left in self.buckets for k in left]

    def fail(self, exc: BaseException) -> None:
        for fut, _, _ in self.buckets:
            if not fut.done():
                fut.set_exception(exc)


#: compressed algorithms the hook runs where the bucket lives (gather routes; "auto" means
#: them for device buckets); codecs always staged through the host
_DEVICE_ALGORITHMS = ("auto", "allgather", "sparse_allgather", "ring", "tree",
                      "recursive_doubling", "rabenseifner")
_STAGED_CODECS = ("powersgd",)


def _codec_algorithms(codec: Any) -> tuple[str, ...]:
    """The algorithms a lossy codec composes with: PowerSGD's two rounds are dense sums,
    so any dense algorithm (``native`` too); every other codec, the compressed ones."""
    if codec.name == "powersgd":                   # routed as compressed_allreduce does
        from ..collectives.powersgd import ALGORITHMS as POWERSGD_ALGORITHMS

        return POWERSGD_ALGORITHMS
    from ..collectives.compressed import COMPRESSED_ALGORITHMS

    return COMPRESSED_ALGORITHMS


def _work(q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        task = q.get()
        if task is None:
            return
        task()


def _resolve_transport(transport: Any, process_group: Any, timeout: float | None
                       ) -> tuple[Transport, Transport | None]:
    """(the transport of gradcomm's messages, the device process group or None)."""
    if isinstance(transport, str):
        if transport == "mpi":
            from mpi4py import MPI

            return get_transport(MPI.COMM_WORLD, timeout=timeout), None
        if transport != "torch":
            raise ConfigError(f"transport must be None, 'torch', 'mpi', an mpi4py "
                              f"communicator or a Transport; got {transport!r}")
        transport = None
    if transport is not None:
        return get_transport(transport, timeout=timeout), None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("make_comm_hook needs torch.distributed initialised (DDP does) "
                          "or transport=")
    group = process_group if process_group is not None else dist.group.WORLD
    backend = _payload_backend(str(dist.get_backend(group)))
    if backend is None:
        return get_transport(group, timeout=timeout), None
    return (get_transport(_host_group(group, backend), timeout=timeout),
            get_transport(group, timeout=timeout))


#: process-group backends whose point-to-point moves device buffers only
_DEVICE_BACKENDS = frozenset({"nccl"})


def _payload_backend(backend: str) -> str | None:
    """The backend of the group the hook sends its (host) messages over, for a DDP
    process group of ``backend``: None to use that group itself, else a group of that
    backend over the same ranks (``"gloo"`` for NCCL, which moves device buffers only).

    Example:
        >>> _payload_backend("gloo"), _payload_backend("nccl"), _payload_backend("mpi")
        (None, 'gloo', None)
    """
    return "gloo" if backend in _DEVICE_BACKENDS else None


def _host_group(group: Any, backend: str = "gloo") -> Any:
    """A new ``backend`` process group over the ranks of ``group``, in the same rank
    order. Collective: a group of every rank is made by all processes (in the same order
    as their other group creations, torch's rule); a smaller one with group-local
    synchronisation by its members alone, which torch names after the ranks and the
    number of groups the process knows, so its members must have made the same groups
    before."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    extra: dict[str, Any] = {} if ranks == sorted(ranks) else {"sort_ranks": False}
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, backend=backend, **extra)
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True, **extra)


def _numpy(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v.reshape(-1)
    return v.detach().cpu().numpy().reshape(-1)


# A rank's residuals travel as: uint64 header length, msgpack header {"arrays": [[group,
# name, dtype, count], ...], "meta": {...}}, then the raw arrays in header order. No pickle.
_MAX_STATE_HEADER = 1 << 26
#: array groups of a rank's state and the dtype kinds each may hold
_GROUPS = {"residuals": "f", "extra": "fiu"}


def _pack_local(groups: Mapping[str, Mapping[str, np.ndarray]],
                meta: Mapping[str, Any]) -> np.ndarray:
    items = [(g, k, v) for g, arrays in groups.items() for k, v in arrays.items()]
    table = [[g, k, v.dtype.str, int(v.size)] for g, k, v in items]
    hb = msgpack.packb({"arrays": table, "meta": dict(meta)}, use_bin_type=True)
    return np.concatenate([np.array([len(hb)], np.uint64).view(np.uint8),
                           np.frombuffer(hb, np.uint8),
                           *[np.ascontiguousarray(v).reshape(-1).view(np.uint8)
                             for _, _, v in items]])


def _unpack_local(block: np.ndarray, rank: int
                  ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    bad = f"rank {rank}'s comm-hook state is corrupt"
    if raw.size < 8:
        raise PayloadError(f"{bad}: {raw.size} bytes")
    n = int(raw[:8].view(np.uint64)[0])
    if n > min(_MAX_STATE_HEADER, raw.size - 8):
        raise PayloadError(f"{bad}: header of {n} bytes")
    try:
        head = msgpack.unpackb(raw[8:8 + n].tobytes(), raw=False)
        table, meta = head["arrays"], head["meta"]
    except Exception as exc:
        raise PayloadError(f"{bad}: {exc}") from None
    pos = 8 + n
    groups: dict[str, dict[str, np.ndarray]] = {g: {} for g in _GROUPS}
    for entry in table:
        try:
            group, name = str(entry[0]), str(entry[1])
            dt, count = np.dtype(entry[2]), int(entry[3])
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise PayloadError(f"{bad}: entry {entry!r}: {exc}") from None
        size = count * dt.itemsize
        if group not in _GROUPS or dt.kind not in _GROUPS[group] or count < 0 or \
                pos + size > raw.size:
            raise PayloadError(f"{bad}: entry {group}/{name} ({dt}, {count})")
        groups[group][name] = raw[pos:pos + size].copy().view(dt)
        pos += size
    if pos != raw.size:
        raise PayloadError(f"{bad}: {raw.size - pos} trailing bytes")
    return groups, meta


def _gather_to_root(t: Transport, block: np.ndarray) -> list[np.ndarray]:
    from ..comm.base import TAG_DATA, TAG_SIZES

    if t.rank != 0:
        t.send(np.array([block.size], np.int64), 0, TAG_SIZES)
        t.send(block, 0, TAG_DATA)
        return []
    blocks = [block]
    for r in range(1, t.size):
        size = np.empty(1, np.int64)
        t.recv(size, r, TAG_SIZES)
        if not 0 <= size[0] <= 1 << 40:
            raise PayloadError(f"rank {r} announced a state of {size[0]} bytes")
        b = np.empty(int(size[0]), np.uint8)
        t.recv(b, r, TAG_DATA)
        blocks.append(b)
    return blocks


__all__ = ["CommHookState", "STATE_FORMAT", "STATE_VERSION", "UnboundModelWarning",
           "comm_hook", "make_comm_hook"]
