"""Allreduce with a compressor: every codec composes with every collective.

A compressed allreduce takes one of three routes (:mod:`.routes`), decided once per call
by the front door (:mod:`.allreduce`):

- **per hop** (``ring``, ``tree``, ``recursive_doubling``, ``rabenseifner``): the dense
  algorithm runs on a :class:`~.wire.CompressedWire`, which sends codec payloads
  (:mod:`.frames`) and decodes, adds and re-encodes at every reduce hop; finished
  segments travel compressed in the allgather phase, so the bytes per rank stay
  2(p−1)/p of the compressed size. Each re-compression adds error; with error feedback
  every hop keeps its own residual. A large ring runs its codec work on a worker thread
  while messages move (:mod:`.ring`).
- **allgather**: every rank compresses ``e + g`` once, the frames are allgathered, and
  every rank decodes and sums them in rank order: no re-compression error, but (p−1)·c
  bytes sent per rank.
- **sparse_allgather**: as allgather, for sparse codecs (topk): only (index, value)
  pairs move.

``algorithm="auto"`` picks the route with the lowest modelled time (:mod:`.auto`, over
the cost model of :mod:`gradcomm.collectives.costmodel`). PowerSGD's two rounds of dense
sums are its own route (:mod:`.powersgd`). Ops ``sum`` and ``mean`` only, floating dtypes
only; 16-bit floats are widened to float32 for the codecs; for ``mean`` with a lossy codec
the inputs are divided by p *before* compressing. Device buffers (cupy, torch CUDA) run
their codecs on the device and only payloads cross to the host. Stochastic codecs draw
from seeds ``(seed, step, crc32(key), rank)`` (:mod:`.seeds`); what a transport keeps
between calls is in :mod:`.state`.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.arange(4.0, dtype=np.float32) * (t.rank + 1)
    ...     return compressed_allreduce(t, x, "float32", op="sum", algorithm="auto",
    ...                                 compressor="fp16").tolist()
    >>> run_ranks(2, fn)[0]
    [0.0, 3.0, 6.0, 9.0]
"""

from __future__ import annotations

from ._args import COMPRESSED_ALGORITHMS, GATHER_ALGORITHMS, HOP_ALGORITHMS, POWERSGD_ALGORITHMS
from .allreduce import compressed_allreduce
from .auto import auto_route

__all__ = ["COMPRESSED_ALGORITHMS", "GATHER_ALGORITHMS", "HOP_ALGORITHMS",
           "POWERSGD_ALGORITHMS", "auto_route", "compressed_allreduce"]
