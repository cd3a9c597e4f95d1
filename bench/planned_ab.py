"""A/B of the DDP plan's gathered route: ``PlannedGather.run`` (compressed/planned.py)
against ``routes.run(route="allgather")`` on the same input, int8 with a KeyedResiduals
store (the hook's), 2 thread ranks. The two take turns over ROUNDS rounds of CALLS calls
(a barrier before each round, the order alternating); per round the mean per call, then
the median over rounds, the slower rank's. Prints a markdown row per size:
``| elements | unplanned µs | planned µs | planned / unplanned |``.

    python bench/planned_ab.py ROUNDS CALLS N [N ...]
    python bench/planned_ab.py 30 20 1024 16384 262144
"""
import statistics as st
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gradcomm import compressors
from gradcomm.comm import run_ranks
from gradcomm.compressed import planned, routes
from gradcomm.error_feedback import KeyedResiduals

ROUNDS, CALLS = int(sys.argv[1]), int(sys.argv[2])
SIZES = [int(a) for a in sys.argv[3:]]

def fn(t):
    out = {}
    for n in SIZES:
        c = compressors.get("int8")
        store = KeyedResiduals(); store.set_parts("u", [("w", n, None)])
        g = planned.plan_gather(t, c, n, "u", seed=0, feedback=True)
        x0 = np.random.default_rng(t.rank).standard_normal(n).astype(np.float32)
        x = x0.copy()
        times = {"planned": [], "unplanned": []}
        for r in range(ROUNDS):
            for name in (("planned", "unplanned") if r % 2 == 0 else ("unplanned", "planned")):
                t.barrier()
                a = time.perf_counter()
                for s in range(CALLS):
                    x[...] = x0
                    if name == "planned":
                        g.run(t, x, s, store)
                    else:
                        routes.run(t, x, "float32", "sum", "allgather", c, 0, s, store, "u",
                                   True)
                times[name].append((time.perf_counter() - a) / CALLS * 1e6)
        out[n] = {k: st.median(v) for k, v in times.items()}
    return out

res = run_ranks(2, fn, timeout=600)
for n in SIZES:
    a, b = max(r[n]["unplanned"] for r in res), max(r[n]["planned"] for r in res)
    print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
