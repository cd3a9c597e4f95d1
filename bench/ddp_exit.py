"""How often a DDP script exits non-zero: with the gradcomm hook vs DDP's own allreduce.

Each run is a real ``torchrun`` (``python -m torch.distributed.run``; ``--spawn``:
``torch.multiprocessing.spawn`` from one parent) of 2 gloo ranks training a small model a
few steps, written as a user's script is: no barrier before teardown, no ``os._exit``,
``dist.destroy_process_group()`` at the end and nothing else (the hook's state is not
closed by hand). The variants alternate run by run; every run's exit status (any rank, or
the launcher) is printed, then the counts of non-zero ones.

    python bench/ddp_exit.py --runs 20        # 20 runs of each variant, interleaved
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("hook", "builtin")


def worker(variant: str) -> None:
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
                bucket_cap_mb=0.005)
    if variant == "hook":
        from gradcomm.integrations.ddp import make_comm_hook

        state, hook = make_comm_hook("topk", ratio=0.1, model=model)
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "variant": variant}), flush=True)
    dist.destroy_process_group()


def _spawned(rank: int, variant: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(variant)


def spawn(variant: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(variant, port), nprocs=2)


def launch(variant: str, port: int, timeout: float, spawned: bool = False
           ) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), __file__,
           "--worker", variant]
    if spawned:
        cmd = [sys.executable, __file__, "--spawn-run", variant, "--port", str(port)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -9, "timeout"
    ok = p.stdout.count("RESULT ") == 2
    return (p.returncode if ok or p.returncode else 99), p.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--spawn", action="store_true",
                    help="start the ranks with torch.multiprocessing.spawn")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--spawn-run", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.spawn_run:
        spawn(args.spawn_run, args.port)
        return
    from tests._launch import free_port

    bad = {v: 0 for v in VARIANTS}
    codes: dict[str, list[int]] = {v: [] for v in VARIANTS}
    began = time.time()
    for i in range(args.runs):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            rc, err = launch(v, free_port(), args.timeout, args.spawn)
            codes[v].append(rc)
            bad[v] += rc != 0
            tail = f": {err.strip().splitlines()[-1:]}" if rc else ""
            print(f"# run {i} {v}: exit {rc}{tail}", flush=True)
    load = os.getloadavg()[0]
    print(json.dumps({"runs": args.runs, "launcher": "spawn" if args.spawn else "torchrun",
                      "nonzero": bad, "codes": codes,
                      "seconds": round(time.time() - began), "load": round(load, 2)}))


if __name__ == "__main__":
    main()
