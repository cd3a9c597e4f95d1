"""One validated reduction: the configuration and the routing that ``gradcomm.allreduce``,
``gradcomm.Allreduce`` and ``wrap(comm).Allreduce`` share.

A :class:`Reduction` holds what a caller configured (op, algorithm, codec and its options,
seed, check) and answers the questions every entry point used to answer on its own:
whether a call is compressed (:meth:`~Reduction.compresses`), where its flat working copy
lives (:meth:`~Reduction.flat`), and which collective runs it (:meth:`~Reduction.run`:
``dense_allreduce`` or ``compressed_allreduce``, decided once per call).
:meth:`Reduction.configure` validates a configuration up front (``Allreduce``, ``wrap``);
a plain :class:`Reduction` (``gradcomm.allreduce``) leaves the checks to the collective,
which raises them on every rank after the cross-rank check.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> plan = Reduction.configure(algorithm="ring", compressor="fp16")
    >>> def fn(t):
    ...     buf, meta = plan.flat(np.full(3, t.rank + 1.0, np.float32), t)
    ...     return plan.run(t, buf, meta.dtype, meta=meta).tolist()
    >>> run_ranks(2, fn)[0]
    [3.0, 3.0, 3.0]
    >>> plan.compresses("float32"), Reduction().compresses("float32")
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import arrays, compressors
from ._dtypes import FLOATS
from .collectives import ALGORITHMS, DENSE, dense_allreduce
from .comm.base import PIPELINE_CHUNK
from .compressed import GATHER_ALGORITHMS, compressed_allreduce
from .compressed._args import check_algorithm as check_codec_algorithm
from .compressors.powersgd import PowerSGD
from .compressors._options import closest
from .error_feedback import ResidualStore
from .errors import ConfigError, UnknownOptionError, UnsupportedError
from .ops import OPS


#: the keywords of the entry points beside a codec's options (suggested for typos)
KEYWORDS = ("comm", "op", "algorithm", "compressor", "check", "error_feedback", "seed",
            "key")


def check_options(compressor: Any, options: Mapping[str, Any]) -> None:
    """Options are codec options: none without a compressor, and only the codec's own
    with one (UnknownOptionError naming the closest keyword otherwise).

    Example:
        >>> check_options(None, {"ratio": 0.1})
        Traceback (most recent call last):
        ...
        gradcomm.errors.UnknownOptionError: unknown options ['ratio'] (compressor options need compressor=...)
        >>> check_options("topk", {"errorfeedback": False})
        Traceback (most recent call last):
        ...
        gradcomm.errors.UnknownOptionError: compressor 'topk' has no option 'errorfeedback' (did you mean 'error_feedback'?); its options: ratio, k
    """
    if compressor is not None:
        compressors.check_options(compressor, options, also=KEYWORDS)
        return
    if "timeout" in options:
        raise UnknownOptionError(
            "timeout= is not an allreduce option: the deadline belongs to the transport; "
            "pass comm=gradcomm.comm.get_transport(comm, timeout=...) (or set t.timeout "
            "on a Transport)")
    if options:
        hint = "".join(closest(name, KEYWORDS) for name in sorted(options))
        raise UnknownOptionError(f"unknown options {sorted(options)}{hint} (compressor "
                                 "options need compressor=...)")


def with_shape(compressor: Any, meta: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` plus ``shape=`` the array's shape for codecs that view their input by
    its shape (class attribute ``uses_shape``: powersgd) when it has 2+ dimensions; a
    flat array keeps the codec's flat layout, and a caller's ``shape``/``shapes`` wins."""
    options = dict(options)
    if len(meta.shape) < 2 or "shape" in options or "shapes" in options:
        return options
    cls = type(compressor) if isinstance(compressor, compressors.Compressor) else None
    if isinstance(compressor, str):
        try:
            cls = compressors._load(compressor)        # the class: options checked later
        except KeyError:
            return options                             # unknown name: reported later
    if cls is None or not cls.uses_shape:              # None: no codec, or reported later
        return options
    return {**options, "shape": meta.shape}


def _viewable(b: Any, x: Any, meta: arrays.Meta) -> bool:
    """Whether array ``x`` (backend ``b``) can be reduced through a flat host view: a
    C-contiguous numpy array in native byte order (no subclass) or CPU tensor."""
    return meta.device == "cpu" and b.is_contiguous(x) and (
        meta.kind != "numpy" or (type(x) is np.ndarray and x.dtype.isnative))


