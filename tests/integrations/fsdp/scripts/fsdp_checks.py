"""FSDP2 compressed reduce-scatter checks, many per launch (gloo start-up is the slow part).

    python fsdp_checks.py CHECK [CHECK ...] [--dir D]     (torchrun variables set)

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``; a failing check
appends to ``errors`` and the launch goes on with the next check.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gradcomm import compressors
from gradcomm.bench.replay import replay_reduce_scatter
from gradcomm.error_feedback import ErrorFeedback, torch_safe_globals
from gradcomm.errors import ConfigError
from gradcomm.integrations.fsdp import compress_fsdp, load_dcp, make_reduce_scatter

ERRORS: list[str] = []
INFO: dict[str, object] = {}
OPTIONS = {"topk": {"ratio": 0.2}, "randomk": {"ratio": 0.3}, "int8": {"bits": 4}}
CODECS = os.environ.get("CODECS", ",".join(c for c in compressors.names() if c != "powersgd")).split(",")
DIR = "."


def fail(msg: str) -> None:
    ERRORS.append(f"rank {dist.get_rank()}: {msg}")


def mesh1():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)        # 5 and 9 rows: padded and uneven on 2 and 3 ranks
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 9), nn.Tanh(),
                         nn.Linear(9, 3))


def shard(m: nn.Module, mesh=None, mp=None, reshard=(True, False, True)) -> nn.Module:
    mesh = mesh if mesh is not None else mesh1()
    kw = {} if mp is None else {"mp_policy": mp}
    fully_shard(m[0], mesh=mesh, reshard_after_forward=reshard[0], **kw)
    fully_shard(m[2], mesh=mesh, reshard_after_forward=reshard[1], **kw)
    fully_shard(m, mesh=mesh, reshard_after_forward=reshard[2], **kw)
    return m


def batch(step: int, rank: int | None = None):
    r = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randn(6, 7, generator=g)
    return x, torch.sin(x[:, :3] * 2.0) + 0.1 * torch.randn(6, 3, generator=g)


def train(m: nn.Module, opt, steps: range, accumulate: int = 1) -> float:
    loss = torch.zeros(())
    for s in steps:
        for a in range(accumulate):
            if hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(a == accumulate - 1)
            x, y = batch(s * accumulate + a)
            loss = (m(x) - y).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss)


def local(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1).float() for p in m.parameters()])


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


class Recorder(ReduceScatter):
    """Delegates to ``inner``; keeps (key, op, input copy, output copy) per call."""

    def __init__(self, inner, key: str, log: list) -> None:
        self.inner, self.key, self.log = inner, key, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        x = input_tensor.clone()
        res = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.log.append((self.key, op == dist.ReduceOp.AVG, x, output_tensor.clone()))
        return res


def record(m: nn.Module, state) -> list:
    log: list = []
    for name, mod in m.named_modules():
        key = name or "(root)"
        if key in state.comms:
            mod.set_custom_reduce_scatter(Recorder(state.comms[key], key, log))
    return log


def storage(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 \
        else t.numpy()


def check_log(log: list, codec: str, dtype: str, opts: dict, seed: int, label: str) -> int:
    """Every recorded shard == the replay of every rank's recorded input (EF on)."""
    p, me = dist.get_world_size(), dist.get_rank()
    stores = [ErrorFeedback() for _ in range(p)]
    for i, (key, avg, x, out) in enumerate(log):
        xs = [storage(a) for a in gathered(x)]
        want = replay_reduce_scatter(xs, dtype=dtype, op="mean" if avg else "sum",
                                     algorithm="auto", compressor=codec, seed=seed,
                                     residuals=stores, key=key, **opts)
        if storage(out).tobytes() != want[me].tobytes():
            fail(f"{label}: call {i} ({key}) differs from the replay")
            return i
    return len(log)


# -- the checks ---------------------------------------------------------------------------
def check_parity() -> None:
    """compress_fsdp(None) == FSDP2's own reduce-scatter, bitwise, several steps."""
    res = []
    for install in (False, True):
        m = shard(make_model())
        if install:
            st = compress_fsdp(m, None)
            if st.ef.enabled:
                fail("error feedback enabled without a codec")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        train(m, opt, range(4))
        res.append(local(m))
        if install and not all(c.calls == 4 for c in st.comms.values()):
            fail(f"parity: reduce-scatter calls {st.stats}")
    if res[0].numpy().tobytes() != res[1].numpy().tobytes():
        fail("compress_fsdp(None) differs from FSDP2's own reduce-scatter")


def check_codecs() -> None:
    """Per codec, each module's shard of every step == the replay (EF, seed 3)."""
    done = {}
    for codec in CODECS:
        opts = OPTIONS.get(codec, {})
        m = shard(make_model())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = compress_fsdp(m, codec, seed=3, **opts)
        log = record(m, st)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        train(m, opt, range(3))
        done[codec] = check_log(log, codec, "float32", opts, 3, codec)
    INFO["codecs"] = done


