"""gossip_average / Gossip on a real launcher (mpirun, or torchrun with --launcher torch).

Every rank checks its own result of one round against W·X (W the topology's matrix; the
inputs are a known function of the rank), the traffic of a round against the topology,
that ranks disagreeing on the step all get MismatchError, and that CHOCO gossip with the
lossless codec matches dense gossip. With ``--train-epochs N`` it then trains digits with
DecentralizedSGD (comm=None: the launcher's group), as ``gossip_train.py`` does, in the same
launch. Prints ``RESULT {json}`` per rank.

    mpirun -n 4 python tests/integrations/scripts/gossip_check.py
    torchrun --nproc-per-node 3 tests/integrations/scripts/gossip_check.py --launcher torch
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def inputs(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "torch"])
    ap.add_argument("--train-epochs", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=None, help="cap on steps per epoch")
    ap.add_argument("--topology", default="ring", help="of the training run")
    args = ap.parse_args(argv)
    if args.launcher == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    from gradcomm import gossip_average
    from gradcomm.collectives import topologies
    from gradcomm.collectives.gossip import Gossip
    from gradcomm.comm import get_transport
    from gradcomm.errors import GradcommError

    t = get_transport(None)
    p, rank, n = t.size, t.rank, 1003
    X = np.stack([inputs(r, n) for r in range(p)])
    res: dict = {"rank": rank, "size": p, "transport": t.name, "errors": []}
    for name in topologies.NAMES:
        try:
            topo = topologies.get(name, p)
        except GradcommError:
            continue
        for step in range(topo.period + 1):
            y = gossip_average(X[rank], None, topology=name, step=step)
            want = (topo.matrix(step) @ X)[rank]
            if not np.allclose(y, want, rtol=0, atol=1e-13):
                res["errors"].append(f"{name} step {step}: max err {np.abs(y - want).max()}")
            t.stats.reset()
            gossip_average(X[rank].astype(np.float32), None, topology=name, step=step,
                           check=False)
            s = t.stats.snapshot()
            deg = len(topo.recv_from(rank, step))
            if s != {"bytes_sent": 4 * n * deg, "messages_sent": deg,
                     "bytes_received": 4 * n * deg, "messages_received": deg}:
                res["errors"].append(f"{name} step {step}: traffic {s}, degree {deg}")
    try:                                     # ranks disagree on the step
        gossip_average(np.ones(3), None, step=rank % 2)
        res["mismatch"] = "none raised"
    except GradcommError as exc:
        res["mismatch"] = type(exc).__name__
    g = Gossip(None, topology="ring", compressor="none")
    a = b = X[rank]
    for s in range(3):
        a, b = g(a), gossip_average(b, None, step=s)
    res["choco_max_diff"] = float(np.abs(a - b).max())
    if args.train_epochs:
        import torch

        from gossip_train import train

        torch.set_num_threads(1)
        res["train"] = train(None, topology=args.topology, epochs=args.train_epochs,
                             max_steps=args.train_steps)
    print("RESULT " + json.dumps(res), flush=True)
    if args.launcher == "torch":
        from gradcomm.integrations.ddp.lifecycle import end_process_group

        end_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))))
    sys.exit(main())
