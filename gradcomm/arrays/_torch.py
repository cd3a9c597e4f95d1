"""The torch backend: tensors on the CPU or a CUDA device (torch imported on first use).

A CUDA tensor's ``"device"`` placement is a cupy array sharing nothing with it (a copy
through DLPack, which orders torch's stream before cupy's); its ``"native"`` placement is
a flat torch clone. bfloat16 travels as uint16 bits; uint16 tensors, which torch supports
only "barebones", are copied as their signed twin.

Example:
    >>> import torch
    >>> x = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
    >>> m = TORCH.meta(x); m.dtype, m.device
    ('bfloat16', 'cpu')
    >>> buf = TORCH.to_flat(x, m, "host"); buf.dtype.name
    'uint16'
    >>> TORCH.from_host(buf, m).tolist()
    [[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import STORAGE
from ..errors import ConfigError
from ._cupy import CUPY
from .base import Backend, Meta, byte_count

#: torch dtype -> logical name, filled on first sight
_NAMES: dict[Any, str] = {}
#: torch dtypes with only "barebones" support (views, creation; copies and arithmetic
#: missing on some devices and versions): moved and copied as their signed twin
_BAREBONES = {"uint16": "int16"}


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


class TorchBackend(Backend):
    """torch tensors (parameters included), CPU or CUDA."""

    kind = "torch"
    host_only = False

    def _name(self, t: Any) -> str:
        """The logical dtype name of ``t``; ConfigError for dtypes gradcomm cannot carry."""
        name = _NAMES.get(t.dtype)
        if name is not None:
            return name
        name = str(t.dtype).removeprefix("torch.")
        if name != "bool" and name not in STORAGE:
            raise ConfigError(f"unsupported torch dtype {t.dtype}")
        _NAMES[t.dtype] = name
        return name

    def meta(self, x: Any) -> Meta:
        import torch

        if x.layout != torch.strided:
            raise ConfigError(f"torch tensors of layout {x.layout} are unsupported: gradcomm "
                              "reduces dense tensors (x.to_dense())")
        if x.device.type == "meta":
            raise ConfigError("a meta tensor has no data to reduce (materialise it first, "
                              "e.g. with to_empty(device=...))")
        return Meta("torch", self._name(x), tuple(x.shape), str(x.device))

    def dtype_name(self, a: Any) -> str:
        return str(a.dtype).removeprefix("torch.")

    def size(self, a: Any) -> int:
        return int(a.numel())

    def itemsize(self, a: Any) -> int:
        return int(a.element_size())

    def nbytes(self, a: Any) -> int:
        return int(a.numel() * a.element_size())

    def data_ptr(self, a: Any) -> int:
        return int(a.data_ptr())

    def is_contiguous(self, a: Any) -> bool:
        return bool(a.is_contiguous())

    # -- flat buffers --------------------------------------------------------------------
    def to_flat(self, x: Any, meta: Meta, where: str) -> Any:
        t = x.detach()
        if where == "native":
            t = t.reshape(-1).clone()            # clone: contiguous and never aliased
            return t.view(_dtype("uint16")) if self._name(t) == "bfloat16" else t
        if where == "device" and t.device.type != "cpu":
            import cupy
            import torch

            with cupy.cuda.Device(int(meta.device.split(":")[1])):
                t = t.contiguous()
                if meta.dtype == "bfloat16":
                    t = t.view(torch.int16)
                buf = cupy.from_dlpack(t).reshape(-1).copy()     # DLPack orders the streams
                if meta.dtype == "bfloat16":
                    buf = buf.view(cupy.uint16)
                CUPY.sync(buf)
            return buf
        if t.device.type != "cpu":
            t = t.cpu()                          # device -> host copy is already fresh
            return self.host_view(t.contiguous())
        if not t.is_contiguous():
            return self.host_view(t.contiguous())  # .contiguous() copied
        return self.host_view(t).copy()

    def from_host(self, buf: np.ndarray, meta: Meta) -> Any:
        import torch

        if meta.dtype == "bfloat16":
            t = torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(buf)
        t = t.reshape(meta.shape)
        return t if meta.device == "cpu" else t.to(meta.device)

    def from_device(self, buf: Any, meta: Meta) -> Any:
        import torch

        if isinstance(buf, torch.Tensor):        # a "native" buffer
            if meta.dtype == "bfloat16":
                return buf.view(torch.bfloat16).reshape(meta.shape)
            return buf.reshape(meta.shape)
        if meta.dtype == "bfloat16":             # a cupy buffer
            import cupy

            return torch.from_dlpack(buf.view(cupy.int16)).view(torch.bfloat16).reshape(
                meta.shape)
        return torch.from_dlpack(buf).reshape(meta.shape)

    def host_view(self, x: Any) -> np.ndarray:
        if x.device.type != "cpu":
            raise ConfigError(f"host_view needs a CPU tensor, got device {x.device}")
        if not x.is_contiguous():
            raise ConfigError("host_view needs a contiguous tensor")
        t = x.detach()
        if self._name(t) == "bfloat16":
            import torch

            return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        return t.numpy().reshape(-1)

    def small_view(self, x: Any, limit: int) -> np.ndarray | None:
        import torch

        if x.device.type != "cpu" or x.layout != torch.strided or x.dtype == torch.bfloat16 \
                or x.numel() * x.element_size() > limit or not x.is_contiguous():
            return None
        return x.detach().numpy()

    def from_small(self, a: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(a)

    def host(self, a: Any) -> np.ndarray:
        t = a.detach()
        if self._name(t) in ("uint16", "bfloat16"):
            import torch

            t = t.view(torch.int16)
            return (t.cpu() if t.device.type != "cpu" else t).numpy().view(np.uint16)
        return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()

    def like(self, a: np.ndarray, ref: Any) -> Any:
        import torch

        if a.dtype == np.uint16:                 # torch.from_numpy lacks uint16; and the
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16))   # copy is int16's
            if ref.device.type != "cpu":
                t = t.to(ref.device, non_blocking=False)
            return t.view(torch.uint16)
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if ref.device.type == "cpu" else t.to(ref.device, non_blocking=False)

    def empty(self, like: Any, n: int, dtype: str) -> Any:
        import torch

        if dtype in _BAREBONES:           # made (and later copied) as their signed twin
            return torch.empty(n, dtype=_dtype(_BAREBONES[dtype]),
                               device=like.device).view(_dtype(dtype))
        return torch.empty(n, dtype=_dtype(dtype), device=like.device)

    # -- arithmetic and copies -----------------------------------------------------------
    def flat(self, a: Any) -> Any:
        return a.detach().contiguous().reshape(-1)

    def cast(self, a: Any, dtype: str) -> Any:
        return a.to(_dtype(dtype))

    def assign(self, out: Any, v: Any) -> None:
        twin = _BAREBONES.get(self._name(out))
        if twin is not None:              # copy unsigned 16-bit data as its signed twin
            out = out.view(_dtype(twin))
            if not isinstance(v, (int, float)) and self._name(v) in _BAREBONES:
                v = v.view(_dtype(twin))
        if isinstance(v, (int, float)):
            out.fill_(v)
        else:
            out.copy_(v)

    def divide_(self, a: Any, p: int) -> None:
        import torch

        # torch.full, not torch.tensor: a fill kernel, where torch.tensor(p, device=cuda)
        # is a blocking host-to-device copy that synchronises the stream
        a.div_(torch.full((), p, dtype=a.dtype, device=a.device))

    def subtract(self, a: Any, b: Any, out: Any) -> None:
        import torch

        torch.sub(a, b, out=out)

    def clone(self, a: Any) -> Any:
        twin = _BAREBONES.get(self.dtype_name(a))
        if twin is not None:                # copied as its signed twin, viewed back
            return a.detach().view(_dtype(twin)).clone().view(a.dtype)
        return a.detach().clone()

    def bitcast(self, a: Any, dtype: str) -> Any:
        return a.view(_dtype(dtype))

    # -- memory seen as bytes ------------------------------------------------------------
    def sync(self, buf: Any) -> None:
        if buf.is_cuda:
            import torch

            torch.cuda.current_stream(buf.device).synchronize()

    def _device_bytes(self, x: Any, meta: Meta) -> Any:
        """A flat torch.uint8 view of contiguous CUDA tensor ``x`` (no copy)."""
        if not x.is_contiguous():
            raise ConfigError(f"a non-contiguous torch array on {meta.device} cannot "
                              "be copied as one block; pass a contiguous array")
        import torch

        return x.detach().reshape(-1).view(torch.uint8)

    def byte_view(self, x: Any) -> Any:
        meta = self.meta(x)
        if meta.device == "cpu":
            return self.host_view(x).view(np.uint8)
        import cupy

        return cupy.from_dlpack(self._device_bytes(x, meta))   # DLPack orders the streams

    def copy_to_host(self, x: Any, nbytes: int | None) -> np.ndarray:
        meta = self.meta(x)
        if meta.device == "cpu":
            return self.host_bytes_out(x, nbytes)
        self.sync(x)
        raw = self._device_bytes(x, meta)
        raw = raw[:byte_count(int(raw.numel()), nbytes)]
        return raw.cpu().numpy()                 # a blocking copy on the current stream

    def copy_from_host(self, x: Any, src: np.ndarray) -> None:
        meta = self.meta(x)
        if meta.device == "cpu":
            self.host_bytes_in(x, src)
            return
        raw = self._device_bytes(x, meta)
        raw = raw[:byte_count(int(raw.numel()), src.size)]
        if src.size == 0:
            return
        import torch

        raw.copy_(torch.from_numpy(src if src.flags.writeable else src.copy()))
        self.sync(x)

    def torch_bytes(self, buf: Any) -> Any:
        import torch

        return buf.detach().reshape(-1).view(torch.uint8)


TORCH = TorchBackend()
