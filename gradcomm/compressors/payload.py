"""The wire format of a codec's output: :class:`Payload`, and validated reading of a peer's.

A :class:`Payload` is self-describing: a versioned msgpack header naming the codec, its
per-rank scalars and its buffers' dtypes and lengths, followed by the raw buffers. Its
``nbytes`` is exactly ``len(payload.to_bytes())``. :meth:`Payload.from_bytes` bounds and
validates everything a peer sent before any allocation: a corrupt, truncated or hostile
payload raises :class:`~gradcomm.errors.PayloadError`. No pickle. Decoders read a peer's
payload through :class:`Reader` (exact header keys and buffer names, typed scalars) and
:func:`make_out` (the output array, checked against what the payload announces).

Example:
    >>> import numpy as np
    >>> p = Payload("none", {"count": 2}, {"values": np.array([1.0, 2.0], np.float32)})
    >>> q = Payload.from_bytes(p.to_bytes())
    >>> q.codec, q.header["count"], q.buffers["values"].tolist(), p.nbytes == len(p.to_bytes())
    ('none', 2, [1.0, 2.0], True)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from .. import arrays
from .._dtypes import CODES, NAMES, STORAGE
from ..errors import ConfigError, PayloadError

MAGIC = b"GC"
VERSION = 1
_PREFIX = struct.Struct("<2sBI")          # magic, version, header length
#: largest msgpack header accepted from a peer
MAX_HEADER = 64 * 1024
#: largest payload accepted from a peer (bytes); callers may pass a tighter bound
MAX_PAYLOAD = 1 << 34
#: largest output (bytes) a payload may make the decoder allocate when it is given no
#: ``out``: sparse and low-rank codecs (topk, powersgd) announce their element count, so a
#: 45-byte payload could otherwise claim gigabytes. A receiver knows how many values it
#: expects and passes ``out=`` (as every collective does): the payload must then match it
MAX_DECODE_BYTES = 1 << 28
#: dtypes a codec accepts and restores (bfloat16 is widened to float32 upstream)
FLOAT_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class Payload:
    """A codec's output: ``codec`` name, scalar ``header`` and flat ``buffers``.

    Buffers live where the codec ran: numpy on the host, or cupy / torch arrays (CPU or
    CUDA) for a codec given such an array. The wire form (:meth:`to_bytes`,
    :meth:`write_into`) is always host bytes; :meth:`to` moves the buffers of a received
    payload to where it will be decoded.
    """

    codec: str
    header: Mapping[str, Any]
    buffers: Mapping[str, np.ndarray] = field(default_factory=dict)

    def _meta(self) -> bytes:
        bufs = []
        for name, b in self.buffers.items():
            bufs.append([name, CODES[arrays.dtype_name(b)], arrays.size(b)])
        return msgpack.packb({"c": self.codec, "h": dict(self.header), "b": bufs},
                             use_bin_type=True)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: prefix + msgpack header + raw buffers."""
        return _PREFIX.size + len(self._meta()) + self._body()

    def _body(self) -> int:
        return sum(b.nbytes if isinstance(b, np.ndarray) else arrays.nbytes(b)
                   for b in self.buffers.values())

    def rebased(self, src: np.ndarray, dst: Any) -> Payload:
        """This payload with every buffer that is a view of host bytes ``src`` replaced by
        the same bytes of ``dst`` (a flat uint8 copy of ``src``, e.g. on a device: one
        copy moves many received payloads at once); other buffers are copied to where
        ``dst`` is.

        Example:
            >>> raw = Payload("none", {"n": 2}, {"v": np.ones(2, np.float32)}).to_bytes()
            >>> p = Payload.from_bytes(raw)
            >>> q = p.rebased(raw, raw.copy()); q.buffers["v"].tolist()
            [1.0, 1.0]
        """
        base, bufs = src.ctypes.data, {}
        for k, b in self.buffers.items():
            off = b.ctypes.data - base if isinstance(b, np.ndarray) else -1
            if 0 <= off and off + b.nbytes <= src.size and off % b.itemsize == 0:
                bufs[k] = arrays.bitcast(dst[off:off + b.nbytes], b.dtype.name)
            else:
                bufs[k] = arrays.like(np.ascontiguousarray(b), dst) if arrays.is_host(b) \
                    else b
        return Payload(self.codec, self.header, bufs)

    def to(self, ref: Any) -> Payload:
        """This payload with its buffers where ``ref`` (an array) lives: host buffers are
        copied to ``ref``'s kind and device; buffers already there are kept.

        Example:
            >>> p = Payload("none", {"n": 1}, {"values": np.ones(1, np.float32)})
            >>> p.to(np.zeros(1)) is p
            True
        """
        if arrays.is_host(ref):
            if all(isinstance(b, np.ndarray) for b in self.buffers.values()):
                return self
            return Payload(self.codec, self.header,
                           {k: arrays.host(b) for k, b in self.buffers.items()})
        return Payload(self.codec, self.header,
                       {k: arrays.like(np.ascontiguousarray(b), ref) if arrays.is_host(b)
                        else b for k, b in self.buffers.items()})

    def to_bytes(self) -> np.ndarray:
        """The wire form, as a flat uint8 array of exactly ``nbytes`` bytes."""
        meta = self._meta()
        out = np.empty(_PREFIX.size + len(meta) + self._body(), np.uint8)
        self.write_into(out, meta)
        return out

    def write_into(self, out: np.ndarray, meta: bytes | None = None) -> int:
        """Write the wire form at the start of flat uint8 ``out``; returns its length.

        A buffer that already sits where the wire form puts it (made as a view of ``out``
        and filled by ``compress(..., out=)``) is not copied again. ``meta`` is this
        payload's msgpack header if the caller already has it.

        Example:
            >>> p = Payload("none", {"n": 2}, {"values": np.array([1.0, 2.0], np.float32)})
            >>> buf = np.zeros(64, np.uint8)
            >>> m = p.write_into(buf); bytes(buf[:m]) == bytes(p.to_bytes())
            True
        """
        meta = self._meta() if meta is None else meta
        total = _PREFIX.size + len(meta) + self._body()
        if out.dtype != np.uint8 or out.ndim != 1 or out.size < total:
            raise ValueError(f"write_into needs a flat uint8 array of >= {total} bytes")
        _PREFIX.pack_into(out, 0, MAGIC, VERSION, len(meta))
        pos = _PREFIX.size
        out[pos:pos + len(meta)] = np.frombuffer(meta, np.uint8)
        pos += len(meta)
        base = out.ctypes.data
        for b in self.buffers.values():
            if not isinstance(b, np.ndarray):                 # a device buffer: copied here
                b = arrays.host(b)
            n = b.nbytes
            if n and not (b.flags.c_contiguous and b.ctypes.data == base + pos):
                out[pos:pos + n] = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
            pos += n
        return total

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


