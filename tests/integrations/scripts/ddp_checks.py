"""DDP comm-hook checks, run on every rank of one launch (many checks per launch: gloo
start-up is the slow part).

    torchrun-style (RANK/WORLD_SIZE/MASTER_*): the hook talks over the DDP process group;
    mpirun: torch.distributed is initialised from Open MPI's variables (gloo, for DDP's own
    broadcasts) and the hook uses ``transport="mpi"`` (MPI.COMM_WORLD).

    python ddp_checks.py parity compressors rebuild resume join [--port P]

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``; a check that
finds a problem appends a message to ``errors`` (it does not stop the other checks).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomm
from gradcomm.integrations.ddp import _Residuals, make_comm_hook

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: options per codec for these checks (ratios high enough for a small model)
OPTIONS = {"topk": {"ratio": 0.1}, "randomk": {"ratio": 0.1}, "powersgd": {"rank": 2},
           "int8": {"bits": 4}}
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
                                 **{**OPTIONS.get(compressor or "", {}), **kw})
    ddp.register_comm_hook(state, hook)
    return ddp, state


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def same_everywhere(t: torch.Tensor, group=None) -> bool:
    """Whether ``t`` holds the same bytes on every rank of ``group``."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(b) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, b, group=group)
    return all(torch.equal(parts[0], q) for q in parts)


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
    saved = [_Residuals.from_entry(e, r) for r, e in enumerate(sd["ranks"])]
    return {k: v.astype(np.float64) for k, v in
            _Residuals.redistribute(saved, 1, 0)._residuals.items()}


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


CHECKS = {"parity": check_parity, "warmup": check_warmup, "compressors": check_compressors, "rebuild": check_rebuild,
          "resume": check_resume, "join": check_join, "resize": check_resize}


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
    this rank's ``RESULT {json}`` line (errors and info), then leave the process group."""
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
    dist.barrier()  # no teardown while a peer still talks (gloo aborts)
    dist.destroy_process_group()
    # the checks are done and reported: skip torch's own teardown, which can abort a gloo
    # process at exit (not what these checks test); under mpirun, finalize MPI first
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
