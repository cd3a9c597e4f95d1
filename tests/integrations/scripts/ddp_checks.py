"""DDP comm-hook checks, run on every rank of one launch (many checks per launch: gloo
start-up is the slow part).

    torchrun-style (RANK/WORLD_SIZE/MASTER_*): the hook talks over the DDP process group;
    mpirun: torch.distributed is initialised from Open MPI's variables (gloo, for DDP's own
    broadcasts) and the hook uses ``transport="mpi"`` (MPI.COMM_WORLD).

    python ddp_checks.py exact parity compressors rebuild resume join [--port P]

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``; a check that
finds a problem appends a message to ``errors`` (it does not stop the other checks).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomm
from gradcomm.integrations.ddp import make_comm_hook
from gradcomm.integrations.ddp.checkpoint import residuals_of
from gradcomm.integrations.ddp.residuals import redistribute

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: options per codec for these checks (ratios high enough for a small model)
OPTIONS = {"topk": {"ratio": 0.1}, "randomk": {"ratio": 0.1}, "powersgd": {"rank": 2, "start_iter": 0},
           "int8": {"bits": 4}}
#: the hooks here compress from the first step, not after ``start_iter="auto"``'s dense
#: warm-up (150 steps for topk, randomk and powersgd)
FIRST = {"start_iter": 0}
#: bucket_cap_mb giving several buckets for the model below (9412 parameters)
CAP = 0.01
ERRORS: list[str] = []
INFO: dict[str, object] = {}
TRANSPORT: str | None = None
#: --quick: codecs and steps of check_compressors
QUICK: dict = {}


def fail(msg: str) -> None:
    ERRORS.append(f"rank {dist.get_rank()}: {msg}")


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).to(dtype)


def batch(step: int, rank: int | None = None, dtype: torch.dtype = torch.float32):
    """Different data on every rank (``rank`` defaults to this rank) and step."""
    r = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * r + step)
    return torch.randn(8, 12, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def loss_of(model: nn.Module, xy) -> torch.Tensor:
    x, y = xy
    return (model(x) - y).float().square().mean()


def hooked(model: nn.Module, compressor=None, group=None, cap: float = CAP, **kw):
    ddp = DDP(model, bucket_cap_mb=cap, process_group=group)
    state, hook = make_comm_hook(compressor, transport=TRANSPORT if group is None else None,
                                 process_group=group, model=ddp,
                                 **{**FIRST, **OPTIONS.get(compressor or "", {}), **kw})
    ddp.register_comm_hook(state, hook)
    return ddp, state


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def same_everywhere(t: torch.Tensor, group=None) -> bool:
    """Whether ``t`` holds the same bytes on every rank of ``group``."""
    from gradcomm.integrations.ddp.lifecycle import wait_released

    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(b) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, b, group=group)
    same = all(torch.equal(parts[0], q) for q in parts)
    # gloo's workers let go of these while Python runs, not at exit (bench/RESULTS.md,
    # "Exit aborts": this is often a check's last collective)
    wait_released(b, *parts)
    return same


def algorithms_dense() -> list[str]:
    return ["native", "ring", "tree", "recursive_doubling", "rabenseifner", "auto"]


# -- checks -------------------------------------------------------------------------------
def check_parity(steps: int = 3) -> None:
    """make_comm_hook(None) == DDP's built-in allreduce, bitwise, for every dense
    algorithm and fp32/fp16/bf16 models (at p = 2 any summation order gives the same
    bytes; at other p only 'native', which is the process group's own allreduce)."""
    p = dist.get_world_size()
    algos = algorithms_dense() if p == 2 else ["native", "auto"]
    for dt_name, dt in DTYPES.items():
        for algo in algos:
            if TRANSPORT == "mpi" and algo == "native" and dt_name != "float32":
                continue                      # MPI cannot reduce 16-bit floats
            ref = DDP(make_model(dt), bucket_cap_mb=CAP)
            ours, state = hooked(make_model(dt), None, algorithm=algo)
            for step in range(steps):
                xy = batch(step, dtype=dt)
                for m in (ref, ours):
                    m.zero_grad()
                    loss_of(m, xy).backward()
                bad = [n for (n, a), b in zip(ref.module.named_parameters(), ours.parameters())
                       if not torch.equal(a.grad, b.grad)]
                if bad:
                    fail(f"parity {dt_name} {algo} step {step}: gradients differ in {bad}")
                    break
            state.close()


def check_warmup(start: int = 2) -> None:
    """start_iter: the first backward passes are plain averages (== DDP's built-in), the
    next one is compressed."""
    ref = DDP(make_model(), bucket_cap_mb=CAP)
    ours, state = hooked(make_model(), "topk", start_iter=start)
    for step in range(start + 1):
        xy = batch(step)
        for m in (ref, ours):
            m.zero_grad()
            loss_of(m, xy).backward()
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(),
                                                                ours.parameters()))
        if same != (step < start):
            fail(f"warm-up: step {step} {'equals' if same else 'differs from'} DDP's "
                 f"built-in average (start_iter={start})")
    state.close()


