"""How much of the hook's communication hides behind backward compute.

    torchrun --nproc_per_node 2 tests/integrations/scripts/ddp_overlap.py [--compressor topk]
    mpirun -n 2 python tests/integrations/scripts/ddp_overlap.py --port 29600   # MPI transport

Times one backward pass (median of ``--iters``) of an MLP of ``--layers`` x
Linear(``--width``) in three modes on the same buckets:

- ``local``: a hook that returns each bucket at once (no communication): the compute;
- ``blocking``: gradcomm's hook, waited for inside the hook on the autograd thread, so
  each bucket's reduction stalls backward (what a synchronous hook costs);
- ``overlapped``: gradcomm's hook as shipped (worker thread, futures completed off the
  autograd thread).

``hidden = (blocking - overlapped) / comm`` is the fraction of the communication time
(``state.stats['comm_seconds']`` per iteration) that overlapped with compute. Needs idle
cores: on a machine shared with other jobs the numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomm.integrations.ddp import comm_hook, make_comm_hook


def local_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def blocking_hook(state, bucket):
    fut = comm_hook(state, bucket)
    fut.wait()                    # on the autograd thread, NOT in a .then callback
    return fut


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compressor", default="none")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--port", type=int, default=29600, help="gloo port under mpirun")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transport = None
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(args.port)
        dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
        transport = "mpi"
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    x = torch.randn(args.batch, args.width)
    compressor = None if args.compressor == "none" else args.compressor
    # compressed from the first step (not after start_iter="auto"'s dense warm-up)
    options = {"ratio": 0.01, "start_iter": 0} if compressor in ("topk", "randomk") else {}
    out = {}
    for mode, hook in (("local", local_hook), ("blocking", blocking_hook),
                       ("overlapped", comm_hook)):
        model = DDP(nn.Sequential(*layers), bucket_cap_mb=args.bucket_cap_mb)
        state, _ = make_comm_hook(compressor, algorithm=args.algorithm, transport=transport,
                                  model=model, **options)
        model.register_comm_hook(state, hook)
        times = []
        for it in range(args.iters + 2):               # 2 warm-up (bucket rebuild)
            loss = model(x).square().mean()
            dist.barrier()
            t0 = time.perf_counter()
            loss.backward()
            if it >= 2:
                times.append(time.perf_counter() - t0)
            if it == 1:
                state.stats["comm_seconds"] = 0.0
        out[mode] = statistics.median(times)
        if mode != "local":
            out[f"comm_{mode}"] = state.stats["comm_seconds"] / args.iters
        state.close()
    comm = out["comm_overlapped"]
    hidden = (out["blocking"] - out["overlapped"]) / comm if comm > 0 else 0.0
    res = {"rank": dist.get_rank(), "ranks": dist.get_world_size(),
           "transport": transport or "torch", "compressor": args.compressor,
           "algorithm": args.algorithm,
           "backward_ms": {k: round(v * 1e3, 2) for k, v in out.items()},
           "hidden_fraction": round(hidden, 3)}
    if dist.get_rank() == 0:
        b = res["backward_ms"]
        print(f"backward: compute only {b['local']} ms, blocking hook {b['blocking']} ms, "
              f"overlapped hook {b['overlapped']} ms; communication {b['comm_overlapped']} "
              f"ms/iter, of which {hidden:.0%} hidden behind compute", flush=True)
    print("RESULT " + json.dumps(res), flush=True)
    from gradcomm.integrations.ddp.lifecycle import end_process_group

    end_process_group()


if __name__ == "__main__":
    main()
