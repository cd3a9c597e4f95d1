"""``powersgd``: rank-``r`` approximation by one power iteration (Vogels et al., NeurIPS 2019).

A gradient part of ``n`` elements is viewed as a matrix ``M`` (``rows`` x ``cols``) and
sent as two thin factors: ``P = M Q`` is orthogonalised (Gram-Schmidt), ``Q = M^T P``,
and the receiver forms ``P Q^T``. Both products are linear in ``M``, so the factors of
several ranks can be *summed* (with one shared ``Q``): that is what
:mod:`gradcomm.compressed.powersgd` does, in two allreduce rounds
of ``r·rows`` and ``r·cols`` values, keeping ``Q`` per key as a warm start between steps
(stateful; this module holds only the stateless parts).

**Matrix shape.** A part with a known shape ``(s0, s1, ...)`` is viewed as
``(s0, n / s0)`` (as PyTorch's hook does; a 1-D part is ``(n, 1)``). A flat part (no
shape) is laid out row-major in ``cols = ceil(sqrt(n))`` columns and
``rows = ceil(n / cols)`` rows; the last row is zero-padded (never materialised: the
products treat it separately). :func:`layout` decides, deterministically from ``n`` or
the shape alone, and also whether compressing pays: ``r = min(rank, rows, cols)`` and
the part is compressed only if ``r·(rows + cols)·min_compression_rate < n`` (PyTorch's
rule); otherwise its values travel uncompressed (so small and most 1-D tensors do).

**Numbers.** float16/bfloat16 inputs are worked on, and their factors sent, in float32;
float64 stays float64. Columns are normalised by their largest magnitude first (no
overflow in the norm); an all-zero column stays zero (zeros decode to zeros, no 0/0); a
non-finite column becomes NaN, so a NaN or +-inf input decodes to NaN (the library's
policy: overflows are never silently dropped).

As a stateless codec (``compress``/``decompress``: the registry, gossip, benchmarks) a
payload holds the flat layout's ``P`` (orthonormal) and ``Q`` from one power iteration
started at a random ``Q`` drawn from ``seed`` (``shared_seed``: ranks passing the same
seed start from the same ``Q``). ``decode(encode(x))`` is the projection of ``M`` on the
span of ``P``: a contraction, so error feedback is stable.

Options (validated, as PyTorch's ``PowerSGDState``): ``rank`` (matrix approximation rank,
default 1), ``min_compression_rate`` (default 2.0), ``start_iter`` (steps of a key sent
uncompressed first, default 0; used by the collective) and ``warm_start`` (reuse ``Q``
between steps, default True; used by the collective).

Example:
    >>> import numpy as np
    >>> m = np.outer(np.arange(1.0, 33.0), np.linspace(-1, 1, 32))   # rank 1, 32 x 32
    >>> c = PowerSGD(rank=1)
    >>> p = c.compress(m.reshape(-1), seed=0)
    >>> c.layout(m.size), p.nbytes < m.nbytes / 10
    (Layout(rows=32, cols=32, r=1), True)
    >>> bool(np.allclose(c.decompress(p), m.reshape(-1)))    # rank 1: recovered
    True
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from ._options import dtype_code, positive_int, seed_words
from .base import Compressor, need_out, reuse
from .payload import Payload, Reader, make_out, payload_nbytes
from ..errors import ConfigError, PayloadError

#: upper bound of the ``rank`` option (factors wider than this are no compression)
MAX_RANK = 1024


class Layout(NamedTuple):
    """A part as a matrix: ``rows`` x ``cols`` (row-major, last row possibly short) and
    the approximation rank ``r`` (0: sent uncompressed)."""

    rows: int
    cols: int
    r: int


def matrix_shape(n: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
    """``(rows, cols)`` of a part of ``n`` elements: ``(shape[0], n // shape[0])`` for a
    known shape (``(n, 1)`` for 0-d/1-d), else near-square ``cols = ceil(sqrt(n))``.

    Example:
        >>> matrix_shape(1000), matrix_shape(12, (3, 2, 2)), matrix_shape(7, (7,))
        ((32, 32), (3, 4), (7, 1))
    """
    if shape is not None:
        rows = int(shape[0]) if len(shape) > 1 else n
        return (rows, n // rows) if rows else (0, 0)
    if n == 0:
        return 0, 0
    cols = math.isqrt(n - 1) + 1              # ceil(sqrt(n))
    return -(-n // cols), cols


def layout(n: int, shape: Sequence[int] | None = None, *, rank: int = 1,
           min_compression_rate: float = 2.0) -> Layout:
    """The matrix view of a part and its rank (``r = 0``: not worth compressing)."""
    rows, cols = matrix_shape(n, shape)
    r = min(rank, rows, cols)
    if r == 0 or not r * (rows + cols) * min_compression_rate < n:
        r = 0
    return Layout(rows, cols, r)


def work_dtype(dtype: Any) -> np.dtype:
    """dtype the factors are computed and sent in: float64 for float64, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def orthonormalize(rows: np.ndarray) -> np.ndarray:
    """Gram-Schmidt (modified, applied twice) on the ROWS of a C-contiguous ``(r, m)``
    array, in place: afterwards its nonzero rows are orthonormal. A zero row stays zero; a
    row with a non-finite value becomes NaN. Deterministic: equal input bytes give equal
    output bytes.

    Example:
        >>> a = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
        >>> orthonormalize(a).round(6).tolist()
        [[0.6, 0.8], [0.8, -0.6], [0.0, 0.0]]
    """
    for i in range(rows.shape[0]):
        v = rows[i]
        for _ in range(2):                    # "twice is enough" (Kahan, Parlett)
            for j in range(i):
                v -= rows[j] * np.dot(rows[j], v)
        big = np.max(np.abs(v)) if v.size else 0
        if not np.isfinite(big):
            v.fill(np.nan)
        elif big > 0:
            v /= big
            v /= np.sqrt(np.dot(v, v))
        else:
            v.fill(0)
    return rows


def random_factor(r: int, m: int, seed: Any, dtype: Any) -> np.ndarray:
    """An ``(r, m)`` standard normal array drawn from ``seed`` (same seed, same bytes)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        seed_words(seed).tolist())))
    return rng.standard_normal((r, m)).astype(dtype)


# -- the products, on a flat part laid out as (rows, cols) ---------------------------------
def _split(x: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    full = x.size // cols if cols else 0
    return x[:full * cols].reshape(full, cols), x[full * cols:]


def left(x: np.ndarray, lay: Layout, qt: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``P^T = Q^T M^T`` into ``out`` (``(r, rows)``): ``x`` flat, ``qt`` ``(r, cols)``."""
    body, tail = _split(x, lay.cols)
    full = body.shape[0]
    if tail.size == 0:
        np.matmul(qt, body.T, out=out)
    else:
        out[:, :full] = qt @ body.T
        out[:, full] = qt[:, :tail.size] @ tail
    return out


def right(x: np.ndarray, lay: Layout, pt: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``Q^T = P^T M`` into ``out`` (``(r, cols)``): ``x`` flat, ``pt`` ``(r, rows)``."""
    body, tail = _split(x, lay.cols)
    full = body.shape[0]
    if tail.size == 0:
        np.matmul(pt, body, out=out)
    else:
        np.matmul(pt[:, :full], body, out=out)
        out[:, :tail.size] += pt[:, full:full + 1] * tail
    return out


def product(pt: np.ndarray, qt: np.ndarray, lay: Layout, out: np.ndarray) -> np.ndarray:
    """The flat part ``P Q^T`` (first ``out.size`` elements of the matrix) into ``out``."""
    body, tail = _split(out, lay.cols)
    full = body.shape[0]
    if pt.shape[0] == 1:                   # an outer product: BLAS with k = 1 is ~5x slower
        np.multiply(pt[0, :full, None], qt[0], out=body, casting="unsafe")
    elif body.dtype == pt.dtype:
        np.matmul(pt[:, :full].T, qt, out=body)
    else:
        body[...] = pt[:, :full].T @ qt
    if tail.size:
        tail[...] = pt[:, full] @ qt[:, :tail.size]
    return out


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD; as a codec, one power iteration from a seeded ``Q``."""

    options = ("rank", "min_compression_rate", "start_iter", "warm_start")

    name = "powersgd"
    #: P and Q of several ranks add up (the collective sums them; see the module doc)
    reduction = "summable"
    shared_seed = True
    #: the decoded output is a projection of the input: error feedback is stable
    contractive = True
    #: the collective views a part by its shape: entry points pass ``shape=`` (2+ dims)
    uses_shape = True
    reuses_out = True
    decodes_add = True

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, start_iter: int = 0,
                 warm_start: bool = True) -> None:
        self.rank = positive_int("rank", rank, 1, MAX_RANK)
        if isinstance(min_compression_rate, bool) or \
                not isinstance(min_compression_rate, (int, float, np.integer, np.floating)) \
                or not 0 <= min_compression_rate < math.inf:
            raise ConfigError(f"min_compression_rate must be a finite number >= 0, got "
                              f"{min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        self.start_iter = positive_int("start_iter", start_iter, 0)
        if not isinstance(warm_start, (bool, np.bool_)):
            raise ConfigError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = bool(warm_start)

    def get_config(self) -> dict[str, Any]:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate,
                "start_iter": self.start_iter, "warm_start": self.warm_start}

    def layout(self, n: int, shape: Sequence[int] | None = None) -> Layout:
        """The matrix view and rank of a part of ``n`` elements (``shape`` if known)."""
        return layout(n, shape, rank=self.rank, min_compression_rate=self.min_compression_rate)

    # -- the stateless codec --------------------------------------------------------------
    def _encode(self, x: np.ndarray, seed: Sequence[int] | int | None, out: Payload | None,
                fk: Any, residual: Any, decoded: Any) -> Payload:
        """One power iteration from the seed's ``Q`` (``residual`` and ``decoded`` are
        applied around it by :meth:`compress`: this codec does not fuse them)."""
        n, lay = x.size, self.layout(x.size)
        wdt = work_dtype(x.dtype)
        header = {"n": n, "dt": dtype_code(x.dtype), "rows": lay.rows, "cols": lay.cols,
                  "r": lay.r}
        pt = reuse(out, "p", wdt, lay.r * lay.rows).reshape(lay.r, lay.rows)
        qt = reuse(out, "q", wdt, lay.r * lay.cols).reshape(lay.r, lay.cols)
        v = reuse(out, "v", x.dtype, 0 if lay.r else n)
        if lay.r:
            xw = x if x.dtype == wdt else x.astype(wdt)
            q0 = orthonormalize(random_factor(lay.r, lay.cols, seed, wdt))
            orthonormalize(left(xw, lay, q0, pt))
            right(xw, lay, pt, qt)
        else:
            v[...] = x
        return Payload(self.name, header, {"p": pt.reshape(-1), "q": qt.reshape(-1), "v": v})

    def decompress(self, payload: Payload, out: np.ndarray | None = None, *,
                   add: bool = False) -> np.ndarray:
        """Decode into ``out`` (new if None); ``add``: ``out = decoded + out`` (the
        product is formed in scratch first)."""
        need_out(add, out, self.name)
        rd = Reader(payload, self.name, ("n", "dt", "rows", "cols", "r"), ("p", "q", "v"))
        dt = rd.dtype()
        n = rd.int("n", 0, 1 << 62)
        lay = self.layout(n)
        got = Layout(rd.int("rows", 0, 1 << 62), rd.int("cols", 0, 1 << 62),
                     rd.int("r", 0, MAX_RANK))
        if got != lay:
            raise PayloadError(f"powersgd payload: {n} elements as {got}, this codec "
                               f"({self.get_config()}) expects {lay}")
        wdt = work_dtype(dt)
        pt = rd.buffer("p", wdt.name, lay.r * lay.rows).reshape(lay.r, lay.rows)
        qt = rd.buffer("q", wdt.name, lay.r * lay.cols).reshape(lay.r, lay.cols)
        v = rd.buffer("v", dt.name, 0 if lay.r else n)
        out = make_out(out, n, dt)
        dec = np.empty(n, dt) if add else out
        if lay.r:
            product(pt, qt, lay, dec)
        else:
            dec[...] = v
        if add:
            with np.errstate(invalid="ignore", over="ignore"):
                out += dec                      # IEEE addition commutes
        return out

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        lay, code = self.layout(n), dtype_code(dtype)
        wdt = work_dtype(np.dtype(dtype)).name
        return payload_nbytes(self.name, {"n": n, "dt": code, "rows": lay.rows,
                                          "cols": lay.cols, "r": lay.r},
                              [("p", wdt, lay.r * lay.rows), ("q", wdt, lay.r * lay.cols),
                               ("v", dtype, 0 if lay.r else n)])


__all__ = ["Layout", "PowerSGD", "layout", "left", "matrix_shape", "orthonormalize",
           "product", "random_factor", "right", "work_dtype"]
