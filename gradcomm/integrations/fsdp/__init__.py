"""PyTorch FSDP2 (``fully_shard``): a compressed reduce-scatter with error feedback.

``compress_fsdp(model, "int8", error_feedback=True)`` installs a
:class:`~.comm.CompressedReduceScatter` on every FSDPModule in ``model``
(``set_custom_reduce_scatter``) and returns the :class:`~.state.FSDPState` that holds
their residuals:

1. FSDP2 copies a module's gradients into one flat padded buffer (each parameter padded
   to a multiple of p rows) in the reduce dtype and calls the reduce-scatter with op
   AVG, SUM or PREMUL_SUM (gradient divide factor).
2. The reduce-scatter adds the module's error-feedback residual, over the *whole* local
   gradient, to every segment it sends, compresses each once, exchanges them
   (``algorithm="auto"``: the all-to-all, the qgZ shape), and sums its own
   shard in rank order (:mod:`gradcomm.compressed.reduce_scatter`); 16-bit reduce dtypes
   run the codec in float32. Residuals are kept where the gradient lives.
3. FSDP2 divides (if it does), casts back to the parameter dtype and accumulates the
   shard into ``.grad`` as usual.

``compress_fsdp(model, None)`` runs torch's own reduce-scatter: parameters bitwise equal
to FSDP2's. Stochastic codecs draw from ``(seed, step, crc32(module key), rank, ...)``, so
a rerun is bitwise the same. Works with ``MixedPrecisionPolicy(reduce_dtype=...)``,
``set_gradient_divide_factor``, nested ``fully_shard``, uneven shards,
``reshard_after_forward`` either way and ``set_requires_gradient_sync(False)`` (FSDP2
then skips the reduce-scatter and accumulates unsharded gradients until the sync step).

**HSDP**: build 1-D FSDP on the shard dimension and let gradcomm average the shards over
the replicate dimension with a compressed allreduce: ``fully_shard(m,
mesh=mesh["shard"])``, then ``compress_fsdp(m, "int8", replicate_group=mesh["replicate"]
.get_group())`` (``set_all_reduce_hook``; residual per module, ``replicate_algorithm``
default ``"allgather"``). A module on a 2-D mesh (FSDP2's own HSDP, whose replicate
all-reduce cannot be replaced) is refused with this advice. Checkpoints: :mod:`.state`.

Example:
    >>> make_reduce_scatter(None)
    CompressedReduceScatter(None, key='default', error_feedback=False)
"""

from __future__ import annotations

import warnings
from typing import Any

from ...error_feedback import ErrorFeedbackWarning, contractive
from ...errors import ConfigError

ROOT_KEY = "(root)"


def _codec(name: Any, options: dict[str, Any]) -> Any:
    from ... import compressors

    if name is None:
        if options:
            raise ConfigError(f"unknown options {sorted(options)} (compressor options need "
                              "a compressor)")
        return None
    codec = compressors.get(name, **options)
    if codec.name == "powersgd":
        raise ConfigError("powersgd has no reduce-scatter (its factors are sums of whole "
                          "matrices, FSDP2 hands over shards); use int8, fp16, bf16, topk, "
                          "onebit, ... or DDP's comm hook for PowerSGD")
    return codec


def make_reduce_scatter(compressor: Any = None, *, error_feedback: bool = True,
                        algorithm: str = "auto", seed: int = 0, key: str = "default",
                        **options: Any) -> Any:
    """One torch ``ReduceScatter`` for ``module.set_custom_reduce_scatter``: ``compressor``
    (a name with ``**options``, an instance, or None for torch's own) on that module.

    It keeps its own residual (one module per object; use :func:`compress_fsdp` for
    per-parameter checkpoints and a model-wide state). A gradient divide factor needs
    :func:`compress_fsdp` (it reads the factor from the module).
    """
    from .comm import CompressedReduceScatter

    codec = _codec(compressor, options)
    ef_on = bool(error_feedback) and codec is not None and codec.lossy and contractive(codec)
    from ...error_feedback import ErrorFeedback

    return CompressedReduceScatter(codec, ef=ErrorFeedback(enabled=ef_on), key=key,
                                   algorithm=algorithm, seed=seed)


