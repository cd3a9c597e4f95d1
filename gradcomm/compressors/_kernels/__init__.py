"""Codec kernels: a pure-numpy path that is always correct and a numba path that is fast.

Both implement the same functions with the same floating-point operations in the same
order, so they produce identical bytes (tested). :func:`get` returns the numba module when
numba is installed (the ``fast`` extra) and the numpy module otherwise; the environment
variable ``GRADCOMM_KERNELS=numpy|numba|auto`` overrides the choice. Codecs call
:func:`for_size`, which under ``auto`` keeps arrays below :data:`FAST_MIN` elements on the
numpy path: they gain nothing from compiled code, and a process that only ever compresses
small arrays (tests, small models) never pays numba's one-time compilation (tens of
seconds on a cold cache). numba is imported on first use, not when gradcomm is imported;
compiled kernels are cached on disk (``cache=True``).

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

from ...errors import ConfigError

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
    """Kernel paths usable here (``numpy`` always)."""
    return tuple(n for n in ("numba", "numpy") if _load(n) is not None)


def get(name: str | None = None) -> ModuleType:
    """The kernel module ``name`` ("numpy", "numba", or None/"auto" for the best one)."""
    name = name or os.environ.get("GRADCOMM_KERNELS", "auto") or "auto"
    if name == "auto":
        return _load("numba") or _load("numpy")
    if name not in ("numpy", "numba"):
        raise ConfigError(f"kernel path must be 'numpy', 'numba' or 'auto', got {name!r}")
    mod = _load(name)
    if mod is None:
        raise ConfigError(f"kernel path {name!r} is not available (install gradcomm[fast])")
    return mod


def for_size(n: int) -> ModuleType:
    """The kernel module for an array of ``n`` elements (see :data:`FAST_MIN`)."""
    name = os.environ.get("GRADCOMM_KERNELS", "auto") or "auto"
    if name == "auto" and n < FAST_MIN:
        return _load("numpy")
    return get(name)


def f32_target(out):
    """Where a float32 kernel writes a result meant for ``out`` (``out`` itself if float32)."""
    import numpy as np
    return out if out.dtype == np.float32 else np.empty(out.size, np.float32)


def f32_finish(tmp, out, k: ModuleType, add: bool = False):
    """Round the float32 ``tmp`` into ``out`` (float16 through ``k``'s canonical cast);
    with ``add``, ``out = rounded + out`` instead (a float32 ``out`` is the kernel's own
    target: its kernel already added)."""
    import numpy as np
    if tmp is not out:
        if out.dtype == np.float16:
            if add:
                h = np.empty(out.size, np.uint16)
                k.f32_to_f16(tmp, h)
                np.add(h.view(np.float16), out, out=out)
            else:
                k.f32_to_f16(tmp, out.view(np.uint16))
        elif add:
            np.add(tmp, out, out=out)
        else:
            out[...] = tmp
    return out
