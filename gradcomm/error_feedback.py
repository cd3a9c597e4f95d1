"""Error feedback: the compression error of one step is added back into the next.

For every ``key`` (usually a parameter name) :class:`ErrorFeedback` keeps a residual ``e``:
the value compressed is ``e + g`` and afterwards ``e ← (e + g) − decoded``, so what the
codec dropped is sent later instead of being lost (1-bit SGD, EF-SGD, DGC). Over ``T``
steps this telescopes: ``Σ decoded + e_T = Σ g``. Collectives that re-compress partial
sums at every hop keep one more residual per hop under ``"<key>#<hop>"`` in the same
object, and a step counter per key (it seeds the stochastic codecs). Stateful codecs keep
other per-key arrays in the same object (:meth:`ErrorFeedback.extra`, e.g. PowerSGD's
warm-start ``Q`` under ``"<key>#q"``), checkpointed with the residuals.

:class:`ResidualStore` is what the compressed collectives ask of such an object (steps,
the key's residual, per-hop residuals with their location, codec state, the tensors a
buffer is made of). :class:`ErrorFeedback` implements it, and :class:`KeyedResiduals` for
owners that keep their own books (the DDP hook indexes one by parameter name:
:mod:`gradcomm.integrations.ddp.residuals`).

Everything is held as plain numpy arrays and ints, so :meth:`ErrorFeedback.state_dict`
saves with ``numpy.savez`` (no pickle) or ``torch.save`` (load it with
``torch.load(path, weights_only=False)`` or inside
``torch.serialization.safe_globals(torch_safe_globals())``), and
:meth:`ErrorFeedback.load_state_dict` restores a continuation bitwise equal to never
having stopped.

Example:
    >>> import numpy as np
    >>> ef = ErrorFeedback()
    >>> g = np.array([0.25, 1.0], np.float32)
    >>> x = ef.compensate("w", g.copy())            # e + g (e starts at 0)
    >>> decoded = np.round(x)                        # a toy lossy codec
    >>> ef.update("w", x, decoded); ef.residual("w", 2, np.float32).tolist()
    [0.25, 0.0]
    >>> ef2 = ErrorFeedback(); ef2.load_state_dict(ef.state_dict())
    >>> ef2.residual("w", 2, np.float32).tolist()
    [0.25, 0.0]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from . import arrays
from .errors import ConfigError

#: format version of :meth:`ErrorFeedback.state_dict`
STATE_VERSION = 1
_RES, _STEP, _VER = "residual/", "step/", "gradcomm_error_feedback_version"
_EXTRA = "extra/"
#: separator between a key and the hop of a per-hop residual
HOP_SEP = "#"


@runtime_checkable
class ResidualStore(Protocol):
    """What a compressed collective needs from its caller's error-feedback state.

    A reduction of ``key`` asks for :meth:`step` first (it seeds the stochastic codecs;
    every rank must answer the same) and calls :meth:`advance` once it completed. Routes
    that compress the whole buffer once (allgather, sparse allgather; every route when
    p = 1) use the key's own residual: as one flat array (:meth:`flat_residual`) that a
    codec adds and updates in its own pass, or, when the store keeps it in pieces, through
    :meth:`compensate` before compressing and :meth:`update` after. Routes that
    re-compress a partial sum at every hop keep one residual per hop
    (:meth:`hop_residual`), told where the hop's segment starts in the buffer. Stateful
    codecs keep arrays between steps (:meth:`extra`, :meth:`set_extra`), and PowerSGD
    cuts a buffer into the tensors :meth:`parts` names.

    Example:
        >>> isinstance(ErrorFeedback(), ResidualStore)
        True
    """

    #: False: nothing is compensated and no residual is kept (steps and extras still are)
    enabled: bool

    def step(self, key: str) -> int:
        """The step of this reduction of ``key`` (the same on every rank)."""

    def advance(self, key: str) -> None:
        """A reduction of ``key`` completed (a store whose step is an outside clock, such as
        the DDP hook's iteration, has nothing to count)."""

    def flat_residual(self, key: str, n: int, dtype: Any, like: Any = None) -> Any | None:
        """``key``'s residual as one flat array of ``n`` elements of ``dtype`` where ``like``
        lives, which a codec may add and update in a single pass; None if the store keeps
        it in pieces (then :meth:`compensate` and :meth:`update` are called)."""

    def compensate(self, key: str, x: Any) -> Any:
        """``x += `` what the store owes ``key`` (flat ``x``, in place); returns ``x``."""

    def update(self, key: str, x: Any, decoded: Any) -> None:
        """Keep ``x - decoded`` as ``key``'s residual (``x``: what was compressed)."""

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        """The residual of hop ``name`` (``"<key>#<hop>"``): ``n`` elements of ``dtype``
        where ``like`` lives, for the segment that starts at ``offset`` of the buffer."""

    def extra(self, name: str) -> np.ndarray | None:
        """The codec state stored under ``name`` (``"<key>#..."``), or None."""

    def set_extra(self, name: str, value: np.ndarray) -> None:
        """Store flat numeric codec state ``value`` under ``name``."""

    def parts(self, key: str) -> Sequence[tuple[str, int, Any]] | None:
        """The tensors ``key``'s buffer is made of, in order, as ``(name, elements,
        shape or None)``; None if the store does not know."""


class ErrorFeedbackWarning(UserWarning):
    """Error feedback was asked for with a codec it would destabilise; it is not applied."""


class ResidualResetWarning(UserWarning):
    """A stored residual no longer fits its key (shape or dtype changed) and was zeroed."""


class ErrorFeedback:
    """Residuals per key and step counters, checkpointable as plain arrays and ints.

    ``enabled=False`` keeps only the step counters (the compressed values are then sent
    without compensation); :meth:`compensate` and :meth:`update` become no-ops.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self._residuals: dict[str, np.ndarray] = {}
        self._steps: dict[str, int] = {}
        self._extras: dict[str, np.ndarray] = {}

    # -- residuals ----------------------------------------------------------------------
    def residual(self, name: str, n: int, dtype: Any, like: Any = None) -> Any:
        """The residual ``name`` as a flat array of ``n`` elements of ``dtype``, kept
        where ``like`` (an array: numpy by default, or a cupy / torch array on its device,
        for codecs that run there) lives.

        Created as zeros on first use. A stored residual of another length or dtype (the
        parameter was resized, the algorithm or rank count changed) is reset to zeros with
        a :class:`ResidualResetWarning`. One held elsewhere (a checkpoint loaded on the
        host, then used on a GPU) is moved.
        """
        return held_residual(self._residuals, name, n, dtype, like)

    def flat_residual(self, key: str, n: int, dtype: Any, like: Any = None) -> Any:
        """:meth:`residual` ``key``: this store keeps every key's residual in one piece."""
        return held_residual(self._residuals, key, n, dtype, like)

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        """:meth:`residual` ``name`` (hops are told apart by name; ``offset`` is not
        needed)."""
        return held_residual(self._residuals, name, n, dtype, like)

    def parts(self, key: str) -> None:
        """None: this store does not know what tensors a key's buffer is made of."""
        return None

    def compensate(self, name: str, x: Any) -> Any:
        """``x += e`` in place (flat ``x``, any array kind) and return ``x``; no-op when
        disabled."""
        if self.enabled:
            x += held_residual(self._residuals, name, arrays.size(x), arrays.dtype_name(x), x)
        return x

    def update(self, name: str, x: Any, decoded: Any) -> None:
        """``e ← x − decoded`` where ``x`` is what was compressed (from :meth:`compensate`)."""
        if self.enabled:
            arrays.subtract(x, decoded, held_residual(self._residuals, name, arrays.size(x),
                                                      arrays.dtype_name(x), x))

    def reset(self, key: str | None = None) -> None:
        """Forget the residuals (and steps) of ``key`` and its hops, or of every key."""
        if key is None:
            self._residuals.clear()
            self._steps.clear()
            self._extras.clear()
            return
        for name in self._of(key, self._residuals):
            del self._residuals[name]
        for name in self._of(key, self._extras):
            del self._extras[name]
        self._steps.pop(key, None)

    def clear(self, key: str) -> None:
        """Zero ``key``'s residual and its hops' and drop its codec state (steps are kept:
        they seed the codecs alike on every rank); what the divergence guard does."""
        for name in self._of(key, self._residuals):
            arrays.assign(self._residuals[name], 0.0)
        for name in self._of(key, self._extras):
            del self._extras[name]

    def _roots(self, key: str) -> Sequence[str]:
        """The names whose entries (``name`` and ``"name#..."``) belong to ``key``."""
        return (key,)

    def _of(self, key: str, table: Mapping[str, Any]) -> list[str]:
        """The names in ``table`` that belong to ``key`` (:meth:`_roots`), sorted."""
        roots = self._roots(key)
        return sorted(n for n in table
                      if any(n == r or n.startswith(r + HOP_SEP) for r in roots))

    def names(self) -> Iterator[str]:
        """Names of the stored residuals (keys and ``key#hop`` entries)."""
        return iter(sorted(self._residuals))

    def residuals_of(self, key: str) -> list[np.ndarray]:
        """The residual of ``key`` and those of its hops (in name order)."""
        return [self._residuals[n] for n in self._of(key, self._residuals)]

    # -- other per-key state of stateful codecs ---------------------------------------------
    def extra(self, name: str) -> np.ndarray | None:
        """The flat array stored under ``name`` by :meth:`set_extra`, or None.

        Stateful codecs keep what they carry between steps here (PowerSGD: the warm-start
        ``Q`` of each part), so that it is checkpointed and reset with the residuals; it
        is kept whether or not error feedback is ``enabled``. Name entries after their key
        (``"<key>#..."``) so that :meth:`reset` of the key drops them too.
        """
        return self._extras.get(name)

    def set_extra(self, name: str, value: np.ndarray) -> None:
        """Store flat numeric array ``value`` (not copied) under ``name``."""
        self._extras[name] = checked_extra(name, value)

    def extra_names(self) -> Iterator[str]:
        """Names of the stored extra arrays."""
        return iter(sorted(self._extras))

    # -- steps --------------------------------------------------------------------------
    def step(self, key: str) -> int:
        """How many times ``key`` was reduced so far (seeds the stochastic codecs)."""
        return self._steps.get(key, 0)

    def advance(self, key: str) -> None:
        """Count one more reduction of ``key``."""
        self._steps[key] = self._steps.get(key, 0) + 1

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A flat ``{name: ndarray | int}`` copy of every residual and step counter.

        Names are ``"residual/<key>"``, ``"step/<key>"`` and ``"extra/<name>"`` (codec
        state, see :meth:`extra`) plus a version entry, so the dict passes straight to
        ``numpy.savez(path, **sd)``.
        """
        sd: dict[str, Any] = {_VER: STATE_VERSION}
        for name, e in self._residuals.items():
            sd[_RES + name] = arrays.host(e).copy()      # device residuals come to the host
        for key, s in self._steps.items():
            sd[_STEP + key] = int(s)
        for name, v in self._extras.items():
            sd[_EXTRA + name] = v.copy()
        return sd

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (also as loaded back by ``numpy.load``).

        Raises ConfigError for a state of another format or version.
        """
        try:
            version = int(np.asarray(state[_VER]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError("not an ErrorFeedback state dict (no "
                              f"{_VER!r} entry)") from None
        if version != STATE_VERSION:
            raise ConfigError(f"ErrorFeedback state version {version}, this gradcomm "
                              f"reads {STATE_VERSION}")
        residuals: dict[str, np.ndarray] = {}
        steps: dict[str, int] = {}
        extras: dict[str, np.ndarray] = {}
        for name in state:
            value = state[name]
            if name.startswith(_RES):
                arr = np.array(value, copy=True)
                if arr.ndim != 1 or arr.dtype.kind != "f":
                    raise ConfigError(f"residual {name!r}: expected a flat float array, "
                                      f"got shape {arr.shape} dtype {arr.dtype}")
                residuals[name[len(_RES):]] = arr
            elif name.startswith(_STEP):
                s = np.asarray(value)
                if s.ndim != 0 or s.dtype.kind not in "iu" or int(s) < 0:
                    raise ConfigError(f"step {name!r}: expected an int >= 0, got {value!r}")
                steps[name[len(_STEP):]] = int(s)
            elif name.startswith(_EXTRA):
                arr = np.array(value, copy=True)
                if arr.ndim != 1 or arr.dtype.kind not in "fiu":
                    raise ConfigError(f"extra state {name!r}: expected a flat numeric array, "
                                      f"got shape {arr.shape} dtype {arr.dtype}")
                extras[name[len(_EXTRA):]] = arr
            elif name != _VER:
                raise ConfigError(f"unexpected entry {name!r} in an ErrorFeedback state")
        self._residuals, self._steps, self._extras = residuals, steps, extras

    def __repr__(self) -> str:
        return (f"ErrorFeedback(enabled={self.enabled}, residuals={len(self._residuals)}, "
                f"keys={len(self._steps)})")


@dataclass
class _Layout:
    """One key's residual as one flat buffer: ``views[i]``, the view of it that piece
    ``i``'s residual is (None: the piece holds no residual yet), and the ``runs``
    ``(start, end)`` of consecutive pieces that hold one."""

    flat: Any
    views: list[Any]
    runs: list[tuple[int, int]]


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
        arrays.assign(lay.flat, 0.0)

    def update(self, key: str, x: Any, decoded: Any) -> None:
        """Each piece of ``key`` keeps its slice of ``x - decoded``."""
        if not self.enabled:
            return
        lay = self._layout(key, x) or self._lay_out(key, x)
        arrays.subtract(x, decoded, lay.flat)
        if any(v is None for v in lay.views):        # every piece holds a residual now
            self._register(key, lay, all_pieces=True)

    def _layout(self, key: str, x: Any) -> _Layout | None:
        """``key``'s :class:`_Layout` if it is still what the table holds, where ``x``
        is and of its dtype; else None."""
        lay = self._flats.get(key)
        if lay is None or arrays.dtype_name(lay.flat) != arrays.dtype_name(x) \
                or misplaced(lay.flat, x):
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
        lay = self._flats[key] = _Layout(flat, [None] * len(pieces), [])
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


def held_residual(table: dict[str, Any], name: str, n: int, dtype: Any, like: Any) -> Any:
    """``table[name]`` as a flat array of ``n`` elements of ``dtype`` where ``like`` lives
    (None: numpy); see :meth:`ErrorFeedback.residual`, which keeps its residuals this way.

    Example:
        >>> table = {}
        >>> held_residual(table, "w", 2, "float32", None).tolist(), sorted(table)
        ([0.0, 0.0], ['w'])
    """
    dt = np.dtype(dtype)
    e = table.get(name)
    if e is not None and (tuple(e.shape) != (n,) or arrays.dtype_name(e) != dt.name):
        warnings.warn(f"error-feedback residual {name!r} held {arrays.size(e)} x "
                      f"{arrays.dtype_name(e)} but {n} x {dt} is needed now; it was "
                      "reset to zeros", ResidualResetWarning, stacklevel=4)
        e = None
    home = like is not None and not arrays.is_host(like)
    if e is None:
        e = np.zeros(n, dt)
        if home:
            e = arrays.like(e, like)
        table[name] = e
    elif misplaced(e, like):
        e = table[name] = arrays.like(arrays.host(e).copy(), like) if home \
            else arrays.host(e).copy()
    return e


def misplaced(e: Any, like: Any) -> bool:
    """Whether array ``e`` is not where ``like`` lives (None: the host).

    Example:
        >>> misplaced(np.zeros(1), None), misplaced(np.zeros(1), np.ones(2))
        (False, False)
    """
    home = like is not None and not arrays.is_host(like)
    return home != (not arrays.is_host(e)) or (home and arrays.meta_of(e).device !=
                                                 arrays.meta_of(like).device)


def checked_extra(name: str, value: Any) -> np.ndarray:
    """``value`` if it is a flat numeric numpy array (codec state), else ConfigError."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "fiu":
        raise ConfigError(f"extra state {name!r} must be a flat numeric numpy array, got "
                          f"{getattr(value, 'shape', type(value).__name__)}")
    return value


def contractive(codec: Any, per_hop: bool = False) -> bool:
    """Whether error feedback is stable with ``codec``: its error must shrink the input,
    ``||C(x) − x|| < ||x||`` (in expectation, or elementwise relative to ``max |x|``).

    Error feedback feeds ``e + g`` back into the codec. For a contraction the residual
    stays bounded (EF-SGD theory); for a codec whose error can exceed its input, and
    grows with it, the residual grows without bound (measured here: QSGD with 4 levels
    reaches 10^9·||g|| within 300 steps; TernGrad's per-hop residuals diverge in trees).
    Contractions: fp16, bf16, int8 with >= 2 bits (error <= one level of the input's
    range), topk, randomk (not rescaled), onebit; QSGD when its variance bound
    ``min(d/s², √d/s) < 1`` (d = bucket size, s = levels; the default 512 / 127 gives
    0.03). Not: TernGrad (error up to ``max |v|`` per element), QSGD with few levels,
    1-bit int8. TernGrad still takes error feedback (``Compressor.feedback_stable``):
    each element's error stays below its bucket's ``max |v|``, which is sent exactly,
    and error feedback is measured to be what trains it with SGD (issue 13). That holds for
    one compression of a rank's own input (the gathered routes, the all-to-all
    reduce-scatter), not for a per-hop route (``per_hop=True``: ring, tree, recursive
    doubling, Rabenseifner, the ring reduce-scatter), which re-compresses partial sums and
    keeps a residual per hop: there TernGrad's residuals grow (measured: the running mean's
    error rises from 1.2x to 1.6x the signal over 24 steps at p = 4), so only contractions
    take error feedback per hop. Each codec
    declares it (``Compressor.contractive``; int8 and QSGD set it
    from their options).

    Example:
        >>> from gradcomm import compressors
        >>> contractive(compressors.get("topk")), contractive(compressors.get("int8", bits=1))
        (True, False)
        >>> contractive(compressors.get("terngrad")), contractive(compressors.get("terngrad"), per_hop=True)
        (True, False)
    """
    return bool(codec.contractive or (codec.feedback_stable and not per_hop))


def torch_safe_globals() -> list[Any]:
    """The numpy globals ``torch.load(weights_only=True)`` must allow to read a state.

    Example:
        >>> len(torch_safe_globals()) >= 3
        True
    """
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    dtypes = [type(np.dtype(c)) for c in ("float16", "float32", "float64")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


__all__ = ["ErrorFeedback", "ErrorFeedbackWarning", "KeyedResiduals", "ResidualResetWarning",
           "ResidualStore", "STATE_VERSION", "checked_extra", "contractive", "held_residual", "misplaced",
           "torch_safe_globals"]