def compress_fsdp(model: Any, compressor: Any = None, *, error_feedback: bool = True,
                  algorithm: str = "auto", seed: int = 0, replicate_group: Any = None,
                  replicate_algorithm: str = "allgather", guard: bool = True,
                  residual_bound: float | None = 1000.0, weights: str | None = None,
                  weight_bucket_size: int = 256, **options: Any) -> Any:
    """Install a compressed reduce-scatter on every FSDPModule in ``model`` (call after
    ``fully_shard``, on every rank); returns the :class:`~.state.FSDPState`.

    Args:
        model: the root module (itself or its submodules wrapped by ``fully_shard``).
        compressor: a codec name (options in ``**options``), an instance, or None
            (torch's own reduce-scatter, bitwise).
        error_feedback: keep a residual per module over its whole local gradient (only
            for lossy codecs that are contractions; others warn and run without).
        algorithm: ``"auto"`` (= all-to-all), ``"alltoall"`` or
            ``"ring"``.
        seed: seeds the stochastic codecs.
        replicate_group: HSDP: the ProcessGroup of the replicate dimension; the shards
            are then averaged over it through the same codec (``set_all_reduce_hook``).
        replicate_algorithm: the compressed allreduce's algorithm there.
        guard: the divergence guard (:mod:`gradcomm.compressed.guard`): after each
            reduce-scatter the ranks agree (one small allreduce) whether a module's
            residuals went non-finite or past ``residual_bound`` times the largest
            gradient norm seen, and zero them on every rank (``state.guard.stats``).
        weights: ``"int8"``: also quantize the parameter all-gather (ZeRO++'s qwZ
            shape, :mod:`.allgather`): forward and backward compute with blockwise-int8
            weights (``weight_bucket_size`` elements per block) rounded to the param
            dtype (float32, bfloat16 or float16 on CPU), the master shards, gradients and
            optimizer step stay exact; asynchronous (a Work FSDP2 waits on) where
            FSDP2 can compute before it waits. Default None: FSDP2's own all-gather.

    Which to pick (measured in bench/RESULTS.md, FSDP2 section): ``"int8"`` alone cuts
    the reduce-scatter's bytes 4x but leaves the fp32 all-gather, which then carries most
    of the step's bytes (at most 2.4x fewer than fp32 FSDP2 in all); add
    ``weights="int8"`` when the link is the bottleneck: about 6x fewer bytes than fp32
    and 4x fewer than bf16 FSDP2, at the same test accuracy in our runs, since every
    forward sees weights within half a quantization level of a 256-element block. Keep
    ``weights=None`` where forward must see the exact weights, or where the link is fast
    enough that the quantization's CPU time costs more than the bytes save.
    """
    from torch.distributed.fsdp import FSDPModule

    from ...comm import get_transport
    from ...compressed.guard import Guard
    from ...compressed.reduce_scatter import ALGORITHMS
    from .comm import CompressedReduceScatter, ReplicateHook
    from .layout import layout_of
    from .state import FSDPState

    codec = _codec(compressor, options)
    from .allgather import WEIGHT_CODECS, QuantizedAllGather

    if weights is not None and weights not in WEIGHT_CODECS:
        raise ConfigError(f"unknown weights codec {weights!r}; known: None, "
                          f"{', '.join(WEIGHT_CODECS)}")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    lossy = codec is not None and codec.lossy
    if error_feedback and lossy and not contractive(codec):
        warnings.warn(f"error_feedback=True is not applied with {codec!r}: its error can "
                      "exceed its input (see gradcomm.error_feedback.contractive); pass "
                      "error_feedback=False to silence this", ErrorFeedbackWarning,
                      stacklevel=2)
    state = FSDPState(codec, options, seed=seed, algorithm=algorithm,
                      error_feedback=bool(error_feedback) and lossy and contractive(codec))
    state.guard = Guard(residual_bound) if guard and state.ef.enabled else None
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    sides = _SIDES
    found = False
    for mname, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        found = True
        key = mname or ROOT_KEY
        groups = module._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        if len(groups) > 1:
            raise ConfigError(f"FSDP module {key!r} has {len(groups)} parameter groups "
                              "(per-parameter meshes): set_custom_reduce_scatter does not "
                              "support that; use one mesh per module")
        g = groups[0]
        if g._is_hsdp:
            raise ConfigError(f"FSDP module {key!r} is on a 2-D (HSDP) mesh, whose replicate "
                              "all-reduce FSDP2 runs itself: shard on mesh['shard'] and pass "
                              "replicate_group=mesh['replicate'].get_group() to "
                              "compress_fsdp to compress that dimension too")
        if codec is not None and any(fp.offload_to_cpu for fp in g.fsdp_params):
            raise ConfigError(f"FSDP module {key!r} offloads to CPU; compressed "
                              "reduce-scatter is not supported with CPUOffloadPolicy")
        lay = layout_of(key, g, names)
        side = None if codec is None else side_group(g.mesh_info.shard_process_group, sides)
        comm = CompressedReduceScatter(codec, ef=state.ef, key=key, algorithm=algorithm,
                                       seed=seed, group=g, side_group=side,
                                       guard=state.guard)
        comm.shard_rank = g.mesh_info.shard_mesh_rank
        module.set_custom_reduce_scatter(comm)
        state.layouts[key], state.comms[key] = lay, comm
        if weights is not None:
            gather = QuantizedAllGather(
                bucket_size=weight_bucket_size,
                side_group=side_group(g.mesh_info.shard_process_group, _GATHER_SIDES))
            module.set_custom_all_gather(gather)
            state.gathers[key] = gather
        if replicate_group is not None:
            rep = replicate_group if codec is None else side_group(replicate_group, sides)
            hook = ReplicateHook(codec, rep, state.ef, key,
                                 algorithm=replicate_algorithm, seed=seed)
            module.set_all_reduce_hook(hook)
            state.hooks[key] = hook
    if not found:
        raise ConfigError("compress_fsdp: no FSDPModule in the model; call fully_shard "
                          "on its blocks and on the root first")
    import torch.distributed as dist

    state.world = get_transport(side_group(dist.group.WORLD, sides))
    return state


