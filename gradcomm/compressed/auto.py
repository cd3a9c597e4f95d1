"""A compressed ``algorithm="auto"``: the route with the lowest modelled time.

The per-hop candidate is the dense table's choice for the compressed size c
(:func:`gradcomm.collectives.auto.select`); summable codecs always take it (gathering
them only adds decoding). Gathered codecs compare it with allgather (sparse_allgather for
sparse codecs) under :func:`gradcomm.collectives.costmodel.route_times`, fed by the
transport's agreed calibrated profile if there is one. Device buffers take the gather
routes (few, large transfers and kernel launches); PowerSGD, whose rounds each pick a
dense algorithm, keeps ``"auto"``.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(4, lambda t: auto_route(t, "int8", 10**6, "float32"))[0]
    'rabenseifner'
"""

from __future__ import annotations

from typing import Any

from .. import compressors
from .._dtypes import storage
from ..collectives.auto import agreed_profile, select
from ..collectives.costmodel import route_times
from ..comm.base import Transport
from ..compressors.base import Compressor
from ..compressors.powersgd import PowerSGD
from . import routes
from .frames import max_nbytes


def choose(t: Transport, codec: Compressor, n: int, dtype: str, itemsize: int) -> str:
    """The host route of ``n`` elements of working ``dtype`` (float32 or float64; storage
    ``itemsize`` bytes each): the lowest modelled time (on a tie the gathered route,
    which does not re-compress)."""
    c = max_nbytes(codec, n, dtype)
    per_hop = select(t, c)
    if codec.reduction == "summable":
        return per_hop
    times = route_times(t.size, n, c, itemsize, codec.name, per_hop, agreed_profile(t),
                        gathered=True, sparse=codec.sparse,
                        chunk_bytes=routes.message_bytes(codec, n, dtype))
    return min(times, key=lambda r: (times[r], r == per_hop))    # ties: exact route


def route_of(t: Transport, codec: Compressor, n: int, dtype: str, *, device: bool) -> str:
    """The route ``algorithm="auto"`` takes for ``n`` elements of logical ``dtype``
    through ``codec`` (not PowerSGD); ``device``: the buffer is a device array."""
    if device:
        return "sparse_allgather" if codec.sparse else "allgather"
    wdt = "float64" if dtype == "float64" else "float32"
    return choose(t, codec, n, wdt, storage(dtype).itemsize)


def auto_route(t: Transport, compressor: Any, n: int, dtype: str, *, device: bool = False,
               **options: Any) -> str:
    """The route ``algorithm="auto"`` takes on ``t`` for ``n`` elements of logical
    ``dtype`` through ``compressor`` (a name with ``options``, or a codec): one of
    :data:`~gradcomm.compressed.HOP_ALGORITHMS` or
    :data:`~gradcomm.compressed.GATHER_ALGORITHMS`. ``device``: the buffer is a device
    array (gather routes only). Local (no communication): it reads the profile the ranks
    already agreed on, if any. PowerSGD, whose rounds each pick a dense algorithm, gives
    ``"auto"``."""
    codec = compressors.get(compressor, **options)
    if isinstance(codec, PowerSGD):
        return "auto"
    return route_of(t, codec, n, dtype, device=device)
