"""The frame format of compressed allreduces: codec payloads laid out for exact receives.

A frame is ``[nparts u32][0 u32]`` then ``nparts`` × ``[offset u64][count u64][lead << 56
| bytes u64]``; the table is followed by each part's region: ``lead`` zero bytes, the
payload (``bytes`` long), zeros up to a multiple of 8; then zeros up to a size that
follows from the element count alone (:meth:`Frames.bound`: what receivers post). The lead
puts the payload's buffers on 8-byte boundaries, so receivers decode them in place, and
the sender's codec writes its output straight into the frame (``compress(..., out=)``
with buffers that are views of the frame: no copy; the layout is learned once per codec,
count and dtype). A finished segment assembled from finished pieces is sent as those
pieces' payloads (:meth:`Frames.assemble`), not re-compressed. Peer frames are validated
(:meth:`Frames.parts`, :meth:`Frames.payload`): parts must tile the segment, sizes must
fit, payloads parse and decode to the right length; anything else is a
:class:`~gradcomm.errors.PayloadError`.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> x = np.arange(6, dtype=np.float32)
    >>> f = Frames(compressors.get("fp16"), x)
    >>> frame, data = f.single(x, (0,), 6, f.bound(6))
    >>> out = np.empty(6, np.float32)
    >>> [(off, m) for off, m, _ in f.parts(frame, 6, 1)], frame.size == f.bound(6)
    ([(0, 6)], True)
    >>> f.decode(data, out); out.tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import arrays
from ..compressors.base import Compressor, Payload, add_tally
from ..errors import PayloadError, UnsupportedError
from .state import Scratch

HDR = struct.Struct("<II")        # frame: number of parts, reserved (0)
PART = struct.Struct("<QQQ")      # part: offset in the segment, elements, lead|bytes
LEN_BITS = 56                     # part word 3: (lead << 56) | payload bytes
PREFIX_SIZE = 7                   # a payload's fixed prefix (magic, version, header length)


def round8(n: int) -> int:
    return (n + 7) & ~7


def max_nbytes(codec: Compressor, n: int, dtype: str) -> int:
    """Upper bound of ``codec``'s payload bytes for ``n`` elements of ``dtype`` (what a
    receiver posts).

    Example:
        >>> from gradcomm import compressors
        >>> max_nbytes(compressors.get("none"), 4, "float32") > 16
        True
    """
    try:
        return int(codec.max_nbytes(n, dtype))
    except UnsupportedError:
        if codec.lossy:
            raise
    if codec.lossy:
        raise UnsupportedError(f"compressor {codec.name!r} does not declare max_nbytes(n, "
                               "dtype), needed to post exact receive sizes")
    return codec.compress(np.zeros(n, dtype)).nbytes   # lossless: size depends on n only


def _in_place(payload: Payload, views: dict[str, np.ndarray]) -> bool:
    """Whether every buffer of ``payload`` is exactly its template view (same order)."""
    if list(payload.buffers) != list(views):
        return False
    return all(b.nbytes == views[k].nbytes and b.ctypes.data == views[k].ctypes.data
               for k, b in payload.buffers.items())


@dataclass
class Layout:
    """Where a codec's buffers sit in a payload of one element count: ``lead`` bytes from
    the part's start (room for the largest prefix + header, rounded to 8) then each
    buffer ``(name, dtype, count, offset)`` back to back."""

    lead: int
    buffers: list[tuple[str, np.dtype, int, int]]


class Frames:
    """Frames of ``codec`` payloads for segments of ``base`` (the reduced flat buffer),
    with buffers from ``scratch`` (reused across calls on one transport), else fresh.

    Codecs run where ``base`` is (``device``: not host memory); ``fused``: the codec
    takes ``compress(..., residual=, decoded=)`` (its declared ``fuses_feedback``).
    """

    def __init__(self, codec: Compressor, base: Any, scratch: Scratch | None = None) -> None:
        self.codec, self.base = codec, base
        self.dtype = arrays.dtype_name(base)
        self.device = not arrays.is_host(base)      # codecs run on the base's device
        self.scratch = scratch if scratch is not None else Scratch()
        self._bounds: dict[tuple[int, int], int] = {}
        self._maxes: dict[int, int] = {}
        # bytes a part may need beyond its share of max_nbytes(n): a header, one block of
        # rounding, the lead, and wider integers in the header (msgpack ints grow to 9 bytes)
        self.gap = round8(self.max(1)) + 56
        self._reuse = codec.reuses_out and not self.device
        self.fused = codec.fuses_feedback              # fused EF / round trip
        self._add = codec.decodes_add                  # fused decode-and-add
        self._codec_key = (type(codec), repr(sorted(codec.get_config().items())))

    # -- sizes ----------------------------------------------------------------------------
    def bound(self, n: int, parts: int = 1) -> int:
        """Frame bytes for ``n`` elements in up to ``parts`` parts."""
        b = self._bounds.get((n, parts))
        if b is None:
            b = (HDR.size + PART.size * parts + round8(self.max(n) + 7)
                 + (parts - 1) * self.gap)
            self._bounds[(n, parts)] = b
        return b

    def max(self, n: int) -> int:
        """The codec's payload bound for ``n`` elements (cached)."""
        m = self._maxes.get(n)
        if m is None:
            m = self._maxes[n] = max_nbytes(self.codec, n, self.dtype)
        return m

    def take(self, nbytes: int) -> np.ndarray:
        """A distinct byte buffer for this call (frames, landings)."""
        return self.scratch.arena.take(nbytes)

    def floats(self, slot: int, n: int) -> Any:
        """Float scratch of ``n`` elements where ``base`` lives (one per ``slot``)."""
        if self.device:
            return arrays.empty_like_kind(self.base, n, self.dtype)
        return self.scratch.floats(slot, n, self.base.dtype)

    # -- writing --------------------------------------------------------------------------
    def _layout(self, n: int) -> Layout | None:
        return self.scratch.layouts.get((self._codec_key, n, self.dtype))

    def _learn(self, n: int, payload: Payload, head: int) -> None:
        bufs, pos = [], 0
        for name, b in payload.buffers.items():
            bufs.append((name, b.dtype, int(b.size), pos))
            pos += b.nbytes
        lead = round8(max(head, self.max(n) - pos))
        self.scratch.layouts[(self._codec_key, n, self.dtype)] = Layout(lead, bufs)

    def _write_payload(self, frame: np.ndarray, pos: int, x: np.ndarray,
                       seed: tuple[int, ...], n: int, fused: dict[str, np.ndarray]
                       ) -> tuple[int, int]:
        """Compress ``x`` into the part region of ``frame`` starting at ``pos`` (8-aligned):
        zeros, then the payload with its buffers 8-aligned. Returns (lead, bytes).
        ``fused``: the codec's ``residual``/``decoded`` arguments (empty if none)."""
        lay = self._layout(n) if self._reuse else None
        views: dict[str, np.ndarray] = {}
        if lay is not None:
            b0 = pos + lay.lead
            for name, dt, count, o in lay.buffers:
                views[name] = frame[b0 + o:b0 + o + count * dt.itemsize].view(dt)
            payload = self.codec.compress(x, seed=seed,
                                          out=Payload(self.codec.name, {}, views), **fused)
        else:
            payload = self.codec.compress(x, seed=seed, **fused)
        meta = payload._meta()
        head = PREFIX_SIZE + len(meta)
        plen = head + payload._body()
        if plen > self.max(n):
            raise PayloadError(f"{self.codec.name} produced {plen} bytes for {n} elements, "
                               "above its declared max_nbytes")
        if lay is not None and head <= lay.lead and _in_place(payload, views):
            start = pos + lay.lead - head             # buffers already in place
            payload.write_into(frame[start:start + plen], meta)
        else:
            start = pos + (-(pos + head)) % 8
            if views:                                 # moved buffers may overlap the head
                frame[start:start + plen] = payload.to_bytes()
            else:
                payload.write_into(frame[start:start + plen], meta)
            if self._reuse and lay is None:
                self._learn(n, payload, head)
        frame[pos:start] = 0
        end = start + plen
        frame[end:round8(end)] = 0
        return start - pos, plen

    def single(self, x: np.ndarray, seed: tuple[int, ...], n: int, size: int, *,
               residual: np.ndarray | None = None, decoded: np.ndarray | None = None,
               tally: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A one-part frame of ``size`` bytes holding ``x`` compressed; (frame, payload).

        With ``residual`` e, ``y = x + e`` is compressed and ``e = y − decode`` is left;
        with ``decoded``, ``decode`` is left there (may be ``x``): fused into the codec's
        pass when it can (``compress(..., residual=, decoded=)``), else step by step
        (the same bytes). ``tally``: ``+= (sq_norm(e), e.size)`` of the new ``e``
        (:meth:`~gradcomm.compressors.base.Compressor.compress`)."""
        frame = self.take(size)
        pos = HDR.size + PART.size
        fused: dict[str, np.ndarray] = {}
        if residual is not None or decoded is not None:
            if self.fused:
                if residual is not None:
                    fused["residual"] = residual
                    if tally is not None:
                        fused["tally"] = tally
                if decoded is not None:
                    fused["decoded"] = decoded
            elif residual is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    residual += x                       # IEEE addition commutes
                x = residual
        lead, plen = self._write_payload(frame, pos, x, seed, n, fused)
        HDR.pack_into(frame, 0, 1, 0)
        PART.pack_into(frame, HDR.size, 0, n, (lead << LEN_BITS) | plen)
        frame[round8(pos + lead + plen):] = 0
        data = frame[pos + lead:pos + lead + plen]
        if not fused and (residual is not None or decoded is not None):
            dec = decoded if decoded is not None else self.floats(0, n)
            self.decode(data, dec)
            if residual is not None:
                with np.errstate(invalid="ignore"):
                    residual -= dec
                add_tally(tally, residual)
        return frame, data

    def assemble(self, parts: list[tuple[int, int, np.ndarray]], size: int
                 ) -> np.ndarray | None:
        """A frame of ``size`` bytes from existing payloads (None if they do not fit)."""
        pos = HDR.size + PART.size * len(parts)
        places = []
        for off, m, data in parts:
            head = PREFIX_SIZE + struct.unpack_from("<I", data, 3)[0]
            lead = (-(pos + head)) % 8
            places.append((pos, lead))
            pos = round8(pos + lead + data.size)
        if pos > size:
            return None
        frame = self.take(size)
        HDR.pack_into(frame, 0, len(parts), 0)
        for i, ((off, m, data), (at, lead)) in enumerate(zip(parts, places)):
            PART.pack_into(frame, HDR.size + PART.size * i, off, m,
                           (lead << LEN_BITS) | data.size)
            frame[at:at + lead] = 0
            frame[at + lead:at + lead + data.size] = data
            end = at + lead + data.size
            frame[end:round8(end)] = 0
        frame[pos:] = 0
        return frame

    # -- reading --------------------------------------------------------------------------
    def parts(self, frame: np.ndarray, n: int, max_parts: int
              ) -> list[tuple[int, int, np.ndarray]]:
        """Validated (offset, count, payload bytes) of a peer's frame for ``n`` elements."""
        if frame.size < HDR.size:
            raise PayloadError(f"compressed frame of {frame.size} bytes has no header")
        nparts, reserved = HDR.unpack_from(frame, 0)
        pos = HDR.size + PART.size * nparts
        if not 1 <= nparts <= max_parts or reserved or pos > frame.size:
            raise PayloadError(f"compressed frame announces {nparts} parts (allowed 1.."
                               f"{max_parts}) in {frame.size} bytes")
        parts, expect = [], 0
        for i in range(nparts):
            off, m, word = PART.unpack_from(frame, HDR.size + PART.size * i)
            lead, plen = word >> LEN_BITS, word & ((1 << LEN_BITS) - 1)
            if off != expect or m < 1 or off + m > n or pos + lead + plen > frame.size:
                raise PayloadError(f"compressed frame part {i}: offset {off}, {m} elements, "
                                   f"{plen} bytes do not fit a segment of {n} elements in "
                                   f"{frame.size} bytes")
            parts.append((off, m, frame[pos + lead:pos + lead + plen]))
            pos = round8(pos + lead + plen)
            expect = off + m
        if expect != n:
            raise PayloadError(f"compressed frame covers {expect} of {n} elements")
        return parts

    def payload(self, data: np.ndarray, n: int) -> Payload:
        """The validated payload of ``n`` elements in bytes ``data``."""
        payload = Payload.from_bytes(data, max_nbytes=data.size)
        if payload.codec != self.codec.name:
            raise PayloadError(f"payload of codec {payload.codec!r} where {self.codec.name!r} "
                               "was agreed")
        m = payload.header.get("n", n)
        if m != n:
            raise PayloadError(f"{self.codec.name} payload announces {m!r} elements, "
                               f"{n} expected")
        return payload

    def decode(self, data: np.ndarray, dst: np.ndarray) -> None:
        """``dst[...] = decode(data)`` (contiguous ``dst``), validated: codec name, the
        announced count ``n`` and, in the codecs, everything else."""
        self.decode_payload(self.payload(data, arrays.size(dst)), dst)

    def decode_payload(self, payload: Payload, dst: np.ndarray) -> None:
        """``dst[...] = decode(payload)``; a payload the codec cannot read is a
        PayloadError."""
        try:
            res = self.codec.decompress(payload, out=dst)
        except PayloadError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            raise PayloadError(f"{self.codec.name} payload does not decode: {exc}") from None
        if res is not dst:
            n = arrays.size(dst)
            if arrays.is_host(res) != arrays.is_host(dst) or tuple(res.shape) != (n,):
                raise PayloadError(f"{self.codec.name} payload decodes to "
                                   f"{getattr(res, 'shape', type(res))}, ({n},) expected")
            arrays.assign(dst, res)

    def decode_add(self, data: np.ndarray, seg: np.ndarray) -> None:
        """``seg += decode(data)``, validated."""
        self.decode_add_payload(self.payload(data, arrays.size(seg)), seg)

    def decode_onto(self, data: np.ndarray, seg: np.ndarray, base: np.ndarray) -> None:
        """``seg = decode(data) + base`` (``base`` only read), validated: the bytes of
        copying ``base`` into ``seg``, then :meth:`decode_add`; in one pass where the
        codec declares ``decodes_onto``."""
        payload = self.payload(data, arrays.size(seg))
        if not self.codec.decodes_onto:
            arrays.assign(seg, base)
            self.decode_add_payload(payload, seg)
            return
        self._into(lambda: self.codec.decompress_onto(payload, base, seg), seg)

    def decode_add_payload(self, payload: Payload, seg: np.ndarray) -> None:
        """``seg += decode(payload)`` (fused when the codec decodes with ``add=True``)."""
        if not self._add:
            dec = self.floats(1, arrays.size(seg))
            self.decode_payload(payload, dec)
            with np.errstate(invalid="ignore", over="ignore"):
                seg += dec                      # IEEE addition commutes: order-free
            return
        self._into(lambda: self.codec.decompress(payload, out=seg, add=True), seg)

    def _into(self, decode: Any, seg: np.ndarray) -> None:
        """Run ``decode()``, which decodes into ``seg``: a payload the codec cannot read,
        or a result elsewhere, is a PayloadError."""
        try:
            res = decode()
        except PayloadError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            raise PayloadError(f"{self.codec.name} payload does not decode: {exc}") from None
        if res is not seg:
            raise PayloadError(f"{self.codec.name} did not decode into the given out=")
