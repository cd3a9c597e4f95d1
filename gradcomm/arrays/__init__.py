"""The one module that knows the array libraries (numpy, torch, cupy).

Everything else in gradcomm works on flat, contiguous buffers with numpy-compatible
storage dtypes (``bfloat16`` is carried as ``uint16``). Here arrays become such buffers and
go back. A library is only consulted if it is already in ``sys.modules``, so inspecting a
numpy array never imports torch or cupy.

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
import sys
from dataclasses import dataclass
from typing import Any, ContextManager

import numpy as np

from .._dtypes import STORAGE
from ..errors import ConfigError


@dataclass(frozen=True)
class Meta:
    """What is needed to turn a flat buffer back into the user's kind of array."""

    kind: str            # "numpy" | "torch" | "cupy"
    dtype: str           # logical dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    device: str = "cpu"  # "cpu" or e.g. "cuda:0"

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def kind(x: Any) -> str:
    """'numpy', 'torch' or 'cupy'; ConfigError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise ConfigError(f"expected a numpy array, torch tensor or cupy array, got "
                      f"{type(x).__module__}.{type(x).__qualname__}")


#: numpy / torch dtype -> logical name, filled on first sight (``dtype.name`` is computed
#: in Python by numpy: ~2 µs, more than a small allreduce's whole budget)
_NAMES: dict[Any, str] = {}
#: (dtype, shape) -> Meta of a host numpy array (Meta is immutable, so one can be shared)
_NUMPY_META: dict[tuple[Any, tuple[int, ...]], Meta] = {}
_CACHE_LIMIT = 4096


def _torch_dtype_name(t: Any) -> str:
    name = _NAMES.get(t.dtype)
    if name is not None:
        return name
    name = str(t.dtype).removeprefix("torch.")
    if name != "bool" and name not in STORAGE:
        raise ConfigError(f"unsupported torch dtype {t.dtype}")
    _NAMES[t.dtype] = name
    return name


def _numpy_meta(x: np.ndarray) -> Meta:
    key = (x.dtype, x.shape)
    meta = _NUMPY_META.get(key)
    if meta is not None:
        return meta
    name = x.dtype.name
    if name not in STORAGE:
        raise ConfigError(f"unsupported dtype {x.dtype}; supported: {', '.join(STORAGE)}")
    meta = Meta("numpy", name, tuple(x.shape))
    if len(_NUMPY_META) >= _CACHE_LIMIT:
        _NUMPY_META.clear()
    _NUMPY_META[key] = meta
    return meta


def meta_of(x: Any) -> Meta:
    """Describe ``x`` without copying it."""
    if isinstance(x, np.ndarray):
        return _numpy_meta(x)
    k = kind(x)
    if k == "torch":
        return Meta(k, _torch_dtype_name(x), tuple(x.shape), str(x.device))
    return Meta(k, x.dtype.name, tuple(x.shape), f"cuda:{x.device.id}")


def host_view(x: Any) -> np.ndarray:
    """A flat numpy view of a contiguous CPU array (no copy), bfloat16 as uint16.

    Raises ConfigError if ``x`` is not contiguous or not in host memory.
    """
    k = kind(x)
    if k == "torch":
        if x.device.type != "cpu":
            raise ConfigError(f"host_view needs a CPU tensor, got device {x.device}")
        if not x.is_contiguous():
            raise ConfigError("host_view needs a contiguous tensor")
        t = x.detach()
        if _torch_dtype_name(t) == "bfloat16":
            import torch

            return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        return t.numpy().reshape(-1)
    if k == "cupy":
        raise ConfigError("host_view needs host memory, got a cupy array")
    if not x.flags.c_contiguous:
        raise ConfigError("host_view needs a C-contiguous array")
    return x.reshape(-1)


def to_flat(x: Any) -> tuple[np.ndarray, Meta]:
    """A fresh flat host copy of ``x`` in its storage dtype, and its :class:`Meta`.

    ``x`` itself is never modified or aliased.
    """
    meta = meta_of(x)
    return _host_copy(x, meta), meta


def _host_copy(x: Any, meta: Meta) -> np.ndarray:
    """:func:`to_flat`'s copy, for ``meta = meta_of(x)``."""
    k = meta.kind
    if k == "numpy":
        if x.dtype.isnative:
            if type(x) is np.ndarray and x.flags.c_contiguous:
                return x.reshape(-1).copy()
            return np.array(x, order="C", copy=True).reshape(-1)
        # native byte order: a big-endian ">f4" has the same dtype name as "<f4"
        return np.array(x, dtype=x.dtype.newbyteorder("="), order="C", copy=True).reshape(-1)
    if k == "torch":
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()                       # device -> host copy is already fresh
            return host_view(t.contiguous())
        if not t.is_contiguous():
            return host_view(t.contiguous())  # .contiguous() copied
        return host_view(t).copy()
    import cupy

    return cupy.asnumpy(x).reshape(-1).copy()


