"""Cross-rank agreement on a collective's arguments, before any data moves.

Each rank packs what must agree (collective, count, dtype, op, algorithm, compressor...)
into int64 fields; one small max-reduction of ``[fields, -fields]`` tells every rank, at
the same moment, whether all ranks passed the same values. A disagreement raises
:class:`MismatchError` on every rank, naming the fields that differ; the transport stays
usable.

The reduction is the transport's own bounded allreduce (:meth:`Transport.small_allreduce`,
e.g. one ``MPI_Iallreduce`` of 256 bytes) where the transport says that is cheap
(``fast_native``), else a recursive doubling of point-to-point messages (tag
``TAG_CHECK``). Either way it waits with the transport's deadline, so a rank that never
joins is a :class:`DeadlineError`, not a hang. Both forms reduce :data:`NATIVE_FIELDS`
fields (missing ones zero, extra ones hashed into the last), so two ranks calling
different collectives (a dense and a compressed allreduce) still exchange equal-sized
buffers and learn that they differ.

Calls that skip the exchange (``check="first"`` after the first call) carry their
signature in the data path instead: :func:`data_tag` gives the tag their messages use,
one of :data:`SIGNED_TAGS` chosen by a hash of the arguments, so ranks that disagree post
receives that the others' sends never match (a deadline, never mixed data).

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: agree(t, "allreduce", count=4, dtype="float32"))
    [frozenset(), frozenset()]
"""

from __future__ import annotations

import zlib
from typing import Any, Collection

import numpy as np

from .._dtypes import CODES, NAMES
from ..comm.base import TAG_CHECK, Transport
from ..errors import MismatchError
from . import recursive_doubling
from ..ops import Reducer

_MAX = Reducer("max", "int64")
#: fields in the native form of the check (the collective's name counts as one)
NATIVE_FIELDS = 16
#: tags of the data messages of unchecked calls (:func:`data_tag`): above the library's
#: subsystem tags and a program's usual ones, within MPI's guaranteed ``MPI_TAG_UB``
SIGNED_TAGS = range(1 << 14, 1 << 15)
#: distinct argument tuples whose packed codes each transport keeps (and, with them,
#: whether that transport verified them, for ``once=True``)
_CACHE_LIMIT = 1024


def _code(name: str, value: Any) -> int:
    if isinstance(value, bool) or value is None:
        return {None: -1, False: 0, True: 1}[value]
    if isinstance(value, int):
        return value
    if name == "dtype" and value in CODES:
        return CODES[value]
    return zlib.crc32(repr(value).encode())


class _Signature:
    """The packed form of one argument tuple, computed once and reused."""

    __slots__ = ("names", "values", "native", "native_names", "native_values",
                 "native_bytes", "verified", "tag")

    def __init__(self, collective: str, fields: dict[str, Any]) -> None:
        self.verified = False               # all ranks agreed on these arguments once
        self.names = ["collective", *fields]
        self.values: list[Any] = [collective, *fields.values()]
        codes = np.array([_code(n, v) for n, v in zip(self.names, self.values)], np.int64)
        self.tag = SIGNED_TAGS[zlib.crc32(codes.tobytes()) % len(SIGNED_TAGS)]
        k, m = NATIVE_FIELDS, len(codes)
        if m > k:                           # hash the tail into the last field
            tail = codes[k - 1:]
            codes = np.concatenate([codes[:k - 1],
                                    [zlib.crc32(tail.tobytes())]]).astype(np.int64)
            self.native_names = self.names[:k - 1] + ["one of " + ", ".join(self.names[k - 1:])]
            self.native_values = self.values[:k - 1] + [_HASHED]
        else:                               # pad with zeros
            codes = np.concatenate([codes, np.zeros(k - m, np.int64)])
            self.native_names = self.names + [f"argument {i}" for i in range(m, k)]
            self.native_values = self.values + [_ABSENT] * (k - m)
        self.native = np.concatenate([codes, -codes])
        self.native_bytes = self.native.tobytes()


_HASHED, _ABSENT = object(), object()
_AGREED: frozenset[str] = frozenset()


def _signature(t: Transport, collective: str, fields: dict[str, Any]) -> _Signature:
    """This transport's packed form of the arguments (kept per transport, so that each
    rank's cache, and what it verified, follows that rank's own sequence of calls)."""
    cache = t.state.signatures
    try:
        key: Any = (collective, *fields.items())
        sig = cache.get(key)
    except TypeError:                       # an unhashable value: pack it every time
        return _Signature(collective, fields)
    if sig is None:
        sig = _Signature(collective, fields)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = sig
    return sig


