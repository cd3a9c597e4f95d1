"""The one package that knows the array libraries (numpy, torch, cupy).

Everything else in gradcomm works on flat, contiguous buffers with numpy-compatible
storage dtypes (``bfloat16`` is carried as ``uint16``) and calls the functions here, which
never branch on the library: :func:`backend` picks one :class:`~.base.Backend` per array
(:mod:`._numpy`, :mod:`._torch`, :mod:`._cupy`) by its type, once. A library is only
consulted if it is already in ``sys.modules``, so inspecting a numpy array never imports
torch or cupy.

One flat representation, one pair of converters: :func:`to_flat` makes a fresh flat copy
placed where :func:`~.placement.placement` says ("host", "device" or "native"), and
:func:`from_flat` turns any such buffer back into the user's kind of array.

Example:
    >>> import numpy as np
    >>> buf, meta = to_flat(np.arange(6, dtype=np.float32).reshape(2, 3))
    >>> buf.shape, meta.dtype, meta.shape
    ((6,), 'float32', (2, 3))
    >>> from_flat(buf * 2, meta).tolist()
    [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, ContextManager

import numpy as np

from .._dtypes import STORAGE
from ..errors import ConfigError
from ._cupy import CUPY
from ._numpy import NUMPY
from ._torch import TORCH
from .base import PLACEMENTS, Backend, Meta
from .placement import CODEC_PLACEMENTS, HOST_ONLY, codec_mode, cuda_usable, placement

__all__ = [
    "CODEC_PLACEMENTS", "HOST_ONLY", "PLACEMENTS", "Backend", "Meta", "assign", "backend",
    "bitcast", "byte_view", "cast", "clone", "codec_mode", "copy_from_host",
    "copy_to_host", "cuda_usable", "data_ptr", "device_scope", "device_scoped",
    "divide_", "dtype_name", "empty", "empty_like_kind", "flat", "from_flat", "host",
    "host_view", "is_contiguous", "is_device", "is_host", "itemsize", "kind", "like",
    "meta_of", "namespace", "nbytes", "placement", "size", "subtract", "sync", "to_flat",
    "torch_bytes",
]

#: Meta.kind -> backend
_KINDS: dict[str, Backend] = {b.kind: b for b in (NUMPY, TORCH, CUPY)}
#: array type -> backend, filled on first sight (subclasses such as torch.nn.Parameter
#: get their own entry)
_TYPES: dict[type, Backend] = {np.ndarray: NUMPY}
_TYPES_LIMIT = 256


def _find(x: Any) -> Backend | None:
    """The backend of ``x``'s type by isinstance (libraries already imported only)."""
    if isinstance(x, np.ndarray):
        b: Backend = NUMPY
    else:
        torch = sys.modules.get("torch")
        cupy = sys.modules.get("cupy")
        if torch is not None and isinstance(x, torch.Tensor):
            b = TORCH
        elif cupy is not None and isinstance(x, cupy.ndarray):
            b = CUPY
        else:
            return None
    if len(_TYPES) < _TYPES_LIMIT:
        _TYPES[type(x)] = b
    return b


def backend(x: Any) -> Backend:
    """The :class:`~.base.Backend` of array ``x``; ConfigError for anything else.

    Example:
        >>> import numpy as np
        >>> backend(np.zeros(2)).kind
        'numpy'
    """
    b = _TYPES.get(type(x)) or _find(x)
    if b is None:
        raise ConfigError(f"expected a numpy array, torch tensor or cupy array, got "
                          f"{type(x).__module__}.{type(x).__qualname__}")
    return b


def kind(x: Any) -> str:
    """'numpy', 'torch' or 'cupy'; ConfigError for anything else."""
    return backend(x).kind


def small_view(x: Any, limit: int) -> np.ndarray | None:
    """:meth:`Backend.small_view <gradcomm.arrays.base.Backend.small_view>` of ``x`` (None
    for anything that is not an array of a known library: never raises)."""
    b = _TYPES.get(type(x)) or _find(x)
    return None if b is None else b.small_view(x, limit)


