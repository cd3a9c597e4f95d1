"""Sparse allgather: the union of every rank's (index, value) pairs, duplicates summed.

1. Each rank merges its own duplicate indices (sorted, summed), so it holds k <= n pairs.
2. One small allgather tells every rank every k and every largest index; the dense length
   n is ``size`` when given (agreed by the cross-rank check), else the largest index + 1
   over all ranks. Announced sizes and ranges are validated identically on every rank.
3. **Sparse or dense** (the SparCML switch), decided from K = Σ k by every rank alike:
   gathering moves (p−1)/p·K·(i + v) bytes into a rank on average (i = 4-byte indices when
   n <= 2^31, else 8; v = value bytes); the dense ``auto`` allreduce f·n·(v + m), where
   m = 1 for the bool presence mask the public function also reduces (0 otherwise) and
   f = 2(p−1)/p for ring / Rabenseifner (large arrays), ceil(log2 p) for recursive doubling
   (small ones). Gathering is used while ``(p−1)/p·K·(i + v) <= f·n·(v + m)``; above that
   the pairs are scattered into a dense array (and mask) and reduced with the dense
   ``auto`` algorithm. E.g. float32 values, large n, ring: dense once the ranks together
   hold more than K = n/2 pairs (0.625·n with the mask), for any p.
4. Sparse path: the (index, value) blocks are allgathered (variable sizes), each peer block
   is checked (indices strictly increasing, inside [0, n)), and the blocks are merged in
   rank order: every rank computes the same sums from the same bytes. A rank whose first
   index and gaps all fit 16 bits (:data:`GAP_MAX`; top-k's 1 % has gaps near 100) sends
   its indices as uint16 gaps, announced with its count: 2 + v bytes a pair instead of
   i + v. The switch of step 3 still counts i, so the path taken, and the sums, do not
   depend on it.

:func:`sparse_allgather` is the user-facing form; :func:`allreduce` returns the dense sum
(what the top-k compressed allreduce needs, no mask).

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     i, v = sparse_allgather(np.array([t.rank, 5]), np.array([1.0, 2.0]), t)
    ...     return i.tolist(), v.tolist()
    >>> run_ranks(2, fn)[0]
    ([0, 1, 5], [1.0, 1.0, 4.0])
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from .. import arrays
from .._dtypes import bf16_to_f32, f32_to_bf16
from ..comm import get_transport
from ..comm.background import Prefault, background
from ..comm.base import Transport
from ..errors import ConfigError, GradcommError, PayloadError
from ._check import agree_args
from .allgather import allgather_ints, allgatherv

#: value dtypes the sum is defined for (bfloat16 is summed in float32)
VALUE_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


#: the largest gap between consecutive indices sent as a 2-byte delta: a rank whose
#: first index and gaps all fit sends uint16 gaps instead of 4- or 8-byte indices
GAP_MAX = 0xFFFF


def merge(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique indices and the sums of their values, in input order per index.

    Example:
        >>> i, v = merge(np.array([3, 1, 3]), np.array([1.0, 2.0, 4.0]))
        >>> i.tolist(), v.tolist()
        ([1, 3], [2.0, 5.0])
    """
    if indices.size == 0 or (indices.size == 1) or bool(np.all(indices[1:] > indices[:-1])):
        return indices, values
    order = np.argsort(indices, kind="stable")
    idx, val = indices[order], values[order]
    starts = np.flatnonzero(np.concatenate([[True], idx[1:] != idx[:-1]]))
    return idx[starts], np.add.reduceat(val, starts)


def _dense_factor(t: Transport, nbytes: int) -> int:
    """p·f: p × the dense allreduce's bytes per rank in units of the array's bytes."""
    from .auto import select

    p = t.size
    if select(t, nbytes) in ("ring", "rabenseifner"):
        return 2 * (p - 1)
    rounds = p.bit_length() - 1 + (p & (p - 1) != 0)
    return p * rounds


