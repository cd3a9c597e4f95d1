"""``bench/train.py --fsdp``: the same training with FSDP2 (``fully_shard``) instead of DDP.

Variants (the ``--fsdp`` default: :data:`FSDP_VARIANTS`):

* ``fsdp`` — FSDP2's own reduce-scatter in float32: the reference;
* ``fsdp-bf16`` — FSDP2's own, ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``;
* ``fsdp-gc-<codec>[:opt=v;...]`` — ``gradcomm.integrations.fsdp.compress_fsdp(model,
  codec, **opts)`` (``ef=0``: no error feedback; ``alg=ring``: the ring route;
  ``weights=int8``: the quantized weight all-gather too; ``agsync=1`` / ``agsync=0``:
  that gather's exchange always inside FSDP2's call / always on its worker thread; by
  default where FSDP2 can compute before it waits).

Every hidden layer and the root are ``fully_shard``-ed on a 1-D CPU mesh (gloo) with
``reshard_after_forward=False``, so each step moves one all-gather of the parameters
(forward) and one reduce-scatter of the gradients; only the reduce-scatter is compressed.
Timed like the DDP variants (slowest rank, NIC counter, interleaved repeats); accuracy and
loss are computed on the full parameters (gathered after training), and ``same`` says
whether every rank's gathered parameters are bitwise equal.

Example:
    >>> v = parse_fsdp_variant("fsdp-gc-int8:bits=4")
    >>> v["kind"], v["codec"], v["options"]
    ('fsdp-gc', 'int8', {'bits': 4})
"""

from __future__ import annotations

import statistics
from typing import Any

from _train_common import make_model, parse_options, report, run_steps

FSDP_VARIANTS = "fsdp,fsdp-bf16,fsdp-gc-int8,fsdp-gc-fp16,fsdp-gc-int8:alg=ring"
FSDP_REPORT = "fsdp-gc-int8"


def parse_fsdp_variant(text: str) -> dict[str, Any]:
    """``"fsdp-gc-topk:ratio=0.01;ef=0"`` -> its kind, codec and options."""
    name, options = parse_options(text)
    v: dict[str, Any] = {"label": text, "options": options}
    if name in ("fsdp", "fsdp-bf16"):
        if options:
            raise ValueError(f"variant {name!r} takes no options")
        v["kind"] = name
    elif name.startswith("fsdp-gc-"):
        v["kind"], v["codec"] = "fsdp-gc", name[len("fsdp-gc-"):]
        v["ef"] = bool(options.pop("ef", 1))
        v["algorithm"] = str(options.pop("alg", "auto"))
        sync = options.pop("agsync", None)
        v["gather_overlap"] = None if sync is None else not bool(sync)
    else:
        raise ValueError(f"unknown FSDP variant {name!r}: fsdp, fsdp-bf16 or fsdp-gc-<codec>")
    return v


def train_fsdp_variant(v: dict[str, Any], args: Any, data: Any, rank: int, world: int
                       ) -> dict[str, Any]:
    """One FSDP2 training of variant ``v``; the row ``bench/train.py`` reports."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(args.width, args.depth, args.seed)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if v["kind"] == "fsdp-bf16" \
        else MixedPrecisionPolicy()
    for layer in list(model)[:-1]:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    state = None
    if v["kind"] == "fsdp-gc":
        from gradcomm.integrations.fsdp import compress_fsdp

        codec = None if v["codec"] == "none" else v["codec"]
        kw = dict(v["options"])
        state = compress_fsdp(model, codec, error_feedback=v["ef"], algorithm=v["algorithm"],
                              seed=args.seed, **kw)
        for gather in state.gathers.values():
            gather.overlap = v["gather_overlap"]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    times, start_bytes, end_bytes = run_steps(model, opt, lossf, data, args, rank, world)
    full = {k: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
            for k, t in model.state_dict().items()}
    plain = make_model(args.width, args.depth, args.seed)
    plain.load_state_dict(full)
    return report(v, args, plain, lossf, data, world, times, start_bytes, end_bytes,
                  None if state is None else state.bytes_sent)


def summarize_fsdp(rows: list[dict[str, Any]], report_variant: str = FSDP_REPORT
                   ) -> dict[str, Any]:
    """Speed-ups of every row vs ``fsdp`` (fp32) and ``fsdp-bf16``, paired by repeat for
    the variant named in advance; issue 15's targets: >= 2.5x vs fp32 and >= 1.3x vs
    bf16 within 1 accuracy point of fp32."""
    by = {r["variant"]: r for r in rows}
    ref, bf16 = by.get("fsdp"), by.get("fsdp-bf16")
    for r in rows:
        if ref is not None:
            r["acc_gap_pts"] = 100 * (r["test_acc"] - ref["test_acc"])
            r["speedup_vs_ddp"] = ref["step_s_mean"] / r["step_s_mean"]      # vs fp32
        if bf16 is not None:
            r["speedup_vs_torch_fp16"] = bf16["step_s_mean"] / r["step_s_mean"]  # vs bf16
    named = by.get(report_variant)
    out: dict[str, Any] = {"variant": report_variant, "columns": "'vs fp16' = vs fsdp-bf16, "
                           "'vs ddp' = vs fsdp (fp32)"}
    if named is None or ref is None or bf16 is None:
        out["variant"] += " (not measured with both references)"
        return out

    def paired(base: dict[str, Any]) -> list[float]:
        return [b / v for b, v in zip(base.get("step_s_runs", [base["step_s_mean"]]),
                                      named.get("step_s_runs", [named["step_s_mean"]]))]

    vs32, vs16 = paired(ref), paired(bf16)
    out.update(speedup_vs_fp32=statistics.fmean(vs32), speedup_vs_bf16=statistics.fmean(vs16),
               runs_vs_fp32=[round(x, 3) for x in vs32],
               runs_vs_bf16=[round(x, 3) for x in vs16], acc_gap_pts=named["acc_gap_pts"])
    out["targets_met"] = (out["speedup_vs_fp32"] >= 2.5 and out["speedup_vs_bf16"] >= 1.3
                          and named["acc_gap_pts"] >= -1.0)
    return out


__all__ = ["FSDP_REPORT", "FSDP_VARIANTS", "parse_fsdp_variant", "summarize_fsdp",
           "train_fsdp_variant"]