def check_options() -> None:
    """bf16 reduce dtype; reshard_after_forward mixed (in the model); the ring route;
    a gradient divide factor; gradient accumulation without sync."""
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    m = shard(make_model(), mp=mp)
    st = compress_fsdp(m, "int8", seed=1)
    log = record(m, st)
    train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(3))
    if any(x.dtype != torch.bfloat16 for _, _, x, _ in log):
        fail("reduce_dtype=bfloat16 did not reach the reduce-scatter")
    check_log(log, "int8", "bfloat16", {}, 1, "bf16")
    if [n for n in st.ef.names()] != sorted(st.comms) or \
            any(e.dtype != np.float32 for e in st.ef.residuals_of("(root)")):
        fail(f"bf16: residuals {list(st.ef.names())} are not one float32 array per module")
    m = shard(make_model())
    st = compress_fsdp(m, "topk", ratio=0.3, algorithm="ring")
    train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(2))
    # divide factor: factor f gives f/p times the AVG gradient (lossless codec)
    grads = []
    for factor in (None, 3.0):
        m = shard(make_model())
        compress_fsdp(m, "none")
        if factor is not None:
            for mod in (m[0], m[2], m):
                mod.set_gradient_divide_factor(factor)
        x, y = batch(0)
        (m(x) - y).square().mean().backward()
        grads.append(torch.cat([q.grad.to_local().reshape(-1) for q in m.parameters()]))
    p = dist.get_world_size()
    if not torch.allclose(grads[1] * 3.0, grads[0] * p, rtol=1e-5, atol=1e-7):
        fail("gradient divide factor not applied as PREMUL_SUM(1/f)")
    # accumulation: 3 micro-batches, one reduce-scatter per module per step
    outs = []
    for codec in (None, "none"):
        m = shard(make_model())
        st = compress_fsdp(m, codec)
        train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(2), accumulate=3)
        outs.append(local(m))
        if st.stats != {k: 2 for k in st.comms}:
            fail(f"accumulation: reduce-scatters {st.stats}, 2 per module expected")
    if not torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6):
        fail("accumulation with the lossless codec departs from FSDP2's own")


def check_errors() -> None:
    """Unsupported set-ups raise ConfigError with advice."""
    for bad, want in [(lambda: compress_fsdp(shard(make_model()), "powersgd"), "powersgd"),
                      (lambda: compress_fsdp(make_model(), "int8"), "fully_shard"),
                      (lambda: make_reduce_scatter("int8", nonsense=1), "")]:
        try:
            bad()
            fail(f"no error ({want})")
        except (ConfigError, TypeError, ValueError) as exc:
            if want not in str(exc):
                fail(f"error without advice: {exc}")
    p = dist.get_world_size()
    mesh2 = init_device_mesh("cpu", (1, p), mesh_dim_names=("replicate", "shard"))
    m = make_model()
    fully_shard(m, mesh=mesh2)
    try:
        compress_fsdp(m, "int8")
        fail("a 2-D (HSDP) mesh was accepted")
    except ConfigError as exc:
        if "replicate_group" not in str(exc):
            fail(f"HSDP error without advice: {exc}")


def _run_resumed(codec: str, dcp_dir: str | None, weights: str | None = None) -> None:
    opts = OPTIONS.get(codec, {})

    def fresh():
        m = shard(make_model())
        return m, compress_fsdp(m, codec, seed=7, weights=weights, **opts), torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9)

    m, st, opt = fresh()
    train(m, opt, range(3))
    sd = st.state_dict()
    buf = io.BytesIO()
    torch.save({"ef": sd, "opt": opt.state_dict()}, buf)
    params = [q.to_local().detach().clone() for q in m.parameters()]
    train(m, opt, range(3, 6))
    want = local(m)
    m2, st2, opt2 = fresh()
    buf.seek(0)
    with torch.serialization.safe_globals(torch_safe_globals()):
        ck = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for q, v in zip(m2.parameters(), params):
            q.to_local().copy_(v)
    opt2.load_state_dict(ck["opt"])
    if dcp_dir is None:
        st2.load_state_dict(ck["ef"])
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save({"gradcomm": sd}, checkpoint_id=dcp_dir)
        load_dcp(st2, dcp_dir)
    train(m2, opt2, range(3, 6))
    if local(m2).numpy().tobytes() != want.numpy().tobytes():
        fail(f"{codec}: resume ({'dcp' if dcp_dir else 'torch.save'}, weights {weights}) "
             "differs from the unbroken run")