def agree(t: Transport, collective: str, *, once: bool = False,
          negotiable: Collection[str] = (), **fields: Any) -> frozenset[str] | None:
    """Raise :class:`MismatchError` on every rank unless all ranks passed equal fields.

    ``once``: skip the exchange if this transport already verified exactly these
    arguments, with or without ``once`` (every rank has then seen them: see
    ``check="first"`` in
    :func:`~gradcomm.collectives.dense_allreduce`). ``negotiable`` names fields whose
    difference is no error: their names are returned instead (the same set on every
    rank), for the caller to reconcile. Returns the empty set when all agree, None when
    the exchange was skipped (``once``).
    """
    if t.size == 1:
        return _AGREED
    sig = _signature(t, collective, fields)
    if once and sig.verified:
        return None
    return verify(t, sig, negotiable)


def signature(t: Transport, collective: str, **fields: Any) -> _Signature:
    """The packed arguments that :func:`verify` exchanges (kept per transport): for a
    caller that checks the same arguments often and keeps them (see
    :mod:`~gradcomm.collectives.small`)."""
    return _signature(t, collective, fields)


def verify(t: Transport, sig: _Signature, negotiable: Collection[str] = ()
           ) -> frozenset[str]:
    """The exchange of :func:`agree` for packed arguments ``sig`` (:func:`signature`):
    MismatchError on every rank unless all ranks passed equal ones (those in
    ``negotiable`` are returned instead)."""
    buf = sig.native.copy()
    if t.fast_native:
        t.small_allreduce(buf, "max", "int64")
    else:
        recursive_doubling.allreduce(t, buf, _MAX, tag=TAG_CHECK)
    if buf.tobytes() == sig.native_bytes:
        sig.verified = True                 # max(c) = c and max(-c) = -c: all equal
        return _AGREED
    k = len(sig.native) // 2
    hi, lo = buf[:k], -buf[k:]
    names, values = sig.native_names, sig.native_values
    bad = [i for i in range(k) if hi[i] != lo[i]]
    if all(names[i] in negotiable for i in bad):
        return frozenset(names[i] for i in bad)
    parts = []
    for i in bad:
        name, value = names[i], values[i]
        if name == "valid":
            parts.append("a rank's own checks rejected its arguments (that rank raises why)")
        elif value is _HASHED:
            parts.append(f"{name} differs")
        elif value is _ABSENT:
            parts.append(f"{name} differs (some ranks passed more arguments)")
        elif isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{name} ranges from {lo[i]} to {hi[i]}")
        elif name == "dtype" and lo[i] in NAMES and hi[i] in NAMES:
            parts.append(f"dtype differs (e.g. {NAMES[int(lo[i])]} vs {NAMES[int(hi[i])]})")
        else:
            parts.append(f"{name} differs (this rank: {value!r})")
    raise MismatchError(f"rank {t.rank}: ranks called {sig.values[0]} with different "
                        f"arguments: {'; '.join(parts)}")


def data_tag(t: Transport, collective: str, **fields: Any) -> int:
    """The tag of the data messages of a call with these arguments that skipped the
    exchange: equal on ranks that passed equal arguments, and (but for a hash collision,
    1 in ``len(SIGNED_TAGS)``) different otherwise, so that ranks that disagree wait for
    messages that never come (a :class:`~gradcomm.errors.DeadlineError` on every rank)
    instead of combining mismatched data.

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> a, b = run_ranks(2, lambda t: data_tag(t, "allreduce", count=4, op="sum"))
        >>> a == b and a in SIGNED_TAGS
        True
    """
    return _signature(t, collective, fields).tag


def agree_args(t: Transport, collective: str, problem: Exception | None, /,
               **fields: Any) -> None:
    """:func:`agree` for a collective whose ranks first validated their own arguments.

    All ranks agree on ``fields`` plus ``valid`` (``problem is None``); on a mismatch, a
    rank whose arguments failed its own checks raises its ``problem`` instead of the
    :class:`MismatchError`, so that rank says what is wrong and the others that ranks
    differ. The caller raises ``problem`` afterwards (when all ranks failed alike).

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> from gradcomm.errors import ConfigError
        >>> def fn(t):
        ...     try:
        ...         agree_args(t, "demo", ConfigError("bad") if t.rank else None, size=4)
        ...     except Exception as exc:
        ...         return type(exc).__name__
        >>> run_ranks(2, fn)
        ['MismatchError', 'ConfigError']
    """
    try:
        agree(t, collective, **fields, valid=problem is None)
    except MismatchError:
        if problem is not None:
            raise problem from None
        raise
