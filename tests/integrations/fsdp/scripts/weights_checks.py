"""Checks of ``compress_fsdp(..., weights="int8")``, the quantized weight all-gather, many
per launch (torchrun variables set):

    python weights_checks.py CHECK [CHECK ...] [--dir D]

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``. The model is
fsdp_checks.py's (nested ``fully_shard``, 5 and 9 rows: padded, uneven shards on 2 and 3
ranks).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_checks import (ERRORS, INFO, _run_resumed, batch, fail, gathered, local,
                         make_model, mesh1, shard)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradcomm import compressors
from gradcomm.errors import ConfigError
from gradcomm.integrations.fsdp import compress_fsdp
from gradcomm.integrations.fsdp.allgather import PendingGather

CODEC = compressors.get("int8", bucket_size=256)
RESHARDS = {"mixed": (True, False, True), "all": (True, True, True),
            "none": (False, False, False)}
#: gathers issued inside backward (3 steps x 2 micro-batches x the modules that reshard
#: after forward): those, and only those, come back as a Work by default
BACKWARD = {"mixed": 12, "all": 18, "none": 0}


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What every rank computes with for shard ``x`` (param dtype): the codec's round trip
    in float32, rounded back to the param dtype."""
    a = x.detach().reshape(-1).to(torch.float32).numpy().copy()
    return torch.from_numpy(CODEC.decompress(CODEC.compress(a))).to(x.dtype)


