"""The DDP hook's checkpoints: a state dict of every rank's residuals, and its loading.

:func:`collect` is collective: each rank packs its residuals (:func:`pack_local`: a
msgpack header and the raw arrays, no pickle) and they are allgathered (or gathered to
rank 0), so that one ``torch.save`` on rank 0 is a complete checkpoint of tensors, ints
and strings that loads with ``torch.load(path, weights_only=True)``. :func:`restore` is
local and accepts a checkpoint taken at any rank count ``p``: at ``p' == p`` each rank
takes its own residuals back; at ``p' != p`` every old rank's hop residuals are folded
into its per-parameter residuals and new rank ``r'`` takes the sum of those of the old
ranks ``r`` with ``r mod p' == r'`` (:func:`~.residuals.redistribute`), so the total error
mass is kept. Codec state (PowerSGD's warm-start ``Q``) is the same on every rank: at
``p' != p`` every new rank takes old rank 0's copy.

Example:
    >>> import numpy as np
    >>> block = pack_local({"residuals": {"w": np.float32([1, 2])}}, {"units": {}})
    >>> groups, meta = unpack_local(block, rank=0)
    >>> groups["residuals"]["w"].tolist(), meta
    ([1.0, 2.0], {'units': {}})
"""

from __future__ import annotations

from typing import Any, Mapping

import msgpack
import numpy as np

from ...comm.base import Transport
from ...errors import ConfigError, PayloadError
from .residuals import ParameterResiduals, redistribute

#: ``state_dict()["format"]`` and its version
STATE_FORMAT, STATE_VERSION = "gradcomm.ddp_comm_hook", 1


def collect(t: Transport, residuals: ParameterResiduals, rank0_only: bool,
            momentum: Mapping[str, Mapping[str, np.ndarray]] | None = None
            ) -> list[dict[str, Any]] | None:
    """Every rank's residuals, units and offsets (and ``momentum``'s groups: the velocity
    of momentum correction) as ``state_dict()["ranks"]`` (torch tensors); with
    ``rank0_only``, None on the ranks other than 0. Collective over ``t``."""
    from ...collectives import agree
    from ...collectives.allgather import allgatherv
    from ...collectives.gather import gatherv

    agree(t, "ddp_state_dict", rank0_only=rank0_only)
    groups, meta = residuals.local_state()
    block = pack_local({**groups, **(momentum or {})}, meta)
    if t.size == 1:
        blocks = [block]
    elif rank0_only:
        blocks = gatherv(t, block)
    else:
        blocks = allgatherv(t, block)
    if rank0_only and t.rank != 0:
        return None
    import torch

    ranks = []
    for r, b in enumerate(blocks):
        groups, meta = unpack_local(b, r)
        ranks.append({**{g: {k: torch.from_numpy(v) for k, v in named.items()}
                         for g, named in groups.items()},
                      "units": meta["units"], "offsets": meta["offsets"]})
    return ranks


def state_dict(t: Transport, residuals: ParameterResiduals, rank0_only: bool,
               config: Mapping[str, Any], iteration: int, layout: list[list[str]],
               momentum: Any, adam: Any) -> dict[str, Any]:
    """The hook's ``state_dict()`` (:meth:`~.hook.CommHookState.state_dict`): its
    ``config``, counters, bucket ``layout``, every rank's residuals (:func:`collect`),
    momentum correction's factors and velocity (``momentum``: a
    :class:`~.momentum.MomentumCorrection` or None) and the Adam route's state
    (``adam``: the hook's :class:`~.adam.AdamSlot`). Collective over ``t``."""
    groups = {**({} if momentum is None else momentum.local_state()), **adam.local_state()}
    ranks = collect(t, residuals, rank0_only, groups)
    if ranks is None:
        return {}
    return {
        "format": STATE_FORMAT, "version": STATE_VERSION, "config": dict(config),
        "iter": iteration, "world_size": t.size, "layout": [list(u) for u in layout],
        "ranks": ranks, "momentum": None if momentum is None else momentum.config(),
        "feedback": residuals.enabled, "adam": adam.config(),
    }


