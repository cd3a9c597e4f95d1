"""Random-k's update rules under SGD momentum, simulated: p ranks in one process.

The convergence benchmark's synthetic task, model and data order (``bench/converge.py``),
with each rank's gradient computed in turn and the codec's rule applied in plain torch:
no transport, no hook, so a rule can be tried in minutes before it is built. The dense
rule reproduces ``converge.py``'s ``ddp`` (90.33 % against 90.38 % at p=4, seed 0).
Random-k keeps the same positions on every rank (a shared seed), as the codec does.

Rules (``--rules``, comma-separated; ``:warm=N`` runs N dense steps first,
``:ratio=R`` changes the density):

* ``dense``: the mean gradient, SGD momentum;
* ``masked``: DGC's momentum correction with factor masking (the DDP hook's): velocity
  ``u = m u + g``, residual ``e += u``, send ``e`` at the positions, clear ``e`` and ``u``
  there; the mean is the step (no optimizer momentum);
* ``unmasked``: the same without clearing ``u``;
* ``tail``: masked, with the cleared velocity's future pushes ``m/(1-m) u`` put into ``e``;
* ``gradient``: error feedback on the gradient, SGD momentum on the mean;
* ``ef21``: EF21 (each rank's estimate ``h`` of its gradient moves by the sent difference;
  SGD momentum on the mean estimate);
* ``unbiased``: values divided by the ratio, no error feedback, SGD momentum;
* suffix ``_cyclic``: each coordinate exactly once per ``1/ratio`` steps (a random
  partition per cycle) instead of independent draws.

Example:
    python bench/randomk_sim.py --np 4 --seed 0 --rules "dense,masked,masked:warm=150"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_common import load_data, make_model  # noqa: E402  (bench/_train_common.py)

RULES = ("dense", "masked", "unmasked", "tail", "gradient", "ef21", "unbiased")


def run(rule: str, p: int = 4, seed: int = 0, ratio: float = 0.25, warm: int = 0,
        lr: float = 0.1, m: float = 0.9, epochs: int = 3, batch: int = 32) -> tuple[float, float, int]:
    """(test accuracy, test loss, steps) after ``epochs`` of the synthetic task."""
    import torch

    cyclic = rule.endswith("_cyclic")
    base = rule.removesuffix("_cyclic")
    if base not in RULES:
        raise SystemExit(f"unknown rule {rule!r}; rules: {', '.join(RULES)} (+ _cyclic)")
    Xtr, ytr, Xte, yte = load_data("synthetic", seed)
    model = make_model(256, 2, seed)
    params = list(model.parameters())
    n = len(Xtr)
    steps = epochs * n // (batch * p)
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(n), 0
    draws = torch.Generator().manual_seed(1234 + seed)
    lossf = torch.nn.CrossEntropyLoss()

    def zeros() -> list[Any]:
        return [torch.zeros_like(q) for q in params]

    buf = zeros()
    u, e, h = ([zeros() for _ in range(p)] for _ in range(3))
    mean_h = zeros()
    slots: list[Any] = []
    for step in range(steps):
        if pos + batch * p > n:
            order, pos = rng.permutation(n), 0
        grads = []
        for r in range(p):
            idx = order[pos + r * batch: pos + (r + 1) * batch]
            model.zero_grad()
            lossf(model(Xtr[idx]), ytr[idx]).backward()
            grads.append([q.grad.detach().clone() for q in params])
        pos += batch * p
        if cyclic:
            cycle = round(1 / ratio)
            if step % cycle == 0:
                slots = [torch.randint(0, cycle, q.shape, generator=draws) for q in params]
            masks = [(s == step % cycle).float() for s in slots]
        else:
            masks = [(torch.rand(q.shape, generator=draws) < ratio).float() for q in params]
        now = base if step >= warm else "dense"
        updates = []
        for j in range(len(params)):
            keep, total, momentum = masks[j], 0, True
            if now == "dense":
                d = sum(g[j] for g in grads) / p
            elif now == "unbiased":
                d = sum(keep * g[j] for g in grads) / (p * ratio)
            elif now == "ef21":
                for r in range(p):
                    c = keep * (grads[r][j] - h[r][j])
                    h[r][j] += c
                    total = total + c
                mean_h[j] += total / p
                d = mean_h[j].clone()
            else:
                for r in range(p):
                    if now == "gradient":
                        e[r][j].add_(grads[r][j])
                    else:
                        u[r][j].mul_(m).add_(grads[r][j])
                        e[r][j].add_(u[r][j])
                    sent = keep * e[r][j]
                    total = total + sent
                    e[r][j] -= sent
                    if now == "tail":
                        e[r][j] += keep * u[r][j] * (m / (1 - m))
                    if now in ("masked", "tail"):
                        u[r][j] *= (1 - keep)
                d, momentum = total / p, now == "gradient"
            updates.append((d, momentum))
        with torch.no_grad():
            for j, q in enumerate(params):
                d, momentum = updates[j]
                if momentum:
                    buf[j].mul_(m).add_(d)
                    d = buf[j]
                q -= lr * d
    with torch.no_grad():
        logits = model(Xte)
        acc = float((logits.argmax(1) == yte).float().mean())
        loss = float(lossf(logits, yte))
    return acc, loss, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=4, help="simulated ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rules", default="dense,masked,masked:warm=150")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    for spec in args.rules.split(","):
        rule, *opts = spec.split(":")
        kw: dict[str, Any] = {}
        for o in opts:
            k, _, v = o.partition("=")
            kw[k] = float(v) if k == "ratio" else int(v)
        acc, loss, steps = run(rule, p=args.np, seed=args.seed, **kw)
        print(f"p={args.np} seed={args.seed} {spec}: acc {acc * 100:.2f} % loss {loss:.3f} "
              f"({steps} steps)", flush=True)


if __name__ == "__main__":
    main()
