"""The function set every kernel path implements: :class:`Kernels` (and :class:`FusedKernels`).

A kernel path is a module (:mod:`._numpy`, :mod:`._numba`, :mod:`._xp`); codecs reach it
through :func:`~gradcomm.compressors._kernels.for_array` and call only what is listed
here. All three paths implement all of :class:`Kernels` with the same bytes; a path whose
``FUSED`` is True (numba) also implements :class:`FusedKernels`, which folds error
feedback and the round trip into the encoding pass. ``tests/compressors/test_kernels.py``
checks every path against these lists, names and parameters included.

Conventions: ``key`` is a host numpy uint32[4] (:func:`~gradcomm.compressors._options.
seed_words`); outputs are written in place; decoders return the number of invalid codes
(0 when all are valid); ``add`` means ``out = decoded + base`` (``base`` defaults to
``out``; another array of its size and kind is only read); ``like`` is an array whose
kind and device the result gets (None: host numpy).

Example:
    >>> from gradcomm.compressors._kernels import _numpy
    >>> missing = [n for n in members(Kernels) if not hasattr(_numpy, n)]
    >>> missing, _numpy.FUSED
    ([], False)
"""

from __future__ import annotations

from typing import Any, Protocol


class Kernels(Protocol):
    """The codec kernels of one path (module attributes: the path is a module)."""

    #: the path's name ("numpy", "numba", "xp")
    NAME: str
    #: whether the path also implements :class:`FusedKernels`
    FUSED: bool

    # -- random stream and bit packing
    def philox_words(self, key: Any, start: int, count: int, like: Any = None) -> Any:
        """Words ``start .. start+count-1`` of the Philox4x32-10 stream keyed by ``key``."""

    def dither(self, key: Any, start: int, count: int, like: Any = None) -> Any:
        """float32 dither ``(d + 0.5) / 2^16`` of elements ``start .. start+count-1``."""

    def pack(self, codes: Any, bits: int, out: Any = None) -> Any:
        """``bits``-bit codes (uint8) into a little-endian bit stream."""

    def unpack(self, packed: Any, n: int, bits: int) -> Any:
        """The first ``n`` ``bits``-bit codes of a bit stream (uint8)."""

    # -- 16-bit casts
    def f32_to_f16(self, x: Any, out: Any) -> None:
        """IEEE half bits (uint16) of float32 ``x``, NaN canonical."""

    def f16_to_f32(self, h: Any, out: Any, add: bool = False, base: Any = None) -> None:
        """float32 of half bits ``h`` (``add``: plus ``base``, default ``out``)."""

    def f32_to_bf16(self, x: Any, out: Any) -> None:
        """bfloat16 bits (uint16) of float32 ``x``, rounded to nearest even."""

    def bf16_to_f32(self, h: Any, out: Any, add: bool = False, base: Any = None) -> None:
        """float32 of bfloat16 bits ``h`` (``add``: plus ``base``, default ``out``)."""

    def finite16(self, h: Any, bf16: bool = False) -> bool:
        """Whether every half (``bf16``: bfloat16) of bits ``h`` is finite: what widening
        it gives, without the pass over the float32 result."""

    # -- bucketed quantizers (int8, qsgd / terngrad, onebit)
    def minmax_encode(self, x: Any, bs: int, bits: int, stochastic: bool, key: Any,
                      lo_out: Any, unit_out: Any, packed: Any) -> None:
        """Per-bucket min/max levels (int8)."""

    def minmax_decode(self, packed: Any, n: int, bs: int, bits: int, lo: Any, unit: Any,
                      out: Any, add: bool = False, base: Any = None) -> int:
        """Decode :meth:`minmax_encode`'s codes."""

    def fixed_encode(self, x: Any, bits: int, scale: float, stochastic: bool, key: Any,
                     packed: Any) -> None:
        """Symmetric levels of a shared scale (int8 with ``scale=``)."""

    def fixed_decode(self, packed: Any, n: int, bits: int, scale: float, out: Any,
                     add: bool = False, base: Any = None) -> int:
        """Decode :meth:`fixed_encode`'s codes."""

    def signlevel_encode(self, x: Any, bs: int, levels: int, bits: int, l2: bool, key: Any,
                         scale_out: Any, packed: Any) -> None:
        """Sign and stochastic level of the bucket's L2 norm (qsgd) or max (terngrad)."""

    def signlevel_decode(self, packed: Any, n: int, bs: int, levels: int, bits: int,
                         scale: Any, out: Any, add: bool = False, base: Any = None) -> int:
        """Decode :meth:`signlevel_encode`'s codes (returns the codes above ``levels``)."""

    def onebit_encode(self, x: Any, bs: int, pos_out: Any, neg_out: Any,
                      packed: Any) -> None:
        """Sign bits and the per-bucket means of the two sign groups."""

    def onebit_decode(self, packed: Any, n: int, bs: int, pos: Any, neg: Any, out: Any,
                      add: bool = False, base: Any = None) -> int:
        """Decode :meth:`onebit_encode`'s bits."""

    # -- top-k / random-k
    def abs_keys(self, x: Any) -> Any:
        """Unsigned integer keys ordered like ``|x|``, NaN above +inf."""

    def topk_select(self, x: Any, k: int) -> tuple[Any, Any]:
        """(int64 indices ascending, values) of the ``k`` largest ``|x|``."""

    def scatter(self, out: Any, idx: Any, vals: Any, add: bool) -> int:
        """``out[idx] = vals`` (or ``+=``) after checking the indices (1: invalid)."""

    def randomk_indices(self, key: Any, n: int, k: int, like: Any = None) -> Any:
        """The ``k`` of ``range(n)`` that random-k keeps, ascending (int64)."""

    def all_finite(self, x: Any) -> bool:
        """Whether no element of ``x`` is NaN or +-inf."""

    # -- squared norms (the divergence guard's)
    def sq_norm(self, a: Any) -> float:
        """``sum(a * a)`` in float64, in the 64-lane order of :mod:`._numpy` (NaN or inf if
        ``a`` holds one)."""

    def copy_sq_norm(self, src: Any, dst: Any) -> float:
        """``dst[...] = src`` and :meth:`sq_norm` of it, in one pass where the path can."""

    # -- DGC's momentum correction (the DDP hook's, integrations/ddp/momentum.py)
    def velocity_in(self, u: Any, x: Any, m: float) -> None:
        """``u = u * m + x``, then ``x[...] = u`` (flat, one dtype; ``m`` rounded to it
        first), in one pass where the path can."""

    def momentum_undo(self, o: Any, prev: Any, now: Any, m: float) -> None:
        """``now[...] = o``, then ``o -= prev * m`` (``m`` rounded to the dtype first), in
        one pass where the path can; ``prev`` is scratch afterwards."""

    # -- 1-bit Adam's compressed step (integrations/ddp/onebit_adam.py), float32 flat arrays
    def adam_floor_denom(self, g: Any, v: Any, d: Any, c2: float, bc2: float) -> None:
        """``v = maximum(v, g * g * c2)`` (the frozen variance, never below Adam's floor
        for gradient ``g``), then ``d = v / bc2`` (its bias correction); scalars in the
        arrays' dtype; one pass where the path can."""

    def adam_precondition(self, m: Any, d: Any, x: Any, eps: float) -> None:
        """``d += eps``, then ``x = m / d`` (the preconditioned momentum), one pass where
        the path can (the square root of ``d`` is taken between the two calls)."""

    def adam_release(self, z: Any, d: Any, m: Any, step: Any, bc1: float,
                     replace: bool) -> None:
        """``m = z * d`` if ``replace`` (the averaged momentum), then ``step = z / bc1``
        (its bias correction), one pass where the path can."""


