"""What :func:`~gradcomm.integrations.fsdp.compress_fsdp` returns: the installed
reduce-scatters, their error-feedback residuals, and checkpoints of them.

Each FSDPModule's reduce-scatter keeps one flat residual over its whole local (padded)
gradient under the module's key; the HSDP replicate hook keeps one over the shard under
``"<key>#replicate"``. Checkpoints store them **per parameter name**, in each parameter's
own row-major order (:mod:`.layout`), every rank's, so that:

- ``state.state_dict()`` is collective (call it on every rank): every rank then holds
  the same flat dict of tensors, ints and strings (``"r<rank>/residual/<name>"``,
  ``"r<rank>/replicate/<name>"``, ``"r<rank>/step/<key>"``, ...). One ``torch.save`` on
  rank 0 is a complete checkpoint (``torch.load(path, weights_only=True)`` reads it);
  ``torch.distributed.checkpoint.save({"gradcomm": sd}, ...)`` saves it as replicated
  entries, and :func:`load_dcp` reads it back at any rank count.
- ``state.load_state_dict(sd)`` is local. At the rank count and shard sizes it was saved
  at, every rank takes its own residuals back and the continuation is bitwise that of an
  unbroken run. At another, new rank r' takes, per parameter, the sum (in rank order) of
  the saved ranks r with ``r mod p' == r'`` (the padding cut off, the replicate residual
  added in at its rows), so the total error mass is kept; per-hop replicate residuals
  (non-gathered replicate algorithms) are then dropped with a warning.

Example:
    >>> st = FSDPState(None, {}, seed=0, algorithm="auto", error_feedback=False)
    >>> st.signature
    'none'
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np

from ...error_feedback import HOP_SEP, ErrorFeedback, ResidualResetWarning
from ...errors import ConfigError
from .layout import Layout

FORMAT, VERSION = "gradcomm.fsdp", 1
_REP = "#replicate"


class FSDPState:
    """The codec, seed and residuals of every compressed FSDPModule of one model."""

    def __init__(self, codec: Any, options: Mapping[str, Any], *, seed: int, algorithm: str,
                 error_feedback: bool) -> None:
        self.codec, self.options, self.seed, self.algorithm = codec, dict(options), seed, \
            algorithm
        self.ef = ErrorFeedback(enabled=bool(error_feedback) and codec is not None)
        self.layouts: dict[str, Layout] = {}
        self.comms: dict[str, Any] = {}
        self.hooks: dict[str, Any] = {}
        #: the quantized all-gathers (``compress_fsdp(weights="int8")``), by module key
        self.gathers: dict[str, Any] = {}
        self.world: Any = None              # the transport checkpoints are collected over
        self.guard: Any = None              # the divergence guard (compress_fsdp sets it)

    @property
    def signature(self) -> str:
        c = self.codec
        return "none" if c is None else f"{c.name}{sorted(c.get_config().items())!r}"

    @property
    def stats(self) -> dict[str, int]:
        """Reduce-scatter calls per module key."""
        return {k: c.calls for k, c in self.comms.items()}

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's compressed reduce-scatters sent (all modules, so far)."""
        return sum(c.bytes_sent for c in self.comms.values())

    # -- saving ---------------------------------------------------------------------------
    def _local(self, shard_rank: dict[str, int]) -> tuple[dict[str, dict[str, np.ndarray]],
                                                          dict[str, Any]]:
        res: dict[str, np.ndarray] = {}
        extra: dict[str, np.ndarray] = {}
        steps = {}
        table = dict(self.ef.state_dict())
        for key, lay in self.layouts.items():
            steps[key] = self.ef.step(key)
            e = table.get(f"residual/{key}")
            if e is not None and np.asarray(e).size == lay.n:
                for name, a in lay.split(e).items():
                    res[name] = a
            rep = table.get(f"residual/{key}{_REP}")
            if rep is not None and np.asarray(rep).size == lay.shard:
                for name, a in lay.shard_to_param(np.asarray(rep), shard_rank[key]).items():
                    extra["replicate/" + name] = a
            for entry, v in table.items():  # per-hop residuals of the replicate hook
                if entry.startswith(f"residual/{key}{_REP}{HOP_SEP}"):
                    extra["hop/" + entry[len("residual/"):]] = np.asarray(v)
        meta = {"steps": steps, "shard_rank": shard_rank,
                "rows": {k: {q.name: q.rows for q in lay.params} for k, lay in self.layouts.items()}}
        return {"residuals": res, "extra": extra}, meta

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals and steps as one flat dict (collective: every rank)."""
        import torch

        from ...collectives import agree
        from ...collectives.allgather import allgatherv
        from ..ddp.checkpoint import pack_local, unpack_local

        t = self.world
        if t is None:
            raise ConfigError("state_dict() before compress_fsdp installed anything")
        agree(t, "fsdp_state_dict", modules=len(self.layouts), codec=self.signature)
        ranks = {k: c.shard_rank for k, c in self.comms.items()}
        block = pack_local(*self._local(ranks))
        blocks = [block] if t.size == 1 else allgatherv(t, block)
        sd: dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": t.size,
                              "compressor": self.signature, "seed": int(self.seed)}
        for r, b in enumerate(blocks):
            groups, meta = unpack_local(b, r)
            for name, a in groups["residuals"].items():
                sd[f"r{r}/residual/{name}"] = torch.from_numpy(a)
            for name, a in groups["extra"].items():
                sd[f"r{r}/{name}"] = torch.from_numpy(a)
            for key, s in meta["steps"].items():
                sd[f"r{r}/step/{key}"] = int(s)
            for key, s in meta["shard_rank"].items():
                sd[f"r{r}/shard_rank/{key}"] = int(s)
            for key, rows in meta["rows"].items():
                for name, c in rows.items():
                    sd[f"r{r}/rows/{name}"] = int(c)
        return sd

    # -- loading --------------------------------------------------------------------------
    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output saved at any rank count (local)."""
        if not isinstance(sd, Mapping) or sd.get("format") != FORMAT:
            raise ConfigError("not a gradcomm FSDP state dict (format "
                              f"{sd.get('format') if isinstance(sd, Mapping) else None!r})")
        if int(sd.get("version", -1)) != VERSION:
            raise ConfigError(f"gradcomm FSDP state version {sd.get('version')!r}, this "
                              f"gradcomm reads {VERSION}")
        if str(sd["compressor"]) != self.signature or int(sd["seed"]) != int(self.seed):
            raise ConfigError(f"state saved with compressor {sd['compressor']} and seed "
                              f"{sd['seed']}; this one has {self.signature} and seed "
                              f"{self.seed}")
        p_old, t = int(sd["world_size"]), self.world
        me, p_new = (0, 1) if t is None else (t.rank, t.size)
        per_rank: list[dict[str, dict[str, np.ndarray]]] = [
            {"residual": {}, "replicate": {}, "hop": {}, "rows": {}} for _ in range(p_old)]
        steps: dict[str, int] = {}
        for k, v in sd.items():
            if not k.startswith("r") or "/" not in k:
                continue
            head, kind, name = k.split("/", 2) if k.count("/") >= 2 else (k, "", "")
            try:
                r = int(head[1:])
            except ValueError:
                raise ConfigError(f"unexpected entry {k!r} in a gradcomm FSDP state") from None
            if not 0 <= r < p_old:
                raise ConfigError(f"entry {k!r} names rank {r} of {p_old}")
            if kind in ("residual", "replicate", "hop"):
                a = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
                if a.dtype.kind != "f":
                    raise ConfigError(f"entry {k!r} is not a floating array")
                per_rank[r][kind][name] = np.array(a, copy=True).reshape(-1)
            elif kind == "step" and r == 0:
                steps[name] = int(v)
            elif kind == "rows":
                per_rank[r]["rows"][name] = int(v)
        same = p_old == p_new and all(
            per_rank[me]["rows"].get(q.name, q.rows) == q.rows
            for lay in self.layouts.values() for q in lay.params)
        table: dict[str, Any] = {"gradcomm_error_feedback_version": 1}
        for key, s in steps.items():
            table[f"step/{key}"] = s
        if same:
            mine = per_rank[me]
            for key, lay in self.layouts.items():
                names = [q.name for q in lay.params]
                if any(n in mine["residual"] for n in names):
                    table[f"residual/{key}"] = lay.join(mine["residual"], _dtype(mine["residual"]))
                if any(n in mine["replicate"] for n in names):
                    c = self.comms[key].shard_rank
                    full = lay.join(mine["replicate"], _dtype(mine["replicate"]))
                    table[f"residual/{key}{_REP}"] = np.ascontiguousarray(
                        full.reshape(lay.p, lay.shard)[c])
            for name, a in mine["hop"].items():
                table[f"residual/{name}"] = a
        else:
            if any(per_rank[r]["hop"] for r in range(p_old)):
                warnings.warn("per-hop residuals of the replicate hook cannot move to "
                              f"another rank count ({p_old} -> {p_new}); they were dropped",
                              ResidualResetWarning, stacklevel=2)
            for key, lay in self.layouts.items():
                total: dict[str, np.ndarray] = {}
                for r in range(me, p_old, p_new):
                    for kind in ("residual", "replicate"):
                        for q in lay.params:
                            a = per_rank[r][kind].get(q.name)
                            if a is None:
                                continue
                            a = a[:q.numel]
                            total[q.name] = a.copy() if q.name not in total else \
                                total[q.name] + a
                if total:
                    table[f"residual/{key}"] = lay.join(total, _dtype(total))
        self.ef.load_state_dict(table)

    def __repr__(self) -> str:
        return (f"FSDPState({self.signature}, modules={list(self.layouts)}, "
                f"error_feedback={self.ef.enabled}, seed={self.seed})")


def _dtype(arrays: Mapping[str, np.ndarray]) -> Any:
    return next(iter(arrays.values())).dtype if arrays else np.float32


def load_dcp(state: FSDPState, checkpoint_id: Any, key: str = "gradcomm") -> None:
    """Load ``state`` from a ``torch.distributed.checkpoint`` saved as ``{key:
    state.state_dict(), ...}``, at any rank count (the entries' shapes are read from the
    checkpoint's metadata first). Collective, like ``dcp.load``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    prefix = key + "."
    template: dict[str, Any] = {}
    for fqn, m in meta.items():
        if not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix):]
        template[name] = torch.empty(tuple(m.size), dtype=m.properties.dtype) \
            if isinstance(m, TensorStorageMetadata) else 0
    if not template:
        raise ConfigError(f"no {key!r} entries in the checkpoint at {checkpoint_id!r}")
    wrapped = {key: template}
    dcp.load(wrapped, checkpoint_id=checkpoint_id)
    state.load_state_dict(wrapped[key])


__all__ = ["FORMAT", "FSDPState", "VERSION", "load_dcp"]