def check_config(state: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """ConfigError unless checkpoint ``state`` (of this format) was saved by a hook
    configured as ``config`` (:meth:`~.hook.CommHookState.config`), naming what differs.

    Example:
        >>> mine = {"compressor": "topk", "seed": 0}
        >>> state = {"format": STATE_FORMAT, "config": {"compressor": "onebit", "seed": 0}}
        >>> check_config(state, mine)
        Traceback (most recent call last):
        ...
        gradcomm.errors.ConfigError: state saved by a hook with compressor='onebit'; this hook has compressor='topk'
    """
    _check_format(state)
    saved = state.get("config")
    if not isinstance(saved, Mapping):
        raise ConfigError("the DDP comm-hook state has no config: it was not saved by "
                          "CommHookState.state_dict()")
    saved = {str(k): _plain(v) for k, v in saved.items()}
    diff = [k for k in config if _plain(config[k]) != saved.get(k)]
    if diff:
        raise ConfigError("state saved by a hook with "
                          + ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
                          + "; this hook has "
                          + ", ".join(f"{k}={_plain(config[k])!r}" for k in diff))


def _plain(v: Any) -> Any:
    """``v`` with tuples as lists and mappings as plain dicts (as a checkpoint holds it)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _check_format(state: Any) -> None:
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ConfigError("not a gradcomm DDP comm-hook state dict (format "
                          f"{state.get('format') if isinstance(state, Mapping) else None!r}); "
                          "state_dict(rank0_only=True) returns {} on ranks other than 0")


def restore(state: Mapping[str, Any], p_new: int, rank: int) -> ParameterResiduals:
    """Rank ``rank`` of ``p_new``'s residuals from a checkpoint ``state`` (checked).

    New rank ``r'`` of ``p'`` receives ``sum(e_r for r in range(p) if r % p' == r')``,
    summed in rank order (hop residuals folded first), which keeps the total error
    mass up to float rounding.
    """
    _check_format(state)
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"DDP comm-hook state version {state.get('version')!r}, this "
                          f"gradcomm reads {STATE_VERSION}")
    missing = [k for k in ("ranks", "world_size", "iter") if k not in state]
    if missing:
        raise ConfigError(f"DDP comm-hook state lacks {', '.join(missing)}: it was saved "
                          "incompletely or edited (state_dict() writes them all)")
    ranks = state["ranks"]
    if not isinstance(ranks, list) or len(ranks) != state["world_size"]:
        raise ConfigError(f"state holds {len(ranks)} ranks' residuals for world size "
                          f"{state['world_size']}: it was saved incompletely")
    saved = [residuals_of(entry, r) for r, entry in enumerate(ranks)]
    if len(ranks) == p_new:
        return saved[rank]
    return redistribute(saved, p_new, rank)      # hops differ at another p: fold them first


def restore_momentum(state: Mapping[str, Any], p_new: int, rank: int
                     ) -> tuple[Mapping[str, Any], dict[str, np.ndarray],
                                dict[str, np.ndarray]] | None:
    """``(factors, velocity, previous)`` of momentum correction for rank ``rank`` of
    ``p_new`` from a checked checkpoint ``state``, or None if it holds none. At the saved
    rank count each rank takes its own velocity; at another, every rank takes the mean of
    the saved ranks' (the velocity of the averaged update is kept, each rank's deviation
    from it is not). ``previous`` (the reduced result) is the same on every rank: rank
    0's."""
    factors = state.get("momentum")
    if factors is None:
        return None
    if not isinstance(factors, Mapping) or {"momentum", "optimizer_momentum",
                                            "mask"} - set(factors):
        raise ConfigError(f"malformed momentum factors in the state: {factors!r}")
    ranks = state["ranks"]
    saved = [{g: {str(k): np.array(_flat(v), copy=True)
                  for k, v in entry.get(g, {}).items()} for g in ("velocity", "previous")}
             for entry in ranks]
    for r, groups in enumerate(saved):
        for g, named in groups.items():
            if any(v.dtype.kind != "f" for v in named.values()):
                raise ConfigError(f"momentum {g} of rank {r} is not floating")
    if len(ranks) == p_new:
        return factors, saved[rank]["velocity"], saved[rank]["previous"]
    velocity = {k: (sum(s["velocity"][k] for s in saved) / len(saved)).astype(v.dtype)
                for k, v in saved[0]["velocity"].items()
                if all(k in s["velocity"] and s["velocity"][k].size == v.size for s in saved)}
    return factors, velocity, saved[0]["previous"]


