"""Codec throughput: encode and decode time of every compressor next to a plain memory copy.

``python -m gradcomm.bench.codecs`` prints one row per codec for one array (16 Mi float32 by
default): encode and decode milliseconds and GB/s (of input bytes), the decode-add's
milliseconds (``decompress(add=True)``, what a reduction's sum runs: the same pass as the
decode, so a slower one shows a kernel gone wrong), encode + decode over the time
of ``np.copyto`` of the same array into a preallocated buffer (measured in the same run,
interleaved with the codec's own repeats, so a busy machine slows both), wire bytes, the
compression ratio and the relative error ``||x - C(x)|| / ||x||``. Encoding reuses the
previous payload's buffers (``compress(out=)``) and decoding writes into a preallocated
array, as a training loop would. Medians of ``repeats`` after one warm-up (which also
compiles the numba kernels). Each codec's target (:data:`TARGETS`) is shown next to the ratio.

Example:
    >>> rows = codec_throughput(n=4096, names=["fp16", "topk:ratio=0.1"], repeats=1)
    >>> [(r["codec"], r["wire_bytes"] < 4096 * 4) for r in rows]
    [('fp16', True), ('topk:ratio=0.1', True)]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Sequence

import numpy as np

from .. import compressors
from ..compressors import _kernels

#: codecs measured by default (name[:option=value,...])
DEFAULT = ("none", "fp16", "bf16", "int8", "int8:rounding=stochastic", "qsgd", "terngrad",
           "topk", "randomk", "onebit")
#: targets for (encode + decode) / copy on 16M float32 (int8: nearest rounding)
TARGETS = {"fp16": 2.0, "int8": 2.0, "onebit": 2.0, "qsgd": 4.0, "terngrad": 4.0,
           "randomk": 4.0, "topk": 5.0}


def target(name: str, opts: dict[str, Any]) -> float | None:
    """The target of a codec configuration (stochastic int8 counts as stochastic)."""
    if name == "int8" and opts.get("rounding") == "stochastic":
        return 4.0
    return TARGETS.get(name)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"int8:bits=4,rounding=stochastic"`` -> ``("int8", {"bits": 4, ...})``."""
    name, _, rest = spec.partition(":")
    opts: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        for conv in (int, float):
            try:
                opts[key] = conv(val)
                break
            except ValueError:
                continue
        else:
            opts[key] = None if val == "None" else val
    return name, opts


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def codec_throughput(n: int = 16 * 2 ** 20, names: Sequence[str] | None = None,
                     repeats: int = 5, dtype: str = "float32", seed: int = 0
                     ) -> list[dict[str, Any]]:
    """Measure each codec in ``names`` (specs as in :func:`parse_spec`; default
    :data:`DEFAULT` plus any other registered codec) on ``n`` normal ``dtype`` values."""
    specs = list(names) if names else list(DEFAULT) + [
        c for c in compressors.names() if c not in {parse_spec(d)[0] for d in DEFAULT}]
    x = np.random.default_rng(seed).standard_normal(n).astype(dtype)
    copy_dst = np.empty_like(x)
    y = np.empty_like(x)
    norm = float(np.linalg.norm(x.astype(np.float64))) or 1.0
    rows = []
    for spec in specs:
        name, opts = parse_spec(spec)
        codec = compressors.get(name, **opts)
        reuse = codec.reuses_out
        p = codec.compress(x, seed=(seed, 0))                    # warm-up (and JIT)
        codec.decompress(p, out=y)
        np.copyto(copy_dst, x)
        enc, dec, cop, add = [], [], [], []
        for r in range(max(1, repeats)):
            cop.append(_timed(lambda: np.copyto(copy_dst, x)))
            t = time.perf_counter()
            p = codec.compress(x, seed=(seed, r + 1), **({"out": p} if reuse else {}))
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            codec.decompress(p, out=y)
            dec.append(time.perf_counter() - t)
            add.append(_timed(lambda: codec.decompress(p, out=copy_dst, add=True)))
        e, d, c, a = (statistics.median(v) for v in (enc, dec, cop, add))
        err = float(np.linalg.norm(x.astype(np.float64) - y.astype(np.float64))) / norm
        rows.append({
            "codec": spec, "config": codec.get_config(), "n": n, "dtype": dtype,
            "kernels": _kernels.for_size(n).NAME, "encode_s": e, "decode_s": d, "copy_s": c,
            "decode_add_s": a,
            "ratio_vs_copy": (e + d) / c if c > 0 else float("inf"),
            "target": target(name, opts), "encode_GBps": x.nbytes / e / 1e9 if e > 0 else None,
            "decode_GBps": x.nbytes / d / 1e9 if d > 0 else None,
            "wire_bytes": int(p.nbytes), "compression": x.nbytes / max(1, p.nbytes),
            "rel_error": err})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'codec':26s} {'enc ms':>8s} {'dec ms':>8s} {'add ms':>8s} {'enc GB/s':>9s} "
            f"{'dec GB/s':>9s} "
            f"{'x copy':>7s} {'target':>7s} {'wire bytes':>12s} {'ratio':>7s} {'rel err':>9s}")
    lines = [head]
    for r in rows:
        tgt = "" if r["target"] is None else \
            f"{'<=' if r['ratio_vs_copy'] <= r['target'] else '>'}{r['target']:g}"
        gbps = lambda v: f"{v:9.2f}" if v else f"{'inf':>9s}"          # noqa: E731
        lines.append(f"{r['codec']:26s} {r['encode_s'] * 1e3:8.2f} {r['decode_s'] * 1e3:8.2f} "
                     f"{r['decode_add_s'] * 1e3:8.2f} "
                     f"{gbps(r['encode_GBps'])} {gbps(r['decode_GBps'])} "
                     f"{r['ratio_vs_copy']:7.2f} {tgt:>7s} {r['wire_bytes']:12d} "
                     f"{r['compression']:7.1f} {r['rel_error']:9.2e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m gradcomm.bench.codecs [--n N] [--codecs a,b] ...``."""
    ap = argparse.ArgumentParser(prog="python -m gradcomm.bench.codecs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16 * 2 ** 20, help="elements (default 16Mi)")
    ap.add_argument("--codecs", default=None,
                    help="comma-separated; options after ':' joined by '+' "
                         "(e.g. fp16,int8:bits=4+rounding=stochastic)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    names = [s.replace("+", ",") for s in a.codecs.split(",")] if a.codecs else None
    rows = codec_throughput(a.n, names, a.repeats, a.dtype)
    print(f"# gradcomm codec throughput: n={a.n} {a.dtype}, median of {a.repeats}, "
          f"kernels={rows[0]['kernels'] if rows else '-'}, copy {rows[0]['copy_s'] * 1e3:.2f} ms"
          if rows else "# no codecs")
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