def from_flat(buf: np.ndarray, meta: Meta) -> Any:
    """Wrap a flat storage buffer (taken over, not copied on the host) as ``meta`` says."""
    if meta.kind == "numpy":
        return buf.reshape(meta.shape)
    if meta.kind == "torch":
        import torch

        if meta.dtype == "bfloat16":
            t = torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(buf)
        t = t.reshape(meta.shape)
        return t if meta.device == "cpu" else t.to(meta.device)
    import cupy

    with cupy.cuda.Device(int(meta.device.split(":")[1])):
        return cupy.asarray(buf).reshape(meta.shape)


def empty(meta: Meta) -> Any:
    """A new uninitialised array of the kind, dtype, shape and device ``meta`` describes."""
    return from_flat(np.empty(meta.count, STORAGE[meta.dtype]), meta)


# -- device arrays (CUDA) -------------------------------------------------------------------
# A CUDA array is staged through host memory (``to_flat`` / ``from_flat`` above: the copies
# wait for the producing stream) unless the transport moves device buffers itself
# (``"cuda" in transport.devices``, e.g. a CUDA-aware MPI); then it stays on its device as
# a flat cupy array (torch tensors are shared with cupy through DLPack), the collectives'
# numpy calls dispatch to cupy, and :func:`sync` is called before a library touches it.

def cuda_usable(lib: str) -> bool:
    """Whether CUDA works through ``lib`` ("torch" or "cupy"): importable AND a device is
    usable (``import cupy`` may succeed on a machine without a GPU).

    Example:
        >>> cuda_usable("numpy")
        False
    """
    try:
        if lib == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if lib == "cupy":
            import cupy

            return bool(cupy.cuda.is_available())
    except Exception:  # a broken CUDA install raises all sorts of errors: not usable
        return False
    return False


def placement(meta: Meta, devices: frozenset[str] | set[str]) -> str:
    """Where the collective should work on an array described by ``meta``: "host" or
    "device" (device arrays stay on the device only if the transport moves device
    buffers and cupy can run the arithmetic there).

    Example:
        >>> placement(Meta("torch", "float32", (2,), "cuda:0"), {"cpu"})
        'host'
        >>> placement(Meta("numpy", "float32", (2,)), {"cpu", "cuda"})
        'host'
    """
    if meta.device == "cpu" or "cuda" not in devices:
        return "host"
    return "device" if cuda_usable("cupy") else "host"


def to_flat_for(x: Any, devices: frozenset[str] | set[str]) -> tuple[Any, Meta]:
    """:func:`to_flat`, except that a CUDA array stays on its device when
    :func:`placement` says so: a fresh flat cupy array in the storage dtype, with the
    stream that produced ``x`` synchronised. ``x`` is never modified or aliased.

    Example:
        >>> import numpy as np
        >>> buf, meta = to_flat_for(np.ones((2, 2), np.float32), {"cpu", "cuda"})
        >>> type(buf).__name__, buf.shape
        ('ndarray', (4,))
    """
    if type(x) is np.ndarray and x.dtype.isnative:      # the common case, shortest path
        meta = _numpy_meta(x)
        y = x.copy()                                     # C order, whatever x's layout
        return (y if y.ndim == 1 else y.reshape(-1)), meta
    meta = meta_of(x)
    if placement(meta, devices) == "host":
        return _host_copy(x, meta), meta
    import cupy

    with cupy.cuda.Device(int(meta.device.split(":")[1])):
        if meta.kind == "cupy":
            buf = cupy.array(x, copy=True, order="C").reshape(-1)
        else:
            import torch

            t = x.detach().contiguous()
            if meta.dtype == "bfloat16":
                t = t.view(torch.int16)
            buf = cupy.from_dlpack(t).reshape(-1).copy()     # DLPack orders the streams
            if meta.dtype == "bfloat16":
                buf = buf.view(cupy.uint16)
        sync(buf)
    return buf, meta


