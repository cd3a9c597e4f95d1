"""What rank 0 prints and writes: the table, progress, summary, JSON and plot.

Example:
    >>> from gradcomm.bench.sweep import Row
    >>> r = Row(4096, 1024, "float32", "sum", "ring", None, True, "ring", 10, 1, 20.0, 19.0,
    ...         21.0, 20.0, 22.0, 0.2048, 0.2048, 4096.0, 2.0, None, 0)
    >>> print(format_row(r))  # doctest: +NORMALIZE_WHITESPACE
    4096  1024  float32  ring  -  yes  10  20.0  19.0  21.0  20.0  22.0  -  -  0.20  0.20  4096  -  0
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Sequence, TextIO

from ..errors import ConfigError
from .sweep import Row

#: (header, width, row attribute) of the printed columns, OSU / nccl-tests order
COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("size(B)", 12, "size"), ("count", 11, "count"), ("dtype", 8, "dtype"),
    ("algorithm", 19, "algorithm"), ("compressor", 16, "compressor"), ("check", 5, "check"),
    ("iters", 5, "iters"), ("avg(us)", 10, "avg_us"), ("min(us)", 10, "min_us"),
    ("max(us)", 10, "max_us"), ("p50(us)", 10, "p50_us"), ("p95(us)", 10, "p95_us"),
    ("spread(%)", 9, "spread_pct"), ("pred(us)", 10, "pred_us"),
    ("algbw(GB/s)", 11, "algbw_gbs"), ("busbw(GB/s)", 11, "busbw_gbs"),
    ("wire(B/rank)", 12, "wire_bytes"), ("rel_err", 8, "rel_err"), ("#wrong", 6, "wrong"),
)
#: the column added when the link's rate is known (``extra["link_pct"]``)
LINK_COLUMN = ("link(%)", 7, "link_pct")


def add_link_efficiency(row: Row, rate_bps: float, ranks: int,
                        collective: str = "allreduce") -> None:
    """``row.extra["link_pct"]``: the bytes one rank sent per call over what its link
    carries in the call's mean time at ``rate_bps`` (per direction), in percent. Rows
    without a byte count (the library's own collective) count the bandwidth-optimal
    2(p-1)/p·size (reduce-scatter: (p-1)/p·size), as busbw does.

    Example:
        >>> r = Row(10**6, 250000, "float32", "sum", "ring", None, True, "ring",
        ...         avg_us=16000.0, wire_bytes=10**6)
        >>> add_link_efficiency(r, 1e9, 2); r.extra["link_pct"]
        50.0
    """
    if row.note or not row.avg_us:
        return
    from .rs import BUS_FACTOR

    optimal = BUS_FACTOR[collective](max(1, ranks)) * row.size
    sent = row.wire_bytes if row.wire_bytes else optimal
    row.extra["link_pct"] = sent * 8 / (row.avg_us * 1e-6 * rate_bps) * 100


def _cell(attr: str, value: Any) -> str:
    if value is None:
        return "-"
    if attr == "check":
        return "yes" if value else "no"
    if attr.endswith("_us"):
        return f"{value:.1f}"
    if attr.endswith("_gbs"):
        return f"{value:.2f}"
    if attr in ("spread_pct", "link_pct"):
        return f"{value:.1f}"
    if attr == "wire_bytes":
        return f"{value:.0f}"
    if attr == "rel_err":
        return f"{value:.2e}"
    return str(value)


def _columns(link: bool) -> tuple[tuple[str, int, str], ...]:
    return COLUMNS + (LINK_COLUMN,) if link else COLUMNS


def header(link: bool = False) -> str:
    """The column header line (starts with '#', as nccl-tests'); ``link`` adds link(%)."""
    return "#" + " ".join(f"{h:>{w}}" for h, w, _ in _columns(link))[1:]


def format_row(row: Row, link: bool = False) -> str:
    """One row as a fixed-width line; an unsupported variant as a '#' comment."""
    if row.note:
        return f"# {row.size:>10} {row.label}: {row.note}"
    cells = []
    for _, w, a in _columns(link):
        text = _cell(a, row.extra.get(a) if a in ("pred_us", "link_pct") else getattr(row, a))
        if a == "compressor" and row.compressor is not None:
            # with its options and error feedback, e.g. topk,ratio=0.01+ef
            text = "+".join(x for x in row.label.split("+")[1:] if x != "nocheck")
        cells.append(f"{text:>{w}}")
    return " ".join(cells)


class Printer:
    """Prints rows on stdout as they come, with a progress indicator on stderr.

    The indicator is tqdm's bar when tqdm is installed, else a one-line counter; it is
    only shown when ``progress`` is true (by default: stderr is a terminal). With the
    link's ``rate_bps`` every row gets the link(%) column (``ranks``: the rank count).
    """

    def __init__(self, out: TextIO | None = None, progress: bool | None = None,
                 rate_bps: float | None = None, ranks: int = 2) -> None:
        self.out = out if out is not None else sys.stdout
        self.rate_bps, self.ranks = rate_bps, ranks
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._bar: Any = None
        self._done = self._total = 0

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            self._clear()
            print(text, file=self.out, flush=True)

    def begin(self, total: int) -> None:
        self._total, self._done = total, 0
        self.line(header(self.rate_bps is not None))
        if not self.progress or total < 2:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="row", file=sys.stderr, leave=False,
                         dynamic_ncols=True)

    def step(self, what: str) -> None:
        if not self.progress:
            return
        if self._bar is not None:
            self._bar.set_description_str(what, refresh=True)
        else:
            sys.stderr.write(f"\r[{self._done + 1}/{self._total}] {what}\033[K")
            sys.stderr.flush()

    def row(self, row: Row) -> None:
        self._done += 1
        if self.rate_bps:
            add_link_efficiency(row, self.rate_bps, self.ranks)
        self.line(format_row(row, self.rate_bps is not None))
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._clear()

    def _clear(self) -> None:
        if self.progress and self._bar is None and self._total:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def add_compression_ratios(rows: Sequence[Row]) -> None:
    """``extra["compression_ratio"]`` of each compressed row: wire bytes of the dense row
    of the same algorithm, size and check setting over the compressed row's (the
    reduce-scatter's ``alltoall``, a compressed route only: the dense ring's)."""
    dense = {(r.size, r.algorithm, r.check): r.wire_bytes for r in rows
             if r.compressor is None and r.wire_bytes}
    for r in rows:
        alg = "ring" if r.algorithm == "alltoall" else r.algorithm
        ref = dense.get((r.size, alg, r.check))
        if r.compressor is not None and ref and r.wire_bytes:
            r.extra["compression_ratio"] = ref / r.wire_bytes


# -- summary ---------------------------------------------------------------------------

def _ok(r: Row) -> bool:
    return not r.note and r.avg_us is not None


def _is_dense_checked(r: Row) -> bool:
    """A dense row as users call gradcomm (with the check), or the baseline."""
    return r.compressor is None and not r.error_feedback and r.check in (True, None)


def _reference(rows: Sequence[Row], baseline: str | None) -> str:
    names = {r.algorithm for r in rows if _ok(r)}
    if baseline and baseline in names:
        return baseline
    return "native"


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": float(statistics.median(values)),
            "max": max(values)}


