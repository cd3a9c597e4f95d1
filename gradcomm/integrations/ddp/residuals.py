"""The DDP hook's error-feedback state: residuals per parameter name, per-hop residuals.

:class:`ParameterResiduals` keeps every residual in one
:class:`~gradcomm.error_feedback.KeyedResiduals` store, indexed by parameter name: the hook
reduces *units* (the parameters reduced together); :meth:`ParameterResiduals.open` adds
the parameters' residuals to the unit's buffer and tells the store which parameters the
unit is made of, so the collective uses that store alone and never calls back here. When a unit is not reduced again (bucket rebuild, another
``bucket_cap_mb``, another rank count) its hop residuals are folded into the residuals of
the parameters they cover, a replicated hop residual counted once (:func:`count_copies`);
:func:`redistribute` moves a checkpoint's residuals to another rank count. No error mass
is dropped.

Example:
    >>> import numpy as np
    >>> res = ParameterResiduals(True)
    >>> x = np.ones(5, np.float32)
    >>> unit = res.open(["w", "b"], [3, 2], x, step=0)
    >>> res.store.update(unit, x, np.float32([1, 0, 1, 1, 0.5]))   # the collective's call
    >>> res.residual("w", 3, np.float32).tolist(), res.residual("b", 2, np.float32).tolist()
    ([0.0, 1.0, 0.0], [0.0, 0.5])
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
from typing import Any, Iterator, Mapping, Sequence

import msgpack
import numpy as np

from ... import arrays
from ...comm.base import Transport
from ...error_feedback import HOP_SEP, KeyedResiduals, checked_extra, held_residual
from ...errors import ConfigError


def unit_key(keys: Sequence[str]) -> str:
    """The name of the unit of parameters ``keys`` (the same on every rank)."""
    return "unit:" + hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]


class ParameterResiduals:
    """Residuals by parameter name, the per-hop residuals of the units reduced, codec state.

    Everything lives in :attr:`store` (a :class:`~gradcomm.error_feedback.KeyedResiduals`,
    the :class:`~gradcomm.error_feedback.ResidualStore` handed to ``compressed_allreduce``);
    this class indexes it. :meth:`open` adds each parameter's residual to its slice of the
    unit's flat buffer and names the unit's parts in the store, whose ``update`` cuts
    ``x - decoded`` back into per-parameter residuals; collectives that re-compress per
    hop keep ``"<unit>#<hop>"`` residuals there with the offset where each lies in its
    unit, so that when the unit disappears (bucket rebuild, another rank count) its hop
    residuals are folded into the parameters' residuals, losing nothing. Stateful codecs
    keep per-parameter *extra* state there too (PowerSGD's warm-start ``"<name>#q"``, the
    same bytes on every rank), checkpointed with the residuals. ``shapes`` maps parameter
    names to their shapes (the hook records them), so that PowerSGD views each parameter
    as PyTorch's hook does.
    """

    def __init__(self, enabled: bool) -> None:
        self.store = KeyedResiduals(bool(enabled))
        self.units: dict[str, tuple[list[str], list[int]]] = {}
        self.shapes: dict[str, tuple[int, ...] | None] = {}
        self._used: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    @property
    def _residuals(self) -> dict[str, Any]:
        """Parameters' and hops' residuals by name (the store's table)."""
        return self.store._residuals

    @_residuals.setter
    def _residuals(self, table: dict[str, Any]) -> None:
        self.store._residuals = table

    @property
    def _extras(self) -> dict[str, np.ndarray]:
        return self.store._extras

    @_extras.setter
    def _extras(self, table: dict[str, np.ndarray]) -> None:
        self.store._extras = table

    @property
    def offsets(self) -> dict[str, int]:
        """Where each hop residual starts in its unit's buffer."""
        return self.store.offsets

    @offsets.setter
    def offsets(self, table: dict[str, int]) -> None:
        self.store.offsets = table

    def residual(self, name: str, n: int, dtype: Any, like: Any = None) -> Any:
        """The residual ``name`` (a parameter, or a hop of a unit) as a flat array of ``n``
        elements of ``dtype`` where ``like`` lives, as
        :meth:`~gradcomm.error_feedback.ErrorFeedback.residual` keeps it."""
        return held_residual(self._residuals, name, n, dtype, like)

    def names(self) -> Iterator[str]:
        """Names of the stored residuals (parameters and ``unit#hop`` entries)."""
        return iter(sorted(self._residuals))

    def sq_norm(self) -> float:
        """Sum of squares of every residual held (parameters and hops), in float64."""
        return float(sum(float((arrays.host(e).astype(np.float64) ** 2).sum())
                         for e in self._residuals.values()))

    def unit_arrays(self, unit: str) -> list[Any]:
        """The residuals of unit ``unit``'s parameters and hops (what the guard checks)."""
        names = set(self.units.get(unit, ([], []))[0])
        prefix = unit + HOP_SEP
        return [e for k, e in self._residuals.items() if k in names or k.startswith(prefix)]

    def clear(self) -> None:
        """Drop every residual held so far (units, offsets and codec state stay)."""
        self._residuals.clear()

    def clear_unit(self, unit: str) -> None:
        """Zero the residuals of unit ``unit``'s parameters and hops and drop their codec
        state (PowerSGD's ``Q``): the divergence guard's reset, on every rank alike."""
        self.store.clear(unit)

    def extra(self, name: str) -> np.ndarray | None:
        """The codec state stored under ``name``, or None."""
        return self._extras.get(name)

    def set_extra(self, name: str, value: np.ndarray) -> None:
        """Store flat numeric codec state ``value`` (not copied) under ``name``."""
        self._extras[name] = checked_extra(name, value)

    def extra_names(self) -> Iterator[str]:
        """Names of the stored codec state arrays."""
        return iter(sorted(self._extras))

    def open(self, keys: list[str], lengths: list[int], x: Any, step: int,
             unit: str | None = None, take: bool = True) -> str:
        """Add each parameter's residual to its slice of flat ``x`` (any array kind; a
        residual held elsewhere, e.g. loaded on the host, moves to ``x``'s device) and zero
        it; make :attr:`store` the unit's residual store for this reduction, at the hook's
        iteration ``step``. Returns the unit's key (``unit``, if the caller knows it).
        ``take=False``: the residuals are left where they are (a caller that adds them in
        a codec's fused pass: :meth:`~gradcomm.error_feedback.KeyedResiduals.owed`)."""
        unit = unit_key(keys) if unit is None else unit
        self.units[unit] = (list(keys), list(lengths))
        self._used.add(unit)
        store = self.store
        store.clock = int(step)
        if store.parts(unit) is None:
            store.set_parts(unit, [(k, n, self.shapes.get(k)) for k, n in zip(keys, lengths)])
        if take:
            store.take(unit, x)
        return unit

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
            from ...collectives.allgather import allgatherv

            blocks = allgatherv(t, np.frombuffer(msgpack.packb(mine), np.uint8))
            every = [msgpack.unpackb(b.tobytes(), raw=False) for b in blocks]
        else:
            every = [mine]
        copies = count_copies(every)[0 if t is None else t.rank]
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
        self.store.set_parts(unit, None)
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

    def restore(self, other: ParameterResiduals) -> None:
        """Take ``other``'s residuals, extra state, units and offsets (not its shapes)."""
        for unit in self.units:
            self.store.set_parts(unit, None)
        self._residuals, self.units, self.offsets = other._residuals, other.units, other.offsets
        self._extras = other._extras
        self._used = set(self.units)     # the replayed first iteration uses them again

    def copy(self) -> ParameterResiduals:
        """An independent copy (arrays, extra state, units, offsets, shapes)."""
        out = type(self)(self.enabled)
        out._residuals = {k: arrays.clone(v) for k, v in self._residuals.items()}
        out._extras = {k: v.copy() for k, v in self._extras.items()}
        out.units = {k: (list(n), list(ls)) for k, (n, ls) in self.units.items()}
        out.offsets = dict(self.offsets)
        out.shapes = dict(self.shapes)
        return out


def count_copies(every: list[Mapping[str, list[int]]]) -> list[dict[str, int]]:
    """For each rank's digests, how many ranks hold each of its hop residuals identically."""
    from collections import Counter

    seen = Counter((name, *map(int, d)) for digests in every for name, d in digests.items())
    return [{name: seen[(name, *map(int, d))] for name, d in digests.items()}
            for digests in every]



def redistribute(saved: list[ParameterResiduals], p_new: int, rank: int) -> ParameterResiduals:
    """This rank's residuals at ``p_new`` ranks from every saved rank's residuals.

    Hop residuals are folded into per-parameter residuals (divided by their number of
    identical copies among the saved ranks), then new rank ``rank`` sums the residuals
    of the saved ranks ``r`` with ``r % p_new == rank``, in rank order. Extra state
    (PowerSGD's warm-start ``Q``) is the same on every saved rank: every new rank
    takes saved rank 0's copy, so the new ranks agree too.
    """
    copies = count_copies([part.digests(list(part.units)) for part in saved])
    out = ParameterResiduals(True)
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


__all__ = ["ParameterResiduals", "count_copies", "redistribute", "unit_key"]
