"""What an array backend is: :class:`Meta` (what a flat buffer needs to become the user's
array again) and :class:`Backend` (everything gradcomm does that depends on the array's
library, one subclass per library).

Flat buffers are contiguous 1-D arrays in a numpy-compatible storage dtype (``bfloat16``
is carried as ``uint16``). Where one lives is a *placement*:

- ``"host"``: a numpy array in host memory (every transport moves these);
- ``"device"``: a cupy array on the array's CUDA device, for transports that move device
  buffers themselves (torch CUDA tensors are shared with cupy through DLPack);
- ``"native"``: an array of the array's own library where it lives (torch CPU or CUDA,
  cupy), where the device codec kernels run.

Example:
    >>> m = Meta("numpy", "float32", (2, 3))
    >>> m.count, m.device
    (6, 'cpu')
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError

#: the placements of a flat buffer (see the module docstring)
PLACEMENTS = ("host", "device", "native")


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


def byte_count(total: int, nbytes: int | None) -> int:
    """``nbytes`` checked against an array of ``total`` bytes (``None``: all of them).

    Example:
        >>> byte_count(8, None), byte_count(8, 3)
        (8, 3)
    """
    if nbytes is None:
        return total
    if not 0 <= nbytes <= total:
        raise ConfigError(f"{nbytes} bytes requested from an array of {total} bytes")
    return int(nbytes)


class Backend(ABC):
    """The operations on one library's arrays (numpy, torch or cupy).

    One instance per library; :func:`gradcomm.arrays.backend` picks it once per array by
    the array's type. Methods take arrays of this backend's library (``x``, ``a``) and
    return arrays of it, unless they say otherwise.
    """

    #: "numpy", "torch" or "cupy" (:attr:`Meta.kind`)
    kind: ClassVar[str]
    #: whether this library's arrays live in host memory only (numpy)
    host_only: ClassVar[bool]

    # -- description ---------------------------------------------------------------------
    @abstractmethod
    def meta(self, x: Any) -> Meta:
        """Describe ``x`` without copying it (ConfigError for an unsupported dtype)."""

    @abstractmethod
    def dtype_name(self, a: Any) -> str:
        """Storage dtype name of ``a`` ("float32", "uint16", ...)."""

    @abstractmethod
    def size(self, a: Any) -> int:
        """Element count."""

    @abstractmethod
    def itemsize(self, a: Any) -> int:
        """Bytes per element."""

    def nbytes(self, a: Any) -> int:
        """Bytes held."""
        return self.size(a) * self.itemsize(a)

    @abstractmethod
    def data_ptr(self, a: Any) -> int:
        """Address of the first element (host or device)."""

    @abstractmethod
    def is_contiguous(self, a: Any) -> bool:
        """Whether the elements are one C-contiguous block of memory."""

    # -- flat buffers --------------------------------------------------------------------
    @abstractmethod
    def to_flat(self, x: Any, meta: Meta, where: str) -> Any:
        """A fresh flat copy of ``x`` in its storage dtype, placed ``where`` (one of
        :data:`PLACEMENTS`; a placement this library's arrays cannot take gives a host
        copy). ``x`` is never modified or aliased."""

    @abstractmethod
    def from_host(self, buf: np.ndarray, meta: Meta) -> Any:
        """Host flat buffer ``buf`` (taken over, not copied on the host) as an array of
        this library shaped as ``meta`` says."""

    @abstractmethod
    def from_device(self, buf: Any, meta: Meta) -> Any:
        """Flat device buffer ``buf`` (a cupy array, or one of this library's own; no
        copy) as an array of this library shaped as ``meta`` says."""

    @abstractmethod
    def host_view(self, x: Any) -> np.ndarray:
        """A flat numpy view of contiguous host ``x`` (no copy), bfloat16 as uint16."""

    def small_view(self, x: Any, limit: int) -> np.ndarray | None:
        """``x``'s own memory as a C-contiguous numpy array of its dtype and shape (no
        copy), if it is host memory of at most ``limit`` bytes that numpy can type; else
        None (what :mod:`gradcomm.collectives.small` reduces). None here."""
        return None

    def from_small(self, a: np.ndarray) -> Any:
        """Numpy array ``a`` (a reduced :meth:`small_view`'s copy) as this library's array,
        without a copy."""
        return a

    @abstractmethod
    def host(self, a: Any) -> np.ndarray:
        """A host numpy array with ``a``'s elements (``a`` itself for numpy, a view of
        a CPU tensor, else a device-to-host copy after the producing stream)."""

    @abstractmethod
    def like(self, a: np.ndarray, ref: Any) -> Any:
        """Host array ``a`` as an array of this library on ``ref``'s device."""

    @abstractmethod
    def empty(self, like: Any, n: int, dtype: str) -> Any:
        """A new flat array of ``n`` ``dtype`` elements on ``like``'s device."""

    # -- arithmetic and copies (the device kernels' helpers) -----------------------------
    @abstractmethod
    def flat(self, a: Any) -> Any:
        """``a`` as a flat C-contiguous array (a view when it already is one)."""

    @abstractmethod
    def cast(self, a: Any, dtype: str) -> Any:
        """A copy of ``a`` converted (rounded) to ``dtype``."""

    @abstractmethod
    def assign(self, out: Any, v: Any) -> None:
        """``out[...] = v`` in place (``v`` an array of this library or a scalar)."""

    @abstractmethod
    def divide_(self, a: Any, p: int) -> None:
        """``a /= p`` in place, an IEEE division of every element."""

    @abstractmethod
    def subtract(self, a: Any, b: Any, out: Any) -> None:
        """``out = a - b`` elementwise into ``out``."""

    @abstractmethod
    def clone(self, a: Any) -> Any:
        """A fresh copy, never aliased."""

    @abstractmethod
    def bitcast(self, a: Any, dtype: str) -> Any:
        """``a``'s memory read as ``dtype`` of the same item size (no copy)."""

    # -- memory seen as bytes (staging, transports) ----------------------------------------
    @abstractmethod
    def sync(self, buf: Any) -> None:
        """Wait for the work queued on ``buf``'s current stream (no-op on the host)."""

    @abstractmethod
    def byte_view(self, x: Any) -> Any:
        """A flat uint8 view of contiguous ``x``'s memory where it lives (no copy): numpy
        in host memory, cupy on a CUDA device."""

    @abstractmethod
    def copy_to_host(self, x: Any, nbytes: int | None) -> np.ndarray:
        """A fresh host copy (flat uint8) of the first ``nbytes`` (None: all) of
        contiguous ``x``'s memory, after the stream that produces it."""

    @abstractmethod
    def copy_from_host(self, x: Any, src: np.ndarray) -> None:
        """Copy flat uint8 host bytes ``src`` into the start of contiguous ``x``'s memory;
        returns when the copy is complete."""

    @abstractmethod
    def torch_bytes(self, buf: Any) -> Any:
        """A flat ``torch.uint8`` tensor sharing ``buf``'s memory."""

    # -- shared by the backends whose arrays may be in host memory -----------------------
    def host_bytes_out(self, x: Any, nbytes: int | None) -> np.ndarray:
        """:meth:`copy_to_host` of an array in host memory."""
        raw = self.host_view(x).view(np.uint8)
        return raw[:byte_count(raw.size, nbytes)].copy()

    def host_bytes_in(self, x: Any, src: np.ndarray) -> None:
        """:meth:`copy_from_host` into an array in host memory."""
        raw = self.host_view(x).view(np.uint8)
        np.copyto(raw[:byte_count(raw.size, src.size)], src)
