"""What a benchmark run measures: sizes, variants, iterations, and the link's rate.

:func:`make_plan` turns the parsed command line into a :class:`~gradcomm.bench.sweep.Plan`
(the same on every rank, so bad arguments fail alike everywhere, before ranks meet).

Example:
    >>> parse_compressor("topk:ratio=0.01")
    ('topk', (('ratio', 0.01),))
    >>> from gradcomm.bench.cli import build_parser
    >>> args = build_parser().parse_args(["--compressors", "none@ring,int8",
    ...                                   "--algorithms", "auto"])
    >>> [v.label for v in make_plan(args, None).variants]
    ['ring', 'auto+int8', 'auto+int8+ef']
    >>> args = build_parser().parse_args(["--collective", "reduce_scatter",
    ...                                   "--compressors", "none,int8"])
    >>> [v.label for v in make_plan(args, None).variants]
    ['ring', 'auto', 'ring+int8', 'ring+int8+ef', 'alltoall+int8', 'alltoall+int8+ef', \
'auto+int8', 'auto+int8+ef']
    >>> parse_rate("1gbit"), parse_rate("2.5g"), parse_rate("100mbit")
    (1000000000, 2500000000, 100000000)
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from ..errors import ConfigError
from . import launch, rs
from ._util import parse_size, parse_sizes
from .sweep import Plan, Variant

_BASELINES = (launch.MPIBaseline.name, launch.TorchBaseline.name,
              rs.MPIReduceScatter.name, rs.TorchReduceScatter.name)
#: set by the emulated-network harness (bench/netns.py) to its link rate, bits per second
RATE_ENV = "GRADCOMM_NET_RATE"
_RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9,
               "k": 10**3, "m": 10**6, "g": 10**9}


def parse_compressor(text: str) -> tuple[str | None, tuple[tuple[str, Any], ...]]:
    """'name[:key=value:...]' -> (name or None for dense, options)."""
    name, *opts = text.strip().split(":")
    options = []
    for o in opts:
        key, eq, raw = o.partition("=")
        if not eq:
            raise ConfigError(f"bad compressor option {o!r} in {text!r}: expected key=value")
        value: Any = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                pass
        options.append((key, value))
    return (None if name in ("none", "dense", "") else name), tuple(options)


def parse_rate(text: str) -> int:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"10g"`` or a plain number."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"a link rate looks like 1gbit, 100mbit or 10g; got {text!r}")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])


def link_rate(args: argparse.Namespace) -> int | None:
    """The link's rate in bits per second: ``--link-rate``, else what the harness set
    (``$GRADCOMM_NET_RATE``), else None (unknown: no link column)."""
    text = args.link_rate or os.environ.get(RATE_ENV)
    return parse_rate(text) if text else None


def default_sizes(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` (both rounded to a power of two)."""
    if lo > hi:
        raise ConfigError(f"--min-bytes {lo} exceeds --max-bytes {hi}")
    sizes, s = [], 1
    while s < lo:
        s *= 2
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


def available_algorithms() -> list[str]:
    """Dense algorithms whose module imports in this checkout/installation."""
    import importlib

    from ..collectives import DENSE

    out = []
    for name in DENSE:
        try:
            importlib.import_module(f"gradcomm.collectives.{name}")
        except ImportError:
            continue
        out.append(name)
    return out