def check_resume() -> None:
    """Resume from state_dict (torch.save, and DCP) == the unbroken run, bitwise."""
    _run_resumed("int8", None)
    _run_resumed("randomk", None)          # stochastic: the restored step seeds it
    _run_resumed("qsgd", os.path.join(DIR, f"dcp_resume_{dist.get_world_size()}"))


def check_save() -> None:
    """Train 3 steps with EF and save the state (torch.save on rank 0, and DCP)."""
    m = shard(make_model())
    st = compress_fsdp(m, "int8", bits=2, seed=7)
    train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(3))
    sd = st.state_dict()
    if dist.get_rank() == 0:
        torch.save(sd, os.path.join(DIR, "fsdp_ef.pt"))
    import torch.distributed.checkpoint as dcp

    dcp.save({"gradcomm": sd}, checkpoint_id=os.path.join(DIR, "fsdp_ef_dcp"))
    INFO["saved_world"] = dist.get_world_size()


def _mass(sd: dict) -> dict[str, np.ndarray]:
    rows = {k.split("/", 2)[2]: int(v) for k, v in sd.items() if "/rows/" in k}
    shapes = {n: q.shape for n, q in make_model().named_parameters()}
    out: dict[str, np.ndarray] = {}
    for k, v in sorted(sd.items(), key=lambda kv: kv[0]):
        if "/residual/" in k or "/replicate/" in k:
            name = k.split("/", 2)[2]
            a = v.numpy().astype(np.float64)[:int(np.prod(shapes[name]))]
            out[name] = out.get(name, 0) + a
    assert rows
    return out


def check_resize() -> None:
    """A state saved at another rank count loads here keeping the error mass, by
    torch.save and by DCP, and training goes on."""
    with torch.serialization.safe_globals(torch_safe_globals()):
        saved = torch.load(os.path.join(DIR, "fsdp_ef.pt"), weights_only=True)
    before = _mass(saved)
    for how in ("torch", "dcp"):
        m = shard(make_model())
        st = compress_fsdp(m, "int8", bits=2, seed=7)
        if how == "torch":
            st.load_state_dict(saved)
        else:
            load_dcp(st, os.path.join(DIR, "fsdp_ef_dcp"))
        after = _mass(st.state_dict())
        for name, a in before.items():
            if not np.allclose(after.get(name, 0), a, rtol=0, atol=1e-6):
                fail(f"{how}: error mass of {name} changed")
        if max(float(np.abs(a).max()) for a in before.values()) == 0:
            fail("the saved state holds no error mass (nothing tested)")
        train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(3, 5))
    INFO["resized_from"] = int(saved["world_size"])


def check_converge() -> None:
    """Final training loss of int8 / topk with EF within tolerance of uncompressed."""
    losses = {}
    for codec in (None, "int8", "topk"):
        m = shard(make_model())
        compress_fsdp(m, codec, **({"ratio": 0.1} if codec == "topk" else {}))
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        train(m, opt, range(30))
        x, y = batch(999, rank=0)
        with torch.no_grad():
            losses[codec or "none"] = float((m(x) - y).square().mean())
    INFO["losses"] = losses
    for codec in ("int8", "topk"):
        if losses[codec] > 1.15 * losses["none"] + 0.01:
            fail(f"{codec} converges worse: {losses}")


def check_hsdp() -> None:
    """HSDP from 1-D FSDP on the shard dim + compressed allreduce on the replicate dim:
    identical parameters on every replica, close to the uncompressed average (a p x 1
    mesh; at 4 ranks, ``torchrun --nproc_per_node 4 fsdp_checks.py hsdp``, a 2 x 2)."""
    p = dist.get_world_size()
    shape = (p // 2, 2) if p >= 4 and p % 2 == 0 else (p, 1)   # 4 ranks: a real 2 x 2
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    rep = mesh["replicate"].get_group()
    res = {}
    for codec in (None, "int8"):
        m = shard(make_model(), mesh=mesh["shard"])
        st = compress_fsdp(m, codec, replicate_group=rep)
        train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(4))
        res[codec] = local(m)
        allp = [torch.empty_like(res[codec]) for _ in range(shape[0])]
        dist.all_gather(allp, res[codec], group=rep)
        if any(q.numpy().tobytes() != allp[0].numpy().tobytes() for q in allp):
            fail(f"hsdp {codec}: replicas differ")
        if codec and not any(n.endswith("#replicate") for n in st.ef.names()):
            fail("hsdp: no replicate residual kept")
    if not torch.allclose(res[None], res["int8"], atol=0.05):
        fail("hsdp int8 far from the uncompressed average")


class HookRecorder:
    """Delegates to the replicate hook ``inner``; keeps (key, input copy, output copy)."""

    def __init__(self, inner, key: str, log: list) -> None:
        self.inner, self.key, self.log = inner, key, log

    def __call__(self, reduce_output):
        x = reduce_output.clone()
        self.inner(reduce_output)
        self.log.append((self.key, x, reduce_output.clone()))