def round_ratios(num: Row, den: Row) -> list[float]:
    """``num``'s round mean times over ``den``'s, round by round (the two rows ran in
    the same rounds, interleaved).

    Example:
        >>> a = Row(8, 2, "float32", "sum", "x", None, True, "x", extra={"round_us": [4, 6]})
        >>> b = Row(8, 2, "float32", "sum", "y", None, True, "y", extra={"round_us": [2, 2]})
        >>> round_ratios(a, b)
        [2.0, 3.0]
    """
    xs, ys = num.extra.get("round_us") or [], den.extra.get("round_us") or []
    return [x / y for x, y in zip(xs, ys) if y]


def summarize(rows: Sequence[Row], baseline: str | None = None,
              auto_choice: dict[int, str] | None = None, *, variant: str = "auto",
              fitted_sizes: Sequence[int] = (), targets: bool = True) -> dict[str, Any]:
    """The row named ``variant`` (named in advance: ``auto`` by default, never the best
    of several) against the reference (the raw baseline if measured, else ``native``):
    busbw at the largest size, the worst busbw ratio over 16–64 MiB (the target
    window) and mean latency at 4 KiB (else at the smallest size measured), each with its
    spread over the rounds (the ratio of the two rows' round means, round by round).
    Targets are met only when no element anywhere was wrong.

    ``auto_choice`` (size -> the algorithm ``auto`` picks there) adds how often that is
    the measured fastest (mean time) of the checked dense rows (``native`` included) at
    sizes where two or more were measured, and how often it is within 10 % of it. Rows
    with a model prediction add the median relative error of the predictions, scored
    only at sizes the calibration did not measure (``fitted_sizes``: held out).
    ``targets=False`` (the reduce-scatter rows) reports the ratios without the allreduce
    issue's targets."""
    ref = _reference(rows, baseline)
    by_size: dict[int, list[Row]] = {}
    for r in rows:
        if _ok(r):
            by_size.setdefault(r.size, []).append(r)
    wrong = sum(r.wrong or 0 for r in rows)
    out: dict[str, Any] = {"reference": ref, "variant": variant, "wrong": wrong,
                           "wrong_rows": sorted({f"{r.size} {r.label}" for r in rows
                                                 if r.wrong}),
                           "unsupported": sorted({r.label for r in rows if r.note})}

    def pair(size: int) -> tuple[Row, Row] | None:
        group = by_size.get(size, [])
        mine = [r for r in group if r.label == variant]
        refs = [r for r in group if r.algorithm == ref and _is_dense_checked(r)]
        if not mine or not refs or mine[0] is refs[0]:
            return None
        return mine[0], refs[0]

    def speedup(pr: tuple[Row, Row]) -> tuple[float, dict[str, float] | None]:
        per_round = round_ratios(pr[1], pr[0])          # reference time / variant time
        return pr[1].avg_us / pr[0].avg_us, (_spread(per_round) if per_round else None)  # type: ignore[operator]

    if by_size:
        big = max(by_size)
        pr = pair(big)
        if pr:
            ratio, rounds = speedup(pr)
            out["largest"] = {"size": big, "variant": variant, "busbw": pr[0].busbw_gbs,
                              "reference_busbw": pr[1].busbw_gbs, "ratio": ratio,
                              "rounds": rounds}
        window = [s for s in sorted(by_size) if 16 << 20 <= s <= 64 << 20]
        ratios = []
        for s in window:
            pr = pair(s)
            if pr:
                ratio, rounds = speedup(pr)
                ratios.append((ratio, s, rounds))
        if ratios:
            worst = min(ratios, key=lambda x: x[0])
            out["busbw_16_64MiB"] = {"min_ratio": worst[0], "at_size": worst[1],
                                     "variant": variant, "rounds": worst[2]}
            if targets:
                out["busbw_16_64MiB"].update(target=1.3, met=worst[0] >= 1.3 and not wrong)
        small = 4096 if 4096 in by_size else min(by_size)
        pr = pair(small)
        if pr:
            per_round = round_ratios(pr[0], pr[1])       # variant time / reference time
            lat = out["latency"] = {"size": small, "variant": variant,
                                    "avg_us": pr[0].avg_us, "reference_avg_us": pr[1].avg_us,
                                    "ratio": pr[0].avg_us / pr[1].avg_us,  # type: ignore[operator]
                                    "rounds": _spread(per_round) if per_round else None}
            if small == 4096 and targets:
                lat.update(target=2.0, met=lat["ratio"] <= 2.0 and not wrong)
    if auto_choice:
        out["auto"] = _auto_hits(by_size, auto_choice)
    fitted = {int(s) for s in fitted_sizes}
    errs = [abs(r.extra["pred_us"] / r.avg_us - 1) for r in rows
            if _ok(r) and r.extra.get("pred_us") and r.avg_us and r.size not in fitted]
    if errs:
        out["model"] = {"rows": len(errs), "median_rel_error": float(statistics.median(errs)),
                        "held_out": bool(fitted)}
    return out


