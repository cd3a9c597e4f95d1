"""A/B of the transports' pipeline settings: gradcomm's dense ring under several receive
windows and message sizes, beside ``MPI_Allreduce``, interleaved in one launch.

Each variant is ``WINDOW/MAXCHUNK/PERSEG`` (MiB of receives posted ahead, largest message
in MiB, messages per segment) set on the MPI transport before each call, or
``MPI_Allreduce``; ``0/0.5/8`` is double buffering of 512 KiB messages (the settings
before issue 12). Every call's result is compared with the first variant's, bytewise.
Rank 0 prints the mean and best time of each variant and the first variant's mean over
it::

    python bench/netns.py --rate 1gbit --np 2 -- python bench/pipeline_ab.py \\
        --size 1e8 --rounds 6 --variants MPI_Allreduce,0/0.5/8,64/16/8
    mpirun -n 2 python bench/pipeline_ab.py --size 64MiB --rounds 20   # shared memory
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from _ab import float32_count, options, timed, transport  # noqa: E402
from gradcomm.collectives import ring  # noqa: E402
from gradcomm.comm.base import PIPELINE_CHUNK  # noqa: E402
from gradcomm.ops import Reducer  # noqa: E402


def main() -> int:
    a = options(__doc__, "MPI_Allreduce,0/0.5/8,64/16/8")
    comm, t = transport()
    n = float32_count(a.size)
    x0 = (np.arange(n, dtype=np.float32) % 7) + t.rank
    buf = np.empty_like(x0)
    red = Reducer("sum", "float32")
    specs = a.variants.split(",")

    def call(spec: str) -> None:
        if spec == "MPI_Allreduce":
            comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            return
        w, c, k = spec.split("/")
        t.window_bytes = int(float(w) * (1 << 20))
        t.max_chunk_bytes = max(int(float(c) * (1 << 20)), PIPELINE_CHUNK)
        t.chunks_per_segment = int(k)
        ring.allreduce(t, buf, red)

    times: dict[str, list[float]] = {s: [] for s in specs}
    expect, wrong = None, []
    for _ in range(a.rounds):
        for s in specs:
            buf[:] = x0
            times[s].append(timed(comm, lambda: call(s))[0])
            if expect is None:
                expect = buf.copy()
            elif not np.array_equal(expect, buf):
                wrong.append(s)
    if t.rank == 0:
        first = float(np.mean(times[specs[0]]))
        for s, v in times.items():
            m = float(np.mean(v))
            print(f"{s:16s} mean {m * 1e3:9.1f} ms  best {min(v) * 1e3:9.1f} ms  "
                  f"{specs[0]}/this {first / m:5.2f}", flush=True)
        print(f"# {n * 4} B, {t.size} ranks, {a.rounds} rounds interleaved; wrong: "
              f"{sorted(set(wrong)) or 'none'}", flush=True)
    t.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