def _exchange(t: Transport, idx: np.ndarray, vals: np.ndarray, n: int | None, mask: bool
              ) -> tuple[int, list[tuple[np.ndarray, np.ndarray]] | None, np.ndarray | None,
                         np.ndarray | None]:
    """Steps 2-4. Returns (n, per-rank blocks | None, dense sum | None, dense mask | None)."""
    p = t.size
    gaps = np.diff(idx, prepend=0) if idx.size else idx
    short = not idx.size or (int(idx[0]) >= 0 and int(gaps.max()) <= GAP_MAX
                             and (idx.size == 1 or int(gaps[1:].min()) >= 1))
    info = allgather_ints(t, [idx.size, int(idx[-1]) + 1 if idx.size else 0,
                              2 if short else 0])
    ks, tops, widths = info[:, 0], info[:, 1], info[:, 2]
    if n is None:
        n = int(tops.max()) if p else 0
    bad = [r for r in range(p) if not (0 <= ks[r] <= n and 0 <= tops[r] <= n)]
    if bad:
        r = bad[0]
        raise PayloadError(f"sparse allgather: rank {r} announced {int(ks[r])} pairs up to "
                           f"index {int(tops[r]) - 1}, outside a dense length of {n}")
    odd = [r for r in range(p) if widths[r] not in (0, 2)]
    if odd:
        raise PayloadError(f"sparse allgather: rank {odd[0]} announced index width "
                           f"{int(widths[odd[0]])}, 0 or 2 expected")
    total = int(ks.sum())
    ib = 4 if n <= 2 ** 31 else 8
    vb = vals.dtype.itemsize
    if (p - 1) * total * (ib + vb) > _dense_factor(t, n * vb) * n * (vb + int(mask)):
        from . import dense_allreduce

        dense = np.zeros(n, vals.dtype)
        dense[idx] = vals
        dense_allreduce(t, dense, "sum", vals.dtype.name, "auto", check=False)
        present = None
        if mask:
            present = np.zeros(n, np.bool_)
            present[idx] = True
            dense_allreduce(t, present, "sum", "bool", "auto", check=False)
        return n, None, dense, present
    idt = np.dtype(np.int32 if ib == 4 else np.int64)
    wide = np.where(widths == 2, 2, ib)                 # index bytes each rank sends
    sent = gaps.astype(np.uint16) if short else idx.astype(idt)
    block = np.concatenate([sent.view(np.uint8), vals.view(np.uint8)])
    raw = allgatherv(t, block, sizes=ks * (wide + vb))
    blocks = []
    for r, b in enumerate(raw):
        k, w = int(ks[r]), int(wide[r])
        ir, vr = b[:k * w].view(np.uint16 if w == 2 else idt), b[k * w:].view(vals.dtype)
        if w == 2 and r == t.rank:
            ir = idx                        # this rank's own (checked above), not decoded
        elif w == 2:
            ir = np.cumsum(ir, dtype=np.int64)
        if k and not (ir[0] >= 0 and ir[-1] < n and bool(np.all(ir[1:] > ir[:-1]))):
            raise PayloadError(f"sparse allgather: rank {r} sent indices that are not "
                               f"strictly increasing inside [0, {n})")
        blocks.append((ir, vr))
    return n, blocks, None, None


def allreduce(t: Transport, indices: np.ndarray, values: np.ndarray, n: int, *,
              out: np.ndarray | None = None) -> np.ndarray:
    """Dense length-``n`` sum of every rank's sparse (``indices``, ``values``).

    No cross-rank check (the caller did one). Sums run in rank order on the sparse path.
    """
    idx, vals = merge(np.asarray(indices, np.int64), np.asarray(values))
    if idx.size and not (idx[0] >= 0 and idx[-1] < n):
        raise ConfigError(f"indices must lie in [0, {n}), got {idx[0]}..{idx[-1]}")
    fresh = out is None
    if fresh:                             # zero pages: no fill before the scatter; the
        out = np.zeros(n, vals.dtype)     # kernel maps them in while the pairs travel
    with background(Prefault(out)) if fresh else nullcontext():
        _, blocks, dense, _ = _exchange(t, idx, vals, n, mask=False)
    host = arrays.is_host(out)            # else a device buffer: blocks are copied there
    if dense is not None:
        arrays.assign(out, dense if host else arrays.like(dense, out))
        return out
    if not fresh:
        arrays.assign(out, 0)
    scatter = None
    if not host or (out.dtype == vals.dtype and out.flags.c_contiguous and
                    vals.dtype.kind == "f"):
        from ..compressors import _kernels

        scatter = _kernels.for_array(out).scatter    # compiled scatter-add on large n
    for ir, vr in blocks or []:
        if not host:
            ir, vr = arrays.like(ir, out), arrays.like(vr, out)
        if scatter is not None:
            scatter(out, ir, vr, True)                # blocks were checked in _exchange
        else:
            out[ir] += vr
    return out


