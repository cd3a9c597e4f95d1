"""The numpy backend: host arrays, every placement a host copy.

Example:
    >>> import numpy as np
    >>> b = NUMPY
    >>> x = np.arange(4, dtype=np.float32).reshape(2, 2)
    >>> buf = b.to_flat(x, b.meta(x), "host"); buf.shape
    (4,)
    >>> b.from_host(buf, b.meta(x)).tolist()
    [[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .._dtypes import STORAGE
from ..errors import ConfigError
from .base import Backend, Meta

#: (dtype, shape) -> Meta of a host numpy array (Meta is immutable, so one can be shared;
#: ``dtype.name`` is computed in Python by numpy and costs more than a small allreduce's
#: whole budget)
_META: dict[tuple[Any, tuple[int, ...]], Meta] = {}
_CACHE_LIMIT = 4096


class NumpyBackend(Backend):
    """numpy arrays (subclasses included) in host memory."""

    kind = "numpy"
    host_only = True

    def meta(self, x: np.ndarray) -> Meta:
        key = (x.dtype, x.shape)
        meta = _META.get(key)
        if meta is not None:
            return meta
        name = x.dtype.name
        if name not in STORAGE:
            raise ConfigError(f"unsupported dtype {x.dtype}; supported: {', '.join(STORAGE)}")
        meta = Meta("numpy", name, tuple(x.shape))
        if len(_META) >= _CACHE_LIMIT:
            _META.clear()
        _META[key] = meta
        return meta

    def dtype_name(self, a: np.ndarray) -> str:
        return a.dtype.name

    def size(self, a: np.ndarray) -> int:
        return int(a.size)

    def itemsize(self, a: np.ndarray) -> int:
        return int(a.itemsize)

    def nbytes(self, a: np.ndarray) -> int:
        return int(a.nbytes)

    def data_ptr(self, a: np.ndarray) -> int:
        return int(a.ctypes.data)

    def is_contiguous(self, a: np.ndarray) -> bool:
        return bool(a.flags.c_contiguous)

    def to_flat(self, x: np.ndarray, meta: Meta, where: str) -> np.ndarray:
        if x.dtype.isnative:
            if type(x) is np.ndarray and x.flags.c_contiguous:
                return x.reshape(-1).copy()
            return np.array(x, order="C", copy=True).reshape(-1)
        # native byte order: a big-endian ">f4" has the same dtype name as "<f4"
        return np.array(x, dtype=x.dtype.newbyteorder("="), order="C", copy=True).reshape(-1)

    def from_host(self, buf: np.ndarray, meta: Meta) -> np.ndarray:
        return buf if buf.shape == meta.shape else buf.reshape(meta.shape)

    def from_device(self, buf: Any, meta: Meta) -> Any:
        raise ConfigError("a numpy array cannot be made from a device buffer")

    def host_view(self, x: np.ndarray) -> np.ndarray:
        if not x.flags.c_contiguous:
            raise ConfigError("host_view needs a C-contiguous array")
        return x.reshape(-1)

    def small_view(self, x: np.ndarray, limit: int) -> np.ndarray | None:
        return x if type(x) is np.ndarray and x.nbytes <= limit and x.flags.c_contiguous \
            else None

    def host(self, a: np.ndarray) -> np.ndarray:
        return a

    def like(self, a: np.ndarray, ref: Any) -> np.ndarray:
        return a

    def empty(self, like: Any, n: int, dtype: str) -> np.ndarray:
        return np.empty(n, dtype)

    def flat(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).reshape(-1)

    def cast(self, a: np.ndarray, dtype: str) -> np.ndarray:
        return a.astype(dtype)

    def assign(self, out: np.ndarray, v: Any) -> None:
        out[...] = v

    def divide_(self, a: np.ndarray, p: int) -> None:
        np.divide(a, a.dtype.type(p), out=a)

    def subtract(self, a: Any, b: Any, out: np.ndarray) -> None:
        np.subtract(a, b, out=out)

    def clone(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def bitcast(self, a: np.ndarray, dtype: str) -> np.ndarray:
        return a.view(dtype)

    def sync(self, buf: Any) -> None:
        return None

    # byte copies refuse what meta() refuses (unsupported dtypes), as for the other kinds
    def byte_view(self, x: np.ndarray) -> np.ndarray:
        self.meta(x)
        return self.host_view(x).view(np.uint8)

    def copy_to_host(self, x: np.ndarray, nbytes: int | None) -> np.ndarray:
        self.meta(x)
        return self.host_bytes_out(x, nbytes)

    def copy_from_host(self, x: np.ndarray, src: np.ndarray) -> None:
        self.meta(x)
        self.host_bytes_in(x, src)

    def torch_bytes(self, buf: np.ndarray) -> Any:
        import torch

        flat = buf.reshape(-1).view(np.uint8)
        if flat.flags.writeable:
            return torch.from_numpy(flat)
        with warnings.catch_warnings():          # read-only buffers are only ever sent
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)


NUMPY = NumpyBackend()
