"""``python -m gradcomm.bench --calibrate``: measure the cost model's constants here.

:func:`calibrate` times, on every rank at once and as the benchmark does (barrier, then
the median of the slowest rank), what :class:`~gradcomm.collectives.costmodel.Profile`
holds for the transport and rank count at hand: α and β of a ``sendrecv`` (fitted as
``α + β·n``), each algorithm's own α on 8 bytes, γ and δ of ``Reducer.combine`` per dtype,
the transport's own allreduce, the fixed costs of a call and of its argument check, the
input copy, and (rank 0) codec throughput. Rank 0 builds the profile, saves it, and the
ranks adopt it (:func:`save_and_adopt`), so ``auto`` in the same run already uses it.
``bench/README.md`` ("Calibration") gives the sizes, the fits and the commands.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> prof = run_ranks(2, lambda t: calibrate(t, max_bytes=4096, iters=3, codecs=False))[0]
    >>> (prof.transport, prof.ranks, prof.alpha > 0, len(prof.native) > 0)
    ('threads', 2, True, True)
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
from typing import Any, Callable, Sequence

import numpy as np

from .._dtypes import STORAGE, storage
from ..collectives.auto import HOP
from ..collectives.costmodel import Profile
from ..comm.base import TAG_DATA, Transport
from ._util import median_slowest_us

#: the sizes measured are powers of 8 from 8 bytes up to ``max_bytes`` (and it)
MAX_BYTES = 8 << 20


def sizes_upto(max_bytes: int) -> list[int]:
    """8, 64, 512, … up to ``max_bytes``, plus ``max_bytes`` itself.

    Example:
        >>> sizes_upto(5000)
        [8, 64, 512, 4096, 5000]
    """
    out, s = [], 8
    while s < max_bytes:
        out.append(s)
        s *= 8
    return out + [max(8, max_bytes)]


def _timed(t: Transport, fn: Callable[[], Any], iters: int, warmup: int) -> float | None:
    """Median of the slowest rank's seconds (rank 0; None elsewhere)."""
    us = median_slowest_us(t, fn, iters, warmup)
    return None if us is None else us * 1e-6