def _gather_in(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def check_hsdp22() -> None:
    """HSDP on a real 2 x 2 mesh (4 ranks): ``compress_fsdp(None, replicate_group=)`` on
    1-D FSDP over mesh["shard"] gives parameters bitwise equal to FSDP2's own HSDP
    (``fully_shard`` on the 2-D mesh); with int8 (error feedback, seed 5) every
    reduce-scatter shard equals the replay of its shard group's recorded inputs, and every
    replicate average the replay of the compressed allreduce of its replicate group's
    recorded shards."""
    from gradcomm.bench.replay import replay

    if dist.get_world_size() != 4:
        fail("hsdp22 needs 4 ranks")
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rep, sg = mesh["replicate"].get_group(), mesh["shard"].get_group()
    res = []
    for ours in (False, True):
        m = shard(make_model(), mesh=mesh["shard"] if ours else mesh)
        if ours:
            compress_fsdp(m, None, replicate_group=rep)
        train(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), range(4))
        res.append(local(m))
    if res[0].numpy().tobytes() != res[1].numpy().tobytes():
        fail("hsdp22: compress_fsdp(None, replicate_group=) differs from FSDP2's own HSDP")
    m = shard(make_model(), mesh=mesh["shard"])
    st = compress_fsdp(m, "int8", seed=5, replicate_group=rep)
    rs_log = record(m, st)
    hook_log: list = []
    for name, mod in m.named_modules():
        key = name or "(root)"
        if key in st.hooks:
            mod.set_all_reduce_hook(HookRecorder(st.hooks[key], key, hook_log))
    train(m, torch.optim.SGD(m.parameters(), lr=0.05), range(3))
    me_s, me_r = sg.rank(), rep.rank()
    rs_stores = [ErrorFeedback() for _ in range(2)]
    for i, (key, avg, x, out) in enumerate(rs_log):
        want = replay_reduce_scatter([storage(a) for a in _gather_in(x, sg)],
                                     dtype="float32", op="mean" if avg else "sum",
                                     algorithm="auto", compressor="int8", seed=5,
                                     residuals=rs_stores, key=key)
        if storage(out).tobytes() != want[me_s].tobytes():
            fail(f"hsdp22: reduce-scatter call {i} ({key}) differs from the replay")
            break
    rep_stores = [ErrorFeedback() for _ in range(2)]
    for i, (key, x, out) in enumerate(hook_log):
        want = replay([storage(a) for a in _gather_in(x, rep)], dtype="float32", op="mean",
                      algorithm="allgather", compressor="int8", seed=5,
                      residuals=rep_stores, key=key + "#replicate")
        if storage(out).tobytes() != want.tobytes():
            fail(f"hsdp22: replicate average {i} ({key}) differs from the replay")
            break
    INFO["hsdp22"] = [len(rs_log), len(hook_log)]


def check_guard() -> None:
    """A NaN gradient on rank 0 (the step skipped, as GradScaler does) poisons the
    residuals; the guard resets them on every rank and training goes on finite;
    guard=False (the planted fault) stays non-finite."""
    finite = {}
    for guard in (True, False):
        m = shard(make_model())
        st = compress_fsdp(m, "int8", guard=guard)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        train(m, opt, range(2))
        x, y = batch(2)
        if dist.get_rank() == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (m(x) - y).square().mean().backward()
            opt.zero_grad()                         # the bad step is skipped
            train(m, opt, range(3, 6))
        finite[guard] = bool(torch.isfinite(local(m)).all())
        if guard and st.guard.stats["guard_resets"] < 1:
            fail(f"guard: no reset counted {st.guard.stats}")
    if finite != {True: True, False: False}:
        fail(f"guard: parameters finite with/without the guard: {finite}")


CHECKS = {"guard": check_guard, "parity": check_parity, "codecs": check_codecs, "options": check_options,
          "errors": check_errors, "resume": check_resume, "save": check_save,
          "resize": check_resize, "converge": check_converge, "hsdp": check_hsdp,
          "hsdp22": check_hsdp22}


def main() -> None:
    global DIR
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--dir", default=".")
    args = ap.parse_args()
    DIR = args.dir
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    times = {}
    for name in args.checks:
        began = time.perf_counter()
        try:
            CHECKS[name]()
        except Exception as exc:                    # report it, go on with the next check
            fail(f"{name} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        times[name] = round(time.perf_counter() - began, 2)
        dist.barrier()
    INFO["seconds"] = times
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "errors": ERRORS, "info": INFO}),
          flush=True)
    from gradcomm.integrations.ddp.lifecycle import end_process_group

    end_process_group()         # not a barrier (bench/RESULTS.md, "Exit aborts")


if __name__ == "__main__":
    main()