#: the side groups made so far, by rank set (one per set and process)
_SIDES: dict[tuple[int, ...], Any] = {}
#: those of the quantized weight all-gathers: their worker thread runs while the main
#: thread reduce-scatters on ``_SIDES``, so they never share a group
_GATHER_SIDES: dict[tuple[int, ...], Any] = {}


def side_group(group: Any, cache: dict[tuple[int, ...], Any]) -> Any:
    """A gloo group over ``group``'s ranks for gradcomm's own messages, one per rank set
    and process. Made with local synchronisation: only its members take part, so with
    HSDP each rank makes just the groups of its own shard and replicate sets (as FSDP2
    does for its separate reduce-scatter group)."""
    import torch.distributed as dist

    from ...comm import torch_teardown

    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in cache:
        cache[ranks] = dist.new_group(list(ranks), backend="gloo",
                                      use_local_synchronization=True)
        torch_teardown.before_destroy(forget_sides)
    return cache[ranks]


def forget_sides(group: Any) -> None:
    """Drop the side groups ``group`` is (None: all of them), as torch destroys it, so
    that nothing here keeps a destroyed group, and its gloo threads, alive."""
    for cache in (_SIDES, _GATHER_SIDES):
        for ranks, side in list(cache.items()):
            if group is None or side is group:
                del cache[ranks]


def __getattr__(name: str) -> Any:
    if name in ("FSDPState", "load_dcp"):
        from . import state

        return getattr(state, name)
    if name in ("CompressedReduceScatter", "ReplicateHook"):
        from . import comm

        return getattr(comm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CompressedReduceScatter", "FSDPState", "ReplicateHook", "compress_fsdp",
           "load_dcp", "make_reduce_scatter"]