class GatherLog:
    """Wraps an all-gather: keeps (input copy, output copy after the wait, was async)."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        x = input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, async_op)
        log = self.log

        class Logged(dist.Work):
            def wait(self, timeout=None):
                work.wait()
                log.append((x, output_tensor.clone(), True))
                return True

        if work is None:
            log.append((x, output_tensor.clone(), False))
            return None
        return Logged()


def install_logs(m: nn.Module, st) -> list:
    log: list = []
    for name, mod in m.named_modules():
        if (name or "(root)") in st.gathers:
            mod.set_custom_all_gather(GatherLog(st.gathers[name or "(root)"], log))
    return log


def expected_unsharded(m: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each parameter as forward must see it: every rank's padded shard of its FSDP
    module, concatenated in FSDP2's order, quantized per rank, cut back (collective)."""
    p = dist.get_world_size()
    out = {}
    for name, mod in m.named_modules():
        if not hasattr(mod, "_get_fsdp_state"):
            continue
        groups = mod._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        names = {id(q): n for n, q in m.named_parameters()}
        params = [fp.sharded_param for fp in groups[0].fsdp_params]
        fulls = [q.full_tensor().detach().to(dtype) for q in params]
        rows = [-(-f.shape[0] // p) for f in fulls]
        chunks = [F.pad(f, [0, 0] * (f.dim() - 1) + [0, r * p - f.shape[0]]).reshape(p, -1)
                  for f, r in zip(fulls, rows)]
        flat = torch.cat(chunks, dim=1)                      # (p, S): rank r's shard, row r
        q = torch.stack([roundtrip(flat[r]) for r in range(p)])
        o = 0
        for prm, f, c in zip(params, fulls, chunks):
            k = c.shape[1]
            out[names[id(prm)]] = q[:, o:o + k].reshape(-1)[:f.numel()].reshape(f.shape)
            o += k
    return out


def check_gathers() -> None:
    """Per reshard_after_forward setting and param dtype (float32, bfloat16), with 2
    micro-batches per step: every all-gather output is every rank's recorded shard through
    the codec's round trip in rank order (own one included), returned as a Work exactly
    when issued inside backward (FSDP2's implicit prefetch); every
    forward computes with the round trip of every rank's master shard (padding cut off)."""
    counts = {}
    for label, reshard in RESHARDS.items():
        for dtype in (torch.float32, torch.bfloat16):
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            m = shard(make_model(), mp=mp, reshard=reshard)
            st = compress_fsdp(m, "int8", seed=2, weights="int8")
            log = install_logs(m, st)
            seen: list = []
            for mod_name, mod in m.named_modules():
                if isinstance(mod, nn.Linear):
                    mod.register_forward_pre_hook(
                        lambda mod, args, n=mod_name: seen.append(
                            (n, {k: v.detach().clone() for k, v in mod.named_parameters()})))
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            tag = f"{label}/{str(dtype)[6:]}"
            for s in range(3):
                want = expected_unsharded(m, dtype)
                seen.clear()
                for a in range(2):
                    m.set_requires_gradient_sync(a == 1)
                    x, y = batch(2 * s + a)
                    (m(x.to(dtype)) - y.to(dtype)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                if len(seen) != 6:
                    fail(f"{tag}: {len(seen)} Linear forwards in step {s}")
                for n, got in seen:
                    for k, v in got.items():
                        w = want[f"{n}.{k}"]
                        if v.dtype != dtype or raw(v) != raw(w):
                            fail(f"{tag}: step {s}, forward of {n}.{k} is not the round "
                                 "trip of the master shards")
                            break
            for i, (x, out, was_async) in enumerate(log):
                exp = torch.cat([roundtrip(a) for a in gathered(x)])
                if out.dtype != dtype or raw(out) != raw(exp):
                    fail(f"{tag}: all-gather {i} differs from the codec's round trips "
                         f"(async {was_async})")
                    break
            if sum(a for _, _, a in log) != BACKWARD[label]:
                fail(f"{tag}: {sum(a for _, _, a in log)} gathers returned a Work, "
                     f"{BACKWARD[label]} (those in backward) expected")
            counts[tag] = len(log)
    INFO["gathers"] = counts


def _prefetched(m: nn.Module, on: bool) -> None:
    """Explicit forward and backward prefetch with ``async_op=True`` unshards."""
    if not on:
        return
    blocks = [m[0], m[2]]
    m[0].set_modules_to_forward_prefetch([m[2]])
    m[2].set_modules_to_backward_prefetch([m[0]])
    for b in (m, *blocks):
        b._set_unshard_async_op(True)


def check_overlap() -> None:
    """The asynchronous gather (forced; the default with FSDP2's implicit backward
    prefetch; with explicit forward/backward prefetch and async unshards, where every
    gather returns a Work) gives parameters bitwise equal to the exchange inside the call
    (overlap=False); reruns are bitwise the same; training with codec None stays close
    to FSDP2's own all-gather."""
    res = {}
    for label, overlap, prefetch, weights in [("sync", False, False, "int8"),
                                              ("async", True, False, "int8"),
                                              ("prefetch", None, True, "int8"),
                                              ("again", None, True, "int8"),
                                              ("auto", None, False, "int8"),
                                              ("exact", None, False, None)]:
        m = shard(make_model(), reshard=RESHARDS["all"])
        st = compress_fsdp(m, None, weights=weights)
        for g in st.gathers.values():
            g.overlap = overlap
        _prefetched(m, prefetch)
        works: list = []
        for name, mod in m.named_modules():
            g = st.gathers.get(name or "(root)")
            if g is not None:
                mod.set_custom_all_gather(_Spy(g, works))
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for s in range(4):
            x, y = batch(s)
            (m(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        res[label] = local(m)
        asyncs = sum(isinstance(w, PendingGather) for w in works)
        want = {"sync": 0, "async": len(works), "prefetch": len(works), "again": len(works),
                "auto": 12}.get(label, 0)          # auto: backward regathers 3 x 4 steps
        if weights and asyncs != want:
            fail(f"overlap {label}: {asyncs} of {len(works)} gathers returned a Work, "
                 f"{want} expected")
    for label in ("async", "prefetch", "again", "auto"):
        if res[label].numpy().tobytes() != res["sync"].numpy().tobytes():
            fail(f"overlap: {label} differs from the exchange inside the call")
    if not torch.allclose(res["sync"], res["exact"], atol=0.05) or \
            torch.equal(res["sync"], res["exact"]):
        fail("weights=int8 not close to (or identical with) the exact all-gather")


class _Spy:
    def __init__(self, inner, works: list) -> None:
        self.inner, self.works = inner, works

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        w = self.inner(output_tensor, input_tensor, group, async_op)
        self.works.append(w)
        return w


def check_resume() -> None:
    """A resume from state_dict (and the optimizer's, and the master shards) with
    weights="int8" is bitwise the unbroken run, for int8 and a stochastic codec."""
    _run_resumed("int8", None, weights="int8")
    _run_resumed("randomk", None, weights="int8")


def check_refusals() -> None:
    """Param dtypes the gather cannot code (float64), and an unknown weights codec, are
    ConfigErrors with advice."""
    m = make_model().double()
    fully_shard(m, mesh=mesh1())
    compress_fsdp(m, "int8", weights="int8")
    try:
        m(torch.randn(2, 7, dtype=torch.float64)).sum().backward()
        fail("a float64 weight all-gather was accepted")
    except ConfigError as exc:
        if "param_dtype" not in str(exc) or "weights=None" not in str(exc):
            fail(f"float64 refused without advice: {exc}")
    try:
        compress_fsdp(shard(make_model()), "int8", weights="fp8")
        fail("an unknown weights codec was accepted")
    except ConfigError as exc:
        if "int8" not in str(exc):
            fail(f"unknown weights codec refused without the known ones: {exc}")


CHECKS = {"gathers": check_gathers, "overlap": check_overlap, "resume": check_resume,
          "refusals": check_refusals}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--dir", default=".")
    args = ap.parse_args()
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
