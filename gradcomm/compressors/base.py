"""Payload (what crosses the wire) and Compressor (a stateless codec).

A :class:`Payload` is self-describing: a versioned msgpack header naming the codec, its
per-rank scalars and its buffers' dtypes and lengths, followed by the raw buffers. Its
``nbytes`` is exactly ``len(payload.to_bytes())``. :meth:`Payload.from_bytes` bounds and
validates everything a peer sent before any allocation: a corrupt, truncated or hostile
payload raises :class:`~gradcomm.errors.PayloadError`. No pickle.

Example:
    >>> import numpy as np
    >>> p = Payload("none", {"count": 2}, {"values": np.array([1.0, 2.0], np.float32)})
    >>> q = Payload.from_bytes(p.to_bytes())
    >>> q.codec, q.header["count"], q.buffers["values"].tolist(), p.nbytes == len(p.to_bytes())
    ('none', 2, [1.0, 2.0], True)
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import msgpack
import numpy as np

from .._dtypes import CODES, NAMES, STORAGE
from ..errors import ConfigError, PayloadError

MAGIC = b"GC"
VERSION = 1
_PREFIX = struct.Struct("<2sBI")          # magic, version, header length
#: largest msgpack header accepted from a peer
MAX_HEADER = 64 * 1024
#: largest payload accepted from a peer (bytes); callers may pass a tighter bound
MAX_PAYLOAD = 1 << 34


@dataclass(frozen=True)
class Payload:
    """A codec's output: ``codec`` name, scalar ``header`` and flat ``buffers``."""

    codec: str
    header: Mapping[str, Any]
    buffers: Mapping[str, np.ndarray] = field(default_factory=dict)

    def _meta(self) -> bytes:
        bufs = []
        for name, b in self.buffers.items():
            bufs.append([name, CODES[b.dtype.name], int(b.size)])
        return msgpack.packb({"c": self.codec, "h": dict(self.header), "b": bufs},
                             use_bin_type=True)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: prefix + msgpack header + raw buffers."""
        return _PREFIX.size + len(self._meta()) + sum(b.nbytes for b in self.buffers.values())

    def to_bytes(self) -> np.ndarray:
        """The wire form, as a flat uint8 array of exactly ``nbytes`` bytes."""
        meta = self._meta()
        out = np.empty(self.nbytes, np.uint8)
        _PREFIX.pack_into(out, 0, MAGIC, VERSION, len(meta))
        pos = _PREFIX.size
        out[pos:pos + len(meta)] = np.frombuffer(meta, np.uint8)
        pos += len(meta)
        for b in self.buffers.values():
            n = b.nbytes
            out[pos:pos + n] = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
            pos += n
        return out

    @classmethod
    def from_bytes(cls, data: Any, *, max_nbytes: int = MAX_PAYLOAD) -> Payload:
        """Parse and validate a wire payload; buffers are views into ``data`` (no copy)."""
        raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else \
            data.reshape(-1).view(np.uint8)
        if raw.size > max_nbytes:
            raise PayloadError(f"payload of {raw.size} bytes exceeds the bound {max_nbytes}")
        if raw.size < _PREFIX.size:
            raise PayloadError(f"payload truncated: {raw.size} bytes, no header")
        magic, version, hlen = _PREFIX.unpack_from(raw, 0)
        if magic != MAGIC:
            raise PayloadError(f"not a gradcomm payload (magic {magic!r})")
        if version != VERSION:
            raise PayloadError(f"payload version {version}, this gradcomm reads {VERSION}")
        if hlen > MAX_HEADER or _PREFIX.size + hlen > raw.size:
            raise PayloadError(f"payload header of {hlen} bytes does not fit in {raw.size}")
        try:
            meta = msgpack.unpackb(raw[_PREFIX.size:_PREFIX.size + hlen].tobytes(), raw=False,
                                   strict_map_key=True)     # input already <= MAX_HEADER
        except Exception as exc:  # msgpack raises several types on garbage
            raise PayloadError(f"payload header is not valid msgpack: {exc}") from None
        if not (isinstance(meta, dict) and isinstance(meta.get("c"), str)
                and isinstance(meta.get("h"), dict) and isinstance(meta.get("b"), list)):
            raise PayloadError("payload header lacks codec, scalars or buffer table")
        pos = _PREFIX.size + hlen
        buffers: dict[str, np.ndarray] = {}
        for entry in meta["b"]:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and type(entry[1]) is int and type(entry[2]) is int):
                raise PayloadError(f"malformed buffer entry {entry!r}")
            name, code, count = entry
            if code not in NAMES or count < 0 or name in buffers:
                raise PayloadError(f"buffer {name!r}: bad dtype code {code} or count {count}")
            dt = STORAGE[NAMES[code]]
            n = count * dt.itemsize
            if pos + n > raw.size:
                raise PayloadError(f"payload truncated: buffer {name!r} needs {n} bytes, "
                                   f"{raw.size - pos} left")
            chunk = raw[pos:pos + n]
            buffers[name] = chunk.view(dt) if chunk.ctypes.data % dt.itemsize == 0 \
                else chunk.copy().view(dt)
            pos += n
        if pos != raw.size:
            raise PayloadError(f"payload has {raw.size - pos} trailing bytes")
        return cls(meta["c"], meta["h"], buffers)


class Compressor(ABC):
    """A stateless codec from a flat float array to a :class:`Payload` and back.

    ``reduction`` says how payloads of several ranks combine:
    ``"summable"`` — decoded payloads can be added and re-encoded hop by hop (the codec's
    ``compress`` of a sum is meaningful and ``sum_payloads`` may combine without decoding);
    ``"gathered"`` — payloads are gathered and decoded-and-summed.
    ``shared_seed`` codecs need the same random stream on every rank.

    Example:
        >>> import numpy as np
        >>> from gradcomm.compressors import get
        >>> c = get("none")
        >>> c.decompress(c.compress(np.arange(3, dtype=np.float32))).tolist()
        [0.0, 1.0, 2.0]
    """

    name: ClassVar[str]
    reduction: ClassVar[str] = "gathered"
    shared_seed: ClassVar[bool] = False
    #: True if decode(encode(x)) may differ from x (error feedback is worthwhile)
    lossy: ClassVar[bool] = True

    def get_config(self) -> dict[str, Any]:
        """The options that rebuild this compressor with ``get(name, **config)``."""
        return {}

    @abstractmethod
    def compress(self, x: np.ndarray, *, seed: Sequence[int] | int | None = None) -> Payload:
        """Encode flat float ``x`` (float16/32/64, or bfloat16 bits with dtype=) ."""

    @abstractmethod
    def decompress(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a (validated) payload to a flat array of its original dtype."""

    def decompress_sum(self, payloads: Sequence[Payload], out: np.ndarray | None = None
                       ) -> np.ndarray:
        """Sum of the decoded payloads (codecs override this with fused kernels)."""
        total = self.decompress(payloads[0], out)
        for p in payloads[1:]:
            total += self.decompress(p)
        return total

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({opts})"


def check_codec(payload: Payload, name: str) -> None:
    """Raise PayloadError unless ``payload`` was made by codec ``name``."""
    if payload.codec != name:
        raise PayloadError(f"payload of codec {payload.codec!r} given to codec {name!r}")


def positive_int(name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """Validate an integer option."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or \
            (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")
    return int(value)
