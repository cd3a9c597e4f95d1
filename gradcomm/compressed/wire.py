"""The :class:`~gradcomm.collectives._wire.Wire` of per-hop compressed allreduces.

The dense algorithms (ring, tree, recursive doubling, Rabenseifner) run unchanged on a
:class:`CompressedWire`: it sends codec payloads in :mod:`~gradcomm.compressed.frames`
and decodes, adds and re-encodes at every reduce hop; finished segments travel compressed
in the allgather phase (decoded once, forwarded as received). A partial segment is one
part; a finished segment assembled from finished pieces (Rabenseifner's allgather) is
sent as those pieces' payloads, not re-compressed.

With error feedback every hop keeps its own residual (``"<key>#e<i>"`` for partial sums,
``"<key>#f<i>"`` for finished ones); hops are numbered in call order, which depends on
(n, p, algorithm) only.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.collectives import ring
    >>> from gradcomm.ops import Reducer
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.seeds import Seeds
    >>> def fn(t):
    ...     x = np.full(5, t.rank + 1.0, np.float32)
    ...     wire = CompressedWire(compressors.get("fp16"), x, Seeds(0, 0, "w", t.rank, False))
    ...     ring.allreduce(t, x, Reducer("sum", "float32"), wire=wire)
    ...     return x.tolist()
    >>> run_ranks(3, fn)[2]
    [6.0, 6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..compressors.base import Compressor
from ..error_feedback import HOP_SEP, ResidualStore
from ..errors import ConfigError
from .frames import Frames
from .seeds import Seeds
from .state import Scratch


class CompressedWire:
    """A wire whose messages are codec frames over segments of ``base``.

    ``ef`` (a :class:`~gradcomm.error_feedback.ResidualStore`, or None) keeps one
    residual per hop; ``key`` names them. ``max_parts``: the most finished pieces a finished segment's frame may hold.
    Buffers come from ``scratch`` (reused across calls on one transport), else fresh.
    """

    lossy = True
    folds_from_src = True

    def __init__(self, codec: Compressor, base: np.ndarray, seeds: Seeds, *,
                 max_parts: int = 1, ef: ResidualStore | None = None, key: str = "",
                 scratch: Scratch | None = None, src: np.ndarray | None = None) -> None:
        self.codec, self.base, self.seeds = codec, base, seeds
        #: an out-of-place ring's values (host, like ``base``): its first encodes read
        #: views of it, and ``reduce`` folds from it
        self.src = src
        self.frames = Frames(codec, base, scratch)
        self.dtype = self.frames.dtype
        self.device = self.frames.device
        self.max_parts = max(1, max_parts)
        self.ef = ef if (ef is not None and ef.enabled and codec.lossy) else None
        self.tally = None if self.ef is None else self.ef.tally
        self.key = key
        self._finished: dict[int, tuple[int, np.ndarray]] = {}   # offset -> (n, payload)
        self._partial_hops = 0
        self._final_hops = 0

    def _offset(self, seg: np.ndarray) -> int:
        """Where ``seg`` starts in the buffer (a view of it, or of ``src`` alike)."""
        n, m = arrays.size(self.base), arrays.size(seg)
        for whole in (self.base, self.src):
            if whole is None:
                continue
            off, rem = divmod(arrays.data_ptr(seg) - arrays.data_ptr(whole),
                              arrays.itemsize(self.base))
            if not rem and 0 <= off and off + m <= n:
                return off
        raise ConfigError("CompressedWire: segments must be views of the reduced buffer")

    def _forget(self, lo: int, hi: int) -> None:
        for off in [o for o, (m, _) in self._finished.items() if o < hi and o + m > lo]:
            del self._finished[off]

    def _hop_residual(self, name: str, off: int, n: int, dtype: Any) -> np.ndarray:
        """The residual of one hop, whose segment starts at ``off`` of the buffer."""
        assert self.ef is not None
        return self.ef.hop_residual(name, off, n, dtype, like=self.base)

    # -- the Wire protocol ----------------------------------------------------------------
    def partial_buffer(self, n: int, like: Any, slot: int = 0) -> np.ndarray:
        return self.frames.take(self.frames.bound(n))

    def encode(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), arrays.size(seg)
        hop = self._partial_hops
        self._partial_hops += 1
        seed = self.seeds.partial(off, n, hop)
        f = self.frames
        if self.ef is None:
            return f.single(seg, seed, n, f.bound(n))[0]
        e = self._hop_residual(f"{self.key}{HOP_SEP}e{hop}", off, n, self.dtype)
        return f.single(seg, seed, n, f.bound(n), residual=e, tally=self.tally)[0]

    def reduce(self, recv: np.ndarray, seg: np.ndarray, recv_first: bool,
               mine: np.ndarray | None = None) -> None:
        """``seg += decode(recv)``; with ``mine`` (``src``'s view of the segment),
        ``seg = decode(recv) + mine``: the bytes of the in-place ring (in one pass where
        the codec decodes onto another array)."""
        off, n = self._offset(seg), arrays.size(seg)
        self._forget(off, off + n)
        (_, _, data), = self.frames.parts(recv, n, 1)
        if mine is not None:
            self.frames.decode_onto(data, seg, mine)
        else:
            self.frames.decode_add(data, seg)

    def final(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), arrays.size(seg)
        f = self.frames
        size = f.bound(n, self.max_parts)
        pieces = sorted((o, m, p) for o, (m, p) in self._finished.items()
                        if off <= o and o + m <= off + n)
        if sum(m for _, m, _ in pieces) == n and len(pieces) <= self.max_parts:
            frame = f.assemble([(o - off, m, p) for o, m, p in pieces], size)
            if frame is not None:                       # finished pieces tile the segment
                return frame
        hop = self._final_hops
        self._final_hops += 1
        seed = self.seeds.final(off, n, hop, seg)
        if self.ef is None:
            frame, data = f.single(seg, seed, n, size,
                                   decoded=seg if self.codec.lossy else None)
        else:
            e = self._hop_residual(f"{self.key}{HOP_SEP}f{hop}", off, n, self.dtype)
            frame, data = f.single(seg, seed, n, size, residual=e, decoded=seg,
                                   tally=self.tally)
        self._forget(off, off + n)
        self._finished[off] = (n, data)
        return frame

    def final_buffer(self, n: int, seg: np.ndarray) -> np.ndarray:
        return self.frames.take(self.frames.bound(n, self.max_parts))

    def place(self, recv: np.ndarray, seg: np.ndarray) -> None:
        off, n = self._offset(seg), arrays.size(seg)
        parts = self.frames.parts(recv, n, self.max_parts)
        self._forget(off, off + n)
        for o, m, data in parts:
            self.frames.decode(data, seg[o:o + m])
            self._finished[off + o] = (m, data)
