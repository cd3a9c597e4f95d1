"""``algorithm="auto"``: pick a dense algorithm from message size, rank count and dtype.

With a calibrated profile (``python -m gradcomm.bench --calibrate``, see
:mod:`~gradcomm.collectives.costmodel`) the algorithm with the lowest modelled time wins.
Without one, a table from the α-β model: below :data:`SMALL` bytes latency dominates, so
the library's own allreduce where it is fast and reduces the dtype correctly (MPI: one C
call; not float16/bfloat16; over shared memory up to the transport's ``native_below``,
1 MiB, where it beats the ring) and recursive doubling otherwise; above it bandwidth
dominates and ring's 2(p-1)/p·n bytes per rank win (Rabenseifner sends the same bytes in
fewer rounds for power-of-two p > 2). Where the library's allreduce beats gradcomm's
algorithms on large messages (``native_preferred``: gloo's), checked calls from
:data:`PREFERRED_FROM` bytes (1 MiB) on take it.

``native`` is only chosen where it cannot hang: MPI's blocking ``MPI_Allreduce`` has no
deadline, so on MPI it is chosen only for a call whose argument check just ran (every rank
is known to be in this very call); transports whose native allreduce waits with the
deadline (``native_bounded``: threads, torch) may use it for any call.

**Same choice on every rank.** The choice depends only on the arguments (which the check
makes equal) and on the transport's *agreed* profile (and ``native_below``, agreed with
it). Each rank has a local candidate
(:func:`local_profile`: ``GRADCOMM_PROFILE``, else the default cache file for the
transport and rank count; in-process ``threads`` ranks read only ``GRADCOMM_PROFILE``),
but ``auto`` uses a profile only once the ranks agreed on it: at the first ``auto`` call
with the check on a transport (or :func:`agree_profile`, a collective), the ranks compare
fingerprints in one small exchange; if they differ, rank 0's profile is broadcast and
adopted by all. Until then (e.g. only ``check=False`` calls so far) the table is used.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: select(t, 100))[0]
    'recursive_doubling'
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from ..comm.base import TAG_PROFILE, Transport
from ..comm.state import NATIVE_BELOW
from ..errors import ConfigError, PayloadError
from .costmodel import _MAX_BYTES, PROFILE_ENV, Profile, default_path

#: bytes below which the latency-optimal algorithm is chosen (no profile)
SMALL = 64 * 1024
#: bytes from which a checked call on a ``native_preferred`` transport takes the library's
#: allreduce (gloo, 2 ranks: 1.4x the ring at 1 MiB, 1.1x at 100 MB over 1 Gbit/s; a
#: toss-up at 64-256 KiB, where the check's own exchange costs as much: bench/RESULTS.md)
PREFERRED_FROM = 1 << 20
#: the algorithms written on gradcomm's point-to-point layer
HOP = ("recursive_doubling", "rabenseifner", "ring", "tree")
_CACHE_LIMIT = 4096


def table(t: Transport, nbytes: int, native: bool = False, checked: bool = False) -> str:
    """The built-in choice (no profile); ``native``: the library's allreduce may be used;
    ``checked``: the call's argument check ran (a transport that prefers its library's
    allreduce, ``native_preferred``, then takes it from :data:`PREFERRED_FROM` bytes on).

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(4, lambda t: (table(t, 10), table(t, 1 << 20)))[0]
        ('recursive_doubling', 'rabenseifner')
    """
    p = t.size
    if native and (checked and t.native_preferred and nbytes >= PREFERRED_FROM
                   or t.fast_native and nbytes < t.state.native_below):
        return "native"
    if nbytes < SMALL:
        return "recursive_doubling"
    if p > 2 and p & (p - 1) == 0:
        return "rabenseifner"
    return "ring"


def select(t: Transport, nbytes: int, dtype: str = "float32", op: str = "sum", *,
           native: bool = False, checked: bool = False) -> str:
    """Name of the dense algorithm to use for ``nbytes`` bytes of ``dtype`` on ``t``.

    ``native=True`` lets the library's own allreduce compete (when it reduces ``dtype``
    under ``op`` correctly); callers pass it only where that cannot hang (see the module
    docstring). Without it the answer is one of :data:`HOP` (what per-hop compressed
    routes need). ``checked``: this call's arguments were just checked (see
    :func:`table`; the library's own order of additions then decides the bytes, so the
    internal calls that a replay models, unchecked, keep gradcomm's algorithms).
    """
    cache = t.state.choices
    key = (nbytes, dtype, op, native, checked)
    name = cache.get(key)
    if name is not None:
        return name
    allow = native and t.native_supports(dtype, op)
    prof = agreed_profile(t)
    if prof is None:
        name = table(t, nbytes, allow, checked)
    else:
        name = prof.best((*HOP, "native") if allow else HOP, nbytes, t.size, dtype,
                         transport=t)
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = name
    return name


# -- profiles ---------------------------------------------------------------------------
def agreed_profile(t: Transport) -> Profile | None:
    """The profile every rank of ``t`` agreed on (None: none yet, or none anywhere)."""
    return t.state.profile


def is_agreed(t: Transport) -> bool:
    """Whether the ranks of ``t`` already agreed on a profile (or on having none)."""
    return t.state.profile_agreed


def use_profile(t: Transport, profile: Profile | str | None) -> None:
    """Make ``profile`` (a :class:`Profile`, a file path, or None) this rank's local
    candidate. Local only: it takes effect at the next agreement (the first checked
    ``auto`` call, or :func:`agree_profile`), where rank 0's candidate wins if the ranks'
    differ."""
    if isinstance(profile, str):
        profile = Profile.load(profile)
    if profile is not None and not isinstance(profile, Profile):
        raise ConfigError(f"use_profile needs a Profile, a path or None, got {profile!r}")
    t.state.local_profile, t.state.local_profile_set = profile, True


def local_profile(t: Transport) -> Profile | None:
    """This rank's candidate: :func:`use_profile`'s, else the file named by
    ``GRADCOMM_PROFILE`` (``{transport}`` and ``{ranks}`` are substituted; "none" for
    no profile), else :func:`~gradcomm.collectives.costmodel.default_path` if it exists
    (not for ``threads``). A file that is not a valid profile for this transport and
    rank count is ignored with a warning."""
    st = t.state
    if not st.local_profile_set:
        st.local_profile, st.local_profile_set = _load_local(t), True
    return st.local_profile  # type: ignore[no-any-return]


def profile_path(t: Transport) -> str | None:
    """Where this rank's profile file is: ``GRADCOMM_PROFILE`` (``{transport}`` and
    ``{ranks}`` substituted; None if it says "none"), else the default cache file.

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> path = run_ranks(1, profile_path)[0]
        >>> path is None or path.endswith(".json") or "GRADCOMM_PROFILE" in os.environ
        True
    """
    env = os.environ.get(PROFILE_ENV)
    if env is None:
        return default_path(t.name, t.size)
    if env.strip().lower() in ("", "none", "off", "0"):
        return None
    return env.replace("{transport}", t.name).replace("{ranks}", str(t.size))


def _load_local(t: Transport) -> Profile | None:
    env = os.environ.get(PROFILE_ENV)
    if env is not None:
        path = profile_path(t)
        if path is None:
            return None
        if not os.path.exists(path):
            warnings.warn(f"{PROFILE_ENV}={env}: {path} does not exist; auto uses its "
                          "built-in table", RuntimeWarning, stacklevel=3)
            return None
    elif t.name == "threads":
        return None
    else:
        path = default_path(t.name, t.size)
        if not os.path.exists(path):
            return None
    try:
        prof = Profile.load(path)
    except ConfigError as exc:
        warnings.warn(f"{exc}; auto uses its built-in table", RuntimeWarning, stacklevel=3)
        return None
    if (prof.transport, prof.ranks) != (t.name, t.size):
        warnings.warn(f"profile {path} was measured for {prof.transport} with {prof.ranks} "
                      f"ranks, not {t.name} with {t.size}; ignored", RuntimeWarning,
                      stacklevel=3)
        return None
    return prof


def agree_profile(t: Transport) -> Profile | None:
    """Collective: every rank adopts the same profile (rank 0's candidate if the ranks'
    candidates differ; one small exchange, plus a broadcast only then) and returns it."""
    from ._check import agree

    local = local_profile(t)
    differ = agree(t, "auto profile", negotiable=("profile", "native_below"),
                   profile=local.digest() if local is not None else 0,
                   native_below=t.native_below)
    prof = _broadcast_root(t, local) if "profile" in differ else local
    st = t.state
    st.profile, st.profile_agreed = prof, True
    st.native_below = NATIVE_BELOW if "native_below" in differ else t.native_below
    st.choices.clear()
    st.small.clear()
    return prof


def _broadcast_root(t: Transport, local: Profile | None) -> Profile | None:
    """Rank 0's profile to every rank, down the binomial tree (validated on arrival)."""
    from .tree import children, parent

    up = parent(t.rank)
    if up is None:
        data = local.to_json().encode() if local is not None else b""
        head = np.array([len(data), local.digest() if local is not None else 0], np.int64)
        body = np.frombuffer(data, np.uint8)
    else:
        head = np.empty(2, np.int64)
        t.recv(head, up, TAG_PROFILE)
        size = int(head[0])
        if not 0 <= size <= _MAX_BYTES:
            raise PayloadError(f"rank {t.rank}: rank {up} announced a profile of {size} "
                               f"bytes (at most {_MAX_BYTES})")
        body = np.empty(size, np.uint8)
        if size:
            t.recv(body, up, TAG_PROFILE)
    reqs = []
    for c in children(t.rank, t.size)[::-1]:
        reqs.append(t.isend(head, c, TAG_PROFILE))
        if body.size:
            reqs.append(t.isend(body, c, TAG_PROFILE))
    t.waitall(reqs)
    if up is None or not body.size:
        return local if up is None else None
    try:
        prof = Profile.from_json(body.tobytes(), f"profile from rank {up}")
    except ConfigError as exc:
        raise PayloadError(str(exc)) from None
    if prof.digest() != int(head[1]):
        raise PayloadError(f"rank {t.rank}: the profile from rank {up} does not match its "
                           "fingerprint")
    return prof


def describe(t: Transport) -> dict[str, Any]:
    """What auto is using on ``t``: ``{"agreed": bool, "profile": digest or None}``."""
    prof = agreed_profile(t)
    return {"agreed": is_agreed(t), "profile": None if prof is None else prof.digest()}