def is_device(buf: Any) -> bool:
    """True for a device (cupy) buffer, False for a host (numpy) one."""
    return not isinstance(buf, np.ndarray) and kind(buf) == "cupy"


def sync(buf: Any) -> None:
    """Wait until the work queued on the current CUDA stream (which may still write
    ``buf``) is done, so that a library such as MPI may touch ``buf``. No-op on host
    arrays.

    Example:
        >>> import numpy as np
        >>> sync(np.zeros(3))
    """
    if isinstance(buf, np.ndarray):
        return
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(buf, cupy.ndarray):
        with buf.device:                # the current stream of buf's device, not of the
            cupy.cuda.get_current_stream().synchronize()     # thread's current device
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor) and buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


def from_device_flat(buf: Any, meta: Meta) -> Any:
    """Wrap a flat device (cupy) storage buffer from :func:`to_flat_for` as ``meta`` says
    (no copy): a cupy array, or a torch CUDA tensor sharing its memory through DLPack.
    Host buffers go to :func:`from_flat`.
    """
    if isinstance(buf, np.ndarray):
        if meta.kind == "numpy" and buf.shape == meta.shape:
            return buf
        return from_flat(buf, meta)
    if meta.kind == "cupy":
        return buf.reshape(meta.shape)
    import torch

    if meta.dtype == "bfloat16":
        import cupy

        return torch.from_dlpack(buf.view(cupy.int16)).view(torch.bfloat16).reshape(meta.shape)
    return torch.from_dlpack(buf).reshape(meta.shape)


def torch_bytes(buf: Any) -> Any:
    """A flat ``torch.uint8`` tensor sharing memory with the flat contiguous buffer
    ``buf`` (numpy, torch or cupy; no copy), for libraries that move torch tensors.

    Example:
        >>> import numpy as np
        >>> t = torch_bytes(np.ones(2, np.float32))
        >>> t.dtype, t.numel()
        (torch.uint8, 8)
    """
    import torch

    k = kind(buf)
    if k == "numpy":
        flat = buf.reshape(-1).view(np.uint8)
        if flat.flags.writeable:
            return torch.from_numpy(flat)
        import warnings

        with warnings.catch_warnings():          # read-only buffers are only ever sent
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)
    if k == "torch":
        return buf.detach().reshape(-1).view(torch.uint8)
    return torch.from_dlpack(buf.reshape(-1).view("uint8"))


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
    if kind(x) == "torch":
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def _device_bytes(x: Any) -> Any:
    """A flat uint8 view of a contiguous CUDA array in its own library (no copy)."""
    if not is_contiguous(x):
        raise ConfigError(f"a non-contiguous {kind(x)} array on {meta_of(x).device} cannot "
                          "be copied as one block; pass a contiguous array")
    if kind(x) == "torch":
        import torch

        return x.detach().reshape(-1).view(torch.uint8)
    import cupy

    return x.reshape(-1).view(cupy.uint8)


