"""The cupy backend: arrays on a CUDA device (cupy imported on first use).

cupy allocates and launches on the *current* device whatever its operands' device, so
every method that makes arrays or runs kernels does it inside the array's own device.
Its ``"device"`` and ``"native"`` placements are both a flat cupy copy on that device
(``"device"`` also waits for the copy, since a transport will read it).

Example:
    >>> CUPY.kind, CUPY.host_only
    ('cupy', False)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import Backend, Meta, byte_count


def _device(meta: Meta) -> Any:
    """The cupy Device of a ``"cuda:N"`` Meta."""
    import cupy

    return cupy.cuda.Device(int(meta.device.split(":")[1]))


class CupyBackend(Backend):
    """cupy arrays, on any CUDA device."""

    kind = "cupy"
    host_only = False

    def meta(self, x: Any) -> Meta:
        return Meta("cupy", x.dtype.name, tuple(x.shape), f"cuda:{x.device.id}")

    def dtype_name(self, a: Any) -> str:
        return a.dtype.name

    def size(self, a: Any) -> int:
        return int(a.size)

    def itemsize(self, a: Any) -> int:
        return int(a.itemsize)

    def nbytes(self, a: Any) -> int:
        return int(a.nbytes)

    def data_ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def is_contiguous(self, a: Any) -> bool:
        return bool(a.flags.c_contiguous)

    # -- flat buffers --------------------------------------------------------------------
    def to_flat(self, x: Any, meta: Meta, where: str) -> Any:
        import cupy

        if where == "host":
            return cupy.asnumpy(x).reshape(-1).copy()
        with _device(meta):
            buf = cupy.array(x, copy=True, order="C").reshape(-1)
            if where == "device":
                self.sync(buf)
        return buf

    def from_host(self, buf: np.ndarray, meta: Meta) -> Any:
        import cupy

        with _device(meta):
            return cupy.asarray(buf).reshape(meta.shape)

    def from_device(self, buf: Any, meta: Meta) -> Any:
        return buf.reshape(meta.shape)

    def host_view(self, x: Any) -> np.ndarray:
        raise ConfigError("host_view needs host memory, got a cupy array")

    def host(self, a: Any) -> np.ndarray:
        import cupy

        return cupy.asnumpy(a)

    def like(self, a: np.ndarray, ref: Any) -> Any:
        import cupy

        with cupy.cuda.Device(ref.device.id):
            return cupy.asarray(a)

    def empty(self, like: Any, n: int, dtype: str) -> Any:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(n, dtype)

    # -- arithmetic and copies -----------------------------------------------------------
    def flat(self, a: Any) -> Any:
        import cupy

        with a.device:
            return cupy.ascontiguousarray(a).reshape(-1)

    def cast(self, a: Any, dtype: str) -> Any:
        with a.device:
            return a.astype(dtype)

    def assign(self, out: Any, v: Any) -> None:
        with out.device:
            out[...] = v

    def divide_(self, a: Any, p: int) -> None:
        with a.device:
            a /= a.dtype.type(p)

    def subtract(self, a: Any, b: Any, out: Any) -> None:
        import cupy

        with out.device:
            cupy.subtract(a, b, out=out)

    def clone(self, a: Any) -> Any:
        with a.device:
            return a.copy()

    def bitcast(self, a: Any, dtype: str) -> Any:
        return a.view(dtype)

    # -- memory seen as bytes ------------------------------------------------------------
    def sync(self, buf: Any) -> None:
        import cupy

        with buf.device:                # the current stream of buf's device, not of the
            cupy.cuda.get_current_stream().synchronize()     # thread's current device

    def byte_view(self, x: Any) -> Any:
        if not x.flags.c_contiguous:
            raise ConfigError(f"a non-contiguous cupy array on {self.meta(x).device} cannot "
                              "be copied as one block; pass a contiguous array")
        import cupy

        return x.reshape(-1).view(cupy.uint8)

    def copy_to_host(self, x: Any, nbytes: int | None) -> np.ndarray:
        import cupy

        self.sync(x)
        raw = self.byte_view(x)
        return cupy.asnumpy(raw[:byte_count(int(raw.size), nbytes)])     # blocking too

    def copy_from_host(self, x: Any, src: np.ndarray) -> None:
        raw = self.byte_view(x)
        raw = raw[:byte_count(int(raw.size), src.size)]
        if src.size == 0:
            return
        raw.set(src)
        self.sync(x)

    def torch_bytes(self, buf: Any) -> Any:
        import torch

        return torch.from_dlpack(buf.reshape(-1).view("uint8"))


CUPY = CupyBackend()