def from_small(a: np.ndarray, x: Any) -> Any:
    """Numpy ``a`` as an array of ``x``'s library (:meth:`Backend.from_small`)."""
    return backend(x).from_small(a)


def meta_of(x: Any) -> Meta:
    """Describe ``x`` without copying it."""
    return backend(x).meta(x)


# -- flat buffers -----------------------------------------------------------------------------

def to_flat(x: Any, where: str = "host") -> tuple[Any, Meta]:
    """A fresh flat copy of ``x`` in its storage dtype, placed ``where`` (what
    :func:`placement` said: "host", a numpy array; "device", a cupy array on ``x``'s CUDA
    device, its stream synchronised; "native", an array of ``x``'s own library where it
    lives), and its :class:`Meta`. ``x`` itself is never modified or aliased.

    Example:
        >>> import numpy as np
        >>> buf, meta = to_flat(np.ones((2, 2), np.float32), "native")
        >>> type(buf).__name__, buf.shape
        ('ndarray', (4,))
    """
    b = backend(x)
    meta = b.meta(x)
    return b.to_flat(x, meta, where), meta


def from_flat(buf: Any, meta: Meta) -> Any:
    """Flat storage buffer ``buf`` from :func:`to_flat` (any placement; taken over, not
    copied where it already is on the right side) as the array ``meta`` describes."""
    b = _KINDS[meta.kind]
    if isinstance(buf, np.ndarray):
        return b.from_host(buf, meta)
    return b.from_device(buf, meta)


def empty(meta: Meta) -> Any:
    """A new uninitialised array of the kind, dtype, shape and device ``meta`` describes."""
    return _KINDS[meta.kind].from_host(np.empty(meta.count, STORAGE[meta.dtype]), meta)


def host_view(x: Any) -> np.ndarray:
    """A flat numpy view of a contiguous CPU array (no copy), bfloat16 as uint16.

    Raises ConfigError if ``x`` is not contiguous or not in host memory.
    """
    return backend(x).host_view(x)


def is_device(buf: Any) -> bool:
    """True for a device (cupy) buffer, False for a host (numpy) one."""
    return not isinstance(buf, np.ndarray) and backend(buf) is CUPY


def sync(buf: Any) -> None:
    """Wait until the work queued on the current CUDA stream (which may still write
    ``buf``) is done, so that a library such as MPI may touch ``buf``. No-op on host
    arrays and on anything that is not an array.

    Example:
        >>> import numpy as np
        >>> sync(np.zeros(3))
    """
    b = _TYPES.get(type(buf)) or _find(buf)
    if b is not None:
        b.sync(buf)


def torch_bytes(buf: Any) -> Any:
    """A flat ``torch.uint8`` tensor sharing memory with the flat contiguous buffer
    ``buf`` (numpy, torch or cupy; no copy), for libraries that move torch tensors.

    Example:
        >>> import numpy as np
        >>> t = torch_bytes(np.ones(2, np.float32))
        >>> t.dtype, t.numel()
        (torch.uint8, 8)
    """
    return backend(buf).torch_bytes(buf)


# -- staging through host memory (wrap()'s Allreduce) -----------------------------------------
# Byte-level copies between an array's memory (any kind, any device) and host memory, so
# that callers never branch on the library. Host arrays take the same functions (plain
# copies), which lets the staging logic run and be tested on machines without a GPU.

def is_contiguous(x: Any) -> bool:
    """Whether ``x``'s elements are one C-contiguous block of memory (any kind or device).

    Example:
        >>> import numpy as np
        >>> is_contiguous(np.zeros((2, 3))), is_contiguous(np.zeros((2, 3)).T)
        (True, False)
    """
    return backend(x).is_contiguous(x)


def byte_view(x: Any) -> Any:
    """A flat uint8 view of contiguous ``x``'s memory where it lives (no copy): numpy for
    host arrays, cupy for CUDA arrays (torch tensors through DLPack; needs cupy).

    Example:
        >>> import numpy as np
        >>> x = np.ones(2, np.float32)
        >>> v = byte_view(x); v.dtype.name, v.size, np.shares_memory(v, x)
        ('uint8', 8, True)
    """
    return backend(x).byte_view(x)


