"""How often a DDP script exits non-zero: with the gradcomm hook vs DDP's own allreduce.

Each run is a real ``torchrun`` (``python -m torch.distributed.run``) of 2 gloo ranks
training a small model a few steps, written as a user's script is: no barrier before
teardown, no ``os._exit``, ``dist.destroy_process_group()`` at the end and nothing else
(the hook's state is not closed by hand). The variants alternate run by run; the counts
of runs with a non-zero exit status (any rank, or the launcher) are printed.

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


def launch(variant: str, port: int, timeout: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), __file__,
           "--worker", variant]
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
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from tests._launch import free_port

    bad = {v: 0 for v in VARIANTS}
    codes: dict[str, list[int]] = {v: [] for v in VARIANTS}
    began = time.time()
    for i in range(args.runs):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            rc, err = launch(v, free_port(), args.timeout)
            codes[v].append(rc)
            if rc:
                bad[v] += 1
                print(f"# run {i} {v}: exit {rc}: {err.strip().splitlines()[-1:]}",
                      flush=True)
    load = os.getloadavg()[0]
    print(json.dumps({"runs": args.runs, "nonzero": bad, "codes": codes,
                      "seconds": round(time.time() - began), "load": round(load, 2)}))


if __name__ == "__main__":
    main()