def make_plan(args: argparse.Namespace, baseline: str | None) -> Plan:
    """The variants and sizes to measure; ConfigError for unknown names."""
    from .. import compressors
    from .._dtypes import STORAGE
    from ..collectives import DENSE
    from ..ops import Reducer

    if args.dtype not in STORAGE:
        raise ConfigError(f"unknown dtype {args.dtype!r}; known: {', '.join(STORAGE)}")
    Reducer(args.op, args.dtype)             # e.g. mean of integers: ConfigError now
    if args.iters is None:
        args.iters = 100
    if min(args.iters, args.min_iters) < 1 or args.warmup < 0:
        raise ConfigError("--iters and --min-iters must be >= 1 and --warmup >= 0")
    if args.rounds < 1:
        raise ConfigError("--rounds must be >= 1")
    link_rate(args)                           # a bad --link-rate fails here, on every rank
    if args.calibrate:
        if args.calibrate_iters < 1:
            raise ConfigError("--calibrate-iters must be >= 1")
        parse_size(args.calibrate_max)
    elif args.profile:                        # every rank reads it: fail alike, before ranks meet
        from ..collectives.costmodel import Profile

        Profile.load(args.profile)
    sizes = parse_sizes(args.sizes) if args.sizes else \
        default_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes))
    collective = getattr(args, "collective", "allreduce")
    if collective not in rs.COLLECTIVES:
        raise ConfigError(f"unknown collective {collective!r}; known: "
                          f"{', '.join(rs.COLLECTIVES)}")
    rs_mode = collective == "reduce_scatter"
    known_algos = rs.COMPRESSED_ALGORITHMS if rs_mode else DENSE
    have = list(rs.COMPRESSED_ALGORITHMS) if rs_mode else available_algorithms()
    if args.algorithms:
        algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        for a in algos:
            if a in _BASELINES:
                continue
            if a not in (*known_algos, "auto"):
                raise ConfigError(f"unknown {'reduce-scatter ' if rs_mode else ''}"
                                  f"algorithm {a!r}; known: "
                                  f"{', '.join((*known_algos, 'auto', *_BASELINES))}")
            if a != "auto" and a not in have:
                raise ConfigError(f"algorithm {a!r} is not available in this installation")
    else:
        algos = have if rs_mode else [a for a in have if a != "native"] + ["native"]
    # "spec@algorithm" measures that compressor with that algorithm only
    pinned: list[str | None] = []
    comps = []
    for c in (c for c in args.compressors.split(",") if c.strip()):
        spec, at, alg = c.partition("@")
        if at and alg not in (*known_algos, "auto"):
            raise ConfigError(f"unknown algorithm {alg!r} in --compressors {c!r}")
        comps.append(parse_compressor(spec))
        pinned.append(alg if at else None)
    if not comps:
        comps, pinned = [(None, ())], [None]
    known = compressors.names()
    for name, _ in comps:
        if name is not None and name not in known:
            raise ConfigError(f"unknown compressor {name!r}; known: {', '.join(known)}")
    from ..error_feedback import contractive

    if args.report_variant is None and any(n is None for n, _ in comps) and \
            "auto" not in algos:
        algos = [*algos, "auto"]          # the summary's row, named in advance
    variants: list[Variant] = []
    if baseline and not args.no_baseline:
        variants.append(Variant(baseline, baseline=True))
    for (name, opts), alg in zip(comps, pinned):
        for a in ([alg] if alg else algos):
            if a in _BASELINES:
                if a == baseline and Variant(a, baseline=True) not in variants:
                    variants.append(Variant(a, baseline=True))
                continue
            if name is not None and a == "native":
                continue                      # the library's allreduce cannot compress
            if rs_mode and name is None and a not in (*rs.DENSE_ALGORITHMS, "auto"):
                continue                      # the all-to-all route is a compressed one
            checks = (True, False) if args.no_check else (True,)
            efs: tuple[bool, ...] = (False,)
            if name is not None:
                codec = compressors.get(name, **dict(opts))
                can = codec.lossy and contractive(codec)
                efs = {"both": (False, True) if can else (False,), "off": (False,),
                       "only": (True,) if can else ()}[args.error_feedback]
            variants.extend(Variant(a, name, c, opts, error_feedback=e)
                            for e in efs for c in checks)
    if not variants:
        raise ConfigError("nothing to measure: no algorithm/compressor combination applies")
    report_variant = args.report_variant or "auto"
    if args.report_variant and report_variant not in {v.label for v in variants}:
        raise ConfigError(f"--report-variant {report_variant!r} is not measured; measured: "
                          f"{', '.join(v.label for v in variants)}")
    return Plan(sizes=sizes, variants=variants, dtype=args.dtype, op=args.op,
                iters=args.iters, warmup=args.warmup, min_iters=args.min_iters,
                rounds=args.rounds, collective=collective,
                fresh_result=bool(getattr(args, "fresh_result", False)))


