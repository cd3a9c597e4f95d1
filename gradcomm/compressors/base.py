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

from .. import arrays
from .._dtypes import CODES, NAMES, STORAGE
from ..errors import ConfigError, PayloadError, UnsupportedError

MAGIC = b"GC"
VERSION = 1
_PREFIX = struct.Struct("<2sBI")          # magic, version, header length
#: largest msgpack header accepted from a peer
MAX_HEADER = 64 * 1024
#: largest payload accepted from a peer (bytes); callers may pass a tighter bound
MAX_PAYLOAD = 1 << 34
#: largest element count a payload may announce when the decoder is given no ``out``
#: (sparse codecs such as topk could otherwise make a 100-byte payload allocate terabytes);
#: callers that know the count pass ``out=`` and have no such limit
MAX_COUNT = 1 << 28
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

    def compress(self, x: Any, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: Any = None,
                 decoded: Any = None) -> Payload:
        """Encode flat float ``x`` (float16/32/64; numpy, or cupy / torch on any device:
        the payload's buffers are then of that kind, made by the device kernels).

        With ``residual`` e, encode ``y = x + e`` and leave ``e = y − decode``; with
        ``decoded``, leave ``decode`` there (may be ``x``): one fused pass where the kernel
        path has one, else step by step with the same bytes (:func:`compose`). ``out``: an
        earlier payload whose buffers may be reused. Codecs implement :meth:`_encode`.
        """
        x = as_input(x, self.name)
        fk = None
        if residual is not None or decoded is not None:
            fk = fused_kernels(x, residual, decoded, self.name)
            if fk is None:
                return compose(self, x, seed, out, residual, decoded)
        return self._encode(x, seed, out, fk, residual, decoded)

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        """Encode validated flat ``x``; ``fk``: the fused kernel module that also applies
        ``residual`` / ``decoded`` (None: plain encode)."""
        raise NotImplementedError(f"{type(self).__name__} must define compress or _encode")

    @abstractmethod
    def decompress(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a (validated) payload to a flat array of its original dtype."""

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        """Exact upper bound of ``compress(x).nbytes`` for any ``x`` of ``n`` ``dtype``
        elements (receivers post buffers of this size)."""
        raise UnsupportedError(f"compressor {self.name!r} does not declare max_nbytes")

    def decompress_sum(self, payloads: Sequence[Payload], out: np.ndarray | None = None
                       ) -> np.ndarray:
        """Sum of the decoded payloads (codecs override this with fused kernels)."""
        total = self.decompress(payloads[0], out)
        for p in payloads[1:]:
            part = arrays.empty_like_kind(total, arrays.size(total), arrays.dtype_name(total))
            with np.errstate(invalid="ignore", over="ignore"):
                total += self.decompress(p, out=part)
        return total

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.get_config().items()))))


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


# --- helpers shared by the codecs (encode side) -------------------------------------------

def as_input(x: Any, name: str) -> Any:
    """``x`` as a flat contiguous float16/32/64 array of its own kind (numpy, cupy or
    torch) and device, or ConfigError."""
    if isinstance(x, np.ndarray):
        dt = x.dtype.name
    else:
        try:
            dt = arrays.dtype_name(x) if arrays.kind(x) else ""
        except ConfigError:
            raise ConfigError(f"{name}.compress takes a numpy array, cupy array or torch "
                              f"tensor, got {type(x).__name__}") from None
    if dt not in FLOAT_DTYPES:
        raise ConfigError(f"{name}.compress takes float16, float32 or float64, got "
                          f"{dt} (bfloat16 is widened to float32 by the caller)")
    return arrays.flat(x)


def seed_words(seed: Any) -> np.ndarray:
    """Four uint32 words that key a codec's random stream, from ``seed``.

    ``seed``: None (fresh entropy), a non-negative int, or a tuple/list of them (such as
    ``(seed, step, key_hash, rank)``). Mixed by :class:`numpy.random.SeedSequence`, so
    nearby seeds give independent streams and the same seed gives the same words anywhere.

    Example:
        >>> seed_words((1, 2)).tolist() == seed_words([1, 2]).tolist() != seed_words(1).tolist()
        True
    """
    if seed is not None:
        items = seed if isinstance(seed, (tuple, list)) else (seed,)
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ConfigError(f"seed must be None, a non-negative int or a tuple of them, "
                                  f"got {seed!r}")
        seed = [int(v) for v in items] if isinstance(seed, (tuple, list)) else int(seed)
    return np.random.SeedSequence(seed).generate_state(4, np.uint32)


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


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """Validate an option that takes one of a few values."""
    if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def fused_kernels(x: np.ndarray, residual: Any, decoded: Any, name: str) -> Any:
    """Validate ``compress(x, residual=, decoded=)`` arguments; the kernel module that
    fuses them for ``x`` (float32, writable, on a path with fused encoders), else None
    (the codec then composes: :func:`compose`).

    ``residual`` and ``decoded`` must be flat, contiguous, writable arrays of ``x``'s
    dtype and size (``decoded`` may be ``x`` itself).
    """
    if not isinstance(x, np.ndarray):                     # device arrays: composed
        dt, n = arrays.dtype_name(x), arrays.size(x)
        for what, a in (("residual", residual), ("decoded", decoded)):
            ok = a is not None and not arrays.is_host(a)
            if ok:
                ok = arrays.kind(a) == arrays.kind(x) and arrays.dtype_name(a) == dt and \
                    len(a.shape) == 1 and arrays.size(a) == n and \
                    arrays.meta_of(a).device == arrays.meta_of(x).device and \
                    arrays.is_contiguous(a)
            if a is not None and not ok:
                raise ConfigError(f"{name}.compress: {what} must be a flat {dt}[{n}] array "
                                  f"of x's kind and device, got {type(a).__name__}")
        if residual is not None and residual is x:
            raise ConfigError(f"{name}.compress: residual must not overlap x")
        return None
    for what, a in (("residual", residual), ("decoded", decoded)):
        if a is not None and not (isinstance(a, np.ndarray) and a.dtype == x.dtype and
                                  a.ndim == 1 and a.size == x.size and
                                  a.flags.c_contiguous and a.flags.writeable):
            got = f"{a.dtype.name}{list(a.shape)}" if isinstance(a, np.ndarray) else \
                type(a).__name__
            raise ConfigError(f"{name}.compress: {what} must be a flat writable "
                              f"{x.dtype.name}[{x.size}] array, got {got}")
    if residual is not None and (residual is x or np.shares_memory(residual, x)):
        raise ConfigError(f"{name}.compress: residual must not overlap x")
    if x.dtype != np.float32 or not x.flags.writeable:
        return None
    from . import _kernels

    k = _kernels.for_size(x.size)
    return k if getattr(k, "FUSED", False) else None


def compose(codec: Compressor, x: np.ndarray, seed: Any, out: Any, residual: Any,
            decoded: Any) -> Payload:
    """What ``compress(x, residual=e, decoded=d)`` means, step by step: ``y = x + e``
    (into ``e``); the payload encodes ``y``; ``d = decode(payload)``; ``e = y - d``.
    Fused kernels produce exactly these bytes in one pass."""
    y = x
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, by design
        if residual is not None:
            residual += x                               # IEEE addition commutes
            y = residual
        payload = codec.compress(y, seed=seed, out=out)  # type: ignore[call-arg]
        if residual is None and decoded is None:
            return payload
        dec = decoded if decoded is not None else \
            arrays.empty_like_kind(y, arrays.size(y), arrays.dtype_name(y))
        codec.decompress(payload, out=dec)
        if residual is not None:
            residual -= dec
    return payload


def need_out(add: bool, out: Any, name: str) -> None:
    """ConfigError for ``decompress(..., add=True)`` without ``out`` (nothing to add to)."""
    if add and out is None:
        raise ConfigError(f"{name}.decompress: add=True needs out= (the array to add to)")


def make_out(out: Any, n: int, dtype: np.dtype, zero: bool = False, like: Any = None
             ) -> Any:
    """``out`` checked against the payload's count and dtype, or a new array (zeroed if
    ``zero``; an existing ``out`` is zeroed too).

    A payload that disagrees with the caller's ``out`` raises PayloadError (the peer sent
    something else than expected); without ``out`` the count is bounded by MAX_COUNT,
    and a new array is of ``like``'s kind and device (host numpy if ``like`` is None).
    """
    if out is None:
        if n > MAX_COUNT:
            raise PayloadError(f"payload announces {n} elements, above MAX_COUNT={MAX_COUNT}; "
                               "pass out= to decode larger arrays")
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


# --- helpers shared by the codecs (decode side: everything a peer sent is checked) -------

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


def reuse(out: Payload | None, name: str, dtype: Any, count: int, like: Any = None) -> Any:
    """Buffer ``name`` of an earlier payload ``out`` (a ``compress(..., out=)`` argument) if
    it can hold ``count`` ``dtype`` elements, else a new array; saves page faults on hot
    paths (a fresh 64 MiB allocation costs several memory copies)."""
    dt = np.dtype(dtype)
    if like is not None and not isinstance(like, np.ndarray):    # device: like's kind
        return arrays.empty_like_kind(like, count, dt.name)
    if out is not None:
        b = out.buffers.get(name)
        if isinstance(b, np.ndarray) and b.dtype == dt and b.size >= count and \
                b.flags.c_contiguous and b.flags.writeable:
            return b.reshape(-1)[:count]
    return np.empty(count, dt)


def as_float32(x: Any) -> Any:
    """float32 ``x`` itself, else a rounded copy (the quantizers work in float32)."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 else x.astype(np.float32)
    return x if arrays.dtype_name(x) == "float32" else arrays.cast(x, "float32")


def dtype_code(dtype: Any) -> int:
    """Payload code of a float dtype name or numpy dtype (ConfigError otherwise)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    return CODES[name]
