"""Train a small classifier with PyTorch FSDP2 (``fully_shard``) and a compressed
reduce-scatter from gradcomm.

The data ship with scikit-learn (8x8 handwritten digits, no download). Each rank trains
on its own shard of the data; every block's gradients leave through gradcomm's
reduce-scatter (``compress_fsdp``), with error feedback per parameter.

    torchrun --nproc_per_node 2 examples/fsdp_train.py --compressor int8
    torchrun --nproc_per_node 2 examples/fsdp_train.py --compressor topk --ratio 0.05
    torchrun --nproc_per_node 2 examples/fsdp_train.py --compressor none     # FSDP2's own
    torchrun --nproc_per_node 2 examples/fsdp_train.py --reduce-dtype bfloat16 \\
        --compressor int8 --checkpoint /tmp/fsdp_ef.pt          # saves, then resumes

Prints, per epoch, the training loss (mean over ranks), test accuracy and the bytes the
compressed reduce-scatters sent (all ranks); the last line is ``RESULT {json}``. With
``--checkpoint`` the error-feedback state is saved after the first half of the epochs
(``torch.save`` on rank 0) and loaded back before the second half.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradcomm.error_feedback import torch_safe_globals
from gradcomm.integrations.ddp.lifecycle import wait_released
from gradcomm.integrations.fsdp import compress_fsdp

from _data import load_data  # examples/_data.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressor", default="int8",
                    help="codec name (none = FSDP2's own reduce-scatter, fp16, bf16, int8, "
                         "qsgd, terngrad, topk, randomk, onebit)")
    ap.add_argument("--ratio", type=float, help="kept fraction for topk / randomk")
    ap.add_argument("--algorithm", default="auto", choices=["auto", "alltoall", "ring"])
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--weights", choices=["int8"], default=None,
                    help="also quantize the parameter all-gather (prototype, float32 CPU)")
    ap.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="save the error-feedback state here mid-run and "
                                         "resume from it")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    xtr, ytr = xtr[rank::world], ytr[rank::world]           # this rank's shard

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, args.reduce_dtype))
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    options = {} if args.ratio is None else {"ratio": args.ratio}
    compressor = None if args.compressor == "none" else args.compressor
    state = compress_fsdp(model, compressor, algorithm=args.algorithm,
                          error_feedback=not args.no_error_feedback, seed=args.seed,
                          weights=args.weights, **options)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    steps = len(ytr) // args.batch_size
    began = time.perf_counter()
    accuracy, total = 0.0, torch.zeros(2)
    for epoch in range(args.epochs):
        if args.checkpoint and epoch == args.epochs // 2:
            sd = state.state_dict()                           # collective: every rank
            if rank == 0:
                torch.save(sd, args.checkpoint)
            dist.barrier()
            with torch.serialization.safe_globals(torch_safe_globals()):
                state.load_state_dict(torch.load(args.checkpoint, weights_only=True))
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch * 10 + rank)
        order = torch.randperm(len(ytr), generator=g)
        total = torch.zeros(2)
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)
        with torch.no_grad():
            accuracy = (model(xte).argmax(1) == yte).float().mean().item()
        sent = torch.tensor(float(state.bytes_sent))
        dist.all_reduce(sent)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}  test accuracy "
                  f"{accuracy:.3f}  reduce-scatters sent {sent / 1e6:.3f} MB (all ranks)  "
                  f"[{time.perf_counter() - began:.1f} s]", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world, "compressor": args.compressor, "algorithm": args.algorithm,
            "reduce_dtype": args.reduce_dtype, "loss": float(total[0] / total[1]),
            "accuracy": accuracy, "bytes_sent": int(sent),
            "seconds": round(time.perf_counter() - began, 2)}), flush=True)
    dist.barrier()              # nobody tears gloo down while a peer still uses it
    wait_released(total, sent)  # gloo lets go of the last collectives' tensors first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