def copy_to_host(x: Any, nbytes: int | None = None) -> np.ndarray:
    """A fresh host copy (flat uint8 numpy) of the first ``nbytes`` (default: all) of
    contiguous ``x``'s memory, any kind or device; for a CUDA array the stream that
    produces it is synchronised first. Host arrays are copied too.

    Example:
        >>> import numpy as np
        >>> copy_to_host(np.arange(3, dtype=np.uint8), 2).tolist()
        [0, 1]
    """
    return backend(x).copy_to_host(x, nbytes)


def copy_from_host(x: Any, data: np.ndarray) -> None:
    """Copy the bytes of the contiguous host array ``data`` into the start of contiguous
    ``x``'s memory, in place, any kind or device; returns when the copy is complete (the
    CUDA stream is synchronised).

    Example:
        >>> import numpy as np
        >>> x = np.zeros(3, np.uint8)
        >>> copy_from_host(x, np.array([7, 8], np.uint8)); x.tolist()
        [7, 8, 0]
    """
    if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
        raise ConfigError("copy_from_host needs a C-contiguous numpy array as data")
    backend(x).copy_from_host(x, data.reshape(-1).view(np.uint8))


# -- array namespaces: codec kernels that run where the data is -------------------------------
# The device kernels (``compressors/_kernels/_xp.py``) are written once against a
# numpy-like namespace (the array API, through ``array_api_compat``) and run on numpy,
# cupy and torch arrays, CPU or CUDA. The few things that namespace lacks are here.