def check_compressors(steps: int = 6, algos: tuple[str, ...] = ("auto", "ring")) -> None:
    """Every codec x some algorithms: training runs, parameters identical on every rank.
    PowerSGD also on 'native' (its rounds are dense sums), with each weight viewed by its
    shape (the hook records them) and one warm-start Q per compressed weight."""
    done = []
    steps = QUICK.get("steps", steps)
    for name in gradcomm.compressors.names():
        if QUICK and name not in QUICK["codecs"]:
            continue
        for algo in algos + (("native",) if name == "powersgd" else ()):
            model, state = hooked(make_model(), name, algorithm=algo)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            first = last = None
            for step in range(steps):
                opt.zero_grad()
                loss = loss_of(model, batch(step))
                loss.backward()
                opt.step()
                last = loss.item()
                first = last if first is None else first
            if not (np.isfinite(last) and same_everywhere(flat_params(model))):
                fail(f"compressor {name} {algo}: parameters differ across ranks or loss "
                     f"{last} not finite")
            if name == "powersgd":
                _check_powersgd_state(model, state, algo)
            done.append(f"{name}/{algo}: loss {first:.4f} -> {last:.4f}, "
                        f"{state.stats['bytes_sent']} B sent")
            state.close()
    for dt_name, codec in (("float16", "topk"), ("bfloat16", "int8"), ("float16", "onebit")):
        if codec not in gradcomm.compressors.names() or (QUICK and codec not in QUICK["codecs"]):
            continue
        dt = DTYPES[dt_name]
        model, state = hooked(make_model(dt), codec, algorithm="auto")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(model, batch(step, dtype=dt))
            loss.backward()
            opt.step()
        res = state.residuals._residuals
        if not (np.isfinite(loss.item()) and same_everywhere(flat_params(model))
                and all(v.dtype == np.float32 for v in res.values())):
            fail(f"{dt_name} model with {codec}: parameters differ, loss not finite, or "
                 f"residuals not float32 ({sorted({str(v.dtype) for v in res.values()})})")
        done.append(f"{codec}/{dt_name} model: loss {loss.item():.4f}")
        state.close()
    INFO["compressors"] = done


def _check_powersgd_state(model: DDP, state, algo: str) -> None:
    """Shapes recorded for every parameter; a Q for each weight worth compressing, sized by
    its (shape[0], rest) view; factors sent on the process group's allreduce with
    'native'."""
    shapes = {n: tuple(q.shape) for n, q in model.module.named_parameters()}
    views = {n: state.compressor.layout(int(np.prod(s)), s) for n, s in shapes.items()}
    want = {f"{n}#q": v.r * v.cols for n, v in views.items() if v.r}
    if [n for n, v in views.items() if v.r] != ["0.weight", "2.weight", "4.weight"]:
        fail(f"powersgd/{algo}: unexpected compressed weights {views}")
    got = {k: state.residuals.extra(k).size for k in state.residuals.extra_names()}
    if state.residuals.shapes != shapes or got != want:
        fail(f"powersgd/{algo}: shapes {state.residuals.shapes} (model {shapes}), "
             f"warm starts {got} (expected {want})")
    if algo == "native" and not state.stats["native_nbytes"]:
        fail(f"powersgd/native: no bytes handed to the library's allreduce: {state.stats}")


def _telescoping(model: DDP, state, steps: int, start: int, tin: dict, tout: dict,
                 ref: nn.Module) -> None:
    """Accumulate the hook's outputs and the exact mean gradients (lr = 0: fixed model)."""
    p = dist.get_world_size()
    names = [n for n, _ in model.module.named_parameters()]
    for step in range(start, start + steps):
        xy = batch(step)
        model.zero_grad()
        loss_of(model, xy).backward()
        ref.zero_grad()
        loss_of(ref, xy).backward()
        g = torch.cat([b.grad.double().reshape(-1) for b in ref.parameters()]) / p
        dist.all_reduce(g)                                 # exact in float64 at p = 2
        at = 0
        for n, a in zip(names, model.parameters()):
            k = a.numel()
            tin[n] = tin.get(n, 0) + g[at:at + k].reshape(a.shape)
            tout[n] = tout.get(n, 0) + a.grad.double()
            at += k


