"""The front door of compressed allreduces: one prologue, then the codec's route.

Every call, whatever the codec, goes through the same steps in the same order:

1. resolve the codec (a name with its options, or an instance) and validate op, dtype,
   algorithm, seed and key (:mod:`~gradcomm.compressed._args`); PowerSGD also cuts the
   buffer into parts and draws its starting ``Q`` (:mod:`~gradcomm.compressed.powersgd`);
2. take this call's step (the key's in ``residuals``, else the transport's count);
3. the cross-rank check (``check``): count, dtype, op, algorithm, codec name and config,
   seed, step, key and error feedback agree, or every rank raises; an argument error is
   raised on every rank after it;
4. decide the route once (``auto``: :mod:`~gradcomm.compressed.auto`) and run it
   (:func:`~gradcomm.compressed.routes.run`, or PowerSGD's two rounds); advance the key.

PowerSGD's rounds run on the host: a device buffer is staged through a host copy.

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

from typing import Any

import numpy as np

from .. import arrays, compressors
from ..collectives._check import agree_args
from ..comm.base import Transport
from ..compressors.base import Compressor
from ..compressors.powersgd import PowerSGD
from ..error_feedback import ResidualStore
from ..errors import GradcommError
from . import powersgd, routes
from ._args import check_algorithm, check_key, check_op, check_seed
from .auto import route_of
from .state import next_step

#: step-counter families (PowerSGD counts its calls apart from the other codecs)
_FAMILY = {False: "codec", True: "powersgd"}


def _is_powersgd(compressor: Any) -> bool:
    return isinstance(compressor, PowerSGD) or (isinstance(compressor, str) and
                                                compressor == PowerSGD.name)


def compressed_allreduce(t: Transport, buf: Any, dtype: str, *, op: str, algorithm: str,
                         compressor: Any, check: bool = True, seed: int | None = None,
                         residuals: ResidualStore | None = None, key: str | None = None,
                         problem: Exception | None = None, src: Any = None,
                         kept: bool = False, **options: Any) -> Any:
    """Allreduce flat storage ``buf`` of logical ``dtype`` through ``compressor``.

    ``buf`` may be overwritten; the result (flat, storage dtype) is returned. ``residuals``
    (a :class:`~gradcomm.error_feedback.ResidualStore`) supplies error feedback and the
    step counter of ``key``; without it, steps count the calls on ``t`` and nothing is
    compensated. ``seed``
    (default 0) seeds the stochastic codecs. PowerSGD also takes ``shape=`` / ``shapes=``
    (how the buffer is made of matrices) beside its codec options. Errors in the
    arguments are raised on every rank (after the cross-rank check, when ``check``);
    ``problem``: the caller's own objection to this rank's arguments, raised like them.
    ``src``: this rank's values, of ``buf``'s size and dtype (host), read where they lie
    and not modified; ``buf``'s contents are then ignored (a route that cannot read
    ``src`` copies it into ``buf`` first). ``kept``: ``buf`` is memory the caller keeps
    (an ``out=`` array): the sparse route sums into it, zeroed, instead of fresh pages.
    """
    low_rank = _is_powersgd(compressor)
    if src is not None and low_rank:
        arrays.assign(buf, src)
        src = None
    if low_rank and not arrays.is_host(buf):
        res = compressed_allreduce(t, arrays.host(buf).copy(), dtype, op=op,
                                   algorithm=algorithm, compressor=compressor, check=check,
                                   seed=seed, residuals=residuals, key=key, problem=problem,
                                   **options)
        arrays.assign(buf, arrays.like(res, buf))
        return buf
    shape = options.pop("shape", None) if low_rank else None
    shapes = options.pop("shapes", None) if low_rank else None
    key = "default" if key is None else key
    codec: Compressor | None = None
    parts: list[powersgd.Part] = []
    name = compressor if isinstance(compressor, str) else getattr(compressor, "name", "?")
    n = arrays.size(buf)
    try:
        codec = compressors.get(compressor, **options)
        name = codec.name
        check_op(op, dtype, name, algorithm)
        check_algorithm(algorithm, name, dense_rounds=low_rank)
        seed = check_seed(seed)
        key = check_key(key)
        if low_rank:
            assert isinstance(codec, PowerSGD)
            parts = powersgd.parts_of(n, key, codec, residuals, shape, shapes)
    except (GradcommError, KeyError, TypeError, ValueError) as exc:
        problem = problem or exc
    step = next_step(t, _FAMILY[low_rank], residuals, key)
    compress, qs = False, []
    if low_rank and problem is None:
        assert isinstance(codec, PowerSGD) and isinstance(seed, int)
        compress, qs = powersgd.start(codec, parts, residuals, seed, step, t.size, n, dtype)
    if check:
        if codec is None:
            config = "?"
        elif low_rank:
            config = powersgd.check_config(codec, parts, qs)    # type: ignore[arg-type]
        else:
            config = repr(sorted(codec.get_config().items()))
        # "auto" takes the gather routes for device buffers (on the host: maybe per hop)
        route = algorithm if algorithm != "auto" or low_rank else \
            "auto (host)" if arrays.is_host(buf) else "auto (device buffer)"
        agree_args(t, "compressed allreduce", problem, count=n, dtype=dtype,
                   op=op, algorithm=route, compressor=name, config=config,
                   seed=seed if isinstance(seed, int) else repr(seed), step=step, key=key,
                   error_feedback=residuals is not None and residuals.enabled)
    if problem is not None:
        raise problem
    assert codec is not None and isinstance(seed, (int, np.integer))
    if low_rank:
        out = powersgd.run(t, buf, dtype, op, algorithm, codec, parts,  # type: ignore[arg-type]
                           qs, residuals, key, compress)
    else:
        route = algorithm
        if route == "auto" and t.size > 1 and n:
            route = route_of(t, codec, n, dtype, device=not arrays.is_host(buf))
        out = routes.run(t, buf, dtype, op, route, codec, int(seed), step, residuals, key,
                         src=src, kept=kept)
    if residuals is not None:
        residuals.advance(key)
    return out
