"""Allreduce with a compressor: every codec composes with every collective.

A compressed allreduce takes one of three routes, decided per codec and algorithm:

- **per hop** (``ring``, ``tree``, ``recursive_doubling``, ``rabenseifner``): the dense
  algorithm runs on a :class:`CompressedWire`, which sends codec payloads and decodes,
  adds and re-encodes at every reduce hop; finished segments travel compressed in the
  allgather phase (decoded once, forwarded as received), so the bytes per rank stay
  2(p−1)/p of the compressed size. Natural for *summable* codecs (fp16, bf16, int8,
  randomk with a shared seed, none); for *gathered* codecs (topk, qsgd, terngrad, onebit)
  this is the CGX / 1-bit-Adam scheme extended to trees and recursive doubling. Each
  re-compression adds error: with error feedback every hop keeps its own residual
  (``"<key>#e<i>"`` for partial sums, ``"<key>#f<i>"`` for finished ones), so what a hop
  drops is sent at the same hop of the next step (recursive doubling: ranks that hold
  the same partial sum hold the same residual, so they still produce the same bytes).
  A codec told to keep ``k`` elements keeps ``k/n`` of each segment. Measured one-step
  relative errors at p = 4 (allgather → per hop): fp16 1e-4 → 3e-4, int8 0.004 → 0.009,
  qsgd 0.03 → 0.07, topk(0.1) 0.67 → 0.80; with error feedback the running mean's error
  falls like 1/T (``tests/collectives/test_compressed.py`` prints the table). A large
  ring runs its codec work on a worker thread while messages move
  (:mod:`~gradcomm.collectives.compressed_ring`).
- **allgather**: every rank compresses ``e + g`` once into a frame of the size that
  ``max_nbytes`` fixes (so no size exchange), the frames are allgathered, and every rank
  decodes and sums them in rank order into the result. No re-compression error, but
  (p−1)·c bytes sent and received per rank.
- **sparse_allgather**: as allgather, for codecs whose output is sparse (topk): the
  (index, value) pairs go through :func:`~gradcomm.collectives.sparse_allgather.allreduce`,
  which switches to a dense allreduce when the union gets dense.

Every (compressor, algorithm) pair above works; ``native`` and anything else raise
UnsupportedError / ConfigError naming the pairs that do.

**Device buffers** (cupy arrays, torch CUDA tensors; any non-numpy buffer): the codecs run
where the data is (the device kernels, :mod:`gradcomm.compressors._kernels._xp`) and only
payloads cross to the host: each rank encodes on the device (residual kept there), copies
its payload to a host frame, the frames are allgathered, and every payload is copied back
and decoded-and-summed on the device (sparse codecs: the union of the pairs is scattered
there). ``auto`` takes those gather routes for device buffers (few, large transfers
and kernel launches); an explicit per-hop algorithm runs on the device too, each hop's
payload crossing to the host and back; PowerSGD is run on a host copy (staged). Bytes are
those of the host path (the device kernels match the numpy reference bit for bit).

``algorithm="auto"`` picks the route with the lowest modelled time (:func:`route_times`):
``T = α·messages + β·bytes sent + e·elements encoded + g·elements decoded`` per rank,
for n elements, c = ``max_nbytes`` of the whole buffer, p ranks (q = 2^floor(log2 p),
k = log2 q, m = ceil(c/p / CHUNK_BYTES) chunks per segment):

======================  ==============  ============  ========  ========================
route                   messages        bytes sent    encoded   decoded
======================  ==============  ============  ========  ========================
ring (per hop)          2(p−1)·m        2(p−1)/p·c    n         (2p−1)/p·n
rabenseifner (per hop)  2k (+2 fold)    2(q−1)/q·c    n         (2q−1)/q·n
recursive doubling      k (+2 fold)     k·c           (k+1)·n   (2k+1)·n
tree (per hop)          2·log2(p)·m     2·log2(p)·c   n         2n
allgather               p−1 (Bruck:     (p−1)·c       n         p·n
                        ceil(log2 p))
sparse_allgather        p (Bruck: +1)   (p−1)·c       n         n (zero fill; scatter k·p)
======================  ==============  ============  ========  ========================

The per-hop candidate is the dense table's choice for c bytes (``auto.select``);
summable codecs always take it (gathering them only adds decoding). Gathered codecs
compare it with allgather (sparse_allgather for sparse codecs): e.g. at p = 2 ring and
allgather send the same bytes and the ring decodes 0.5·n less, but for top-k the sparse
route decodes nothing but the kept pairs; at p = 4 allgather sends (p−1)·c = 2× the
ring's bytes, so int8 re-compresses per hop there. α, β and the copy speed come from the
agreed calibrated profile (``python -m gradcomm.bench --calibrate``) if there is one,
else the defaults :data:`ALPHA`, :data:`BETA`, :data:`COPY_S` (hand-set, not measured);
e and g are the default :data:`CODEC_COST` (in copies of one element; a profile's measured
codec speeds replace them); :data:`WIRE_ALPHA` is a default either way. Per-hop
re-compression adds error (measured above); allgather aggregates exactly what each rank
compressed.

Details shared by the routes: ops ``sum`` and ``mean`` only; floating dtypes only;
float16 and bfloat16 are widened to float32 for the codecs (float64 stays float64) and
rounded back at the end; for ``mean`` with a lossy codec the inputs are divided by p
*before* compressing (no overflow in narrow formats). Error feedback applies only to
codecs that are contractions (:func:`gradcomm.error_feedback.contractive`: not TernGrad or
few-level QSGD, whose residuals diverge). With p = 1 nothing is compressed:
the result is ``g + e`` exactly and the residual drops to zero. Stochastic codecs draw from
seeds ``(seed, step, crc32(key), rank)`` (``shared_seed`` codecs: without rank; per-hop
encodings add the segment's offset and length, and finished segments use no rank at all,
so ranks holding equal data produce equal bytes). The cross-rank check covers count,
dtype, op, algorithm, codec name and config, seed, step, key and error feedback.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.full(5, t.rank + 1.0, np.float32)
    ...     return compressed_allreduce(t, x, "float32", op="sum", algorithm="ring",
    ...                                 compressor="none").tolist()
    >>> run_ranks(3, fn)[1]
    [6.0, 6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import contextlib
import struct
import threading
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .. import arrays, compressors
from .._dtypes import FLOATS
from ..comm.base import Transport
from ..compressors.base import Compressor, Payload
from ..error_feedback import HOP_SEP, ResidualStore, contractive
from ..errors import ConfigError, GradcommError, PayloadError, UnsupportedError
from . import compressed_ring
from ._check import agree_args
from ..ops import Reducer

#: algorithms that run per hop on a CompressedWire
HOP_ALGORITHMS = ("ring", "tree", "recursive_doubling", "rabenseifner")
#: algorithms that gather the compressed contributions
GATHER_ALGORITHMS = ("allgather", "sparse_allgather")
#: every algorithm name a compressed allreduce accepts
COMPRESSED_ALGORITHMS = (*HOP_ALGORITHMS, *GATHER_ALGORITHMS, "auto")
OPS = ("sum", "mean")
#: target bytes of one compressed message in the pipelined ring and tree
CHUNK_BYTES = 2 << 20

_HDR = struct.Struct("<II")       # frame: number of parts, reserved (0)
_PART = struct.Struct("<QQQ")     # part: offset in the segment, elements, lead|bytes
_LEN_BITS = 56                    # part word 3: (lead << 56) | payload bytes
_PREFIX_SIZE = 7                  # a payload's fixed prefix (magic, version, header length)
_ALIGN = 64
_STEPS: "weakref.WeakKeyDictionary[Transport, int]" = weakref.WeakKeyDictionary()


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _aligned(nbytes: int, zero: bool = False) -> np.ndarray:
    """A flat uint8 array of ``nbytes`` bytes starting on a 64-byte boundary."""
    raw = (np.zeros if zero else np.empty)(nbytes + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip:skip + nbytes]


class _Arena:
    """The byte buffers of one compressed allreduce (frames, landings), carved from one
    block that later calls reuse.

    Every buffer handed out during a call is distinct, so frames in flight, forwarded
    landings and finished payloads stay intact until the call returns; the next call
    starts over (all sends of the previous one have completed). A call that needs more
    than the block gets separate buffers, and the block grows to that call's need. A fresh
    allocation costs several memory copies in page faults; reuse makes repeated calls
    (training steps) cheap. Thread-safe (a pipelined ring takes buffers from two threads).
    """

    def __init__(self) -> None:
        self.block: np.ndarray | None = None
        self.pos = self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        size = (max(nbytes, 1) + _ALIGN - 1) & ~(_ALIGN - 1)
        with self._lock:
            self.used += size
            b = self.block
            if b is not None and self.pos + size <= b.size:
                self.pos += size
                return b[self.pos - size:self.pos - size + nbytes]
        return _aligned(nbytes)

    def reset(self) -> None:
        """Start a call: grow the block to what the previous call used."""
        with self._lock:
            if self.used > (0 if self.block is None else self.block.size):
                self.block = None
                self.block = _aligned(self.used, zero=True)
            self.pos = self.used = 0

    def discard(self) -> None:
        """Forget the block (after a failed call, a peer's late message may still land)."""
        with self._lock:
            self.block, self.pos, self.used = None, 0, 0


class _State:
    """What one transport's compressed allreduces reuse from call to call: the arena,
    float scratch and the payload layouts learned per (codec, count, dtype)."""

    def __init__(self) -> None:
        self.arena = _Arena()
        self.layouts: dict[tuple[Any, ...], _Layout | None] = {}
        self._floats: dict[tuple[int, str], np.ndarray] = {}
        self.busy = False

    def floats(self, slot: int, n: int, dtype: Any) -> np.ndarray:
        """Scratch of ``n`` elements of ``dtype``; one per ``slot``, grown on demand."""
        dt = np.dtype(dtype)
        s = self._floats.get((slot, dt.name))
        if s is None or s.size < n:
            s = self._floats[slot, dt.name] = np.empty(max(n, 1), dt)
        return s[:n]


_STATES: "weakref.WeakKeyDictionary[Transport, _State]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


@contextlib.contextmanager
def _session(t: Transport) -> Iterator[_State]:
    """The transport's reusable state for one call (a private one if another call on the
    same transport is running); after an error the arena is dropped, not reused."""
    with _STATES_LOCK:
        st = _STATES.get(t)
        if st is None:
            st = _STATES[t] = _State()
        if st.busy:
            st = _State()
        st.busy = True
    st.arena.reset()
    try:
        yield st
    except BaseException:
        st.arena.discard()
        raise
    finally:
        st.busy = False


@dataclass
class _Layout:
    """Where a codec's buffers sit in a payload of one element count: ``lead`` bytes from
    the part's start (room for the largest prefix + header, rounded to 8) then each
    buffer ``(name, dtype, count, offset)`` back to back."""

    lead: int
    buffers: list[tuple[str, np.dtype, int, int]]


def max_nbytes(codec: Compressor, n: int, dtype: str) -> int:
    """Upper bound of ``codec``'s payload bytes for ``n`` elements of ``dtype``."""
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


class _Seeds:
    """Seed tuples for one call: ``(seed, step, crc32(key))`` plus what tells draws apart."""

    def __init__(self, seed: int, step: int, key: str, rank: int, shared: bool) -> None:
        self.base = (seed, step, zlib.crc32(key.encode()))
        self.rank, self.shared = rank, shared

    def whole(self) -> tuple[int, ...]:
        return self.base if self.shared else (*self.base, self.rank)

    def partial(self, off: int, n: int, hop: int) -> tuple[int, ...]:
        if self.shared:
            return (*self.base, off, n)
        return (*self.base, self.rank, 1, hop, off, n)

    def final(self, off: int, n: int, hop: int, seg: np.ndarray) -> tuple[int, ...]:
        if self.shared:
            return (*self.base, off, n)
        stride = max(1, arrays.size(seg) // 64)
        fingerprint = zlib.crc32(np.ascontiguousarray(arrays.host(seg[::stride])).tobytes())
        return (*self.base, 2, hop, off, n, fingerprint)


class CompressedWire:
    """The :class:`~gradcomm.collectives._wire.Wire` of a compressed allreduce.

    Frames: ``[nparts u32][0 u32]`` then ``nparts`` × ``[offset u64][count u64][lead << 56
    | bytes u64]``; the table is followed by each part's region: ``lead`` zero bytes, the
    payload (``bytes`` long), zeros up to a multiple of 8; then zeros up to a size that
    follows from the element count alone (what receivers post). The lead puts the
    payload's buffers on 8-byte boundaries, so receivers decode them in place, and the
    sender's codec writes its output straight into the frame (``compress(..., out=)``
    with buffers that are views of the frame: no copy). A partial segment is one part; a
    finished segment assembled from finished pieces (Rabenseifner's allgather) is sent as
    those pieces' payloads, not re-compressed. Peer frames are validated: parts must tile
    the segment, sizes must fit, payloads parse and decode to the right length.

    ``ef`` (a :class:`ResidualStore`, or None) keeps one residual per hop; ``key`` names
    them. Hops are numbered in call order, which depends on (n, p, algorithm) only.
    Buffers come from ``state`` (reused across calls on one transport), else fresh.
    """

    lossy = True

    def __init__(self, codec: Compressor, base: np.ndarray, seeds: _Seeds, *,
                 max_parts: int = 1, ef: ResidualStore | None = None, key: str = "",
                 state: _State | None = None) -> None:
        self.codec, self.base, self.seeds = codec, base, seeds
        self.dtype = arrays.dtype_name(base)
        self.device = not arrays.is_host(base)      # codecs run on the base's device
        self.max_parts = max(1, max_parts)
        self.ef = ef if (ef is not None and ef.enabled and codec.lossy) else None
        self.key = key
        self.state = state if state is not None else _State()
        self._bounds: dict[tuple[int, int], int] = {}
        self._maxes: dict[int, int] = {}
        # bytes a part may need beyond its share of max_nbytes(n): a header, one block of
        # rounding, the lead, and wider integers in the header (msgpack ints grow to 9 bytes)
        self._gap = _round8(self._max(1)) + 56
        self._finished: dict[int, tuple[int, np.ndarray]] = {}   # offset -> (n, payload)
        self._partial_hops = 0
        self._final_hops = 0
        self._reuse = codec.reuses_out and not self.device
        self._fused = codec.fuses_feedback              # fused EF / round trip
        self._add = codec.decodes_add                   # fused decode-and-add
        self._codec_key = (type(codec), repr(sorted(codec.get_config().items())))

    # -- sizes ----------------------------------------------------------------------------
    def bound(self, n: int, parts: int = 1) -> int:
        """Frame bytes for ``n`` elements in up to ``parts`` parts."""
        b = self._bounds.get((n, parts))
        if b is None:
            b = (_HDR.size + _PART.size * parts + _round8(self._max(n) + 7)
                 + (parts - 1) * self._gap)
            self._bounds[(n, parts)] = b
        return b

    def _max(self, n: int) -> int:
        m = self._maxes.get(n)
        if m is None:
            m = self._maxes[n] = max_nbytes(self.codec, n, self.dtype)
        return m

    def _scratch_of(self, slot: int, n: int) -> Any:
        if self.device:
            return arrays.empty_like_kind(self.base, n, self.dtype)
        return self.state.floats(slot, n, self.base.dtype)

    def _offset(self, seg: np.ndarray) -> int:
        off, rem = divmod(arrays.data_ptr(seg) - arrays.data_ptr(self.base),
                          arrays.itemsize(self.base))
        if rem or off < 0 or off + arrays.size(seg) > arrays.size(self.base):
            raise ConfigError("CompressedWire: segments must be views of the reduced buffer")
        return off

    def _forget(self, lo: int, hi: int) -> None:
        for off in [o for o, (m, _) in self._finished.items() if o < hi and o + m > lo]:
            del self._finished[off]

    def _hop_residual(self, name: str, off: int, n: int, dtype: Any) -> np.ndarray:
        """The residual of one hop, whose segment starts at ``off`` of the buffer."""
        assert self.ef is not None
        return self.ef.hop_residual(name, off, n, dtype, like=self.base)

    # -- frames ---------------------------------------------------------------------------
    def _layout(self, n: int) -> _Layout | None:
        return self.state.layouts.get((self._codec_key, n, self.dtype))

    def _learn(self, n: int, payload: Payload, head: int) -> None:
        bufs, pos = [], 0
        for name, b in payload.buffers.items():
            bufs.append((name, b.dtype, int(b.size), pos))
            pos += b.nbytes
        lead = _round8(max(head, self._max(n) - pos))
        self.state.layouts[(self._codec_key, n, self.dtype)] = _Layout(lead, bufs)

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
        head = _PREFIX_SIZE + len(meta)
        plen = head + payload._body()
        if plen > self._max(n):
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
        frame[end:_round8(end)] = 0
        return start - pos, plen

    def _single(self, x: np.ndarray, seed: tuple[int, ...], n: int, size: int, *,
                residual: np.ndarray | None = None, decoded: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """A one-part frame of ``size`` bytes holding ``x`` compressed; (frame, payload).

        With ``residual`` e, ``y = x + e`` is compressed and ``e = y − decode`` is left;
        with ``decoded``, ``decode`` is left there (may be ``x``): fused into the codec's
        pass when it can (``compress(..., residual=, decoded=)``), else step by step
        (the same bytes)."""
        frame = self.state.arena.take(size)
        pos = _HDR.size + _PART.size
        fused: dict[str, np.ndarray] = {}
        if residual is not None or decoded is not None:
            if self._fused:
                if residual is not None:
                    fused["residual"] = residual
                if decoded is not None:
                    fused["decoded"] = decoded
            elif residual is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    residual += x                       # IEEE addition commutes
                x = residual
        lead, plen = self._write_payload(frame, pos, x, seed, n, fused)
        _HDR.pack_into(frame, 0, 1, 0)
        _PART.pack_into(frame, _HDR.size, 0, n, (lead << _LEN_BITS) | plen)
        frame[_round8(pos + lead + plen):] = 0
        data = frame[pos + lead:pos + lead + plen]
        if not fused and (residual is not None or decoded is not None):
            dec = decoded if decoded is not None else self._scratch_of(0, n)
            self._decode(data, dec)
            if residual is not None:
                with np.errstate(invalid="ignore"):
                    residual -= dec
        return frame, data

    def _assemble(self, parts: list[tuple[int, int, np.ndarray]], size: int
                  ) -> np.ndarray | None:
        """A frame of ``size`` bytes from existing payloads (None if they do not fit)."""
        pos = _HDR.size + _PART.size * len(parts)
        places = []
        for off, m, data in parts:
            head = _PREFIX_SIZE + struct.unpack_from("<I", data, 3)[0]
            lead = (-(pos + head)) % 8
            places.append((pos, lead))
            pos = _round8(pos + lead + data.size)
        if pos > size:
            return None
        frame = self.state.arena.take(size)
        _HDR.pack_into(frame, 0, len(parts), 0)
        for i, ((off, m, data), (at, lead)) in enumerate(zip(parts, places)):
            _PART.pack_into(frame, _HDR.size + _PART.size * i, off, m,
                            (lead << _LEN_BITS) | data.size)
            frame[at:at + lead] = 0
            frame[at + lead:at + lead + data.size] = data
            end = at + lead + data.size
            frame[end:_round8(end)] = 0
        frame[pos:] = 0
        return frame

    def _parts(self, frame: np.ndarray, n: int, max_parts: int
               ) -> list[tuple[int, int, np.ndarray]]:
        """Validated (offset, count, payload bytes) of a peer's frame for ``n`` elements."""
        if frame.size < _HDR.size:
            raise PayloadError(f"compressed frame of {frame.size} bytes has no header")
        nparts, reserved = _HDR.unpack_from(frame, 0)
        pos = _HDR.size + _PART.size * nparts
        if not 1 <= nparts <= max_parts or reserved or pos > frame.size:
            raise PayloadError(f"compressed frame announces {nparts} parts (allowed 1.."
                               f"{max_parts}) in {frame.size} bytes")
        parts, expect = [], 0
        for i in range(nparts):
            off, m, word = _PART.unpack_from(frame, _HDR.size + _PART.size * i)
            lead, plen = word >> _LEN_BITS, word & ((1 << _LEN_BITS) - 1)
            if off != expect or m < 1 or off + m > n or pos + lead + plen > frame.size:
                raise PayloadError(f"compressed frame part {i}: offset {off}, {m} elements, "
                                   f"{plen} bytes do not fit a segment of {n} elements in "
                                   f"{frame.size} bytes")
            parts.append((off, m, frame[pos + lead:pos + lead + plen]))
            pos = _round8(pos + lead + plen)
            expect = off + m
        if expect != n:
            raise PayloadError(f"compressed frame covers {expect} of {n} elements")
        return parts

    def _payload(self, data: np.ndarray, n: int) -> Payload:
        payload = Payload.from_bytes(data, max_nbytes=data.size)
        if payload.codec != self.codec.name:
            raise PayloadError(f"payload of codec {payload.codec!r} where {self.codec.name!r} "
                               "was agreed")
        m = payload.header.get("n", n)
        if m != n:
            raise PayloadError(f"{self.codec.name} payload announces {m!r} elements, "
                               f"{n} expected")
        return payload

    def _decode(self, data: np.ndarray, dst: np.ndarray) -> None:
        """``dst[...] = decode(data)`` (contiguous ``dst``), validated: codec name, the
        announced count ``n`` and, in the codecs, everything else."""
        self._decode_payload(self._payload(data, arrays.size(dst)), dst)

    def _decode_payload(self, payload: Payload, dst: np.ndarray) -> None:
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

    def _decode_add(self, data: np.ndarray, seg: np.ndarray) -> None:
        """``seg += decode(data)``, validated."""
        self._decode_add_payload(self._payload(data, arrays.size(seg)), seg)

    def _decode_add_payload(self, payload: Payload, seg: np.ndarray) -> None:
        if not self._add:
            dec = self._scratch_of(1, arrays.size(seg))
            self._decode_payload(payload, dec)
            with np.errstate(invalid="ignore", over="ignore"):
                seg += dec                      # IEEE addition commutes: order-free
            return
        try:
            res = self.codec.decompress(payload, out=seg, add=True)
        except PayloadError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            raise PayloadError(f"{self.codec.name} payload does not decode: {exc}") from None
        if res is not seg:
            raise PayloadError(f"{self.codec.name} did not decode into the given out=")

    # -- the Wire protocol ----------------------------------------------------------------
    def partial_buffer(self, n: int, like: Any, slot: int = 0) -> np.ndarray:
        return self.state.arena.take(self.bound(n))

    def encode(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), arrays.size(seg)
        hop = self._partial_hops
        self._partial_hops += 1
        seed = self.seeds.partial(off, n, hop)
        if self.ef is None:
            return self._single(seg, seed, n, self.bound(n))[0]
        e = self._hop_residual(f"{self.key}{HOP_SEP}e{hop}", off, n, self.dtype)
        return self._single(seg, seed, n, self.bound(n), residual=e)[0]

    def reduce(self, recv: np.ndarray, seg: np.ndarray, recv_first: bool) -> None:
        off, n = self._offset(seg), arrays.size(seg)
        self._forget(off, off + n)
        (_, _, data), = self._parts(recv, n, 1)
        self._decode_add(data, seg)

    def final(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), arrays.size(seg)
        size = self.bound(n, self.max_parts)
        pieces = sorted((o, m, p) for o, (m, p) in self._finished.items()
                        if off <= o and o + m <= off + n)
        if sum(m for _, m, _ in pieces) == n and len(pieces) <= self.max_parts:
            frame = self._assemble([(o - off, m, p) for o, m, p in pieces], size)
            if frame is not None:                       # finished pieces tile the segment
                return frame
        hop = self._final_hops
        self._final_hops += 1
        seed = self.seeds.final(off, n, hop, seg)
        if self.ef is None:
            frame, data = self._single(seg, seed, n, size,
                                       decoded=seg if self.codec.lossy else None)
        else:
            e = self._hop_residual(f"{self.key}{HOP_SEP}f{hop}", off, n, self.dtype)
            frame, data = self._single(seg, seed, n, size, residual=e, decoded=seg)
        self._forget(off, off + n)
        self._finished[off] = (n, data)
        return frame

    def final_buffer(self, n: int, seg: np.ndarray) -> np.ndarray:
        return self.state.arena.take(self.bound(n, self.max_parts))

    def place(self, recv: np.ndarray, seg: np.ndarray) -> None:
        off, n = self._offset(seg), arrays.size(seg)
        parts = self._parts(recv, n, self.max_parts)
        self._forget(off, off + n)
        for o, m, data in parts:
            self._decode(data, seg[o:o + m])
            self._finished[off + o] = (m, data)


# -- routes -------------------------------------------------------------------------------
# Route-model **defaults**: hand-set constants, not measurements of this machine. They
# steer ``algorithm="auto"``'s route choice wherever no calibrated profile says otherwise
# (a profile's α, β, copy speed and codec speeds replace ALPHA, BETA, COPY_S and
# CODEC_COST; WIRE_ALPHA is always this default). ``python -m gradcomm.bench --calibrate``
# prints which of them its profile replaces and which stay defaults.
#: default (encode, decode) cost per element, in float32 element copies, of each codec's
#: kernels (rough figures once read off ``python -m gradcomm.bench --codecs`` at 16 Mi
#: float32, numba path, on the development VM; not re-measured per machine)
CODEC_COST: dict[str, tuple[float, float]] = {
    "none": (0.5, 0.5), "fp16": (0.6, 0.6), "bf16": (0.6, 0.6), "int8": (2.4, 1.3),
    "qsgd": (1.7, 0.75), "terngrad": (1.5, 0.8), "onebit": (1.2, 0.65),
    "topk": (2.6, 0.75), "randomk": (2.1, 2.1)}
#: default cost of a codec with no entry above (copies per element)
DEFAULT_COST = (2.0, 1.0)
#: default seconds per compressed message without a profile (transport, framing, parsing)
ALPHA = 60e-6
#: default cost of a compressed message beyond a profile's α (framing, parsing, Python);
#: not calibrated: added to the profile's α
WIRE_ALPHA = 40e-6
#: default seconds per byte sent without a profile (between shared memory and 10 Gbit/s)
BETA = 0.5e-9
#: default seconds per byte of a memory copy without a profile
COPY_S = 0.1e-9


def route_times(p: int, n: int, c: int, itemsize: int, codec: Compressor,
                per_hop: str, profile: Any = None) -> dict[str, float]:
    """Modelled seconds of each candidate route (see the module docstring's table).

    Example:
        >>> from gradcomm import compressors
        >>> t = route_times(4, 10**6, 10**6, 4, compressors.get("int8"), "rabenseifner")
        >>> min(t, key=t.get)
        'rabenseifner'
    """
    a, b, copy = ALPHA, BETA, COPY_S
    if profile is not None:
        a, b, copy = profile.alpha + WIRE_ALPHA, profile.beta, profile.copy or COPY_S
    e, g = (x * copy * itemsize for x in CODEC_COST.get(codec.name, DEFAULT_COST))
    measured = profile.codecs if profile is not None else {}
    for spec in sorted(measured):                 # s per float32 byte, measured
        if spec == codec.name or spec.startswith(codec.name + ":"):
            e = measured[spec].get("encode", e / itemsize) * itemsize
            g = measured[spec].get("decode", g / itemsize) * itemsize
            break
    q = 1 << (p.bit_length() - 1)
    k = q.bit_length() - 1
    fold = 0 if p == q else 1
    m = max(1, -(-c // p // CHUNK_BYTES))
    logp = (p - 1).bit_length()
    # (messages, bytes, encoded elements, decoded elements)
    shapes = {
        "ring": (2 * (p - 1) * m, 2 * (p - 1) / p * c, n, (2 * p - 1) / p * n),
        "rabenseifner": (2 * k + 2 * fold, 2 * (q - 1) / q * c + fold * c, n + fold * n,
                         (2 * q - 1) / q * n + fold * 2 * n),
        "recursive_doubling": (k + 2 * fold, k * c + fold * c, (k + 1 + fold) * n,
                               (2 * k + 1 + 2 * fold) * n),
        "tree": (2 * logp * m, 2 * logp * c, n, 2 * n),
    }
    gather_msgs = logp if p * c < 64 * 1024 else p - 1
    out = {per_hop: shapes[per_hop] if per_hop in shapes else shapes["ring"]}
    extra = {}
    if codec.reduction != "summable":
        if codec.sparse:
            out["sparse_allgather"] = (gather_msgs + 1, (p - 1) * c, n, 0.0)
            extra["sparse_allgather"] = copy * itemsize * n      # the zero fill
        else:
            out["allgather"] = (gather_msgs, (p - 1) * c, n, p * n)
    return {name: a * msgs + b * nbytes + e * enc + g * dec + extra.get(name, 0.0)
            for name, (msgs, nbytes, enc, dec) in out.items()}


def _link_bound(t: Transport, codec: Compressor, x: np.ndarray) -> bool:
    """Whether the agreed calibrated profile (if any) models the ring's wire time at more
    than twice its codec time (then keeping the link busy pays for a worker thread)."""
    from .auto import agreed_profile

    prof = agreed_profile(t)
    n = arrays.size(x)
    if prof is None or not n:
        return False
    p = t.size
    c = max_nbytes(codec, n, arrays.dtype_name(x))
    coding = route_times(p, n, c, arrays.itemsize(x), codec, "ring", _NoLink(prof))["ring"]
    return prof.beta * 2 * (p - 1) / p * c > 2 * coding


class _NoLink:
    """A profile's codec and copy speeds with free messages and bytes."""

    def __init__(self, prof: Any) -> None:
        self.alpha, self.beta = -WIRE_ALPHA, 0.0
        self.copy, self.codecs = prof.copy, prof.codecs


def _choose(t: Transport, codec: Compressor, n: int, dtype: str, itemsize: int) -> str:
    """``algorithm="auto"``: the route with the lowest modelled time (on a tie the gathered
    route, which does not re-compress)."""
    from .auto import agreed_profile, select

    c = max_nbytes(codec, n, dtype)
    per_hop = select(t, c)
    if codec.reduction == "summable":
        return per_hop
    times = route_times(t.size, n, c, itemsize, codec, per_hop, agreed_profile(t))
    return min(times, key=lambda r: (times[r], r == per_hop))    # ties: exact route


def auto_route(t: Transport, compressor: Any, n: int, dtype: str, *, device: bool = False,
               **options: Any) -> str:
    """The route ``algorithm="auto"`` takes on ``t`` for ``n`` elements of logical
    ``dtype`` through ``compressor`` (a name with ``options``, or a codec): one of
    :data:`HOP_ALGORITHMS` or :data:`GATHER_ALGORITHMS`. ``device``: the buffer is a device
    array (gather routes only). Local (no communication): it reads the profile the ranks
    already agreed on, if any. PowerSGD, whose rounds each pick a dense algorithm, gives
    ``"auto"``.

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(4, lambda t: auto_route(t, "int8", 10**6, "float32"))[0]
        'rabenseifner'
    """
    codec = compressors.get(compressor, **options)
    if codec.name == "powersgd":
        return "auto"
    if device:
        return "sparse_allgather" if codec.sparse else "allgather"
    wdt = "float64" if dtype == "float64" else "float32"
    from .._dtypes import storage

    return _choose(t, codec, n, wdt, storage(dtype).itemsize)


def segment_codec(codec: Compressor, n: int) -> Compressor:
    """The codec a per-hop wire uses on segments of an ``n``-element buffer: a codec told
    to keep ``k`` elements keeps the same fraction ``k/n`` of every segment instead."""
    k = codec.get_config().get("k")
    if k is None or not n:
        return codec
    return compressors.get(codec.name, ratio=min(1.0, k / n))


def _per_hop(t: Transport, x: np.ndarray, codec: Compressor, name: str, seeds: _Seeds,
             ef: ResidualStore | None, key: str, state: _State | None = None) -> None:
    from . import algorithm

    n, dt, itemsize = arrays.size(x), arrays.dtype_name(x), arrays.itemsize(x)
    codec = segment_codec(codec, n)

    parts = 1 << (t.size.bit_length() - 1) if name == "rabenseifner" else 1
    wire = CompressedWire(codec, x, seeds, max_parts=parts, ef=ef, key=key, state=state)
    kwargs: dict[str, Any] = {}
    if name in ("ring", "tree") and n:
        ratio = n * itemsize / max(1, max_nbytes(codec, n, dt))
        kwargs["chunk_bytes"] = max(itemsize, int(CHUNK_BYTES * max(1.0, ratio)))
    if name == "ring" and compressed_ring.wanted(n * itemsize, t, _link_bound(t, codec, x)):
        compressed_ring.allreduce(t, x, wire, **kwargs)
        return
    algorithm(name)(t, x, Reducer("sum", dt), wire=wire, **kwargs)


def _gathered(t: Transport, x: np.ndarray, codec: Compressor, sparse: bool, seeds: _Seeds,
              ef: ResidualStore | None, key: str, state: _State | None = None) -> None:
    """Every rank compresses ``x`` (+ its residual) once; the payloads are allgathered as
    one-part frames of the same size (no size exchange) and decoded-and-summed in rank
    order into ``x``. Sparse codecs send their (index, value) pairs through
    :func:`~gradcomm.collectives.sparse_allgather.allreduce` instead."""
    from .allgather import allgatherv

    n = arrays.size(x)
    wire = CompressedWire(codec, x, seeds, state=state)
    pairs = codec.sparse_pairs
    size = wire.bound(n)
    e = ef.flat_residual(key, n, wire.dtype, like=x) if ef is not None and wire._fused \
        else None
    if ef is None or e is not None:
        # the key's residual e (if any) is fused into the codec's pass: y = x + e is
        # compressed and e = y - decode(y) left behind; x itself is not needed after
        if sparse and pairs:
            payload = codec.compress(x, seed=seeds.whole(),
                                     **({} if e is None else {"residual": e}))
            _, _, idx, vals = codec.to_sparse(payload)
            _sparse_sum(t, idx, vals, x)
            return
        frame, data = wire._single(x, seeds.whole(), n, size, residual=e)
        if sparse:
            dec = wire._scratch_of(0, n)
            wire._decode(data, dec)
            idx = _nonzero(dec)
            _sparse_sum(t, idx, dec[idx], x)
            return
    else:                       # a residual kept in pieces (the DDP hook's): step by step
        ef.compensate(key, x)
        frame, data = wire._single(x, seeds.whole(), n, size)
        dec = wire._scratch_of(0, n)
        wire._decode(data, dec)
        ef.update(key, x, dec)
        if sparse:
            idx = _nonzero(dec)
            _sparse_sum(t, idx, dec[idx], x)
            return
    landing = wire.state.arena.take(size * t.size)
    blocks = allgatherv(t, frame, sizes=np.full(t.size, size, np.int64), out=landing)
    payloads = []
    for r, b in enumerate(blocks):
        try:
            (_, _, data), = wire._parts(b, n, 1)
            payloads.append(wire._payload(data, n))
        except PayloadError as exc:
            raise PayloadError(f"rank {r}'s payload: {exc}") from None
    if wire.device:             # every payload to the device in one copy (8-byte aligned)
        moved = arrays.like(landing, x)
        payloads = [pl.rebased(landing, moved) for pl in payloads]
    _decode_sum(wire, payloads, x)


def _nonzero(a: Any) -> Any:
    """Indices of ``a``'s non-zero elements (int64, ascending, where ``a`` is)."""
    if arrays.is_host(a):
        return np.flatnonzero(a)
    xp = arrays.namespace(a)
    return xp.astype(xp.nonzero(a)[0], xp.int64)


def _sparse_sum(t: Transport, idx: Any, vals: Any, x: Any) -> None:
    """``x = Σ_ranks scatter(idx, vals)``: the pairs go through the host (they are few);
    the result lands in ``x`` where it is."""
    from .sparse_allgather import allreduce as sparse_allreduce

    sparse_allreduce(t, arrays.host(idx), arrays.host(vals), arrays.size(x), out=x)


def _decode_sum(wire: CompressedWire, payloads: list[Payload], x: np.ndarray) -> None:
    """``x = Σ decode(payloads)`` in rank order (the codec's decompress_sum if it has its
    own, else decode, then decode-and-add)."""
    codec, n = wire.codec, arrays.size(x)
    try:
        if type(codec).decompress_sum is not Compressor.decompress_sum:
            total = codec.decompress_sum(payloads, out=x)
            if total is not x:
                if tuple(total.shape) != (n,):
                    raise PayloadError(f"{codec.name} payloads decode to shape "
                                       f"{tuple(total.shape)}, ({n},) expected")
                arrays.assign(x, total)
            return
        wire._decode_payload(payloads[0], x)
        for p in payloads[1:]:
            wire._decode_add_payload(p, x)
    except PayloadError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise PayloadError(f"{codec.name} payloads do not decode: {exc}") from None


def check_op(op: str, dtype: str, name: str) -> None:
    """Raise unless a compressed allreduce (codec ``name``) can reduce ``dtype`` by ``op``.

    Example:
        >>> check_op("mean", "float32", "fp16")
        >>> check_op("avg", "float32", "fp16")
        Traceback (most recent call last):
        ...
        gradcomm.errors.ConfigError: unknown op 'avg'; known: sum, mean, max, min, prod
    """
    if op not in OPS:
        if op in ("max", "min", "prod"):
            raise UnsupportedError(f"op={op!r} with a compressor: compressed allreduce "
                                   f"supports {', '.join(OPS)}; use compressor=None")
        raise ConfigError(f"unknown op {op!r}; known: sum, mean, max, min, prod")
    if dtype not in FLOATS:
        raise UnsupportedError(f"compressor {name!r} needs a floating dtype, got {dtype}")


def check_seed(seed: Any) -> int:
    """The seed of a compressed allreduce as an int (None: 0), checked.

    Example:
        >>> check_seed(None), check_seed(np.uint8(7))
        (0, 7)
    """
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
            not 0 <= seed < 2 ** 63:
        raise ConfigError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
    return int(seed)


def next_step(steps: "weakref.WeakKeyDictionary[Transport, int]", t: Transport,
              residuals: ResidualStore | None, key: str) -> int:
    """This call's step: that of ``key`` in ``residuals``, else the count of earlier calls
    on ``t`` (kept in ``steps``, which it advances)."""
    if residuals is not None:
        return residuals.step(key)
    step = steps.get(t, 0)
    steps[t] = step + 1
    return step


def compressed_allreduce(t: Transport, buf: np.ndarray, dtype: str, *, op: str,
                         algorithm: str, compressor: Any, check: bool = True,
                         seed: int | None = None, residuals: ResidualStore | None = None,
                         key: str | None = None, **options: Any) -> np.ndarray:
    """Allreduce flat storage ``buf`` of logical ``dtype`` through ``compressor``.

    ``buf`` may be overwritten; the result (flat, storage dtype) is returned. ``residuals``
    (a :class:`ResidualStore`) supplies error feedback and the step counter of ``key``;
    without it, steps count the calls on ``t`` and nothing is compensated. ``seed``
    (default 0) seeds the stochastic codecs. Errors in the arguments are raised on every
    rank (after the cross-rank check, when ``check``).
    """
    powersgd = (compressor if isinstance(compressor, str) else
                getattr(compressor, "name", None)) == "powersgd"
    if not arrays.is_host(buf) and powersgd:
        # PowerSGD's rounds run on the host: a device buffer is staged through a host copy
        res = compressed_allreduce(t, arrays.host(buf).copy(), dtype, op=op,
                                   algorithm=algorithm, compressor=compressor, check=check,
                                   seed=seed, residuals=residuals, key=key, **options)
        arrays.assign(buf, arrays.like(res, buf))
        return buf
    if powersgd:                                # stateful, two rounds: its own route
        from .powersgd import powersgd_allreduce

        return powersgd_allreduce(t, buf, dtype, op=op, algorithm=algorithm, codec=compressor,
                                  check=check, seed=seed, residuals=residuals, key=key,
                                  **options)
    key = "default" if key is None else key
    problem: Exception | None = None
    codec: Compressor | None = None
    name = compressor if isinstance(compressor, str) else getattr(compressor, "name", "?")
    try:
        codec = compressors.get(compressor, **options)
        name = codec.name
        check_op(op, dtype, name)
        if algorithm not in COMPRESSED_ALGORITHMS:
            if algorithm == "native":
                raise UnsupportedError(
                    f"algorithm='native' cannot carry {name!r} payloads; with a compressor "
                    f"use one of {', '.join(COMPRESSED_ALGORITHMS)}")
            raise ConfigError(f"unknown algorithm {algorithm!r}; with a compressor use one "
                              f"of {', '.join(COMPRESSED_ALGORITHMS)}")
        seed = check_seed(seed)
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str, got {type(key).__name__}")
    except (GradcommError, KeyError, TypeError, ValueError) as exc:
        problem = exc
    step = next_step(_STEPS, t, residuals, key)
    if check:
        config = repr(sorted(codec.get_config().items())) if codec is not None else "?"
        # "auto" takes the gather routes for device buffers (on the host: maybe per hop)
        route = algorithm if algorithm != "auto" else \
            "auto (host)" if arrays.is_host(buf) else "auto (device buffer)"
        agree_args(t, "compressed allreduce", problem, count=arrays.size(buf), dtype=dtype,
                   op=op, algorithm=route, compressor=name, config=config,
                   seed=seed if isinstance(seed, int) else repr(seed), step=step, key=key,
                   error_feedback=residuals is not None and residuals.enabled)
    if problem is not None:
        raise problem
    assert codec is not None and isinstance(seed, (int, np.integer))
    out = _run(t, buf, dtype, op, algorithm, codec, int(seed), step, residuals, key)
    if residuals is not None:
        residuals.advance(key)
    return out


@arrays.device_scoped            # cupy: kernels and new arrays on buf's device
def _run(t: Transport, buf: np.ndarray, dtype: str, op: str, algorithm: str,
         codec: Compressor, seed: int, step: int, ef: ResidualStore | None, key: str
         ) -> np.ndarray:
    p, n = t.size, arrays.size(buf)
    ef = ef if (ef is not None and ef.enabled and codec.lossy and contractive(codec)) \
        else None
    pre_divide = op == "mean" and codec.lossy and p > 1
    if p == 1 or n == 0:
        x = _widen(buf, dtype, None)
        if pre_divide:
            arrays.divide_(x, p)
        if ef is not None and n:
            ef.compensate(key, x)
            ef.update(key, x, x)
        return _narrow(x, buf, dtype)
    with _session(t) as state:
        x = _widen(buf, dtype, state)
        if pre_divide:
            arrays.divide_(x, p)
        seeds = _Seeds(seed, step, key, t.rank, codec.shared_seed)
        name = algorithm
        if name == "auto" and not arrays.is_host(x):     # device: gather routes only
            name = "sparse_allgather" if codec.sparse else "allgather"
        elif name == "auto":
            name = _choose(t, codec, n, x.dtype.name, buf.dtype.itemsize)
        if name in HOP_ALGORITHMS:
            _per_hop(t, x, codec, name, seeds, ef, key, state)
        else:
            _gathered(t, x, codec, name == "sparse_allgather", seeds, ef, key, state)
        if op == "mean" and not pre_divide:
            arrays.divide_(x, p)
        return _narrow(x, buf, dtype)


def _widen(buf: np.ndarray, dtype: str, state: _State | None) -> np.ndarray:
    """The float32 working copy of 16-bit floats (reused scratch), else ``buf`` itself."""
    if dtype not in ("bfloat16", "float16"):
        return buf
    from ..compressors import _kernels

    n = arrays.size(buf)
    if not arrays.is_host(buf):
        x = arrays.empty_like_kind(buf, n, "float32")
    else:
        x = state.floats(3, n, np.float32) if state is not None else np.empty(n, np.float32)
    k = _kernels.for_array(buf)
    if dtype == "bfloat16":
        k.bf16_to_f32(buf, x)
    else:
        k.f16_to_f32(arrays.bitcast(buf, "uint16"), x)
    return x


def _narrow(x: np.ndarray, buf: np.ndarray, dtype: str) -> np.ndarray:
    """Round the float32 result back into 16-bit ``buf`` (no-op when ``x is buf``)."""
    if x is not buf:
        from ..compressors import _kernels

        k = _kernels.for_array(buf)
        if dtype == "bfloat16":
            k.f32_to_bf16(x, buf)
        else:
            k.f32_to_f16(x, arrays.bitcast(buf, "uint16"))
    return buf


__all__ = ["COMPRESSED_ALGORITHMS", "CompressedWire", "GATHER_ALGORITHMS", "HOP_ALGORITHMS",
           "auto_route", "compressed_allreduce", "max_nbytes", "segment_codec"]
