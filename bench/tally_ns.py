"""Per-element cost of a codec call with error feedback and the guard's residual norm:
the norm as a separate pass (``e.dot(e)``, what the guard did) against the norm tallied
in the codec's own pass (``compress(..., tally=)``), interleaved round by round in one
process; medians in ns per element::

    OMP_NUM_THREADS=1 python bench/tally_ns.py --count 12500000 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from gradcomm import compressors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=12_500_000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    n = args.count
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    e0 = (rng.standard_normal(n) * 0.1).astype(np.float32)
    print(f"# {n} float32, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}; "
          "median ns per element")
    print(f"{'codec':10s} {'+ef':>8s} {'+ef, dot':>9s} {'+ef, tally':>11s}")
    for name, opts in [("onebit", {}), ("int8", {}), ("topk", {"ratio": 0.01}),
                       ("fp16", {})]:
        c = compressors.get(name, **opts)
        e, t = e0.copy(), np.zeros(2)
        calls = [lambda: c.compress(x, seed=1, residual=e),
                 lambda: (c.compress(x, seed=1, residual=e), e.dot(e)),
                 lambda: c.compress(x, seed=1, residual=e, tally=t)]
        for f in calls:
            f()
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(args.rounds):
            for f, ts in zip(calls, times):
                a = time.perf_counter()
                f()
                ts.append(time.perf_counter() - a)
        ns = [np.median(ts) / n * 1e9 for ts in times]
        print(f"{name:10s} {ns[0]:8.3f} {ns[1]:9.3f} {ns[2]:11.3f}")


if __name__ == "__main__":
    main()