def _host_bytes(x: Any) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous array in host memory (no copy)."""
    return host_view(x).view(np.uint8)


def byte_view(x: Any) -> Any:
    """A flat uint8 view of contiguous ``x``'s memory where it lives (no copy): numpy for
    host arrays, cupy for CUDA arrays (torch tensors through DLPack; needs cupy).

    Example:
        >>> import numpy as np
        >>> x = np.ones(2, np.float32)
        >>> v = byte_view(x); v.dtype.name, v.size, np.shares_memory(v, x)
        ('uint8', 8, True)
    """
    if meta_of(x).device == "cpu":
        return _host_bytes(x)
    raw = _device_bytes(x)
    if kind(x) == "cupy":
        return raw
    import cupy

    return cupy.from_dlpack(raw)        # DLPack orders torch's stream before cupy's


def _byte_count(raw: Any, nbytes: int | None) -> int:
    total = int(raw.numel() if hasattr(raw, "numel") else raw.size)
    if nbytes is None:
        return total
    if not 0 <= nbytes <= total:
        raise ConfigError(f"{nbytes} bytes requested from an array of {total} bytes")
    return int(nbytes)


def copy_to_host(x: Any, nbytes: int | None = None) -> np.ndarray:
    """A fresh host copy (flat uint8 numpy) of the first ``nbytes`` (default: all) of
    contiguous ``x``'s memory, any kind or device; for a CUDA array the stream that
    produces it is synchronised first. Host arrays are copied too.

    Example:
        >>> import numpy as np
        >>> copy_to_host(np.arange(3, dtype=np.uint8), 2).tolist()
        [0, 1]
    """
    if meta_of(x).device == "cpu":
        raw = _host_bytes(x)
        return raw[:_byte_count(raw, nbytes)].copy()
    sync(x)
    raw = _device_bytes(x)
    raw = raw[:_byte_count(raw, nbytes)]
    if kind(x) == "torch":
        return raw.cpu().numpy()                   # a blocking copy on the current stream
    import cupy

    return cupy.asnumpy(raw)                       # blocking too


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
    src = data.reshape(-1).view(np.uint8)
    if meta_of(x).device == "cpu":
        raw = _host_bytes(x)
        np.copyto(raw[:_byte_count(raw, src.size)], src)
        return
    raw = _device_bytes(x)
    raw = raw[:_byte_count(raw, src.size)]
    if src.size == 0:
        return
    if kind(x) == "torch":
        import torch

        raw.copy_(torch.from_numpy(src if src.flags.writeable else src.copy()))
    else:
        raw.set(src)
    sync(x)


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
    import functools

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
    if isinstance(a, np.ndarray) or kind(a) == "cupy":
        return a.dtype.name
    return str(a.dtype).removeprefix("torch.")


#: torch dtypes with only "barebones" support (views, creation; copies and arithmetic
#: missing on some devices and versions): moved and copied as their signed twin
_TORCH_BAREBONES = {"uint16": "int16"}


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def bitcast(a: Any, dtype: str) -> Any:
    """``a``'s memory read as ``dtype`` of the same item size (no copy), any kind.

    Example:
        >>> import numpy as np
        >>> bitcast(np.ones(1, np.float32), "int32").tolist()
        [1065353216]
    """
    if kind(a) == "torch":
        return a.view(_torch_dtype(dtype))
    return a.view(dtype)


def nbytes(a: Any) -> int:
    """Bytes held by a numpy, cupy or torch array."""
    if kind(a) == "torch":
        return int(a.numel() * a.element_size())
    return int(a.nbytes)


def size(a: Any) -> int:
    """Element count of a numpy, cupy or torch array."""
    return int(a.numel()) if kind(a) == "torch" else int(a.size)


def empty_like_kind(like: Any, n: int, dtype: str) -> Any:
    """A new flat array of ``n`` ``dtype`` elements, of ``like``'s kind and device.

    Example:
        >>> import numpy as np
        >>> a = empty_like_kind(np.zeros(1), 3, "uint8"); a.dtype.name, a.shape
        ('uint8', (3,))
    """
    k = kind(like)
    if k == "numpy":
        return np.empty(n, dtype)
    if k == "torch":
        import torch

        if dtype in _TORCH_BAREBONES:     # made (and later copied) as their signed twin
            return torch.empty(n, dtype=_torch_dtype(_TORCH_BAREBONES[dtype]),
                               device=like.device).view(_torch_dtype(dtype))
        return torch.empty(n, dtype=_torch_dtype(dtype), device=like.device)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.empty(n, dtype)


def like(a: np.ndarray, ref: Any) -> Any:
    """Host array ``a`` as an array of ``ref``'s kind and device (no copy where ``ref`` is
    a host array of that kind; else one host-to-device copy).

    Example:
        >>> import numpy as np
        >>> like(np.arange(2), np.zeros(1)).tolist()
        [0, 1]
    """
    k = kind(ref)
    if k == "numpy":
        return a
    if kind(a) != "numpy":
        raise ConfigError(f"like() takes a host numpy array, got {kind(a)}")
    if k == "torch":
        import torch

        if a.dtype == np.uint16:                 # torch.from_numpy lacks uint16; and the
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16))   # copy is int16's
            if ref.device.type != "cpu":
                t = t.to(ref.device, non_blocking=False)
            return t.view(torch.uint16)
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if ref.device.type == "cpu" else t.to(ref.device, non_blocking=False)
    import cupy

    with cupy.cuda.Device(ref.device.id):
        return cupy.asarray(a)


def host(a: Any) -> np.ndarray:
    """A host numpy array with ``a``'s elements (``a`` itself if it is one; a view of a
    CPU tensor; else a device-to-host copy, after the producing stream).

    Example:
        >>> import numpy as np
        >>> x = np.zeros(2); host(x) is x
        True
    """
    k = kind(a)
    if k == "numpy":
        return a
    if k == "torch":
        t = a.detach()
        if _torch_dtype_name(t) in ("uint16", "bfloat16"):
            import torch

            t = t.view(torch.int16)
            return (t.cpu() if t.device.type != "cpu" else t).numpy().view(np.uint16)
        return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()
    import cupy

    return cupy.asnumpy(a)


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
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).reshape(-1)
    if kind(a) == "torch":
        return a.detach().contiguous().reshape(-1)
    import cupy

    with a.device:
        return cupy.ascontiguousarray(a).reshape(-1)


def cast(a: Any, dtype: str) -> Any:
    """A copy of ``a`` converted (rounded) to ``dtype``, same kind and device.

    Example:
        >>> import numpy as np
        >>> cast(np.array([1.5]), "float32").dtype.name
        'float32'
    """
    if kind(a) == "torch":
        return a.to(_torch_dtype(dtype))
    with device_scope(a):
        return a.astype(dtype)


def assign(out: Any, v: Any) -> None:
    """``out[...] = v`` in place, for numpy, cupy and torch ``out`` (``v`` of the same
    kind and device, or a Python scalar).

    Example:
        >>> import numpy as np
        >>> a = np.zeros(2); assign(a, 3.0); a.tolist()
        [3.0, 3.0]
    """
    if kind(out) == "torch":
        twin = _TORCH_BAREBONES.get(_torch_dtype_name(out))
        if twin is not None:              # copy unsigned 16-bit data as its signed twin
            out = out.view(_torch_dtype(twin))
            if not isinstance(v, (int, float)) and _torch_dtype_name(v) in _TORCH_BAREBONES:
                v = v.view(_torch_dtype(twin))
        if isinstance(v, (int, float)):
            out.fill_(v)
        else:
            out.copy_(v)
    else:
        with device_scope(out):
            out[...] = v


def divide_(a: Any, p: int) -> None:
    """``a /= p`` in place as a true IEEE division of every element (torch on CUDA turns
    a division by a Python scalar into a multiplication by its reciprocal, which rounds
    differently; a 0-d tensor divisor does not).

    Example:
        >>> import numpy as np
        >>> a = np.array([3.0], np.float32); divide_(a, 3); a.tolist()
        [1.0]
    """
    if kind(a) == "torch":
        import torch

        # torch.full, not torch.tensor: a fill kernel, where torch.tensor(p, device=cuda)
        # is a blocking host-to-device copy that synchronises the stream
        a.div_(torch.full((), p, dtype=a.dtype, device=a.device))
    elif isinstance(a, np.ndarray):
        np.divide(a, a.dtype.type(p), out=a)
    else:
        with device_scope(a):
            a /= a.dtype.type(p)


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
    if isinstance(out, np.ndarray):
        np.subtract(a, b, out=out)
    elif kind(out) == "torch":
        import torch

        torch.sub(a, b, out=out)
    else:
        import cupy

        with out.device:
            cupy.subtract(a, b, out=out)


def clone(a: Any) -> Any:
    """A fresh copy of ``a``: same kind, dtype, shape and device, never aliased.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(2); b = clone(a); b[0] = 1; a.tolist(), b.tolist()
        ([0.0, 0.0], [1.0, 0.0])
    """
    if kind(a) == "torch":
        twin = _TORCH_BAREBONES.get(dtype_name(a))
        if twin is not None:                # copied as its signed twin, viewed back
            return a.detach().view(_torch_dtype(twin)).clone().view(a.dtype)
        return a.detach().clone()
    with device_scope(a):
        return a.copy()


#: ``GRADCOMM_CODEC_PLACEMENT``: "auto" (codecs run on the device for CUDA arrays, on the
#: host otherwise) or "array" (codecs run on every non-numpy array where it lives, torch
#: CPU tensors included: the device route on a machine without a GPU, used by the tests)
CODEC_PLACEMENTS = ("auto", "array")


def codec_placement(meta: Meta) -> str:
    """Where a compressed allreduce runs its codecs for an array described by ``meta``:
    "device" (on the array's own kind and device, with the device kernels) or "host".

    Example:
        >>> codec_placement(Meta("numpy", "float32", (2,)))
        'host'
        >>> codec_placement(Meta("torch", "float32", (2,), "cuda:0"))
        'device'
    """
    import os

    mode = os.environ.get("GRADCOMM_CODEC_PLACEMENT", "auto") or "auto"
    if mode not in CODEC_PLACEMENTS:
        raise ConfigError(f"GRADCOMM_CODEC_PLACEMENT must be one of "
                          f"{', '.join(CODEC_PLACEMENTS)}, got {mode!r}")
    if meta.kind == "numpy":
        return "host"
    return "device" if meta.device != "cpu" or mode == "array" else "host"


def to_flat_native(x: Any) -> Any:
    """A fresh flat copy of ``x`` in its storage dtype, of ``x``'s own kind and device
    (bfloat16 as uint16 bits): where device codecs work. Numpy arrays get
    :func:`to_flat`'s copy.

    Example:
        >>> import numpy as np
        >>> to_flat_native(np.ones((2, 2), np.float32)).shape
        (4,)
    """
    if isinstance(x, np.ndarray):
        return to_flat(x)[0]
    if kind(x) == "torch":
        t = x.detach().reshape(-1).clone()       # clone: contiguous and never aliased
        return t.view(_torch_dtype("uint16")) if _torch_dtype_name(t) == "bfloat16" else t
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.array(x, copy=True, order="C").reshape(-1)


def from_flat_native(buf: Any, meta: Meta) -> Any:
    """Inverse of :func:`to_flat_native`: ``buf`` (taken over) shaped as ``meta`` says.

    Example:
        >>> import numpy as np
        >>> b = to_flat_native(np.ones((2, 2), np.float32))
        >>> from_flat_native(b, meta_of(np.ones((2, 2), np.float32))).shape
        (2, 2)
    """
    if isinstance(buf, np.ndarray):
        return from_flat(buf, meta)
    if kind(buf) == "torch" and meta.dtype == "bfloat16":
        return buf.view(_torch_dtype("bfloat16")).reshape(meta.shape)
    return buf.reshape(meta.shape)


def itemsize(a: Any) -> int:
    """Bytes per element of a numpy, cupy or torch array.

    Example:
        >>> import numpy as np
        >>> itemsize(np.zeros(1, np.float16))
        2
    """
    return int(a.element_size()) if kind(a) == "torch" else int(a.itemsize)


def data_ptr(a: Any) -> int:
    """Address of ``a``'s first element (host or device), for offsets between views.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(4, np.float32); data_ptr(a[1:]) - data_ptr(a)
        4
    """
    if isinstance(a, np.ndarray):
        return int(a.ctypes.data)
    if kind(a) == "torch":
        return int(a.data_ptr())
    return int(a.data.ptr)