def device_scope(*arrays: Any) -> ContextManager[Any]:
    """A context in which the library of the first cupy array among ``arrays`` creates
    arrays and runs kernels on that array's device; a no-op without one.

    cupy allocates and launches on the *current* device whatever its operands' device
    (``array_api_compat``'s cupy creation functions ignore ``device=``), so code that
    makes new arrays next to a cupy array on another device must run in this scope.
    torch ops run on their operands' device and creation takes ``device=``: no-op.

    Example:
        >>> import numpy as np
        >>> with device_scope(np.zeros(1), 3):
        ...     pass
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return a.device         # a cupy.cuda.Device: a context manager
    return contextlib.nullcontext()


def device_scoped(fn: Any) -> Any:
    """Decorator: run ``fn`` in the :func:`device_scope` of its positional arguments (the
    device kernels: new cupy arrays and kernels go where the data is).

    Example:
        >>> import numpy as np
        >>> device_scoped(lambda a: a + 1)(np.ones(1)).tolist()
        [2.0]
    """
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with device_scope(*args):
            return fn(*args, **kwargs)
    return run


def namespace(x: Any) -> Any:
    """The array-API namespace of ``x`` (numpy, cupy or torch flavour).

    Example:
        >>> import numpy as np
        >>> namespace(np.zeros(2)).__name__
        'array_api_compat.numpy'
    """
    import array_api_compat

    return array_api_compat.array_namespace(x)


def dtype_name(a: Any) -> str:
    """Storage dtype name of a numpy, cupy or torch array (``"float32"``, ``"uint8"`` ...).

    Example:
        >>> import numpy as np
        >>> dtype_name(np.zeros(2, np.uint16))
        'uint16'
    """
    return backend(a).dtype_name(a)


def bitcast(a: Any, dtype: str) -> Any:
    """``a``'s memory read as ``dtype`` of the same item size (no copy), any kind.

    Example:
        >>> import numpy as np
        >>> bitcast(np.ones(1, np.float32), "int32").tolist()
        [1065353216]
    """
    return backend(a).bitcast(a, dtype)


def nbytes(a: Any) -> int:
    """Bytes held by a numpy, cupy or torch array."""
    return backend(a).nbytes(a)


def size(a: Any) -> int:
    """Element count of a numpy, cupy or torch array."""
    return backend(a).size(a)


def itemsize(a: Any) -> int:
    """Bytes per element of a numpy, cupy or torch array.

    Example:
        >>> import numpy as np
        >>> itemsize(np.zeros(1, np.float16))
        2
    """
    return backend(a).itemsize(a)


def data_ptr(a: Any) -> int:
    """Address of ``a``'s first element (host or device), for offsets between views.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(4, np.float32); data_ptr(a[1:]) - data_ptr(a)
        4
    """
    return backend(a).data_ptr(a)


def empty_like_kind(like: Any, n: int, dtype: str) -> Any:
    """A new flat array of ``n`` ``dtype`` elements, of ``like``'s kind and device.

    Example:
        >>> import numpy as np
        >>> a = empty_like_kind(np.zeros(1), 3, "uint8"); a.dtype.name, a.shape
        ('uint8', (3,))
    """
    return backend(like).empty(like, n, dtype)


def like(a: np.ndarray, ref: Any) -> Any:
    """Host array ``a`` as an array of ``ref``'s kind and device (no copy where ``ref`` is
    a host array of that kind; else one host-to-device copy).

    Example:
        >>> import numpy as np
        >>> like(np.arange(2), np.zeros(1)).tolist()
        [0, 1]
    """
    b = backend(ref)
    if b.host_only:
        return a
    if kind(a) != "numpy":
        raise ConfigError(f"like() takes a host numpy array, got {kind(a)}")
    return b.like(a, ref)


def host(a: Any) -> np.ndarray:
    """A host numpy array with ``a``'s elements (``a`` itself if it is one; a view of a
    CPU tensor; else a device-to-host copy, after the producing stream).

    Example:
        >>> import numpy as np
        >>> x = np.zeros(2); host(x) is x
        True
    """
    return backend(a).host(a)


def is_host(a: Any) -> bool:
    """Whether ``a`` is a host numpy array (the kernels' and transports' home ground).

    Example:
        >>> import numpy as np
        >>> is_host(np.zeros(1))
        True
    """
    return isinstance(a, np.ndarray)


def flat(a: Any) -> Any:
    """``a`` as a flat C-contiguous array of its own kind and device (a view when it
    already is one; torch tensors are detached).

    Example:
        >>> import numpy as np
        >>> flat(np.zeros((2, 2)).T).shape
        (4,)
    """
    return backend(a).flat(a)


def cast(a: Any, dtype: str) -> Any:
    """A copy of ``a`` converted (rounded) to ``dtype``, same kind and device.

    Example:
        >>> import numpy as np
        >>> cast(np.array([1.5]), "float32").dtype.name
        'float32'
    """
    return backend(a).cast(a, dtype)


def assign(out: Any, v: Any) -> None:
    """``out[...] = v`` in place, for numpy, cupy and torch ``out`` (``v`` of the same
    kind and device, or a Python scalar).

    Example:
        >>> import numpy as np
        >>> a = np.zeros(2); assign(a, 3.0); a.tolist()
        [3.0, 3.0]
    """
    backend(out).assign(out, v)


def divide_(a: Any, p: int) -> None:
    """``a /= p`` in place as a true IEEE division of every element (torch on CUDA turns
    a division by a Python scalar into a multiplication by its reciprocal, which rounds
    differently; a 0-d tensor divisor does not).

    Example:
        >>> import numpy as np
        >>> a = np.array([3.0], np.float32); divide_(a, 3); a.tolist()
        [1.0]
    """
    backend(a).divide_(a, p)


def subtract(a: Any, b: Any, out: Any) -> None:
    """``out = a - b`` elementwise, written into ``out`` (all three flat, of one kind,
    dtype and device).

    Example:
        >>> import numpy as np
        >>> o = np.empty(2, np.float32)
        >>> subtract(np.array([3, 1], np.float32), np.array([1, 1], np.float32), o)
        >>> o.tolist()
        [2.0, 0.0]
    """
    backend(out).subtract(a, b, out)


def clone(a: Any) -> Any:
    """A fresh copy of ``a``: same kind, dtype, shape and device, never aliased.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(2); b = clone(a); b[0] = 1; a.tolist(), b.tolist()
        ([0.0, 0.0], [1.0, 0.0])
    """
    return backend(a).clone(a)

