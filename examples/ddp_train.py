"""Train a small classifier with PyTorch DDP and a gradcomm communication hook.

The data ship with scikit-learn (8x8 handwritten digits, no download). Each rank trains
on its own shard; the hook compresses the gradients on their way through the allreduce.

    torchrun --nproc_per_node 2 examples/ddp_train.py --compressor topk --ratio 0.01
    mpirun -n 2 python examples/ddp_train.py --compressor onebit --algorithm allgather
    python examples/ddp_train.py                      # one process, no compression
    torchrun --nproc_per_node 2 examples/ddp_train.py --device cuda --compressor int8
    torchrun --nproc_per_node 2 examples/ddp_train.py --optimizer adamw --compressor onebit

Under mpirun the hook talks MPI (``transport="mpi"``; microseconds per message) and
torch.distributed (which DDP itself needs) is initialised from Open MPI's variables.
``--device cuda`` trains on the GPUs (one per rank) over an NCCL process group: the codecs
run on the GPU and the hook sends its payloads over a gloo group it makes itself.
``--optimizer adamw`` keeps AdamW: the hook finds it and, for topk, randomk, onebit and
terngrad, takes its Adam route (dense steps first, then 1-bit Adam's compressed momentum
at ``opt.step()``). Prints, per epoch, the training loss (mean over ranks), test accuracy and the bytes the
hook sent (all ranks); the last line is ``RESULT {json}`` with the final numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomm.integrations.ddp import make_comm_hook
from gradcomm.integrations.ddp.lifecycle import wait_released

from _data import load_data  # examples/_data.py


def setup(backend: str = "gloo") -> str:
    """Initialise torch.distributed (``backend``) for torchrun, mpirun or a plain single
    process; return the transport the hook should use ("torch" or "mpi")."""
    if backend == "nccl":                                     # one GPU per rank
        local = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        torch.cuda.set_device(int(local) % torch.cuda.device_count())
    if "RANK" in os.environ:                                  # torchrun
        dist.init_process_group(backend)
        return "torch"
    if "OMPI_COMM_WORLD_SIZE" in os.environ:                  # mpirun
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        port = 0
        if comm.Get_rank() == 0:
            import socket

            with socket.socket() as s:                        # a free port for gloo
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(backend, rank=comm.Get_rank(), world_size=comm.Get_size())
        return "mpi"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return "torch"


def parse_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressor", default="none",
                    help="codec name (none, fp16, bf16, int8, qsgd, terngrad, topk, randomk, "
                         "onebit, ...)")
    ap.add_argument("--ratio", type=float, help="kept fraction for topk / randomk")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="any other codec option, e.g. --option bits=4")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--start-iter", type=int, default=None,
                    help="uncompressed warm-up steps (default: 0 with SGD; with AdamW the "
                    "hook's own, 100 dense Adam steps on the Adam route)")
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--transport", choices=["auto", "torch", "mpi"], default="auto")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="default 0.1 (SGD), 1e-3 (AdamW)")
    ap.add_argument("--bucket-cap-mb", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU per rank, NCCL for DDP, codecs on the GPU")
    args = ap.parse_args()

    torch.set_num_threads(1)
    launched_by = setup("nccl" if args.device == "cuda" else "gloo")
    transport = launched_by if args.transport == "auto" else args.transport
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    xtr, ytr = xtr[rank::world].to(device), ytr[rank::world].to(device)   # this rank's shard
    xte, yte = xte.to(device), yte.to(device)

    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device),
                bucket_cap_mb=args.bucket_cap_mb)
    if args.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), momentum=0.9,
                                                     lr=0.1 if args.lr is None else args.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if args.lr is None else args.lr)
    start = {} if args.start_iter is None and args.optimizer == "adamw" else \
        {"start_iter": args.start_iter or 0}
    options = parse_options(args.option)
    if args.ratio is not None:
        options["ratio"] = args.ratio
    compressor = None if args.compressor == "none" else args.compressor
    state, hook = make_comm_hook(compressor, algorithm=args.algorithm,
                                 error_feedback=not args.no_error_feedback,
                                 transport=transport, model=model, **start, **options)
    model.register_comm_hook(state, hook)
    loss_fn = nn.CrossEntropyLoss()

    steps = len(ytr) // args.batch_size                       # equal on every rank here
    steps = torch.tensor(steps, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    began = time.perf_counter()
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch * 10 + rank)
        order = torch.randperm(len(ytr), generator=g).to(device)
        total = torch.zeros(2, device=device)
        for i in range(int(steps)):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0], device=device)
        dist.all_reduce(total)
        with torch.no_grad():
            accuracy = (model(xte).argmax(1) == yte).float().mean().item()
        sent = torch.tensor(float(state.stats["bytes_sent"]), device=device)
        dist.all_reduce(sent)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}  test accuracy "
                  f"{accuracy:.3f}  hook sent {sent / 1e6:.2f} MB (all ranks)  "
                  f"[{time.perf_counter() - began:.1f} s]", flush=True)
    native = torch.tensor(float(state.stats["native_nbytes"]), device=device)
    dist.all_reduce(native)
    if rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world, "transport": state.transport.name, "compressor": args.compressor,
            "algorithm": args.algorithm, "loss": float(total[0] / total[1]),
            "accuracy": accuracy, "bytes_sent": int(sent), "native_nbytes": int(native),
            "device": args.device, "optimizer": args.optimizer,
            "adam_route": state.adam.route is not None,
            "seconds": round(time.perf_counter() - began, 2)}), flush=True)
    wait_released(total, sent, native)  # gloo lets go of the last collectives' tensors
    dist.destroy_process_group()     # also closes the hook's state (state.close())


if __name__ == "__main__":
    main()