def total_mass(sd: dict) -> dict[str, np.ndarray]:
    """The error mass every rank's residuals hold together (hops folded), per parameter."""
    saved = [residuals_of(e, r) for r, e in enumerate(sd["ranks"])]
    return {k: v.astype(np.float64) for k, v in
            redistribute(saved, 1, 0)._residuals.items()}


def check_rebuild(steps: int = 4) -> None:
    """Residuals survive DDP's bucket rebuild and a change of bucket_cap_mb: the
    telescoping identity sum(outputs) + error mass == sum(mean gradients) holds across
    both, for a gathered codec and per-hop re-compression (incl. recursive doubling)."""
    sparse = "topk" if "topk" in gradcomm.compressors.names() else "qsgd"
    cases = [(sparse, "allgather"), (sparse, "ring"), (sparse, "recursive_doubling"),
             ("int8", "tree"), ("onebit", "rabenseifner")]
    report = []
    for name, algo in cases:
        if name not in gradcomm.compressors.names():
            fail(f"rebuild: codec {name} missing")
            continue
        ref = make_model()
        tin: dict = {}
        tout: dict = {}
        model, state = hooked(make_model(), name, algorithm=algo, cap=CAP)
        _telescoping(model, state, steps, 0, tin, tout, ref)
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        state.close()
        model, state = hooked(make_model(), name, algorithm=algo, cap=3 * CAP)
        state.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
        _telescoping(model, state, steps, steps, tin, tout, ref)
        mass = total_mass(state.state_dict())
        err = max(float((tout[n] + torch.from_numpy(mass[n]).reshape(tout[n].shape)
                         - tin[n]).abs().max()) for n in tin)
        size = max(float(np.abs(m).max()) for m in mass.values())
        report.append(f"{name}/{algo}: max|mass| {size:.3g}, identity error {err:.2g}")
        if not (err < 1e-5 and size > 1e-3):
            fail(f"rebuild {name}/{algo}: sum(out) + mass - sum(g) = {err:.3g} "
                 f"(mass {size:.3g})")
        state.close()
    INFO["rebuild"] = report


def _train(model: DDP, opt, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, batch(step)).backward()
        opt.step()


