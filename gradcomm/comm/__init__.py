"""Transports: MPI (mpi4py), torch.distributed and in-process threads.

:func:`get_transport` turns whatever the user passed as ``comm=`` into a
:class:`Transport` (cached, so an MPI communicator is duplicated once).

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: t.name)
    ['threads', 'threads']
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

from ..errors import ConfigError
from .base import DEFAULT_TIMEOUT, Request, Stats, Transport
from .state import TransportState
from .threads import ThreadTransport, run_ranks

_CACHE: dict[int, tuple[Any, Transport]] = {}


def _forget_all() -> None:
    """Drop the cached transports (and the communicators / process groups they hold) at
    interpreter exit, while Python still runs: a gloo process group left to be destroyed
    during interpreter teardown can abort the process ("terminate called without an
    active exception") after the program itself has finished."""
    _CACHE.clear()


atexit.register(_forget_all)


def get_transport(comm: Any = None, *, timeout: float | None = None) -> Transport:
    """The transport for ``comm``: a Transport, an mpi4py communicator, a torch
    ProcessGroup, or None (torch's default group if initialised, else MPI.COMM_WORLD)."""
    cached = _CACHE.get(id(comm))           # first: isinstance of the ABC costs more
    if cached is not None and cached[0] is comm:
        return cached[1]
    if isinstance(comm, Transport):
        return comm
    if comm is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            comm = dist.group.WORLD
        else:
            try:
                from mpi4py import MPI
            except ImportError:
                raise ConfigError("comm=None needs torch.distributed initialised or mpi4py "
                                  "installed (pip install 'gradcomm[mpi]')") from None
            comm = MPI.COMM_WORLD
    cached = _CACHE.get(id(comm))
    if cached is not None and cached[0] is comm:
        return cached[1]
    # a subclass (gradcomm's wrap(), a program's own Intracomm subclass) is its library's
    module = next((c.__module__ for c in type(comm).__mro__
                   if c.__module__.startswith(("mpi4py", "torch"))), type(comm).__module__)
    t: Transport
    if module.startswith("mpi4py"):
        from .mpi import MPITransport

        t = MPITransport(comm, timeout=timeout or DEFAULT_TIMEOUT)
    elif module.startswith("torch"):
        from .torch_dist import TorchTransport

        t = TorchTransport(comm, timeout=timeout or DEFAULT_TIMEOUT)
    else:
        raise ConfigError(f"comm must be an mpi4py communicator, a torch ProcessGroup, a "
                          f"gradcomm Transport or None; got {module}.{type(comm).__qualname__}")
    _CACHE[id(comm)] = (comm, t)   # keeps comm alive, so its id is never reused
    return t


__all__ = ["DEFAULT_TIMEOUT", "Request", "Stats", "ThreadTransport", "Transport",
           "TransportState", "get_transport", "run_ranks"]
