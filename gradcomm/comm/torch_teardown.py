"""What happens when ``torch.distributed.destroy_process_group`` runs: whatever uses the
group closes first, then every reference gradcomm or torch kept to it goes, so the group
and its threads end while Python still runs.

A gloo process group keeps worker threads until its last reference goes. A worker still
alive during interpreter shutdown that drops the last reference to a tensor owned by
Python aborts the process ("terminate called without an active exception";
bench/RESULTS.md, "Exit aborts"). Two references outlived ``destroy_process_group``:

- gradcomm's transport cache (:func:`gradcomm.comm.get_transport`) held the group until
  exit;
- ``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` when it is imported.
  Imported after ``init_process_group`` (DDP's constructor imports ``torch._dynamo``, which
  imports it), ten of its functions keep the default group as a default argument.

A group can also outlive ``destroy_process_group`` in the program's own objects, such
as a DDP model in a reference cycle, which the garbage collector frees only at its next
run, perhaps during interpreter shutdown. So :func:`install` also registers an ``atexit``
collection: it runs while Python still runs (before torch's own exit handlers, which
were registered first).

:func:`install` wraps ``destroy_process_group`` once. The callbacks registered with
:func:`before_destroy` run first (the DDP hook's states close). Then torch destroys the
group, and :func:`released` runs:

- it drops cached transports over the group;
- it sets the defaults of torch.distributed's functions that name the group to None,
  which torch reads as the default group;
- it clears torch's DTensor caches, whose entries keep a device mesh and so its groups:
  the native sharding cache (a ``torch.nn.Parameter`` of a DTensor, as ``fully_shard``
  makes, leaves an entry), the redistribution planners and the ``lru_cache``s of
  ``torch.distributed.tensor`` (an optimizer's step on DTensors leaves entries there);
- it collects garbage, so the group's own destructor joins its threads.

Example (one process, a one-rank gloo group):
    >>> import torch.distributed as dist, torch.distributed.nn.functional as fn
    >>> from gradcomm.comm import get_transport
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> t = get_transport(None)                            # cached, with the group
    >>> fn.broadcast.__defaults__ = (dist.group.WORLD,)    # as if imported after init
    >>> dist.destroy_process_group()                       # wrapped by install()
    >>> fn.broadcast.__defaults__
    (None,)
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
import threading
import types
from typing import Any, Callable

_LOCK = threading.Lock()
#: run with the group about to be destroyed (None: every group), before torch destroys it
_BEFORE: list[Callable[[Any], None]] = []
#: torch's own destroy_process_group, once wrapped
_original: Any = None


def before_destroy(fn: Callable[[Any], None]) -> None:
    """Run ``fn(group)`` whenever ``destroy_process_group`` is called, before torch
    destroys ``group`` (None: the default group, so every group). Registered once."""
    with _LOCK:
        if fn not in _BEFORE:
            _BEFORE.append(fn)
    install()


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` once (same signature and
    docstring, same arguments passed on), and collect garbage at exit."""
    global _original
    with _LOCK:
        if _original is not None:
            return
        from torch.distributed import distributed_c10d as c10d
        import torch.distributed as dist

        original = c10d.destroy_process_group

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            group = args[0] if args else kwargs.get("group")
            target = None if group is None or group is dist.group.WORLD else group
            for fn in list(_BEFORE):
                fn(target)
            try:
                return original(*args, **kwargs)
            finally:
                released(target)

        _original = original
        c10d.destroy_process_group = destroy_process_group
        dist.destroy_process_group = destroy_process_group
        atexit.register(gc.collect)


def destroy_group(group: Any) -> None:
    """torch's own ``destroy_process_group(group)`` then :func:`released`, without the
    :func:`before_destroy` callbacks (the caller is the one closing)."""
    import torch.distributed as dist

    try:
        (_original or dist.destroy_process_group)(group)
    finally:
        released(group)


def released(group: Any) -> None:
    """Let go of ``group`` (None: of every torch group), just destroyed: cached transports
    over it are dropped, torch.distributed's functions stop naming it as a default
    argument, and garbage is collected, so the group is freed now if nothing else holds
    it."""
    from torch.distributed import ProcessGroup

    from . import _CACHE

    def stale(v: Any) -> bool:
        return isinstance(v, ProcessGroup) if group is None else v is group

    for key, (comm, _) in list(_CACHE.items()):
        if stale(comm):
            del _CACHE[key]
    for module in _loaded("torch.distributed"):
        for fn in list(vars(module).values()):
            if type(fn) is types.FunctionType and fn.__defaults__ and any(
                    stale(v) for v in fn.__defaults__):
                fn.__defaults__ = tuple(None if stale(v) else v for v in fn.__defaults__)
    if "torch.distributed.tensor" in sys.modules:
        _clear_dtensor_caches()
    gc.collect()


def _loaded(prefix: str) -> list[types.ModuleType]:
    """The modules loaded whose names start with ``prefix``."""
    return [module for name, module in list(sys.modules.items())
            if module is not None and name.startswith(prefix)]


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches: their entries keep device meshes, and with them the
    meshes' groups. They are the native sharding cache, the redistribution planners and
    every ``functools.lru_cache`` of ``torch.distributed.tensor``'s modules and classes,
    such as ``MeshTopoInfo.build_from_mesh``. These are torch's private API: what a
    version lacks is skipped."""
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    planners = getattr(sys.modules.get("torch.distributed.tensor._redistribute"),
                       "clear_redistribute_planner_cache", None)
    for fn in (clear, planners):
        if fn is not None:
            fn()
    for module in _loaded("torch.distributed.tensor"):
        for value in list(vars(module).values()):
            inner = list(vars(value).values()) if isinstance(value, type) else []
            for f in (value, *inner):
                if isinstance(f, (staticmethod, classmethod)):
                    f = f.__func__
                if isinstance(f, functools._lru_cache_wrapper):
                    f.cache_clear()


__all__ = ["before_destroy", "destroy_group", "install", "released"]
