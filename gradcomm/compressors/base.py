"""The codec contract: :class:`Compressor`, and the encode-side helpers codecs share.

A codec turns a flat float array into a self-describing :class:`~.payload.Payload` and
back (:mod:`.payload` holds the wire format and the validated reading of a peer's
payload; :mod:`._options` the option validators). :func:`compose` defines what
``compress(x, residual=, decoded=)`` means step by step; fused kernels produce its bytes
in one pass.

Example:
    >>> import numpy as np
    >>> from gradcomm.compressors import get
    >>> c = get("int8")
    >>> x = np.array([1.0, -2.0, 0.5], np.float32)
    >>> e = np.zeros(3, np.float32)
    >>> p = c.compress(x, residual=e)                 # encodes x + e, leaves e = y - decode
    >>> bool(np.allclose(c.decompress(p) + e, x))
    True
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from .. import arrays
from ..errors import ConfigError, UnsupportedError
from . import _kernels
from ._kernels import FusedKernels
from .payload import FLOAT_DTYPES, Payload


class CodecPlan(Protocol):
    """A codec's work on host float32 arrays of one element count, decided once
    (:meth:`Compressor.plan`: kernel module, sizes, header): the same bytes as
    ``compress`` / ``decompress``, written into and read from the payload's buffers laid
    out by the caller (``views``: buffer name -> a flat numpy view of the right dtype and
    count, as in the payload ``compress`` makes).
    """

    #: the encoding draws from ``seed`` (else ``encode`` ignores it)
    seeded: bool
    #: ``encode`` takes ``residual`` (and ``tally``) in one fused pass (the kernel path
    #: has one); else a caller composes the steps (e.g. ``compressed.planned``)
    fuses: bool

    def encode(self, x: np.ndarray, seed: Any, views: Mapping[str, np.ndarray],
               residual: np.ndarray | None = None, tally: np.ndarray | None = None) -> None:
        """Fill ``views`` with the payload buffers of ``compress(x, seed=seed)``; with
        ``residual`` (only where :attr:`fuses`) those of ``compress(x, seed=seed,
        residual=residual, tally=tally)`` in one pass: ``x + residual`` encoded,
        ``residual`` left holding what the encoding lost, its norm added to ``tally``."""

    def decode(self, views: Mapping[str, np.ndarray], out: np.ndarray, add: bool) -> None:
        """``out = decode`` (``add``: ``out = decode + out``) of the buffers ``views`` of
        a payload whose header is the planned one."""


class Compressor(ABC):
    """A stateless codec from a flat float array to a :class:`Payload` and back.

    What a codec can do is declared on its class (class attributes below, with
    conservative defaults that a codec overrides to say what it has), never discovered
    by inspecting its methods: the collectives, error feedback and entry points read
    these attributes. ``reduction``, ``contractive`` and ``start_iter`` may depend on
    options, so a codec may set them per instance in ``__init__``.

    Subclasses implement :meth:`decompress`, :meth:`max_nbytes` and :meth:`_encode`
    (``compress`` validates and composes around it) or ``compress`` itself; they may
    override :meth:`decompress_sum` with a fused kernel, :meth:`to_sparse` when they
    declare ``sparse_pairs``, and :meth:`plan` when their payloads of one count have a
    fixed layout.

    Example:
        >>> import numpy as np
        >>> from gradcomm.compressors import get
        >>> c = get("none")
        >>> c.decompress(c.compress(np.arange(3, dtype=np.float32))).tolist()
        [0.0, 1.0, 2.0]
        >>> get("topk").sparse, get("int8").reduction, get("int8", scale=1.0).reduction
        (True, 'gathered', 'summable')
    """

    #: the registry name (``get(name)``) and the ``codec`` field of its payloads
    name: ClassVar[str]
    #: how payloads of several ranks combine: ``"summable"`` (decoded payloads can be
    #: added and re-encoded hop by hop) or ``"gathered"`` (payloads are gathered and
    #: decoded-and-summed)
    reduction: str = "gathered"
    #: every rank must draw from the same random stream (collectives leave the rank out
    #: of the seed)
    shared_seed: ClassVar[bool] = False
    #: ``decode(encode(x))`` may differ from ``x`` (error feedback is worthwhile)
    lossy: ClassVar[bool] = True
    #: ``||x - decode(encode(x))|| < ||x||``: error feedback around it stays bounded
    #: (:func:`gradcomm.error_feedback.contractive`)
    contractive: bool = True
    #: not a contraction, but error feedback around it is stable (each element's error is
    #: bounded by its bucket's scale; measured): :func:`gradcomm.error_feedback.contractive`
    #: applies error feedback to it
    feedback_stable: ClassVar[bool] = False
    #: the decoded output is mostly zeros: gathered routes send (index, value) pairs
    sparse: ClassVar[bool] = False
    #: :meth:`to_sparse` gives a payload's (index, value) pairs without decoding it
    sparse_pairs: ClassVar[bool] = False
    #: ``compress(x, out=p)`` writes into ``p``'s buffers where they fit, so a caller may
    #: lay them out in its own frame (else ``out`` is not used)
    reuses_out: ClassVar[bool] = False
    #: ``compress(x, residual=, decoded=)`` runs in the codec's own encoding pass where a
    #: kernel path allows (else the arguments are applied step by step: :func:`compose`;
    #: the bytes are the same either way)
    fuses_feedback: ClassVar[bool] = False
    #: ``decompress(p, out=y, add=True)`` adds in the decoding pass (``y = decoded + y``);
    #: else a caller decodes into scratch and adds
    decodes_add: ClassVar[bool] = False
    #: :meth:`decompress_onto` adds another array in the decoding pass
    #: (``y = decoded + base``, ``base`` only read)
    decodes_onto: ClassVar[bool] = False
    #: entry points pass ``shape=`` (of a 2+-dimensional input) to the collective, which
    #: views a part by its shape
    uses_shape: ClassVar[bool] = False
    #: pieces of a multiple of this many elements, compressed separately (each with its
    #: slice of the residual), decode to the same values and leave the same residuals as
    #: the whole: the gathered route may pipeline them (0: pieces change the bytes)
    piece_quantum: int = 0
    #: steps of a key sent uncompressed before compression starts
    start_iter: int = 0
    #: the keyword options ``__init__`` takes (``get(name, **options)`` checks names
    #: against these before building the codec)
    options: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls):
            if not isinstance(cls.name, str) or not cls.name:
                raise TypeError(f"{cls.__name__}.name must be a non-empty str")
            if cls.reduction not in ("summable", "gathered"):
                raise TypeError(f"{cls.__name__}.reduction must be 'summable' or "
                                f"'gathered', got {cls.reduction!r}")
            if cls.sparse_pairs and not cls.sparse:
                raise TypeError(f"{cls.__name__} declares sparse_pairs without sparse")

    def get_config(self) -> dict[str, Any]:
        """The options that rebuild this compressor with ``get(name, **config)``."""
        return {}

    def compress(self, x: Any, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: Any = None,
                 decoded: Any = None, tally: np.ndarray | None = None) -> Payload:
        """Encode flat float ``x`` (float16/32/64; numpy, or cupy / torch on any device:
        the payload's buffers are then of that kind, made by the device kernels).

        With ``residual`` e, encode ``y = x + e`` and leave ``e = y − decode``; with
        ``decoded``, leave ``decode`` there (may be ``x``): one fused pass where the codec
        declares ``fuses_feedback`` and the kernel path has one, else step by step with
        the same bytes (:func:`compose`). ``out``: an earlier payload whose buffers may be
        reused (``reuses_out``). ``tally`` (host float64[2], with ``residual``):
        ``tally += (sq_norm(e), e.size)`` of the new ``e`` (the kernels' ``sq_norm``, the
        same value on every path; in the fused pass where there is one); a float64[4]
        also takes ``(sq_norm(x), x.size)`` of the input into ``tally[2:4]`` (the 16-bit
        casts' fused pass reads it there as it encodes).
        """
        x = as_input(x, self.name)
        fk = None
        if residual is not None or decoded is not None:
            fk = fused_kernels(x, residual, decoded, self.name)
            if fk is None or not self.fuses_feedback:
                return compose(self, x, seed, out, residual, decoded, tally)
            if tally is not None and residual is not None:
                fk = _kernels.Tallied(fk, tally)
        return self._encode(x, seed, out, fk, residual, decoded)

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        """Encode validated flat ``x``; ``fk``: the fused kernel module that also applies
        ``residual`` / ``decoded`` (None: plain encode). A codec defines this, or
        overrides :meth:`compress` itself."""
        raise NotImplementedError(f"{type(self).__name__} must define compress or _encode")

    @abstractmethod
    def decompress(self, payload: Payload, out: Any = None, *, add: bool = False) -> Any:
        """Decode a (validated) payload to a flat array of its original dtype, into
        ``out`` if given (new otherwise); ``add``: ``out = decoded + out`` (needs ``out``)."""

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        """Exact upper bound of ``compress(x).nbytes`` for any ``x`` of ``n`` ``dtype``
        elements (receivers post buffers of this size)."""
        raise UnsupportedError(f"compressor {self.name!r} does not declare max_nbytes")

    def decompress_sum(self, payloads: Sequence[Payload], out: Any = None) -> Any:
        """Sum of the decoded payloads (codecs override this with fused kernels)."""
        total = self.decompress(payloads[0], out)
        for p in payloads[1:]:
            part = arrays.empty_like_kind(total, arrays.size(total), arrays.dtype_name(total))
            with np.errstate(invalid="ignore", over="ignore"):
                total += self.decompress(p, out=part)
        return total

    def plan(self, n: int, dtype: str) -> CodecPlan | None:
        """The :class:`CodecPlan` for host arrays of ``n`` elements of ``dtype`` whose
        payloads all have one header and buffer layout (None: this codec, or these
        options, do not plan; callers then use :meth:`compress` and :meth:`decompress`)."""
        return None

    def decompress_onto(self, payload: Payload, base: Any, out: Any) -> Any:
        """``out = decoded + base`` for codecs that declare ``decodes_onto``: the bytes
        of copying ``base`` into ``out``, then ``decompress(payload, out, add=True)``,
        in one pass (``out``'s contents are not read, ``base`` is not written)."""
        raise UnsupportedError(f"compressor {self.name!r} does not declare decodes_onto")

    def to_sparse(self, payload: Payload, out: Any = None
                  ) -> tuple[int, np.dtype, Any, Any]:
        """``(n, dtype, indices, values)`` of a payload, for codecs that declare
        ``sparse_pairs``."""
        raise UnsupportedError(f"compressor {self.name!r} does not declare sparse_pairs")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.get_config().items()))))


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


