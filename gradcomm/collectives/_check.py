"""Cross-rank agreement on a collective's arguments, before any data moves.

Each rank packs what must agree (collective, count, dtype, op, algorithm, compressor...)
into int64 fields; one small recursive-doubling max-reduction of ``[fields, -fields]``
tells every rank, at the same moment, whether all ranks passed the same values. A
disagreement raises :class:`MismatchError` on every rank, naming the fields that differ;
the transport stays usable.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: agree(t, "allreduce", count=4, dtype="float32"))
    [None, None]
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .._dtypes import CODES, NAMES
from ..comm.base import TAG_CHECK, Transport
from ..errors import MismatchError
from . import recursive_doubling
from ._reduce import Reducer

_MAX = Reducer("max", "int64")


def _code(name: str, value: Any) -> int:
    if isinstance(value, bool) or value is None:
        return {None: -1, False: 0, True: 1}[value]
    if isinstance(value, int):
        return value
    if name == "dtype" and value in CODES:
        return CODES[value]
    return zlib.crc32(repr(value).encode())


def agree(t: Transport, collective: str, **fields: Any) -> None:
    """Raise :class:`MismatchError` on every rank unless all ranks passed equal fields."""
    if t.size == 1:
        return
    names = ["collective", *fields]
    values = [collective, *fields.values()]
    codes = np.array([_code(n, v) for n, v in zip(names, values)], np.int64)
    buf = np.concatenate([codes, -codes])
    recursive_doubling.allreduce(t, buf, _MAX, tag=TAG_CHECK)
    k = len(codes)
    hi, lo = buf[:k], -buf[k:]
    bad = [i for i in range(k) if hi[i] != lo[i]]
    if not bad:
        return
    parts = []
    for i in bad:
        name = names[i]
        if isinstance(values[i], int) and not isinstance(values[i], bool):
            parts.append(f"{name} ranges from {lo[i]} to {hi[i]}")
        elif name == "dtype" and lo[i] in NAMES and hi[i] in NAMES:
            parts.append(f"dtype differs (e.g. {NAMES[int(lo[i])]} vs {NAMES[int(hi[i])]})")
        else:
            parts.append(f"{name} differs (this rank: {values[i]!r})")
    raise MismatchError(f"rank {t.rank}: ranks called {collective} with different "
                        f"arguments: {'; '.join(parts)}")