class FusedKernels(Kernels, Protocol):
    """Encoders that also take ``residual`` e and ``decoded`` d (either may be None; d may
    be ``x``): encode ``y = x + e``, then leave ``e = y - decode`` and/or ``d = decode``
    in the same pass, with the bytes of the plain kernels composed
    (:func:`~gradcomm.compressors.base.compose`). float32 host arrays. With ``tally``
    (float64[2]) and ``residual``, ``tally += (sq_norm(e), e.size)`` of the new ``e``,
    in the same pass (the divergence guard's residual norm); the 16-bit casts also take
    a float64[4], whose ``tally[2:4] += (sq_norm(x), x.size)`` of the input in the same
    pass (the guard's input norm, on the DDP hook's cast route)."""

    def f32_to_f16_fused(self, x: Any, out: Any, residual: Any = None,
                         decoded: Any = None, tally: Any = None) -> None:
        """:meth:`f32_to_f16`, fused."""

    def f32_to_bf16_fused(self, x: Any, out: Any, residual: Any = None,
                          decoded: Any = None, tally: Any = None) -> None:
        """:meth:`f32_to_bf16`, fused."""

    def minmax_encode_fused(self, x: Any, bs: int, bits: int, stochastic: bool, key: Any,
                            lo_out: Any, unit_out: Any, packed: Any, residual: Any = None,
                            decoded: Any = None, tally: Any = None) -> None:
        """:meth:`minmax_encode`, fused."""

    def fixed_encode_fused(self, x: Any, bits: int, scale: float, stochastic: bool,
                           key: Any, packed: Any, residual: Any = None,
                           decoded: Any = None, tally: Any = None) -> None:
        """:meth:`fixed_encode`, fused."""

    def signlevel_encode_fused(self, x: Any, bs: int, levels: int, bits: int, l2: bool,
                               key: Any, scale_out: Any, packed: Any, residual: Any = None,
                               decoded: Any = None, tally: Any = None) -> None:
        """:meth:`signlevel_encode`, fused."""

    def onebit_encode_fused(self, x: Any, bs: int, pos_out: Any, neg_out: Any, packed: Any,
                            residual: Any = None, decoded: Any = None,
                            tally: Any = None) -> None:
        """:meth:`onebit_encode`, fused."""

    def topk_select_add(self, x: Any, e: Any, k: int) -> tuple[Any, Any]:
        """``e += x``, then :meth:`topk_select` of ``e`` (the addition fused into the
        selection's pass)."""


def members(protocol: type) -> tuple[str, ...]:
    """The names ``protocol`` declares itself and inherits (functions and constants), in
    order of declaration."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls.__module__ != __name__:              # object, typing.Protocol, Generic
            continue
        for n in (*vars(cls).get("__annotations__", {}), *vars(cls)):
            if not n.startswith("_") and n not in names:
                names.append(n)
    return tuple(names)
