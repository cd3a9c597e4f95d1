"""Codec kernels: a pure-numpy path that is always correct, a numba path that is fast, and
an array-generic path (``xp``) that runs on cupy and torch arrays, CPU or CUDA.

All three implement the same functions (:class:`~._protocol.Kernels`; numba also
:class:`~._protocol.FusedKernels`) with the same floating-point operations in the same
order, so they produce identical bytes (tested). :func:`get` returns the numba module when
numba is installed (the ``fast`` extra) and the numpy module otherwise; the environment
variable ``GRADCOMM_KERNELS=numpy|numba|auto`` overrides the choice. Codecs call
:func:`for_size`, which under ``auto`` keeps arrays below :data:`FAST_MIN` elements on the
numpy path: they gain nothing from compiled code, and a process that only ever compresses
small arrays (tests, small models) never pays numba's one-time compilation (tens of
seconds on a cold cache). numba is imported on first use, not when gradcomm is imported;
compiled kernels are cached on disk (``cache=True``).

:func:`for_array` is what codecs call: numpy arrays get :func:`for_size`'s module; cupy
arrays and torch tensors get :mod:`._xp`, written once against the array API (through
``array_api_compat``), so codecs run where the data is with the same bytes as the numpy
path (tested on numpy and torch CPU; a GPU runs the same code). ``GRADCOMM_KERNELS=xp``
sends numpy arrays through it too (the tests do, to cover it with every codec).

Example:
    >>> k = get("numpy")
    >>> k.NAME
    'numpy'
    >>> get().NAME in available()
    True
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from ...errors import ConfigError
from ._protocol import FusedKernels, Kernels

_cache: dict[str, ModuleType | None] = {}
#: smallest array the automatic choice sends to the numba path
FAST_MIN = 1 << 16


def _load(name: str) -> ModuleType | None:
    if name not in _cache:
        try:
            _cache[name] = importlib.import_module(f"{__name__}._{name}")
        except ImportError:
            _cache[name] = None
    return _cache[name]


def available() -> tuple[str, ...]:
    """Kernel paths usable here (``numpy`` always; ``xp`` with array-api-compat)."""
    names = tuple(n for n in ("numba", "numpy") if _load(n) is not None)
    return names + (("xp",) if _xp_usable() else ())


def _xp_usable() -> bool:
    import importlib.util

    return importlib.util.find_spec("array_api_compat") is not None and \
        _load("xp") is not None


def get(name: str | None = None) -> Kernels:
    """The kernel module ``name`` ("numpy", "numba", "xp", or None/"auto" for the best
    one)."""
    name = name or os.environ.get("GRADCOMM_KERNELS", "auto") or "auto"
    if name == "auto":
        return _load("numba") or _load("numpy")
    if name not in ("numpy", "numba", "xp"):
        raise ConfigError(f"kernel path must be 'numpy', 'numba', 'xp' or 'auto', got "
                          f"{name!r}")
    if name == "xp":
        return _xp_module()
    mod = _load(name)
    if mod is None:
        raise ConfigError(f"kernel path {name!r} is not available (install gradcomm[fast])")
    return mod


def _xp_module() -> Kernels:
    if not _xp_usable():
        raise ConfigError("codecs on cupy arrays and torch tensors need array-api-compat "
                          "(pip install 'gradcomm[torch]' or 'gradcomm[gpu]')")
    return _load("xp")  # type: ignore[return-value]


def for_array(a: Any) -> Kernels:
    """The kernel module for array ``a``: :func:`for_size` for numpy, :mod:`._xp` for cupy
    arrays and torch tensors (any device).

    Example:
        >>> import numpy as np
        >>> for_array(np.zeros(3)).NAME in ("numpy", "xp")
        True
    """
    import numpy as np

    if isinstance(a, np.ndarray):
        return for_size(a.size)
    return _xp_module()


def for_size(n: int) -> Kernels:
    """The kernel module for an array of ``n`` elements (see :data:`FAST_MIN`)."""
    name = os.environ.get("GRADCOMM_KERNELS", "auto") or "auto"
    if name == "auto" and n < FAST_MIN:
        return _load("numpy")
    return get(name)


def f32_target(out: Any) -> Any:
    """Where a float32 kernel writes a result meant for ``out`` (``out`` itself if
    float32), any array kind."""
    from ... import arrays
    if arrays.dtype_name(out) == "float32":
        return out
    return arrays.empty_like_kind(out, arrays.size(out), "float32")


def f32_finish(tmp: Any, out: Any, k: Kernels, add: bool = False) -> Any:
    """Round the float32 ``tmp`` into ``out`` (float16 through ``k``'s canonical cast);
    with ``add``, ``out = rounded + out`` instead (a float32 ``out`` is the kernel's own
    target: its kernel already added). Any array kind."""
    import numpy as np

    from ... import arrays
    if tmp is not out:
        if arrays.dtype_name(out) == "float16":
            if add:
                h = arrays.empty_like_kind(out, arrays.size(out), "uint16")
                k.f32_to_f16(tmp, h)
                out += arrays.bitcast(h, "float16")     # IEEE addition commutes
            else:
                k.f32_to_f16(tmp, arrays.bitcast(out, "uint16"))
        elif add:
            with np.errstate(invalid="ignore", over="ignore"):
                out += tmp
        else:
            arrays.assign(out, tmp)
    return out


class Tallied:
    """The fused encoders of ``k`` (a :class:`FusedKernels` path), each also adding its new
    residual's ``(sq_norm, size)`` into ``tally`` (host float64[2]; a float64[4] also
    takes the input's into ``tally[2:4]``: in the 16-bit casts' pass, before the other
    encoders' passes here): what a codec's ``_encode`` is handed for
    ``compress(..., residual=, tally=)``; the codecs call only the ``*_fused`` encoders on
    it.

    Example:
        >>> import numpy as np
        >>> k, t = get("numba"), np.zeros(2)
        >>> x, e = np.array([1.0, -3.0], np.float32), np.zeros(2, np.float32)
        >>> Tallied(k, t).f32_to_f16_fused(x, np.empty(2, np.uint16), e); t.tolist()
        [0.0, 2.0]
    """

    NAME = "tallied"
    FUSED = True

    def __init__(self, k: FusedKernels, tally: Any) -> None:
        self.k, self.tally = k, tally

    def _input(self, x: Any) -> None:
        """The input's ``(sq_norm, size)`` into ``tally[2:4]`` where it has four entries
        (for the encoders that do not take it in their own pass)."""
        if self.tally.size > 2:
            self.tally[2] += self.k.sq_norm(x)
            self.tally[3] += x.size

    def f32_to_f16_fused(self, x: Any, out: Any, residual: Any = None,
                         decoded: Any = None) -> None:
        self.k.f32_to_f16_fused(x, out, residual, decoded, tally=self.tally)

    def f32_to_bf16_fused(self, x: Any, out: Any, residual: Any = None,
                          decoded: Any = None) -> None:
        self.k.f32_to_bf16_fused(x, out, residual, decoded, tally=self.tally)

    def minmax_encode_fused(self, x: Any, bs: int, bits: int, stochastic: bool, key: Any,
                            lo_out: Any, unit_out: Any, packed: Any, residual: Any = None,
                            decoded: Any = None) -> None:
        self._input(x)
        self.k.minmax_encode_fused(x, bs, bits, stochastic, key, lo_out, unit_out, packed,
                                   residual, decoded, tally=self.tally)

    def fixed_encode_fused(self, x: Any, bits: int, scale: float, stochastic: bool,
                           key: Any, packed: Any, residual: Any = None,
                           decoded: Any = None) -> None:
        self._input(x)
        self.k.fixed_encode_fused(x, bits, scale, stochastic, key, packed, residual, decoded,
                                  tally=self.tally)

    def signlevel_encode_fused(self, x: Any, bs: int, levels: int, bits: int, l2: bool,
                               key: Any, scale_out: Any, packed: Any, residual: Any = None,
                               decoded: Any = None) -> None:
        self._input(x)
        self.k.signlevel_encode_fused(x, bs, levels, bits, l2, key, scale_out, packed,
                                      residual, decoded, tally=self.tally)

    def onebit_encode_fused(self, x: Any, bs: int, pos_out: Any, neg_out: Any, packed: Any,
                            residual: Any = None, decoded: Any = None) -> None:
        self._input(x)
        self.k.onebit_encode_fused(x, bs, pos_out, neg_out, packed, residual, decoded,
                                   tally=self.tally)