def sparse_allgather(indices: Any, values: Any, comm: Any = None, *, size: int | None = None,
                     check: bool = True) -> tuple[Any, Any]:
    """Union of all ranks' (index, value) pairs, duplicate indices summed, sorted by index.

    Args:
        indices: 1-D integer array (numpy, torch or cupy), any length (0 included), may
            repeat indices.
        values: array of the same length; float16/bfloat16/float32/float64/int32/int64.
        comm: mpi4py communicator, torch ProcessGroup, Transport or None.
        size: the dense length (indices must lie in [0, size)); default: the largest
            index + 1 over all ranks.
        check: first verify that all ranks passed the same value dtype and size.

    Returns ``(indices, values)``: int64 indices of the kind of ``indices`` and values of
    the kind and dtype of ``values``; every rank returns the same bytes. An index that
    appears anywhere is in the result, even if its values sum to 0.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(3, lambda t: sparse_allgather(np.array([2]), np.array([1.0]), t,
        ...                                         size=4)[1].tolist())[0]
        [3.0]
    """
    t = get_transport(comm)
    problem: Exception | None = None
    vmeta = None
    try:
        ibuf, imeta = arrays.to_flat(indices)
        vbuf, vmeta = arrays.to_flat(values)
        if ibuf.dtype.kind not in "iu":
            raise ConfigError(f"indices must be integers, got {imeta.dtype}")
        if len(imeta.shape) != 1 or len(vmeta.shape) != 1 or ibuf.size != vbuf.size:
            raise ConfigError(f"indices and values must be 1-D of equal length, got shapes "
                              f"{imeta.shape} and {vmeta.shape}")
        if vmeta.dtype not in VALUE_DTYPES:
            raise ConfigError(f"values of dtype {vmeta.dtype} cannot be summed here; "
                              f"supported: {', '.join(VALUE_DTYPES)}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 0):
            raise ConfigError(f"size must be an int >= 0, got {size!r}")
        idx = ibuf.astype(np.int64)
        if idx.size and (idx.min() < 0 or (size is not None and idx.max() >= size)):
            raise ConfigError(f"indices must lie in [0, {size if size is not None else 'n'})"
                              f", got {idx.min()}..{idx.max()}")
        vals = bf16_to_f32(vbuf) if vmeta.dtype == "bfloat16" else vbuf
    except (GradcommError, ValueError, TypeError) as exc:
        problem = exc
    if check:
        agree_args(t, "sparse_allgather", problem, dtype=vmeta.dtype if vmeta else "?",
                   size=-1 if size is None else size)
    if problem is not None:
        raise problem
    assert vmeta is not None
    idx, vals = merge(idx, vals)
    n, blocks, dense, present = _exchange(t, idx, vals, size, mask=True)
    if dense is not None:
        assert present is not None
        out_i = np.flatnonzero(present)
        out_v = dense[out_i]
    elif blocks:
        out_i, out_v = merge(np.concatenate([b[0].astype(np.int64) for b in blocks]),
                             np.concatenate([b[1] for b in blocks]))
    else:
        out_i, out_v = np.zeros(0, np.int64), np.zeros(0, vals.dtype)
    out_i = np.ascontiguousarray(out_i, np.int64)
    if vmeta.dtype == "bfloat16":
        out_v = f32_to_bf16(out_v)
    out_v = np.ascontiguousarray(out_v)
    m = out_i.size
    return (arrays.from_flat(out_i, arrays.Meta(imeta.kind, "int64", (m,), imeta.device)),
            arrays.from_flat(out_v, arrays.Meta(vmeta.kind, vmeta.dtype, (m,), vmeta.device)))


__all__ = ["allreduce", "merge", "sparse_allgather"]