@dataclass(frozen=True)
class Reduction:
    """What to reduce by: ``op``, ``algorithm``, ``compressor`` (None, a name or a
    :class:`~gradcomm.compressors.Compressor`) with its ``options``, ``seed``, ``check``.

    ``exact_fallback`` (``wrap``): a call the codec cannot reduce (an op other than sum,
    a dtype that is not floating) is reduced exactly, by the dense algorithm (``auto``
    for a compressed-only name), instead of being refused.
    """

    op: str = "sum"
    algorithm: str = "auto"
    compressor: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    check: bool | str = True
    exact_fallback: bool = False

    @classmethod
    def configure(cls, *, op: str = "sum", algorithm: str = "auto", compressor: Any = None,
                  options: Mapping[str, Any] | None = None, seed: int | None = None,
                  check: bool | str = True, exact_fallback: bool = False,
                  check_algorithm: bool = False, lossless_dense: bool = False) -> Reduction:
        """A validated Reduction whose compressor is resolved to a codec instance
        (ConfigError / KeyError now, on this rank, rather than at the first call).

        ``seed`` (when given) must be an int in 0..2**63-1; ``check_algorithm``: the
        algorithm must be one that carries the codec (the compressed allreduce's own
        check, :func:`~gradcomm.compressed._args.check_algorithm`: the same words), or,
        without one, a dense one. ``lossless_dense``: a lossless codec is reduced by the
        dense algorithms (the DDP hook), so any dense algorithm carries it.
        """
        options = dict(options or {})
        check_options(compressor, options)
        if op not in OPS:
            raise ConfigError(f"unknown op {op!r}{closest(op, OPS)}; known: {', '.join(OPS)}")
        if compressor is not None and not exact_fallback and op not in ("sum", "mean"):
            raise UnsupportedError(f"op={op!r} with a compressor: compressed allreduce "
                                   "supports sum, mean; use compressor=None")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or
                                 not 0 <= seed < 2 ** 63):
            raise ConfigError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
        codec = None if compressor is None else compressors.get(compressor, **options)
        if check_algorithm:
            if codec is None or (lossless_dense and not codec.lossy):
                if algorithm not in ALGORITHMS or algorithm == "sparse_allgather":
                    known = ", ".join(a for a in ALGORITHMS if a != "sparse_allgather")
                    raise ConfigError(f"unknown algorithm {algorithm!r}; known: {known}")
            else:
                check_codec_algorithm(algorithm, codec.name,
                                      dense_rounds=isinstance(codec, PowerSGD))
        return cls(op, algorithm, codec, {}, seed, check, exact_fallback)

    def compresses(self, dtype: str, op: str | None = None) -> bool:
        """Whether a call on logical ``dtype`` (by ``op``, default this Reduction's) goes
        through the compressed allreduce (``"none"`` for a gather algorithm without a
        codec)."""
        if self.exact_fallback:
            return self.compressor is not None and (op or self.op) == "sum" and \
                dtype in FLOATS
        return self.compressor is not None or self.algorithm in GATHER_ALGORITHMS

    def flat(self, x: Any, t: Any) -> tuple[Any, arrays.Meta]:
        """A fresh flat working copy of array ``x`` and its Meta, placed where the
        reduction runs on transport ``t``.

        :func:`arrays.placement` decides where: dense sums keep a device array on the
        device only on a transport that moves device buffers (CUDA-aware MPI), else they
        stage it through host memory. Compressed reductions run their codecs where the
        data is: a device array stays a flat array of its own library on its device
        ("native"), and only payloads cross to the host; a numpy array is reduced on the
        host without consulting ``GRADCOMM_CODEC_PLACEMENT``.
        """
        b = arrays.backend(x)
        meta = b.meta(x)
        return b.to_flat(x, meta, self._where(x, meta, t)), meta

    def _where(self, x: Any, meta: arrays.Meta, t: Any) -> str:
        """The placement :meth:`flat` gives ``x`` (described by ``meta``) on ``t``."""
        if not self.compresses(meta.dtype):
            return arrays.placement(meta, t.devices)
        return "host" if type(x) is np.ndarray else arrays.placement(meta, codecs=True)

    def views(self, x: Any, t: Any, in_place: bool = False, result: Any = None
              ) -> tuple[Any, Any, arrays.Meta] | None:
        """``(src, buf, meta)`` where the reduction can work in ``x``'s own memory instead
        of :meth:`flat`'s copy (a host array :meth:`flat` would place on the host: a
        C-contiguous numpy array in native byte order or CPU tensor), else None:

        - ``in_place`` (``allreduce_``): ``(None, x's flat view, meta)``: no copy in,
          none out;
        - else, for a reduction of one pipeline chunk and more (below it the latency
          algorithms copy it in anyway): ``(x's flat view, an empty result buffer,
          meta)``, so the reduction reads ``x`` where it lies (``run(..., src=view)``;
          a compressed route that cannot copies it in first); ``result``: that buffer
          instead of a new one (a flat host array of ``x``'s storage dtype and size)."""
        b = arrays.backend(x)
        if not in_place and b.nbytes(x) < PIPELINE_CHUNK:
            return None
        meta = b.meta(x)
        if self._where(x, meta, t) != "host" or not _viewable(b, x, meta):
            return None
        view = b.host_view(x)
        if in_place:
            return None, view, meta
        return view, np.empty_like(view) if result is None else result, meta

    def run(self, t: Any, buf: Any, dtype: str, *, op: str | None = None,
            meta: arrays.Meta | None = None, residuals: ResidualStore | None = None,
            key: str | None = None, problem: Exception | None = None,
            src: Any = None, kept: bool = False) -> Any:
        """Reduce flat ``buf`` (logical ``dtype``) on transport ``t``; returns the result
        (``buf`` or a new flat buffer). ``meta``: the user's array, whose shape codecs
        that view their input by its shape (``uses_shape``) are given; ``residuals`` and
        ``key``: error feedback and the step of ``key`` (compressed calls); ``problem``:
        the caller's objection to this rank's call, raised on this rank before data moves
        (the others learn of it from the cross-rank check); ``src`` (from
        :meth:`views`): the values to reduce into ``buf``, read where they lie;
        ``kept``: ``buf`` is memory the caller keeps (an ``out=`` array), so a route that
        sums into zeros fills it rather than returning fresh zero pages."""
        op = op or self.op
        if not self.compresses(dtype, op):
            check_options(self.compressor, self.options)
            algorithm = self.algorithm
            if self.exact_fallback and algorithm not in DENSE:   # e.g. allgather
                algorithm = "auto"
            return dense_allreduce(t, buf, op, dtype, algorithm, check=self.check,
                                   problem=problem, src=src)
        options = self.options if meta is None else \
            with_shape(self.compressor, meta, self.options)
        return compressed_allreduce(t, buf, dtype, op=op, algorithm=self.algorithm,
                                    compressor=self.compressor or "none", check=self.check,
                                    seed=self.seed, residuals=residuals, key=key,
                                    problem=problem, src=src, kept=kept, **options)