def _iters(size: int, iters: int) -> int:
    return max(3, min(iters, int(iters * (1 << 20) / max(size, 1))))


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` ≥ 0 with ``a + b·x`` ≈ ``y``, least squares on the relative error.

    Example:
        >>> a, b = fit_linear([8, 1000, 100000], [1e-5 + 8e-9, 1e-5 + 1e-6, 1e-5 + 1e-4])
        >>> round(a * 1e6, 3), round(b * 1e9, 3)
        (10.0, 1.0)
    """
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) == 1:
        return float(y[0]), 0.0
    w = 1.0 / np.maximum(y, 1e-12)
    (a, b), *_ = np.linalg.lstsq(np.stack([w, x * w], axis=1), np.ones_like(x), rcond=None)
    if b < 0:
        return float(np.median(y)), 0.0
    if a < 0:
        b = float(np.median(y / x))
        return 0.0, b
    return float(a), float(b)


def calibrate(t: Transport, *, max_bytes: int = MAX_BYTES, iters: int = 50,
              codecs: bool = True, progress: Callable[[str], None] | None = None
              ) -> Profile | None:
    """Measure the constants (every rank) and return the profile (rank 0; None elsewhere).

    The profile is not saved or adopted here: see :func:`save_and_adopt`.
    """
    with np.errstate(over="ignore", invalid="ignore"):   # buffers summed into themselves
        return _calibrate(t, max_bytes, iters, codecs, progress)


def _calibrate(t: Transport, max_bytes: int, iters: int, codecs: bool,
               progress: Callable[[str], None] | None) -> Profile | None:
    from .. import allreduce
    from ..collectives import algorithm
    from ..collectives._check import agree
    from ..ops import Reducer

    def say(what: str) -> None:
        if progress is not None and t.rank == 0:
            progress(what)

    sizes = sizes_upto(max_bytes)
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    times: dict[str, list[float | None]] = {"sendrecv": [], "native": []}
    native_ok = t.native_supports("float32", "sum")
    for s in sizes:
        n = max(1, s // 4)
        x, y = np.ones(n, np.float32), np.empty(n, np.float32)
        k = _iters(s, iters)
        say(f"exchange {s} B")
        if t.size > 1:
            times["sendrecv"].append(_timed(t, lambda: t.sendrecv(x, right, y, left, TAG_DATA),
                                            k, max(1, k // 10)))
        if native_ok:
            say(f"native allreduce {s} B")
            times["native"].append(_timed(t, lambda: t.native_allreduce(y, "sum", "float32"),
                                          k, max(1, k // 10)))

    say("reductions")
    red_sizes = [s for s in (64, 4096, 256 << 10, 2 << 20) if s <= max(max_bytes, 4096)]
    combine: dict[str, list[float | None]] = {}
    for dtype in STORAGE:
        dt_sizes = red_sizes if dtype == "float32" else [red_sizes[0], red_sizes[-1]]
        combine[dtype] = []
        for s in dt_sizes:
            a = np.zeros(max(1, s // storage(dtype).itemsize), storage(dtype))
            b, r = a.copy(), Reducer("sum", dtype)
            k = _iters(s, iters)
            combine[dtype].append(_timed(t, lambda: r.combine(a, b, a), k, 1))

    say("per-call overhead")
    x8 = np.ones(2, np.float32)
    buf8 = x8.copy()
    rd = algorithm("recursive_doubling")
    red = Reducer("sum", "float32")
    k = max(iters, 20)
    tiny: dict[str, float | None] = {}
    for name in HOP:                            # each algorithm on 8 bytes: its own alpha
        fn = algorithm(name)
        tiny[name] = _timed(t, lambda: fn(t, buf8, red), k, 5)
    t_raw = _timed(t, lambda: rd(t, buf8, red), k, 5)
    t_call = _timed(t, lambda: allreduce(x8, t, algorithm="recursive_doubling", check=False),
                    k, 5)
    t_check = _timed(t, lambda: agree(t, "allreduce", count=2, dtype="float32", op="sum",
                                      algorithm="auto"), k, 5)
    big = np.ones(1 << 20, np.float32)
    t_copy = _timed(t, lambda: big.copy(), max(5, iters // 5), 1)

    rows: list[dict[str, Any]] = []
    codec_note = "not measured"
    if codecs and t.rank == 0:
        say("codecs")
        try:
            from .codecs import codec_throughput

            rows = codec_throughput(n=1 << 18, repeats=3)
            codec_note = "1 MiB float32, median of 3"
        except Exception as exc:  # noqa: BLE001 - codecs are optional in a profile
            codec_note = f"failed: {type(exc).__name__}: {exc}"
    t.barrier()
    if t.rank != 0:
        return None

    if t.size > 1:
        alpha, beta = fit_linear(sizes, times["sendrecv"])     # type: ignore[arg-type]
    else:
        alpha = beta = 0.0
    delta, g32 = fit_linear(red_sizes, combine["float32"])   # type: ignore[arg-type]
    gamma = {"float32": g32}
    for dtype, ts in combine.items():
        if dtype != "float32":
            lo, hi = red_sizes[0], red_sizes[-1]
            slope = (ts[-1] - ts[0]) / (hi - lo) if hi > lo else g32  # type: ignore[operator]
            gamma[dtype] = max(0.0, slope)
    native = [[float(s), float(v)] for s, v in zip(sizes, times["native"])]  # type: ignore
    prof = Profile(t.name, t.size, alpha, beta, gamma, delta)
    per_alg = {}
    for name, took in tiny.items():
        if t.size > 1 and took is not None:     # alpha_alg so that predict(8 B) = measured
            steps = Profile(t.name, t.size, 1.0, 0.0, {"float32": 0.0}).predict(name, 8,
                                                                                t.size)
            rest = prof.predict(name, 8, t.size) - alpha * steps
            per_alg[name] = max(0.0, (took - rest) / steps)
    return Profile(
        t.name, t.size, alpha, beta, gamma, delta, native,
        overhead=max(0.0, t_call - t_raw),                       # type: ignore[operator]
        check=(t_check or 0.0) if t.size > 1 else 0.0,
        copy=(t_copy or 0.0) / big.nbytes,
        codecs={r["codec"]: {"encode": r["encode_s"] / (r["n"] * 4),
                             "decode": r["decode_s"] / (r["n"] * 4)} for r in rows},
        info={"host": socket.gethostname(), "platform": platform.platform(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "sizes": sizes, "iters": iters, "codecs": codec_note,
              "sendrecv_s": times["sendrecv"], "native_s": times["native"],
              "tiny_s": tiny},
        alpha_by_algorithm=per_alg,
        exchange=[[float(s), float(v)] for s, v in zip(sizes, times["sendrecv"])]  # type: ignore
        if t.size > 1 else [])


def save_and_adopt(t: Transport, prof: Profile | None, path: str | None) -> Profile | None:
    """Rank 0 saves ``prof`` to ``path`` (if given); every rank adopts rank 0's profile
    (collective). Returns the adopted profile on every rank."""
    from ..collectives import auto

    if t.rank == 0 and prof is not None and path:
        prof.save(path)
    auto.use_profile(t, prof if t.rank == 0 else None)
    return auto.agree_profile(t)


def describe(prof: Profile) -> list[str]:
    """Human-readable lines (each starting with '#') about a profile."""
    per_alg = ", ".join(f"{k} {v * 1e6:.2f}" for k, v in prof.alpha_by_algorithm.items())
    lines = [f"# profile {prof.transport}, {prof.ranks} ranks: alpha {prof.alpha * 1e6:.2f} us"
             + (f" (per algorithm: {per_alg})" if per_alg else "") + ", "
             f"beta {prof.beta * 1e9:.3f} ns/B ({1 / prof.beta / 1e9 if prof.beta else 0:.2f} "
             f"GB/s), gamma(float32) {prof.gamma_of('float32') * 1e9:.3f} ns/B, "
             f"delta {prof.delta * 1e6:.2f} us",
             f"# call overhead {prof.overhead * 1e6:.2f} us, check {prof.check * 1e6:.2f} us, "
             f"copy {prof.copy * 1e9:.3f} ns/B; native points: " +
             (", ".join(f"{int(b)} B {s * 1e6:.1f} us" for b, s in prof.native) or "none")]
    if prof.codecs:
        lines.append("# codecs (ns/B encode/decode): " + ", ".join(
            f"{k} {v['encode'] * 1e9:.2f}/{v['decode'] * 1e9:.2f}"
            for k, v in prof.codecs.items()))
    lines.append(route_defaults_line(prof))
    return lines


def route_defaults_line(prof: Profile | None) -> str:
    """Which constants of the compressed route model (``auto``'s route choice) this
    profile does not measure: they stay the hand-set defaults of
    :mod:`gradcomm.collectives.costmodel`, printed as such.

    Example:
        >>> route_defaults_line(None).startswith("# compressed routes use defaults")
        True
    """
    from ..collectives import costmodel as c

    measured = {k.split(":")[0] for k in (prof.codecs if prof is not None else {})}
    default_codecs = [k for k in c.CODEC_COST if k not in measured]
    parts = [f"WIRE_ALPHA {c.WIRE_ALPHA * 1e6:.0f} us/message"]
    if prof is None:
        parts += [f"ALPHA {c.ALPHA * 1e6:.0f} us", f"BETA {c.BETA * 1e9:.2f} ns/B"]
    if prof is None or not prof.copy:
        parts.append(f"COPY_S {c.COPY_S * 1e9:.2f} ns/B")
    if default_codecs:
        parts.append("CODEC_COST (copies/element encode/decode) " + ", ".join(
            f"{k} {c.CODEC_COST[k][0]}/{c.CODEC_COST[k][1]}" for k in default_codecs))
    return "# compressed routes use defaults (hand-set, not measured): " + "; ".join(parts)
