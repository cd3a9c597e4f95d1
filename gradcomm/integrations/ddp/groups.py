"""Which transports the DDP hook talks over: its own messages, and the device group's.

The hook's messages are host buffers. Over a gloo (or MPI) process group, or a transport
given as ``transport=``, they travel on that; an NCCL group moves device buffers only, so a
gloo group over the same ranks, in the same order, is made for them (collective: every
rank of the group calls it), and the NCCL group itself sums uncompressed device buckets.
What the hook makes here it owns (:class:`Transports`): that gloo group, and for
``transport="mpi"`` its own duplicate of ``MPI.COMM_WORLD``; the state releases them when
it is closed.

Example:
    >>> payload_backend("gloo"), payload_backend("nccl")
    (None, 'gloo')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...comm import get_transport
from ...comm.base import DEFAULT_TIMEOUT, Transport
from ...errors import ConfigError


@dataclass
class Transports:
    """The hook's transports: ``messages`` (host buffers), ``library`` (an NCCL DDP group,
    or None), the torch process ``groups`` it talks over (for
    ``destroy_process_group``), and what it made and must release: ``own_groups`` (a gloo
    group beside an NCCL one) and ``own_transports`` (a duplicated MPI communicator)."""

    messages: Transport
    library: Transport | None = None
    groups: list[Any] = field(default_factory=list)
    own_groups: list[Any] = field(default_factory=list)
    own_transports: list[Transport] = field(default_factory=list)


def resolve_transports(transport: Any, process_group: Any, timeout: float | None
                       ) -> Transports:
    """The hook's :class:`Transports`, from ``make_comm_hook``'s ``transport`` and
    ``process_group``; ConfigError for a transport that cannot carry host buffers."""
    out = _resolve(transport, process_group, timeout)
    messages = out.messages
    if "cpu" not in messages.devices:
        for t in out.own_transports:
            t.close()
        raise ConfigError(f"the {messages.name} transport moves only "
                          f"{'/'.join(sorted(messages.devices))} buffers, and the "
                          "hook's messages are host buffers: pass "
                          "process_group=dist.new_group(backend='gloo') or "
                          "transport='mpi'")
    return out


def _resolve(transport: Any, process_group: Any, timeout: float | None) -> Transports:
    if isinstance(transport, str):
        if transport == "mpi":
            from mpi4py import MPI

            from ...comm.mpi import MPITransport

            own = MPITransport(MPI.COMM_WORLD, timeout=timeout or DEFAULT_TIMEOUT)
            return Transports(own, own_transports=[own])
        if transport != "torch":
            raise ConfigError(f"transport must be None, 'torch', 'mpi', an mpi4py "
                              f"communicator or a Transport; got {transport!r}")
        transport = None
    if transport is not None:
        return Transports(get_transport(transport, timeout=timeout))
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("make_comm_hook needs torch.distributed initialised (DDP does) "
                          "or transport=")
    from ...comm.torch_dist import TorchTransport

    group = process_group if process_group is not None else dist.group.WORLD
    backend = payload_backend(str(dist.get_backend(group)))
    if backend is None:
        return Transports(get_transport(group, timeout=timeout), groups=[group])
    side = host_group(group, backend)
    return Transports(TorchTransport(side, timeout=timeout or DEFAULT_TIMEOUT),
                      get_transport(group, timeout=timeout), groups=[group, side],
                      own_groups=[side])


#: process-group backends whose point-to-point moves device buffers only
DEVICE_BACKENDS = frozenset({"nccl"})


def payload_backend(backend: str) -> str | None:
    """The backend of the group the hook sends its (host) messages over, for a DDP
    process group of ``backend``: None to use that group itself, else a group of that
    backend over the same ranks (``"gloo"`` for NCCL, which moves device buffers only).

    Example:
        >>> payload_backend("gloo"), payload_backend("nccl"), payload_backend("mpi")
        (None, 'gloo', None)
    """
    return "gloo" if backend in DEVICE_BACKENDS else None


def host_group(group: Any, backend: str = "gloo") -> Any:
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


__all__ = ["DEVICE_BACKENDS", "Transports", "host_group", "payload_backend", "resolve_transports"]
