"""When the DDP hook's states are closed: by hand, at interpreter exit, and when
``torch.distributed.destroy_process_group`` runs.

A :class:`~.hook.CommHookState` holds a worker thread and may hold a gloo group it made
beside an NCCL group and a duplicated MPI communicator. Left to interpreter teardown, a
worker still inside a gloo call or a process group destroyed after Python stopped can
abort the process at exit ("terminate called without an active exception"). Every live
state is :func:`register`-ed here; the first registration installs two triggers that
close them first: an ``atexit`` handler (registered after torch's, so it runs before them)
and a callback of the wrapped ``torch.distributed.destroy_process_group``
(:mod:`gradcomm.comm.torch_teardown`) that closes the states using the group being
destroyed (every state on a torch group, for the default group or ``None``) before torch
destroys it.

Example:
    >>> class Thing:
    ...     closed = False
    ...     def close(self): self.closed = True
    ...     def uses(self, group): return group is None
    >>> thing = Thing()
    >>> register(thing); close_using("another group"); thing.closed
    False
    >>> close_using(None); thing.closed
    True
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import Any

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()
_installed = False


def register(state: Any) -> None:
    """Close ``state`` (``state.close()``) at exit and when its process group is destroyed;
    ``state.uses(group)`` says whether it uses ``group``."""
    with _LOCK:
        _LIVE.add(state)
    _install()


def forget(state: Any) -> None:
    """``state`` was closed: nothing more to do for it."""
    with _LOCK:
        _LIVE.discard(state)


def close_all() -> None:
    """Close every live state (at exit)."""
    with _LOCK:
        states = list(_LIVE)
    for state in states:
        state.close()


def close_using(group: Any) -> None:
    """Close the live states that use torch process group ``group`` (None: any torch
    group, as destroying the default group destroys them all)."""
    with _LOCK:
        states = [s for s in _LIVE if s.uses(group)]
    for state in states:
        state.close()


def destroy_group(group: Any) -> None:
    """torch's own ``destroy_process_group(group)`` (no states closed: the caller is one),
    then the group let go of (:func:`gradcomm.comm.torch_teardown.released`)."""
    from ...comm import torch_teardown

    torch_teardown.destroy_group(group)


def wait_released(*tensors: Any, timeout: float = 10.0) -> bool:
    """Wait until torch.distributed holds none of ``tensors`` any more (each tensor's
    reference count is down to the caller's own); True if it is, False at ``timeout``.

    Call it on the tensors of a script's last collectives, after its final barrier and
    before the script ends. gloo's worker threads keep a finished collective's work, and
    its tensors, for a moment after ``wait()`` returns; a barrier keeps the works still
    running when it started. If the last of those references goes while Python is
    shutting down, the worker must take the GIL to free the tensor's Python object, and
    the process aborts ("terminate called without an active exception"; a torch issue,
    seen on loaded machines: bench/RESULTS.md, "Exit aborts"). Waiting here, while the
    caller still holds the tensors, lets that last reference go first.

    Example:
        >>> import torch
        >>> wait_released(torch.ones(3))
        True
    """
    import time

    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def end_process_group(timeout: float = 10.0) -> bool:
    """End a script's torch.distributed run on every rank of the default group: a
    one-element ``all_reduce`` (so no rank tears gloo down while a peer still talks to
    it), :func:`wait_released` of its tensor, then ``destroy_process_group()``, wrapped by
    :mod:`gradcomm.comm.torch_teardown` so the group is let go of and gloo's threads end
    before interpreter shutdown where nothing else holds the group. Not a
    barrier: a barrier's work keeps the works still running when it started alive in
    gloo's workers, and their tensors may then be freed during interpreter shutdown
    (the abort :func:`wait_released` describes). Returns what :func:`wait_released`
    returned (False: the tensor was still held after ``timeout`` seconds).

    Example:
        >>> import os, tempfile, torch.distributed as dist
        >>> store = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> end_process_group(), dist.is_initialized()
        (True, False)
    """
    import torch
    import torch.distributed as dist

    from ...comm import torch_teardown

    torch_teardown.install()
    last = torch.zeros(1)
    dist.all_reduce(last)
    try:
        return wait_released(last, timeout=timeout)
    finally:
        dist.destroy_process_group()


def _install() -> None:
    global _installed
    with _LOCK:
        if _installed:
            return
        _installed = True
    atexit.register(close_all)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return                              # a state over MPI or threads: atexit suffices
    from ...comm import torch_teardown

    torch_teardown.before_destroy(close_using)


__all__ = ["close_all", "close_using", "destroy_group", "end_process_group", "forget", "register",
           "wait_released"]