def payload_nbytes(codec: str, header: Mapping[str, Any],
                   buffers: Sequence[tuple[str, str, int]]) -> int:
    """``Payload(codec, header, ...).nbytes`` for buffers given as (name, dtype, count),
    without building them (codecs use it for ``max_nbytes``).

    Example:
        >>> p = Payload("x", {"n": 3}, {"v": np.zeros(3, np.float32)})
        >>> payload_nbytes("x", {"n": 3}, [("v", "float32", 3)]) == p.nbytes
        True
    """
    meta = msgpack.packb({"c": codec, "h": dict(header),
                          "b": [[name, CODES[dt], int(count)] for name, dt, count in buffers]},
                         use_bin_type=True)
    return _PREFIX.size + len(meta) + sum(int(c) * STORAGE[dt].itemsize
                                          for _, dt, c in buffers)


def check_codec(payload: Payload, name: str) -> None:
    """Raise PayloadError unless ``payload`` was made by codec ``name``."""
    if payload.codec != name:
        raise PayloadError(f"payload of codec {payload.codec!r} given to codec {name!r}")


def make_out(out: Any, n: int, dtype: np.dtype, zero: bool = False, like: Any = None
             ) -> Any:
    """``out`` checked against the payload's count and dtype, or a new array (zeroed if
    ``zero``; an existing ``out`` is zeroed too).

    A payload that disagrees with the caller's ``out`` raises PayloadError (the peer sent
    something else than expected); without ``out`` the output is bounded by
    MAX_DECODE_BYTES, and a new array is of ``like``'s kind and device (host numpy if
    ``like`` is None). Either way nothing is allocated for a payload that fails.
    """
    if out is None:
        nbytes = n * np.dtype(dtype).itemsize
        if nbytes > MAX_DECODE_BYTES:
            raise PayloadError(f"payload announces {n} {np.dtype(dtype).name} elements "
                               f"({nbytes} bytes), above MAX_DECODE_BYTES={MAX_DECODE_BYTES};"
                               " a receiver that expects that many passes out=")
        if like is not None and not arrays.is_host(like):
            out = arrays.empty_like_kind(like, n, np.dtype(dtype).name)
            if zero:
                arrays.assign(out, 0)
            return out
        return np.zeros(n, dtype) if zero else np.empty(n, dtype)   # zeros: lazy pages
    if not isinstance(out, np.ndarray) and arrays.kind(out):
        name = np.dtype(dtype).name
        if arrays.dtype_name(out) != name or arrays.size(out) != n or \
                not arrays.is_contiguous(out):
            raise PayloadError(f"payload decodes to {name}[{n}], out is "
                               f"{arrays.dtype_name(out)}[{arrays.size(out)}] (or not "
                               "contiguous)")
        out = out if len(out.shape) == 1 else arrays.flat(out)
        if zero:
            arrays.assign(out, 0)
        return out
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.size != n or \
            not out.flags.c_contiguous or not out.flags.writeable:
        got = f"{out.dtype.name}[{out.size}]" if isinstance(out, np.ndarray) else type(out)
        raise PayloadError(f"payload decodes to {dtype.name}[{n}], out is {got} "
                           "(or not contiguous and writable)")
    out = out if out.ndim == 1 else out.reshape(-1)
    if zero:
        out.fill(0)
    return out