def fused_kernels(x: np.ndarray, residual: Any, decoded: Any, name: str
                  ) -> FusedKernels | None:
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
    k = _kernels.for_size(x.size)
    return k if k.FUSED else None                       # type: ignore[return-value]


def compose(codec: Compressor, x: np.ndarray, seed: Any, out: Any, residual: Any,
            decoded: Any, tally: np.ndarray | None = None) -> Payload:
    """What ``compress(x, residual=e, decoded=d, tally=t)`` means, step by step:
    ``y = x + e`` (into ``e``); the payload encodes ``y``; ``d = decode(payload)``;
    ``e = y - d``; ``t += (sq_norm(e), e.size)`` (a ``t`` of four: ``t[2:4] +=
    (sq_norm(x), x.size)`` first). Fused kernels produce exactly these bytes (and this
    tally) in one pass."""
    y = x
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, by design
        if residual is not None:
            add_input_tally(tally, x)
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
            add_tally(tally, residual)
    return payload


class DecodesOnto(Compressor):
    """A codec whose decoder can add another array in its own pass: it implements
    :meth:`_decode` and gets :meth:`decompress` and :meth:`decompress_onto` from it (the
    int8, qsgd, terngrad, onebit and 16-bit casts).

    Example:
        >>> import numpy as np
        >>> from gradcomm import compressors
        >>> c = compressors.get("fp16")
        >>> isinstance(c, DecodesOnto), c.decodes_onto
        (True, True)
        >>> x, base = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
        >>> c.decompress_onto(c.compress(x), base, np.empty(4, np.float32)).tolist()
        [1.0, 2.0, 3.0, 4.0]
    """

    decodes_onto = True

    def decompress(self, payload: Payload, out: Any = None, *, add: bool = False) -> Any:
        """Decode into ``out`` (new if None); ``add``: ``out = decoded + out``."""
        return self._decode(payload, out, add, None)

    def decompress_onto(self, payload: Payload, base: Any, out: Any) -> Any:
        """``out = decoded + base`` (:meth:`Compressor.decompress_onto`): one pass for
        float32 ``out`` and ``base`` of one size and kind, else the copy and
        ``decompress(add=True)``."""
        if arrays.dtype_name(out) != "float32" or arrays.dtype_name(base) != "float32" or \
                arrays.size(base) != arrays.size(out) or \
                arrays.is_host(base) != arrays.is_host(out):
            arrays.assign(out, base)
            return self.decompress(payload, out, add=True)
        return self._decode(payload, out, True, base)

    @abstractmethod
    def _decode(self, payload: Payload, out: Any, add: bool, base: Any) -> Any:
        """:meth:`decompress`, adding ``base`` (float32, another array) instead of ``out``
        where it is given."""


def add_input_tally(tally: np.ndarray | None, x: Any) -> None:
    """``tally[2:4] += (sq_norm(x), x.size)`` of the input where ``tally`` has four
    entries (:meth:`Compressor.compress`); no-op otherwise."""
    if tally is not None and tally.size > 2:
        tally[2] += _kernels.for_array(x).sq_norm(x)
        tally[3] += arrays.size(x)


def add_tally(tally: np.ndarray | None, e: Any) -> None:
    """``tally += (sq_norm(e), e.size)`` (the kernels' norm of ``e`` where it lives); no-op
    without a tally."""
    if tally is not None:
        tally[0] += _kernels.for_array(e).sq_norm(e)
        tally[1] += arrays.size(e)


def need_out(add: bool, out: Any, name: str) -> None:
    """ConfigError for ``decompress(..., add=True)`` without ``out`` (nothing to add to)."""
    if add and out is None:
        raise ConfigError(f"{name}.decompress: add=True needs out= (the array to add to)")


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