def check_resume(k: int = 3) -> None:
    """Checkpoint at step k (model, optimizer, hook; rank 0 saves with torch.save, every
    rank loads with weights_only=True), resume in fresh objects: bitwise equal to the
    unbroken run."""
    cases = [("topk", "auto"), ("topk", "ring"), ("qsgd", "recursive_doubling"),
             ("onebit", "allgather"), ("int8", "rabenseifner"), ("powersgd", "native")]
    names = gradcomm.compressors.names()
    for name, algo in cases:
        if name not in names:
            continue
        model, state = hooked(make_model(), name, algorithm=algo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        _train(model, opt, 2 * k, 0)
        unbroken = flat_params(model)
        state.close()

        model, state = hooked(make_model(), name, algorithm=algo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        _train(model, opt, k, 0)
        hook_sd = state.state_dict(rank0_only=True)         # rank 0 writes the one file
        blob = [None]
        if dist.get_rank() == 0:
            buf = io.BytesIO()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "hook": hook_sd}, buf)
            blob = [buf.getvalue()]
        elif hook_sd != {}:
            fail("state_dict(rank0_only=True) returned data on a rank other than 0")
        state.close()
        del model, opt, state
        dist.broadcast_object_list(blob, src=0)            # every rank reads that file
        ck = torch.load(io.BytesIO(blob[0]), weights_only=True)
        fresh = make_model(seed=1)                        # other weights: loading must fix it
        fresh.load_state_dict(ck["model"])
        model, state = hooked(fresh, name, algorithm=algo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        _train(model, opt, k, k)
        if not torch.equal(flat_params(model), unbroken):
            diff = float((flat_params(model) - unbroken).abs().max())
            fail(f"resume {name}/{algo}: parameters differ from the unbroken run by {diff:.3g}")
        state.close()


def check_join(base: int = 3) -> None:
    """Uneven inputs under DDP's join(): rank r has base + 2r batches. No compression:
    bitwise equal to DDP's built-in path under join; with codecs: completes, both ranks'
    hooks ran the same number of iterations, parameters identical."""
    r = dist.get_rank()
    n = base + 2 * r

    def run(model, state=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with model.join():
            for step in range(n):
                opt.zero_grad()
                loss_of(model, batch(step)).backward()
                opt.step()
        return flat_params(model)

    ref = run(DDP(make_model(), bucket_cap_mb=CAP))
    model, state = hooked(make_model(), None, algorithm="native" if TRANSPORT != "mpi"
                          else "ring")
    ours = run(model)
    if not torch.equal(ref, ours):
        fail(f"join: hook(None) differs from built-in DDP by {float((ref - ours).abs().max())}")
    state.close()
    for name, algo in (("topk", "auto"), ("fp16", "ring"), ("qsgd", "recursive_doubling")):
        if name not in gradcomm.compressors.names():
            continue
        model, state = hooked(make_model(), name, algorithm=algo)
        params = run(model)
        iters = torch.tensor([float(state.iter)])
        if not (same_everywhere(params) and same_everywhere(iters)):
            fail(f"join {name}/{algo}: ranks differ after join (iter {state.iter})")
        state.close()


def check_resize(steps: int = 3) -> None:
    """Checkpoints move between rank counts (run with 3 processes): saved on a 2-rank
    subgroup, loaded at 3 ranks, and saved at 3, loaded on 2. The total error mass is
    preserved (exactly 2->3: one old rank per new rank; up to one float32 rounding per
    element 3->2), and training continues with identical parameters."""
    p, r = dist.get_world_size(), dist.get_rank()
    assert p == 3, "check_resize needs 3 processes"
    sub = dist.new_group([0, 1])
    cases = [("topk", "ring"), ("qsgd", "recursive_doubling"), ("onebit", "allgather"),
             ("powersgd", "tree")]
    for name, algo in cases:
        if name not in gradcomm.compressors.names():
            continue
        # 2 -> 3
        blob = [None]
        if r < 2:
            model, state = hooked(make_model(), name, group=sub, algorithm=algo)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            _train(model, opt, steps, 0)
            sd = state.state_dict()
            state.close()
            if r == 0:
                b = io.BytesIO()
                torch.save({"hook": sd, "model": model.module.state_dict()}, b)
                blob = [b.getvalue()]
        dist.broadcast_object_list(blob, src=0)
        _resized(blob[0], name, algo, None, steps, f"{name}/{algo} 2->3")
        # 3 -> 2
        model, state = hooked(make_model(), name, algorithm=algo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        _train(model, opt, steps, 0)
        sd = state.state_dict()
        state.close()
        b = io.BytesIO()
        torch.save({"hook": sd, "model": model.module.state_dict()}, b)
        if r < 2:
            _resized(b.getvalue(), name, algo, sub, steps, f"{name}/{algo} 3->2")
        dist.barrier()


def _resized(blob: bytes, name: str, algo: str, group, steps: int, label: str) -> None:
    ck = torch.load(io.BytesIO(blob), weights_only=True)
    model = make_model()
    model.load_state_dict(ck["model"])
    model, state = hooked(model, name, group=group, algorithm=algo)
    state.load_state_dict(ck["hook"])
    before = total_mass(ck["hook"])
    after = total_mass(state.state_dict())
    exact = "2->3" in label
    for k, v in before.items():
        ok = k in after and (np.array_equal(after[k], v) if exact else
                             np.allclose(after[k], v, rtol=1e-6, atol=1e-7 * np.abs(v).max()))
        if not ok:
            fail(f"resize {label}: error mass of {k} not preserved")
            break
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, opt, steps, 100)
    if not same_everywhere(flat_params(model), group):
        fail(f"resize {label}: parameters differ across ranks after training on")
    state.close()


# -- exact: the compressed hook's buckets against an independent reduction ----------------
#: (codec, algorithm, error feedback) of check_exact: gathered and per-hop routes
EXACT = [("fp16", "ring", True), ("fp16", "allgather", False), ("int8", "tree", True),
         ("int8", "allgather", True), ("topk", "sparse_allgather", True),
         ("topk", "recursive_doubling", True), ("topk", "ring", False),
         ("onebit", "allgather", True), ("onebit", "rabenseifner", True),
         ("randomk", "allgather", True), ("randomk", "ring", True),
         ("randomk", "tree", False)]


def unit_key(keys: list[str]) -> str:
    """The key the hook reduces a unit of parameters under (it seeds the codecs)."""
    import hashlib

    return "unit:" + hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]


class _RefStore(gradcomm.ErrorFeedback):
    """The library's own error feedback (standard compensate/update) with the hook's step
    (its iteration, for every key) and hop offsets recorded."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled)
        self.now = 0
        self.offsets: dict[str, int] = {}

    def step(self, key: str) -> int:
        return self.now

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        self.offsets[name] = int(offset)
        return super().hop_residual(name, offset, n, dtype, like)


class _RefRank:
    """One rank of the reference: per-parameter residuals, the hop residuals of the
    units (in a :class:`_RefStore`), the units seen and those used this iteration."""

    def __init__(self, enabled: bool) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.store = _RefStore(enabled)
        self.units: dict[str, tuple[list[str], list[int]]] = {}
        self.used: set[str] = set()
        self.copies: dict[str, int] = {}       # hop -> ranks holding it identically

    def param(self, name: str, n: int) -> np.ndarray:
        if name not in self.params:
            self.params[name] = np.zeros(n, np.float32)
        return self.params[name]

    def hops(self, unit: str) -> list[str]:
        return [h for h in self.store._residuals if h.startswith(unit + "#")]


def _reference_unit(ranks: list[_RefRank], gs: list[np.ndarray], keys: list[str],
                    lengths: list[int], codec: str, algo: str, step: int) -> np.ndarray:
    """What the hook must return for one unit (every rank's bucket slice ``gs``): each
    rank's g * fl(1/p) plus its parameters' residuals, reduced under the unit's key by
    ``compressed_allreduce`` on in-process ranks (the reference; it records the hop
    offsets the fold needs) and by ``gradcomm.bench.replay`` (no collective code), which
    must agree bitwise, residuals included. Raises AssertionError if they do not."""
    import copy

    from gradcomm.bench.replay import replay
    from gradcomm.compressed import HOP_ALGORITHMS, compressed_allreduce

    p, unit = len(ranks), unit_key(keys)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    per_hop = algo in HOP_ALGORITHMS
    xs = []
    for st, g in zip(ranks, gs):
        st.units[unit] = (list(keys), list(lengths))
        st.used.add(unit)
        st.store.now = step
        x = g * np.float32(1.0 / p)
        if st.store.enabled:
            if per_hop:       # the hop residuals carry the error; folded mass is added here
                for name, a, b in zip(keys, starts[:-1], starts[1:]):
                    if name in st.params:
                        x[a:b] += st.params[name]
                        st.params[name][:] = 0
            else:             # the unit's residual is its parameters' residuals, in order
                e = st.store.residual(unit, int(starts[-1]), np.float32)
                for name, a, b in zip(keys, starts[:-1], starts[1:]):
                    e[a:b] = st.param(name, b - a)
        xs.append(x)
    stores = [copy.deepcopy(st.store) for st in ranks]
    opts = OPTIONS.get(codec, {})
    outs = gradcomm.comm.run_ranks(p, lambda t: np.array(compressed_allreduce(
        t, xs[t.rank].copy(), "float32", op="sum", algorithm=algo, compressor=codec, seed=0,
        residuals=ranks[t.rank].store, key=unit, **opts), copy=True), timeout=60)
    again = replay([x.copy() for x in xs], dtype="float32", op="sum", algorithm=algo,
                   compressor=codec, seed=0, step=step, key=unit, residuals=stores, **opts)
    for r, (st, other) in enumerate(zip(ranks, stores)):
        if outs[r].tobytes() != again.tobytes():
            raise AssertionError(f"compressed_allreduce rank {r} != replay for {codec}/"
                                 f"{algo} step {step}")
        mine = {k: v.tobytes() for k, v in st.store._residuals.items()}
        if mine != {k: v.tobytes() for k, v in other._residuals.items()}:
            raise AssertionError(f"compressed_allreduce rank {r}'s residuals != replay's "
                                 f"for {codec}/{algo} step {step}")
        if st.store.enabled and not per_hop:
            e = st.store._residuals.pop(unit)
            for name, a, b in zip(keys, starts[:-1], starts[1:]):
                st.params[name] = e[a:b].copy()
    return outs[0]


def _reference_fold(ranks: list[_RefRank]) -> int:
    """End of an iteration: every unit not reduced in it has its hop residuals added to
    its parameters' residuals, each divided by the number of ranks holding it with the
    same offset and bytes (a replicated partial sum is owed once). Returns the hops
    folded."""
    folded = 0
    for st in ranks:
        copies = {}
        for unit in st.units:
            if unit in st.used:
                continue
            for h in st.hops(unit):
                e = st.store._residuals[h]
                copies[h] = sum(1 for o in ranks if h in o.store._residuals
                                and o.store.offsets.get(h) == st.store.offsets.get(h)
                                and o.store._residuals[h].tobytes() == e.tobytes())
        st.copies = copies
    for st in ranks:
        for unit in [u for u in st.units if u not in st.used]:
            names, lengths = st.units.pop(unit)
            starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
            for h in st.hops(unit):
                e = st.store._residuals.pop(h)
                off = st.store.offsets.pop(h)
                if st.copies[h] > 1:
                    e = e / np.float32(st.copies[h])
                for name, a, b in zip(names, starts[:-1], starts[1:]):
                    lo, hi = max(off, a), min(off + e.size, b)
                    if lo < hi:
                        st.param(name, b - a)[lo - a:hi - a] += e[lo - off:hi - off]
                folded += 1
        st.used = set()
    return folded


def _recording(names: dict[int, str], calls: list):  # noqa: ANN202 - DDP checks annotations
    """A hook that records each bucket (parameter names, sizes, a copy of its input taken
    before the hook runs) and its future, then runs gradcomm's hook."""
    from gradcomm.integrations.ddp import comm_hook

    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its types
        params = bucket.parameters()
        entry = [[names[id(q)] for q in params], [int(q.numel()) for q in params],
                 bucket.buffer().detach().clone()]
        fut = comm_hook(state, bucket)
        calls.append(entry + [fut])
        return fut

    return hook


def _exact_case(codec: str, algo: str, ef: bool, steps: int) -> str:
    """Train ``steps`` iterations through the recording hook (bucket_cap_mb changes half
    way: new units, folded hop residuals), gather every rank's bucket inputs (over gloo,
    after the backward pass), reduce them with the references, compare outputs every
    step and the final residuals bitwise."""
    p, me = dist.get_world_size(), dist.get_rank()
    module = make_model()
    names = {id(q): n for n, q in module.named_parameters()}
    # clip=None: random-k's default clipping (the guard's, tests/compressed/test_guard.py)
    # rescales the reduced bucket after the collective; the references here replay the
    # collective itself
    state, _ = make_comm_hook(codec, algorithm=algo, error_feedback=ef, model=module,
                              transport=TRANSPORT, clip=None,
                              **{**FIRST, **OPTIONS.get(codec, {})})
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    ranks = [_RefRank(ef) for _ in range(p)]
    mine = ranks[me]
    folded = 0
    ddp = None
    for step in range(steps):
        if step in (0, steps // 2):             # a new DDP, other buckets, the same state
            ddp = DDP(module, bucket_cap_mb=CAP if step == 0 else 3 * CAP)
            calls: list = []
            ddp.register_comm_hook(state, _recording(names, calls))
        calls.clear()
        opt.zero_grad()
        loss_of(ddp, batch(step)).backward()
        layout = [(k, n) for k, n, _, _ in calls]
        got = torch.cat([f.value().detach().reshape(-1).clone() for *_, f in calls])
        inputs = torch.cat([c[2].reshape(-1) for c in calls])
        every = [torch.empty_like(inputs) for _ in range(p)]
        dist.all_gather(every, inputs)
        layouts = [None] * p
        dist.all_gather_object(layouts, layout)
        if any(lay != layout for lay in layouts):
            fail(f"exact {codec}/{algo}: bucket layouts differ across ranks: {layouts}")
            break
        opt.step()
        per_rank = [[] for _ in range(p)]
        for r in range(p):
            at = 0
            for k, n in layout:
                per_rank[r].append(every[r][at:at + sum(n)].numpy().copy())
                at += sum(n)
        try:
            want = np.concatenate([
                _reference_unit(ranks, [per_rank[r][u] for r in range(p)], k, n, codec,
                                algo, step) for u, (k, n) in enumerate(layout)])
        except AssertionError as exc:           # the two references disagree
            fail(f"exact {codec}/{algo} ef={ef}: {exc}")
            break
        folded += _reference_fold(ranks)
        if got.numpy().tobytes() != want.tobytes():
            bad = np.flatnonzero(got.numpy().view(np.uint32) != want.view(np.uint32))
            fail(f"exact {codec}/{algo} ef={ef} step {step}: {bad.size} of {got.numel()} "
                 f"elements differ from the reference (first {bad[:5].tolist()}: "
                 f"{got.numpy()[bad[:3]].tolist()} vs {want[bad[:3]].tolist()})")
            break
    else:
        state.flush()
        ref = {**mine.params, **mine.store._residuals}
        hook = {k: np.asarray(v) for k, v in state.residuals._residuals.items()}
        for k in sorted(set(ref) | set(hook)):
            a = hook.get(k, np.zeros_like(ref.get(k, np.zeros(0, np.float32))))
            b = ref.get(k, np.zeros_like(a))
            if a.tobytes() != b.tobytes():
                fail(f"exact {codec}/{algo} ef={ef}: residual {k} differs from the "
                     f"reference after {steps} steps")
                break
    state.close()
    mass = sum(float(np.abs(v).sum()) for v in [*mine.params.values(),
                                                *mine.store._residuals.values()])
    return f"{codec}/{algo} ef={ef}: {folded} hops folded, |residuals| {mass:.3g}"


def check_exact(steps: int = 4) -> None:
    """The compressed hook's output buckets equal, bitwise, an independent reduction of
    every rank's bucket inputs (``compressed_allreduce`` on in-process ranks and
    ``gradcomm.bench.replay``, which agree, with the hook's keys, seed, steps and
    per-parameter residual layout), every step, and its residuals equal the reference's
    at the end; gathered and per-hop routes, with and without error feedback."""
    done = []
    for codec, algo, ef in EXACT:
        if QUICK and codec not in QUICK["codecs"]:
            continue
        done.append(_exact_case(codec, algo, ef, QUICK.get("steps", steps)))
    INFO["exact"] = done


def check_errors() -> None:
    """Hook errors reach ``backward()`` with their type on every rank: ranks configured
    with different codec options get MismatchError (``except GradcommError`` catches it,
    not DDP's "Unable to cast" RuntimeError); sparse gradients get the hook's own
    "sparse gradients are unsupported" ConfigError; the state closes (``with``)."""
    from gradcomm.errors import ConfigError, GradcommError, MismatchError

    ratio = 0.1 if dist.get_rank() == 0 else 0.2
    model, state = hooked(make_model(), "topk", ratio=ratio)
    with state:
        try:
            loss_of(model, batch(0)).backward()
            fail("codec options differing across ranks: no error")
        except GradcommError as exc:
            if not isinstance(exc, MismatchError) or "config" not in str(exc):
                fail(f"mismatch: {type(exc).__name__}: {exc}")
            INFO["mismatch"] = type(exc).__name__
    torch.manual_seed(0)
    sparse = DDP(nn.Sequential(nn.Embedding(20, 4, sparse=True)))
    state, hook = make_comm_hook(None, model=sparse, transport=TRANSPORT)
    sparse.register_comm_hook(state, hook)
    with state:
        try:
            sparse(torch.tensor([1, 2, 3])).sum().backward()
            fail("sparse gradients: no error")
        except ConfigError as exc:
            if "sparse gradients are unsupported" not in str(exc):
                fail(f"sparse: {exc}")
            INFO["sparse"] = type(exc).__name__


def _cast16(x: np.ndarray, codec: str) -> np.ndarray:
    """float32 ``x`` rounded to ``codec``'s 16 bits (nearest even) and widened back."""
    if codec == "fp16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)             # finite inputs: no NaN handling
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    return (b << 16).view(np.float32)


def check_cast(steps: int = 5) -> None:
    """fp16/bf16 with ``algorithm="auto"`` on gloo take the cast route (the 16-bit payload
    summed by gloo's allreduce; no gradcomm messages): every rank's bucket input times
    fl(1/p) plus its residual is rounded to 16 bits once, the residual keeps exactly what
    the rounding lost, and the result, the same bytes on every rank, is the 16-bit sum:
    bitwise (an independent replay of the sum) at p = 2, where the sum of two values has one
    rounding, within one rounding per addition of the exact sum at p > 2 (gloo's order);
    gradcomm's own messages are only the argument checks. At p = 2 the units run in pieces
    and whole (the cut's trials, one each here), vote and keep one cut, the same on every
    rank (the bytes are checked either way)."""
    from gradcomm.integrations.ddp import cast
    from gradcomm.integrations.ddp.routes import CAST_ROUTE

    p, me = dist.get_world_size(), dist.get_rank()
    done = []
    cast.PIECE = 1000                     # several pieces per bucket: the pipeline runs
    cast.TRIALS = 1                       # runs 1, 2 timed, run 3 votes, run 4 decided
    for codec in ("fp16", "bf16"):
        module = make_model()
        names = {id(q): n for n, q in module.named_parameters()}
        state, _ = make_comm_hook(codec, model=module, transport=TRANSPORT)
        ddp = DDP(module, bucket_cap_mb=CAP)
        calls: list = []
        ddp.register_comm_hook(state, _recording(names, calls))
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        owed = [dict() for _ in range(p)]               # rank -> parameter -> residual
        worst, units = 0.0, 0
        for step in range(steps):
            calls.clear()
            opt.zero_grad()
            loss_of(ddp, batch(step)).backward()
            layout = [(k, n) for k, n, _, _ in calls]
            units += len(layout)
            got = torch.cat([f.value().detach().reshape(-1).clone() for *_, f in calls])
            inputs = torch.cat([c[2].reshape(-1) for c in calls])
            every = [torch.empty_like(inputs) for _ in range(p)]
            dist.all_gather(every, inputs)
            opt.step()
            if not same_everywhere(got):
                fail(f"cast {codec} step {step}: results differ across ranks")
                break
            want, exact = [], []
            at = 0
            for keys, lengths in layout:
                m = sum(lengths)
                xs = []
                for r in range(p):
                    x = every[r][at:at + m].numpy() * np.float32(1.0 / p)
                    x += np.concatenate([owed[r].get(k, np.zeros(n, np.float32))
                                         for k, n in zip(keys, lengths)])
                    h = _cast16(x, codec)
                    e, a = x - h, 0
                    for k, n in zip(keys, lengths):
                        owed[r][k] = e[a:a + n]
                        a += n
                    xs.append(h)
                want.append(_cast16(xs[0] + xs[1], codec) if p == 2 else None)
                exact.append((np.sum(xs, axis=0, dtype=np.float64),
                              np.sum(np.abs(xs), axis=0, dtype=np.float64)))
                at += m
            g = got.numpy()
            if p == 2 and g.tobytes() != np.concatenate(want).tobytes():
                bad = np.flatnonzero(g != np.concatenate(want))
                fail(f"cast {codec} step {step}: {bad.size} of {g.size} elements differ "
                     f"from the 16-bit sum (first {bad[:5].tolist()})")
                break
            total, scale = (np.concatenate(v) for v in zip(*exact))
            ulp = 2.0 ** (-10 if codec == "fp16" else -7)
            err = np.abs(g - total) / np.maximum(scale * ulp * (p - 1), 1e-30)
            worst = max(worst, float(err.max()))
            if not err.max() <= 1.0:
                fail(f"cast {codec} step {step}: result off the sum by {err.max():.2f} "
                     "roundings")
                break
        state.flush()
        for k, e in owed[me].items():
            if np.asarray(state.residuals._residuals.get(k, 0.0)).tobytes() != e.tobytes():
                fail(f"cast {codec}: residual {k} is not what the rounding lost")
                break
        cuts = [(c.n, c.pieced, c.runs, [len(s) for s in c.trials]) for c in
                (plan.cut for plan in state.routes.plans.values()) if c is not None]
        # a digest in a tensor, not all_gather_object: torch's pickled tensors would be
        # the script's last collective's, which lifecycle.wait_released cannot wait on
        digest = hashlib.sha256(json.dumps(sorted(cuts)).encode()).digest()
        same = same_everywhere(torch.frombuffer(bytearray(digest), dtype=torch.uint8))
        split = [c for c in cuts if c[0] > cast.PIECE and c[2] > 2 * cast.TRIALS + 1]
        timed = [cast.TRIALS] * 2 if p == 2 else [0, 0]
        if not same or not split or any(
                c[1] is None or (p > 2 and not c[1]) or c[3] != timed for c in split):
            fail(f"cast {codec}: the cuts (count, pieced, runs, timed) {sorted(cuts)} "
                 f"{'' if same else 'differ across ranks'}")
        routes = {plan.route for plan in state.routes.plans.values()}
        # gradcomm's own messages: the argument checks of new shapes alone (a ring would
        # send 2(p-1)/p of the 16-bit values); the library sums the 16-bit values and the
        # guard's two 16-bit flags per unit
        if routes != {CAST_ROUTE} or state.stats["native_nbytes"] != 2 * steps * \
                inputs.numel() + 2 * cast.FLAGS * units or \
                10 * state.stats["bytes_sent"] > state.stats["native_nbytes"]:
            fail(f"cast {codec}: routes {routes}, stats {state.stats}")
        done.append(f"{codec}: {steps} steps, worst {worst:.2f} roundings")
        state.close()
    INFO["cast"] = done


CHECKS = {"cast": check_cast, "exact": check_exact, "parity": check_parity, "warmup": check_warmup, "compressors": check_compressors, "rebuild": check_rebuild,
          "resume": check_resume, "join": check_join, "resize": check_resize,
          "errors": check_errors}


def init(port: int | None) -> None:
    global TRANSPORT
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=size)
        TRANSPORT = "mpi"
    else:
        dist.init_process_group("gloo")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--port", type=int, default=29555, help="gloo port under mpirun")
    ap.add_argument("--quick", action="store_true", help="a few codecs, fewer steps")
    args = ap.parse_args()
    if args.quick:
        QUICK.update(codecs=("topk", "fp16", "qsgd", "onebit"), steps=3)
    torch.set_num_threads(1)
    init(args.port)
    run_checks(CHECKS, args.checks)


def run_checks(checks: dict, names: list[str]) -> None:
    """Run ``checks[name]()`` for each name (stopping at the first that raises), print
    this rank's ``RESULT {json}`` line (errors and info), then destroy the process group
    (which closes the hook states still open) and exit normally."""
    times = {}
    for name in names:
        began = time.perf_counter()
        try:
            checks[name]()
        except Exception as exc:                        # report, then stop: ranks may diverge
            import traceback

            fail(f"{name} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            times[name] = round(time.perf_counter() - began, 2)
            break
        times[name] = round(time.perf_counter() - began, 2)
    INFO["seconds"] = times
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "errors": ERRORS, "info": INFO}),
          flush=True)
    dist.destroy_process_group()      # as a user's script ends: no barrier, no os._exit


if __name__ == "__main__":
    main()