class Reader:
    """Validated access to a peer's payload: codec name, exact header keys and buffer names.

    Example:
        >>> p = Payload("fp16", {"n": 2, "dt": 3}, {"v": np.zeros(2, np.float16)})
        >>> r = Reader(p, "fp16", ("n", "dt"), ("v",))
        >>> r.int("n", 0, 10), r.dtype().name, r.buffer("v", "float16", 2).size
        (2, 'float32', 2)
        >>> Reader(p, "int8", ("n", "dt"), ("v",))
        Traceback (most recent call last):
        ...
        gradcomm.errors.PayloadError: payload of codec 'fp16' given to codec 'int8'
    """

    def __init__(self, payload: Any, name: str, keys: Sequence[str],
                 buffers: Sequence[str], out: Any = None) -> None:
        if not isinstance(payload, Payload):
            raise PayloadError(f"{name}: expected a Payload, got {type(payload).__name__}")
        check_codec(payload, name)
        self.p, self.name = payload, name
        h, b = payload.header, payload.buffers
        if not isinstance(h, Mapping) or set(h) != set(keys):
            raise PayloadError(f"{name} payload header has keys {sorted(map(str, h))}, "
                               f"expected {sorted(keys)}")
        if not isinstance(b, Mapping) or set(b) != set(buffers):
            raise PayloadError(f"{name} payload has buffers {sorted(map(str, b))}, "
                               f"expected {sorted(buffers)}")
        #: where decoding happens: ``out``'s kind and device, else the payload's buffers'
        #: (a host payload decoded into a device ``out`` has its buffers copied there)
        self.like = out if out is not None else next(iter(b.values()), None)

    def int(self, key: str, low: int, high: int) -> int:
        v = self.p.header[key]
        if type(v) is not int or not low <= v <= high:
            raise PayloadError(f"{self.name} payload: {key}={v!r}, expected an int in "
                               f"{low}..{high}")
        return v

    def float(self, key: str) -> float:
        v = self.p.header[key]
        if type(v) is not float or not np.isfinite(v) or v <= 0:
            raise PayloadError(f"{self.name} payload: {key}={v!r}, expected a finite float > 0")
        return v

    def dtype(self, key: str = "dt") -> np.dtype:
        v = self.p.header[key]
        if type(v) is not int or NAMES.get(v) not in FLOAT_DTYPES:
            raise PayloadError(f"{self.name} payload: dtype code {v!r} is not one of "
                               f"{', '.join(FLOAT_DTYPES)}")
        return STORAGE[NAMES[v]]

    def buffer(self, name: str, dtype: str, count: int) -> Any:
        """Buffer ``name``, checked to be ``dtype[count]``, where decoding happens."""
        b = self.p.buffers[name]
        if isinstance(b, np.ndarray):
            if b.dtype != STORAGE[dtype] or b.ndim != 1 or b.size != count:
                raise PayloadError(f"{self.name} payload: buffer {name!r} is "
                                   f"{b.dtype.name}[{b.size}], expected {dtype}[{count}]")
            b = b if b.flags.c_contiguous else np.ascontiguousarray(b)
            return b if self.like is None or arrays.is_host(self.like) else \
                arrays.like(b, self.like)
        try:
            ok = arrays.dtype_name(b) == STORAGE[dtype].name and len(b.shape) == 1 and \
                arrays.size(b) == count
        except ConfigError:
            ok = False
        if not ok:
            raise PayloadError(f"{self.name} payload: buffer {name!r} is not {dtype}[{count}]")
        return arrays.flat(b) if self.like is None or not arrays.is_host(self.like) else \
            arrays.host(b)