def restore_adam(state: Mapping[str, Any], p_new: int, rank: int
                 ) -> dict[str, np.ndarray] | None:
    """The Adam route's momentum residuals and codec steps (:mod:`.adam`) for rank
    ``rank`` of ``p_new`` from a checked checkpoint ``state``, or None if it holds none.
    At another rank count new rank ``r'`` takes the sum of each residual over the saved
    ranks ``r`` with ``r mod p' == r'`` (the error mass is kept, as for the residuals);
    the steps are the same on every rank: rank 0's."""
    saved = [{str(k): np.array(_flat(v), copy=True) for k, v in entry.get("adam", {}).items()}
             for entry in state["ranks"]]
    if not any(saved):
        return None
    if any(set(s) != set(saved[0]) or any(s[k].shape != v.shape or s[k].dtype != v.dtype
                                           for k, v in saved[0].items()) for s in saved):
        raise ConfigError("the saved ranks' Adam-route residuals differ in names or sizes")
    if len(saved) == p_new:
        return saved[rank]
    mine = [s for r, s in enumerate(saved) if r % p_new == rank]
    return {k: sum((s[k] for s in mine), np.zeros_like(v)) if k.startswith("residual/")
            else v for k, v in saved[0].items()}


def residuals_of(entry: Mapping[str, Any], rank: int) -> ParameterResiduals:
    """One saved rank's residuals (``state_dict()["ranks"][rank]``)."""
    r = ParameterResiduals(True)
    try:
        for k, v in entry["residuals"].items():
            arr = np.array(_flat(v), copy=True)
            if arr.dtype.kind != "f":
                raise ConfigError(f"residual {k!r} of rank {rank} is not floating")
            r._residuals[str(k)] = arr
        for k, v in entry.get("extra", {}).items():      # absent in older checkpoints
            arr = np.array(_flat(v), copy=True)
            if arr.dtype.kind not in "fiu":
                raise ConfigError(f"extra state {k!r} of rank {rank} is not numeric")
            r._extras[str(k)] = arr
        for u, d in entry["units"].items():
            r.units[str(u)] = ([str(n) for n in d["names"]], [int(n) for n in d["lengths"]])
        r.offsets = {str(k): int(v) for k, v in entry["offsets"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"malformed residuals of rank {rank} in the state: {exc}") from None
    return r


def _flat(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v.reshape(-1)
    return v.detach().cpu().numpy().reshape(-1)


# A rank's residuals travel as: uint64 header length, msgpack header {"arrays": [[group,
# name, dtype, count], ...], "meta": {...}}, then the raw arrays in header order. No pickle.
_MAX_STATE_HEADER = 1 << 26
#: array groups of a rank's state and the dtype kinds each may hold
_GROUPS = {"residuals": "f", "extra": "fiu", "velocity": "f", "previous": "f", "adam": "fi"}


def pack_local(groups: Mapping[str, Mapping[str, np.ndarray]],
               meta: Mapping[str, Any]) -> np.ndarray:
    """One rank's state as bytes: its array ``groups`` (residuals, extra) and ``meta``."""
    items = [(g, k, v) for g, named in groups.items() for k, v in named.items()]
    table = [[g, k, v.dtype.str, int(v.size)] for g, k, v in items]
    hb = msgpack.packb({"arrays": table, "meta": dict(meta)}, use_bin_type=True)
    return np.concatenate([np.array([len(hb)], np.uint64).view(np.uint8),
                           np.frombuffer(hb, np.uint8),
                           *[np.ascontiguousarray(v).reshape(-1).view(np.uint8)
                             for _, _, v in items]])


def unpack_local(block: np.ndarray, rank: int
                 ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """:func:`pack_local`'s ``(groups, meta)`` back from rank ``rank``'s ``block``, checked
    (PayloadError for a corrupt block)."""
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


__all__ = ["STATE_FORMAT", "STATE_VERSION", "check_config", "collect", "state_dict", "pack_local", "residuals_of", "restore",
           "restore_adam", "restore_momentum",
           "unpack_local"]
