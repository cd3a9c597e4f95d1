"""The plain residual store: :class:`ErrorFeedback`, residuals and step counters per key,
checkpointable as plain arrays and ints (no pickle), and :func:`torch_safe_globals` for
reading such a checkpoint with ``torch.load(weights_only=True)``.

Example:
    >>> import numpy as np
    >>> ef = ErrorFeedback()
    >>> x = ef.compensate("w", np.array([0.25, 1.0], np.float32))
    >>> ef.update("w", x, np.round(x)); ef.state_dict()["residual/w"].tolist()
    [0.25, 0.0]
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .. import arrays
from ..compressors.base import add_tally
from ..errors import ConfigError
from .store import HOP_SEP, checked_extra, held_residual

#: format version of :meth:`ErrorFeedback.state_dict`
STATE_VERSION = 1
_RES, _STEP, _VER = "residual/", "step/", "gradcomm_error_feedback_version"
_EXTRA = "extra/"


class ErrorFeedback:
    """Residuals per key and step counters, checkpointable as plain arrays and ints.

    ``enabled=False`` keeps only the step counters (the compressed values are then sent
    without compensation); :meth:`compensate` and :meth:`update` become no-ops.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        #: see :attr:`ResidualStore.tally` (None: no tally)
        self.tally: np.ndarray | None = None
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
        """``e ← x − decoded`` where ``x`` is what was compressed (from :meth:`compensate`);
        ``e`` is added to :attr:`tally` when one is set."""
        if self.enabled:
            e = held_residual(self._residuals, name, arrays.size(x), arrays.dtype_name(x), x)
            arrays.subtract(x, decoded, e)
            if self.tally is not None:
                add_tally(self.tally, e)

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


__all__ = ["ErrorFeedback", "STATE_VERSION", "torch_safe_globals"]
