"""Where each parameter's gradient sits in an FSDP2 reduce-scatter input.

FSDP2 builds a module's reduce-scatter input with ``chunk_cat``: every parameter's
gradient is padded along dim 0 to a multiple of p rows and cut into p chunks of ``c``
rows; row r of the ``(p, S)`` input holds chunk r of every parameter, back to back, and
becomes rank r's shard. :class:`Layout` maps between that flat buffer and each
parameter's own flat, padded, row-major order (``p·k`` elements, ``k`` = one chunk's
elements), which is what checkpoints store: a residual there does not depend on p once the
padding is cut off (:meth:`Layout.unpad`).

Example:
    >>> import numpy as np
    >>> lay = Layout("blk", [Param("blk.w", (3, 2), 2), Param("blk.b", (3,), 2)], 2)
    >>> lay.n, [p.chunk for p in lay.params]
    (12, [4, 2])
    >>> flat = np.arange(12.0)
    >>> {k: v.tolist() for k, v in lay.split(flat).items()}["blk.b"]
    [4.0, 5.0, 10.0, 11.0]
    >>> bool((lay.join(lay.split(flat)) == flat).all())
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ...errors import ConfigError


@dataclass(frozen=True)
class Param:
    """One parameter: its name, shape and the dim-0 rows of one chunk (``c``)."""

    name: str
    shape: tuple[int, ...]
    rows: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rest(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk(self) -> int:
        """Elements of one rank's chunk (padding included)."""
        return self.rows * self.rest


class Layout:
    """The reduce-scatter input of one FSDPModule on ``p`` ranks (``key`` names it)."""

    def __init__(self, key: str, params: list[Param], p: int) -> None:
        self.key, self.params, self.p = key, params, p
        self.shard = sum(q.chunk for q in params)
        self.n = p * self.shard
        self.offsets = np.cumsum([0] + [q.chunk for q in params])[:-1].tolist()

    def split(self, flat: Any) -> dict[str, np.ndarray]:
        """Each parameter's ``p·k`` elements of ``flat`` (n elements), in its own order."""
        rows = np.asarray(flat).reshape(self.p, self.shard)
        return {q.name: rows[:, o:o + q.chunk].reshape(-1).copy()
                for q, o in zip(self.params, self.offsets)}

    def join(self, per_param: Mapping[str, np.ndarray], dtype: Any = np.float32
             ) -> np.ndarray:
        """The flat buffer from per-parameter arrays (``p·k`` elements each, or the
        unpadded ``numel``: re-padded with zeros; missing names are zeros)."""
        out = np.zeros((self.p, self.shard), dtype)
        for q, o in zip(self.params, self.offsets):
            a = per_param.get(q.name)
            if a is None:
                continue
            a = np.asarray(a).reshape(-1)
            if a.size == q.numel:
                a = np.concatenate([a, np.zeros(self.p * q.chunk - q.numel, a.dtype)])
            if a.size != self.p * q.chunk:
                raise ConfigError(f"residual of {q.name!r} has {a.size} elements; "
                                  f"{q.numel} (or {self.p * q.chunk} padded) expected")
            out[:, o:o + q.chunk] = a.reshape(self.p, q.chunk)
        return out.reshape(-1)

    def unpad(self, name: str, a: np.ndarray) -> np.ndarray:
        """A parameter's array in its own order without the padding rows."""
        q = next(q for q in self.params if q.name == name)
        return np.asarray(a).reshape(-1)[:q.numel]

    def shard_to_param(self, shard: np.ndarray, rank: int) -> dict[str, np.ndarray]:
        """Rank ``rank``'s shard (``S`` elements) placed in each parameter's own order
        (``p·k`` elements, zeros outside the rank's rows)."""
        out = {}
        for q, o in zip(self.params, self.offsets):
            full = np.zeros(self.p * q.chunk, shard.dtype)
            full[rank * q.chunk:(rank + 1) * q.chunk] = shard[o:o + q.chunk]
            out[q.name] = full
        return out


def layout_of(key: str, group: Any, names: Mapping[int, str]) -> Layout:
    """The :class:`Layout` of an ``FSDPParamGroup`` (its parameters named by ``names``,
    ``id(parameter) -> name``). ConfigError for layouts this integration cannot map."""
    p = group.mesh_info.shard_mesh_size
    params = []
    for fp in group.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            raise ConfigError(f"parameter sharded on dim {fp.fsdp_placement.dim} in {key!r}: "
                              "compressed reduce-scatter supports Shard(0) only (drop "
                              "shard_placement_fn, or leave this module uncompressed)")
        name = names.get(id(fp.sharded_param))
        if name is None:
            raise ConfigError(f"a parameter of FSDP module {key!r} is not among the model's "
                              "named_parameters(); call compress_fsdp on the root module")
        shape = tuple(int(s) for s in fp._orig_size)
        rows = int(fp.padded_sharded_param_size[0]) if shape else 1
        params.append(Param(name, shape, rows))
    return Layout(key, params, p)


__all__ = ["Layout", "Param", "layout_of"]
