"""What ``bench/train.py`` (DDP) and ``bench/train_fsdp.py`` (FSDP2) share: variant options,
the data, the model, the link counter, the training loop and the row a training reports.

Both scripts import it from ``bench/`` (their own folder, first on ``sys.path``).

Example:
    >>> parse_options("gc-topk:ratio=0.01;ef=0")
    ('gc-topk', {'ratio': 0.01, 'ef': 0})
    >>> make_model(8, 2, 0)
    Sequential(
      (0): Linear(in_features=64, out_features=8, bias=True)
      (1): ReLU()
      (2): Linear(in_features=8, out_features=8, bias=True)
      (3): ReLU()
      (4): Linear(in_features=8, out_features=10, bias=True)
    )
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Callable

from gradcomm.bench._util import number


def parse_options(text: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value;..."`` -> ``(name, {key: number(value)})``; ValueError for an
    option without ``=``."""
    name, _, opts = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(";")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"variant option must be key=value; got {item!r} in {text!r}")
        options[key.strip()] = number(val.strip())
    return name, options


# ------------------------------------------------------------------ data and model
def load_data(kind: str, seed: int = 0):  # -> (Xtr, ytr, Xte, yte) torch tensors
    import numpy as np
    import torch

    if kind == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        X, y = d.data.astype(np.float32) / 16.0, d.target.astype(np.int64)
    elif kind == "synthetic":
        from sklearn.datasets import make_classification

        X, y = make_classification(n_samples=24000, n_features=64, n_informative=48,
                                   n_redundant=0, n_classes=10, n_clusters_per_class=2,
                                   class_sep=1.5, random_state=seed)
        X, y = X.astype(np.float32), y.astype(np.int64)
    else:
        raise ValueError(f"data must be digits or synthetic; got {kind!r}")
    perm = np.random.default_rng(seed).permutation(len(X))
    X, y = X[perm], y[perm]
    n_test = len(X) // 5
    Xtr, ytr, Xte, yte = X[n_test:], y[n_test:], X[:n_test], y[:n_test]
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-6
    Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    t = torch.from_numpy
    return t(np.ascontiguousarray(Xtr)), t(ytr), t(np.ascontiguousarray(Xte)), t(yte)


def make_model(width: int, depth: int, seed: int):
    """The MLP 64 -> width (x depth) -> 10, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    d = 64
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    layers.append(torch.nn.Linear(d, 10))
    return torch.nn.Sequential(*layers)


# ------------------------------------------------------------------ link counters
def nic_bytes(ifname: str = "gcnet0") -> tuple[int, int] | None:
    """(rx, tx) bytes of ``ifname`` in this process's network namespace, or None."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        pass
    return None


# ------------------------------------------------------------------ one training
def run_steps(forward: Callable[[Any], Any], opt: Any, lossf: Any, data: Any, args: Any,
              rank: int, world: int) -> tuple[list[float], Any, Any]:
    """``args.steps`` SGD steps of ``forward`` on this rank's share of every batch (the
    same order on every rank); ``(times of the steps after args.warmup, NIC counter at
    the warmup's end, NIC counter once every rank is done)``."""
    import numpy as np
    import torch.distributed as dist

    Xtr, ytr = data[0], data[1]
    n = len(Xtr)
    per_rank = args.batch
    rng = np.random.default_rng(args.seed)       # same order on every rank
    order = rng.permutation(n)
    pos = 0
    times: list[float] = []
    start_bytes = None
    for step in range(args.steps):
        if pos + per_rank * world > n:
            order, pos = rng.permutation(n), 0
        idx = order[pos + rank * per_rank: pos + (rank + 1) * per_rank]
        pos += per_rank * world
        x, y = Xtr[idx], ytr[idx]
        if step == args.warmup:
            dist.barrier()
            start_bytes = nic_bytes()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lossf(forward(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
    # a rank's last send may still be queued at its NIC when its own allreduce is
    # done (it waits for what it receives, not for what it sent): read the counter
    # once every rank has everything, as at the start
    dist.barrier()
    return times, start_bytes, nic_bytes()


def report(v: dict[str, Any], args: Any, model: Any, lossf: Any, data: Any, world: int,
           times: list[float], start_bytes: Any, end_bytes: Any, sent: Any
           ) -> dict[str, Any]:
    """The row of a training of variant ``v``: accuracy and losses of ``model`` (every
    rank holds the same parameters; checked, bitwise), the slowest rank's step times,
    bytes on the link and ``sent`` by gradcomm per step. Collective."""
    import torch
    import torch.distributed as dist

    Xtr, ytr, Xte, yte = data
    model.eval()
    with torch.no_grad():
        logits = model(Xte)
        acc = float((logits.argmax(1) == yte).float().mean())
        test_loss = float(lossf(logits, yte))
        train_loss = float(lossf(model(Xtr), ytr))
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    timed = len(times)
    tx = None
    if start_bytes is not None and end_bytes is not None and timed:
        tx = (end_bytes[1] - start_bytes[1]) / timed
    local = {"mean_s": statistics.fmean(times) if times else float("nan"),
             "p50_s": statistics.median(times) if times else float("nan"),
             "tx_bytes_per_step": tx, "digest": h.hexdigest(), "sent": sent}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    txs = [g["tx_bytes_per_step"] for g in gathered]
    hook_sent = [g["sent"] for g in gathered]
    return {
        "variant": v["label"],
        "kind": v["kind"],
        "steps": args.steps,
        "timed_steps": timed,
        "step_s_mean": max(g["mean_s"] for g in gathered),     # slowest rank
        "step_s_p50": max(g["p50_s"] for g in gathered),
        "tx_bytes_per_step": (statistics.fmean(txs) if all(t is not None for t in txs)
                              else None),
        "hook_bytes_sent_per_step": (statistics.fmean(hook_sent) / max(args.steps, 1)
                                     if all(isinstance(b, (int, float)) for b in hook_sent)
                                     else None),
        "test_acc": acc,
        "test_loss": test_loss,
        "train_loss": train_loss,
        "replicas_identical": len({g["digest"] for g in gathered}) == 1,
    }


__all__ = ["load_data", "make_model", "nic_bytes", "parse_options", "report", "run_steps"]