def _auto_hits(by_size: dict[int, list[Row]], choice: dict[int, str]) -> dict[str, Any]:
    detail = []
    for size in sorted(by_size):
        cands = [r for r in by_size[size] if r.compressor is None and r.check is True
                 and not r.error_feedback and r.algorithm != "auto" and r.avg_us]
        picked = [r for r in cands if r.algorithm == choice.get(size)]
        if len(cands) < 2 or not picked:
            continue
        best = min(cands, key=lambda r: r.avg_us)   # type: ignore[arg-type, return-value]
        detail.append({"size": size, "auto": picked[0].algorithm, "best": best.algorithm,
                       "slowdown": picked[0].avg_us / best.avg_us})  # type: ignore[operator]
    return {"sizes": len(detail), "best": sum(d["auto"] == d["best"] for d in detail),
            "within_10pct": sum(d["slowdown"] <= 1.1 for d in detail), "detail": detail}


def _gbs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _range(g: dict[str, Any]) -> str:
    r = g.get("rounds")
    return f" [rounds {r['min']:.2f}-{r['max']:.2f}]" if r else ""


def summary_line(s: dict[str, Any]) -> str:
    """The one-line summary printed at the end."""
    parts = []
    if "largest" in s:
        g = s["largest"]
        parts.append(f"{_size(g['size'])}: {g['variant']} busbw {_gbs(g['busbw'])} GB/s = "
                     f"{g['ratio']:.2f}x {s['reference']} ({_gbs(g['reference_busbw'])})"
                     f"{_range(g)}")
    if "busbw_16_64MiB" in s:
        g = s["busbw_16_64MiB"]
        parts.append(f"16-64 MiB worst ratio {g['min_ratio']:.2f}x at {_size(g['at_size'])}"
                     f"{_range(g)}" + (f" (target >= 1.3: {'met' if g['met'] else 'not met'})"
                                       if "target" in g else ""))
    if "latency" in s:
        g = s["latency"]
        target = (f", target <= 2: {'met' if g['met'] else 'not met'}" if "target" in g
                  else "")
        parts.append(f"{_size(g['size'])}: {g['variant']} latency {g['avg_us']:.1f} us = "
                     f"{g['ratio']:.2f}x {s['reference']} ({g['reference_avg_us']:.1f} us"
                     f"{target}){_range(g)}")
    if not any(k in s for k in ("largest", "latency")):
        parts.append(f"{s.get('variant', 'auto')} vs {s['reference']}: not both measured")
    if s.get("auto", {}).get("sizes"):
        g = s["auto"]
        parts.append(f"auto picks the measured best at {g['best']}/{g['sizes']} sizes "
                     f"(within 10 % at {g['within_10pct']})")
    if "model" in s:
        held = " at held-out sizes" if s["model"].get("held_out") else ""
        parts.append(f"model error median {s['model']['median_rel_error'] * 100:.0f} % "
                     f"({s['model']['rows']} rows{held})")
    parts.append(f"#wrong {s['wrong']}")
    return "# summary: " + "; ".join(parts)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# -- files -----------------------------------------------------------------------------

def write_json(path: str, env: dict[str, Any], config: dict[str, Any], rows: Sequence[Row],
               summary: dict[str, Any]) -> None:
    """All rows plus environment, configuration and summary, as one JSON document."""
    what = config.get("collective", "allreduce")
    doc = {"benchmark": f"gradcomm.bench {what}", "schema": 1, "environment": env,
           "config": config, "rows": [r.to_dict() for r in rows], "summary": summary}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def require_matplotlib() -> None:
    """Fail before measuring if ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'gradcomm[bench]'") from None


def write_plot(path: str, rows: Sequence[Row], title: str) -> None:
    """busbw and mean time against size, one line per variant."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[Row]] = {}
    for r in rows:
        if r.avg_us is not None:
            lines.setdefault(r.label, []).append(r)
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for label, rs in lines.items():
        xs = [r.size for r in rs]
        ax_bw.plot(xs, [r.busbw_gbs or 0.0 for r in rs], marker=".", label=label)
        ax_t.plot(xs, [r.avg_us for r in rs], marker=".", label=label)
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("busbw (GB/s)")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("mean time (µs)")
    ax_bw.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
