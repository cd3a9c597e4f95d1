"""The residual store of an owner that keeps the books: :class:`KeyedResiduals` (the DDP
hook's, indexed by parameter name in :mod:`gradcomm.integrations.ddp.residuals`): a key's
residual is one flat buffer whose views are its pieces' residuals.

Example:
    >>> import numpy as np
    >>> store = KeyedResiduals()
    >>> store.set_parts("u", [("w", 2, None), ("b", 1, None)])
    >>> store.update("u", np.ones(3, np.float32), np.float32([1, 0, 1]))
    >>> store.residual("w", 2, np.float32).tolist()
    [0.0, 1.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import arrays
from ..compressors import _kernels
from ..compressors._kernels import Kernels
from .feedback import ErrorFeedback
from .store import held_residual, misplaced


@dataclass
class _Layout:
    """One key's residual as one flat buffer: ``views[i]``, the view of it that piece
    ``i``'s residual is (None: the piece holds no residual yet), the ``runs``
    ``(start, end)`` of consecutive pieces that hold one, the buffer's array
    ``backend`` (:func:`gradcomm.arrays.backend`) and the ``kernels`` that take its norm
    (:func:`gradcomm.compressors._kernels.for_array`), both chosen once."""

    flat: Any
    views: list[Any]
    runs: list[tuple[int, int]]
    backend: arrays.Backend
    kernels: Kernels


class KeyedResiduals(ErrorFeedback):
    """A :class:`ResidualStore` for an owner that keeps the books (the DDP hook's units).

    A key's residual is kept in pieces, one named residual per tensor the key is made of
    (:meth:`set_parts`), each a view of one flat buffer per key: the owner adds the key's
    residual to the buffer before the reduction and zeroes it (:meth:`take`: one
    operation per bucket, whatever its number of parameters), so :meth:`compensate` has
    nothing to add, and :meth:`update` writes ``x - decoded`` into the flat buffer, i.e.
    into every piece at once. The buffer is laid out anew (the pieces' residuals taken in
    one by one) when the key's parts, or the dtype or place of its data, change, or when
    a piece's residual was replaced (a checkpoint loaded, a fold). Hop residuals are
    named residuals too, with the offset where each lies in its key's buffer recorded
    (:attr:`offsets`); steps follow the owner's :attr:`clock` (the same on every rank).
    The owner checkpoints what it needs (this class adds nothing to :meth:`state_dict`).

    Example:
        >>> import numpy as np
        >>> store = KeyedResiduals()
        >>> store.clock = 4
        >>> store.set_parts("u", [("w", 2, None), ("b", 1, None)])
        >>> x = np.ones(3, np.float32)
        >>> store.update("u", x, np.float32([1, 0, 1])); store.step("u")
        4
        >>> store.residual("w", 2, np.float32).tolist(), store.residual("b", 1, np.float32)
        ([0.0, 1.0], array([0.], dtype=float32))
        >>> store.hop_residual("u#e0", 2, 1, np.float32).size, store.offsets
        (1, {'u#e0': 2})
        >>> store.take("u", x); x.tolist(), store.residual("w", 2, np.float32).tolist()
        ([1.0, 2.0, 1.0], [0.0, 0.0])
    """

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(enabled)
        self.clock = 0
        self.offsets: dict[str, int] = {}
        self._parts: dict[str, list[tuple[str, int, Any]]] = {}
        self._pieces: dict[str, list[tuple[str, int, int]]] = {}
        #: key -> its flat buffer and the views of it its pieces' residuals are
        self._flats: dict[str, _Layout] = {}

    def set_parts(self, key: str, parts: Sequence[tuple[str, int, Any]] | None) -> None:
        """``key``'s buffer is made of ``parts``: ``(name, elements, shape or None)`` in
        order, each with its own named residual (None: forget the key's parts)."""
        self._flats.pop(key, None)
        if parts is None:
            self._parts.pop(key, None)
            self._pieces.pop(key, None)
            return
        self._parts[key] = [(str(k), int(n), s) for k, n, s in parts]
        pieces, a = [], 0
        for k, n, _ in self._parts[key]:
            pieces.append((k, a, a + n))
            a += n
        self._pieces[key] = pieces

    def step(self, key: str) -> int:
        """The owner's clock."""
        return self.clock

    def advance(self, key: str) -> None:
        """Nothing to count: the step is the owner's clock."""

    def flat_residual(self, key: str, n: int, dtype: Any, like: Any = None) -> None:
        """None: a key's residual is kept in pieces."""
        return None

    def compensate(self, key: str, x: Any) -> Any:
        """``x`` as it is: the owner added the pieces before the reduction."""
        return x

    def take(self, key: str, x: Any) -> None:
        """``x += `` ``key``'s residual (flat ``x`` where the reduction runs, any array
        kind), which is zeroed: the owner's step before the reduction. Residuals of another
        length or dtype are reset (:func:`held_residual`); no-op when disabled."""
        if not self.enabled:
            return
        lay = self._layout(key, x)
        if lay is None:
            self._lay_out(key, x, take=True)
            return
        for a, b in lay.runs:
            x[a:b] += lay.flat[a:b]
        lay.backend.assign(lay.flat, 0.0)

    def owed(self, key: str, x: Any) -> Any | None:
        """``key``'s residual as one flat array as long as ``x``, where ``x`` is and of its
        dtype, once every piece holds one there (after the first :meth:`update`): a
        caller may then hand it to a codec's fused pass (``compress(x, residual=...)``:
        ``x + e`` encoded, ``e`` left holding what the codec lost) instead of
        :meth:`take` and :meth:`update`, with the same bytes. None: not yet (or disabled).

        Example:
            >>> store = KeyedResiduals()
            >>> store.set_parts("u", [("w", 2, None)])
            >>> x = np.float32([1, 2])
            >>> store.owed("u", x), store.update("u", x, np.float32([1, 1]))
            (None, None)
            >>> store.owed("u", x).tolist()
            [0.0, 1.0]
        """
        if not self.enabled:
            return None
        lay = self._layout(key, x)
        if lay is None or lay.runs != [(0, arrays.size(x))]:
            return None
        return lay.flat

    def update(self, key: str, x: Any, decoded: Any) -> None:
        """Each piece of ``key`` keeps its slice of ``x - decoded`` (added to
        :attr:`tally` when one is set, as the codecs' fused passes add theirs)."""
        if not self.enabled:
            return
        lay = self._layout(key, x) or self._lay_out(key, x)
        lay.backend.subtract(x, decoded, lay.flat)
        if self.tally is not None:                  # add_tally's sum, kernels chosen once
            self.tally[0] += lay.kernels.sq_norm(lay.flat)
            self.tally[1] += lay.flat.shape[0]
        if any(v is None for v in lay.views):        # every piece holds a residual now
            self._register(key, lay, all_pieces=True)

    def _layout(self, key: str, x: Any) -> _Layout | None:
        """``key``'s :class:`_Layout` if it is still what the table holds, where ``x``
        is and of its dtype; else None."""
        lay = self._flats.get(key)
        if lay is None:
            return None
        if isinstance(x, np.ndarray) and isinstance(lay.flat, np.ndarray):   # the host
            if lay.flat.dtype != x.dtype:
                return None
        elif arrays.dtype_name(lay.flat) != arrays.dtype_name(x) or misplaced(lay.flat, x):
            return None
        table = self._residuals
        for (name, _, _), view in zip(self._pieces[key], lay.views):
            if table.get(name) is not view:
                return None
        return lay

    def _lay_out(self, key: str, x: Any, take: bool = False) -> _Layout:
        """A new flat buffer for ``key`` where ``x`` is (zeros). With ``take``, each
        piece's residual is added to its slice of ``x`` as it is taken in, and pieces
        without one stay without (none is made before :meth:`update`); else every piece
        gets its view."""
        table, dtype = self._residuals, arrays.dtype_name(x)
        pieces = self._pieces[key]
        flat = held_residual({}, key, pieces[-1][2] if pieces else 0, dtype, x)   # zeros
        for name, a, b in pieces:
            if take:
                _take_piece(table, name, a, b, x)
            elif name in table:
                held_residual(table, name, b - a, dtype, x)     # (warns if reset)
        lay = self._flats[key] = _Layout(flat, [None] * len(pieces), [], arrays.backend(flat),
                                          _kernels.for_array(flat))
        self._register(key, lay, all_pieces=not take)
        return lay

    def _register(self, key: str, lay: _Layout, all_pieces: bool) -> None:
        """Make the pieces' residuals views of ``lay.flat`` (every piece, or those that
        hold one) and note the runs of consecutive pieces that do."""
        table = self._residuals
        lay.runs = []
        for i, (name, a, b) in enumerate(self._pieces[key]):
            if all_pieces or name in table:
                table[name] = lay.views[i] = lay.flat[a:b]
                if lay.runs and lay.runs[-1][1] == a:
                    lay.runs[-1] = (lay.runs[-1][0], b)
                else:
                    lay.runs.append((a, b))

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        """The hop's residual; ``offset`` is recorded (:attr:`offsets`)."""
        self.offsets[name] = int(offset)
        e = self._residuals.get(name)
        if isinstance(e, np.ndarray) and (like is None or isinstance(like, np.ndarray)) \
                and e.shape == (n,) and e.dtype == dtype:        # held as it is needed
            return e
        return held_residual(self._residuals, name, n, dtype, like)

    def parts(self, key: str) -> list[tuple[str, int, Any]] | None:
        """The parts :meth:`set_parts` gave ``key``, or None."""
        return self._parts.get(key)

    def _roots(self, key: str) -> Sequence[str]:
        """``key`` and its parts: :meth:`clear`, :meth:`reset` and :meth:`residuals_of`
        reach the pieces' residuals and codec state (``"<part>#q"``) too."""
        return (key, *(name for name, _, _ in self._parts.get(key, ())))


def _take_piece(table: dict[str, Any], name: str, a: int, b: int, x: Any) -> Any:
    """``x[a:b] += table[name]`` where that residual has ``b - a`` elements of ``x``'s
    dtype (moved to ``x``'s place first); one of another size or dtype is reset
    (:func:`held_residual`). Returns the residual, or None if there is none."""
    e = table.get(name)
    if e is not None:
        dtype = arrays.dtype_name(x)
        kept = tuple(e.shape) == (b - a,) and arrays.dtype_name(e) == dtype
        e = held_residual(table, name, b - a, dtype, x)
        if kept:
            x[a:b] += e
    return e


__all__ = ["KeyedResiduals"]
