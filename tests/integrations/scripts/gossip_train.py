"""Digits (scikit-learn, offline) on p ranks: decentralized gossip SGD vs allreduce SGD.

Used in-process by tests/integrations/test_decentralized.py and as a real multi-process
script:

    mpirun -n 4 python tests/integrations/scripts/gossip_train.py --mode gossip
    torchrun --nproc-per-node 4 tests/integrations/scripts/gossip_train.py --launcher torch

Every rank prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 8x8 images), offline. Read straight from the CSV that
    scikit-learn ships when it is where sklearn.datasets.load_digits reads it: importing
    scikit-learn costs seconds per rank on a busy machine."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    locs = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locs[0], "datasets", "data", "digits.csv.gz") if locs else ""
    if os.path.exists(path):
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load

    return sk_load(return_X_y=True)


def shards(rank: int, p: int, seed: int = 0):
    """This rank's training shard (iid, equal sizes) and the common test split."""
    X, y = load_digits()
    order = np.random.default_rng(seed).permutation(len(y))
    X, y = (X[order] / 16.0).astype(np.float32), y[order].astype(np.int64)
    n_test = len(y) // 5
    Xtr, ytr, Xte, yte = X[n_test:], y[n_test:], X[:n_test], y[:n_test]
    per_rank = len(ytr) // p
    lo = rank * per_rank
    return Xtr[lo:lo + per_rank], ytr[lo:lo + per_rank], Xte, yte


def train(comm: Any = None, *, mode: str = "gossip", topology: str = "ring", epochs: int = 6,
          lr: float = 0.1, batch: int = 16, compressor: str | None = None,
          gamma: float | None = None, max_steps: int | None = None,
          **options: Any) -> dict[str, float]:
    """Train a 64-32-10 MLP; ``mode`` "gossip" (DecentralizedSGD) or "allreduce" (gradients
    averaged by gradcomm.allreduce every step). Returns accuracies and consensus distance.
    ``max_steps`` caps the steps per epoch (quick runs on busy machines)."""
    import torch

    import gradcomm
    from gradcomm.comm import get_transport
    from gradcomm.integrations.decentralized import DecentralizedSGD

    t = get_transport(comm)
    start = time.perf_counter()
    Xtr, ytr, Xte, yte = (torch.from_numpy(a) for a in shards(t.rank, t.size))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    init = torch.Generator().manual_seed(0)    # same initial model on every rank (a private
    with torch.no_grad():                      # generator: ranks may be threads)
        for layer in (model[0], model[2]):
            bound = layer.in_features ** -0.5
            for prm in (layer.weight, layer.bias):
                prm.copy_(torch.rand(prm.shape, generator=init) * 2 * bound - bound)
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    opt: Any = base
    if mode == "gossip":
        opt = DecentralizedSGD(base, comm, topology=topology, compressor=compressor,
                               gamma=gamma, **options)   # comm=None: the launcher's group
    elif mode != "allreduce":
        raise ValueError(f"mode must be gossip or allreduce, got {mode!r}")
    gen = torch.Generator().manual_seed(1000 + t.rank)
    steps = len(ytr) // batch                  # equal on every rank (equal shards)
    steps = steps if max_steps is None else min(steps, max_steps)
    params = list(model.parameters())
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for s in range(steps):
            idx = perm[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx])
            loss.backward()
            if mode == "allreduce":
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                flat = gradcomm.allreduce(flat, comm, op="mean")
                off = 0
                for p in params:
                    p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
            opt.step()

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(Xte).argmax(1) == yte).double().mean())

    out = {"rank": t.rank, "size": t.size, "mode": mode, "topology": topology,
           "local_accuracy": accuracy(), "final_loss": float(loss.detach())}
    if mode == "gossip":
        out["consensus"] = opt.consensus_distance()
        out["rounds"] = opt.steps
        sq = sum(float((p.detach().double() ** 2).sum()) for p in params)
        out["param_norm_sq"] = sq
        opt.average_parameters()
    out["accuracy"] = accuracy()               # of the averaged model (gossip)
    out["train_s"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="gossip", choices=["gossip", "allreduce"])
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--compressor", default=None)
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "torch"])
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    comm = None
    if args.launcher == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    res = train(comm, mode=args.mode, topology=args.topology, epochs=args.epochs,
                compressor=args.compressor)
    print("RESULT " + json.dumps(res), flush=True)
    if args.launcher == "torch":
        from gradcomm.integrations.ddp.lifecycle import end_process_group

        end_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))))
    sys.exit(main())
