"""Same bytes: hashes of every route's output, recorded before a refactor, checked after.

One digest per case: algorithm x codec x op x dtype x count on p = 2..8 ranks, on each wire
(in-process threads, ``mpirun``, gloo processes), plus ``Allreduce`` with error feedback
over three steps (outputs and checkpointed residuals), ``wrap(comm).Allreduce`` under
mpirun, the DDP hook's parameters and state after four steps (gloo, p = 2..4), and every
codec's serialized payloads. A case the library refuses is recorded as its error's class,
so a refusal that changes is a difference too. Every rank must hold the same bytes; the
digest is that rank-0 result's blake2b.

    python bench/golden.py record                  # writes bench/golden/hashes.json
    python bench/golden.py check                   # recompute, print differences, exit 1
    python bench/golden.py check --wires threads   # only the fast part
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILE = ROOT / "bench" / "golden" / "hashes.json"
ALGORITHMS = ("ring", "tree", "recursive_doubling", "rabenseifner", "native", "auto",
              "allgather", "sparse_allgather")
CODECS: dict[str, dict[str, Any]] = {
    "none": {}, "fp16": {}, "bf16": {}, "int8": {}, "qsgd": {}, "terngrad": {},
    "topk": {"ratio": 0.05}, "randomk": {"ratio": 0.05}, "onebit": {},
    "powersgd": {"rank": 2}}
DENSE_DTYPES = ("float32", "float64", "float16", "int32")
PS = tuple(range(2, 9))
#: a label ending so holds this rank's own bytes (residuals): kept per rank, not compared
LOCAL = "@local"
DDP_PS = (2, 3, 4)
#: digests with this in their label hang on the BLAS kernel numpy selects for the CPU
#: (PowerSGD's matmuls and QR round differently per kernel): they are compared only where
#: the group was recorded on the same machine(); the exact replay holds them everywhere
BLAS_BOUND = "powersgd"
#: groups whose every digest hangs on the CPU: the DDP hook's runs train a torch model, and
#: torch's CPU kernels round differently per CPU (on an AMD EPYC family 26, 909983b gave
#: other bytes than the record from an Intel Xeon in 19 of ddp/2's 20 shared labels)
CPU_BOUND_GROUPS = ("ddp/",)
#: the file's entry naming, per group, the machine() it was recorded on
MACHINE = "_machine"


#: OpenBLAS's thread-count getter under the names its builds export
_GET_THREADS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                "openblas_get_num_threads64_", "openblas_get_num_threads")


def blas_threads(group: str = "threads") -> str:
    """The BLAS threads ``group``'s PowerSGD ran with (OpenBLAS splits its products by
    thread count, so the count changes bits): in this process for ``threads/*`` and
    ``payloads`` (what each loaded OpenBLAS says), else what the launched ranks get
    (``tests._launch`` sets ``OMP_NUM_THREADS=1``; ``OPENBLAS_NUM_THREADS`` overrides)."""
    if group.startswith("threads") or group == "payloads":
        import ctypes

        try:                            # numpy's and (once PowerSGD loaded it) scipy's
            paths = sorted({ln.split()[-1] for ln in Path("/proc/self/maps").read_text()
                            .splitlines() if "openblas" in ln})
        except OSError:
            return "?"
        counts = []
        for path in paths:
            lib = ctypes.CDLL(path)
            get = next((getattr(lib, f) for f in _GET_THREADS if hasattr(lib, f)), None)
            counts.append(str(get()) if get is not None else "?")
        return ",".join(counts) or "?"
    return os.environ.get("OPENBLAS_NUM_THREADS") or "1"    # tests._launch: OMP_NUM_THREADS=1


def machine(group: str = "threads") -> str:
    """What ``group``'s BLAS-bound digests depend on: numpy, its BLAS build and threads,
    and the CPU."""
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    cpu = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", info)
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
        # OpenBLAS picks its kernel from cpuid's family and model, which a VM's generic
        # "AMD EPYC" name hides (two such machines differed in 37 powersgd digests)
        ids = "/".join(m.group(1) if (m := re.search(rf"^{k}\s*:\s*(\S+)", info, re.M))
                       else "?" for k in ("cpu family", "model", "stepping"))
        cpu = (model.group(1) if model else "?") + f" {ids} " + ",".join(
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    except (OSError, AttributeError):
        pass
    return (f"numpy {np.__version__}; {blas.get('name')} {blas.get('version')} "
            f"x{blas_threads(group)}; {cpu}")


def differences(group: str, got: dict[str, str], recorded: dict[str, Any]) -> tuple[list[str], int]:
    """(labels whose digest differs from the record, BLAS- or CPU-bound labels not
    comparable here)."""
    want = recorded[group]
    here = recorded.get(MACHINE, {}).get(group) == machine(group)
    keys = want.keys() | got.keys()
    skip = set() if here else {k for k in keys if BLAS_BOUND in k
                               or group.startswith(CPU_BOUND_GROUPS)}
    return sorted(k for k in keys - skip if want.get(k) != got.get(k)), len(skip)


def digest(*arrays: Any) -> str:
    h = hashlib.blake2b(digest_size=10)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.view(np.uint8).tobytes() if a.size else b"")
    return h.hexdigest()


def _gauss(rank: int, count: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng((20261203, rank, count, salt))
    return rng.standard_normal(count).astype(np.float32)


def _counts(p: int) -> tuple[int, ...]:
    return (0, 1, p - 1, 203, 4099)


def _guard(fn: Callable[[], Any]) -> Any:
    from gradcomm.errors import GradcommError

    try:
        return fn()
    except GradcommError as exc:
        return f"refused:{type(exc).__name__}"


def _np(y: Any) -> Any:
    if isinstance(y, str):
        return y
    if hasattr(y, "detach"):
        import torch

        y = y.detach()
        return (y.view(torch.int16) if y.dtype == torch.bfloat16 else y).numpy()
    return np.asarray(y)


def cases(t: Any, *, large: bool = True) -> Iterator[tuple[str, Any]]:
    """(label, this rank's result) for every case on transport ``t``."""
    import gradcomm
    from gradcomm.bench.data import exact_input

    p, r = t.size, t.rank
    for algo in ALGORITHMS:
        for dtype in DENSE_DTYPES:
            for op in ("sum", "max", "mean"):
                if op == "mean" and dtype == "int32":
                    continue
                for n in _counts(p):
                    x = exact_input(r, n, dtype, op)
                    if dtype.startswith("float"):
                        x = (x + _gauss(r, n).astype(dtype)).astype(dtype)
                    yield (f"dense/{algo}/{dtype}/{op}/{n}",
                           _guard(lambda: gradcomm.allreduce(x, t, op=op, algorithm=algo)))
    counts = _counts(p) + ((300007,) if large else ())
    for name, opts in CODECS.items():
        for algo in ALGORITHMS:
            for op in ("sum", "mean"):
                for n in counts:
                    if n == 300007 and (op == "mean" or algo in ("native", "allgather")):
                        continue
                    x = _gauss(r, n)
                    yield (f"codec/{name}/{algo}/float32/{op}/{n}",
                           _guard(lambda: gradcomm.allreduce(
                               x, t, op=op, algorithm=algo, compressor=name, **opts)))
            x16 = _gauss(r, 203).astype(np.float16)
            yield (f"codec/{name}/{algo}/float16/sum/203",
                   _guard(lambda: gradcomm.allreduce(x16, t, algorithm=algo,
                                                     compressor=name, **opts)))
        x2 = _gauss(r, 24 * 17).reshape(24, 17)
        yield (f"codec/{name}/auto/float32/2d/24x17",
               _guard(lambda: gradcomm.allreduce(x2, t, compressor=name, **opts)))
        for algo in ("auto", "ring", "allgather"):
            yield from _ef(t, name, algo, opts)


def _ef(t: Any, name: str, algo: str, opts: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Allreduce with error feedback: three steps of two keys, then the state."""
    import gradcomm

    def run() -> list[Any]:
        ar = gradcomm.Allreduce(t, compressor=name, algorithm=algo, seed=7, **opts)
        out = []
        for step in range(3):
            for key, shape in (("w", (12, 9)), ("b", (37,))):
                x = _gauss(t.rank, int(np.prod(shape)), 10 + step).reshape(shape)
                out.append(ar(x, key=key))
        sd = ar.state_dict()
        local = [np.asarray(sd[k]) for k in sorted(sd)]
        local.append(np.frombuffer(" ".join(sorted(sd)).encode(), np.uint8))
        return out, local

    res = _guard(run)
    if isinstance(res, str):
        yield f"ef/{name}/{algo}", res
    else:
        yield f"ef/{name}/{algo}", digest(*res[0])
        yield f"ef/{name}/{algo}/state{LOCAL}", digest(*res[1])


def payloads() -> dict[str, str]:
    """Every codec's serialized payload of fixed inputs (float32, float16; flat and 2-d)."""
    from gradcomm import compressors

    out: dict[str, str] = {}
    for name, opts in CODECS.items():
        c = compressors.get(name, **opts)
        for n in (1, 203, 4099):
            for dt in ("float32", "float16"):
                x = _gauss(0, n).astype(dt)
                for seed in (0, (3, 1, 4)):
                    key = f"payload/{name}/{dt}/{n}/{seed}"
                    def enc(x=x, seed=seed) -> Any:  # noqa: E306
                        pl = c.compress(x, seed=seed)
                        return np.asarray(pl.to_bytes())
                    res = _guard(enc)
                    out[key] = res if isinstance(res, str) else digest(res)
    return out


def run_transport(t: Any, large: bool = True) -> dict[str, str]:
    """This rank's digests; raises if ranks hold different bytes."""
    out: dict[str, str] = {}
    for label, y in cases(t, large=large):
        out[label] = y if isinstance(y, str) else digest(_np(y))
    return out


def _agree(per_rank: list[dict[str, str]], where: str) -> dict[str, str]:
    """Rank 0's digests (every rank must hold the same) plus each rank's local ones."""
    shared = [{k: v for k, v in d.items() if not k.endswith(LOCAL)} for d in per_rank]
    first = shared[0]
    for r, d in enumerate(shared[1:], 1):
        bad = [k for k in first if d.get(k) != first[k]]
        if bad or d.keys() != first.keys():
            raise SystemExit(f"{where}: rank {r} holds other bytes than rank 0 in {bad[:8]}")
    out = dict(first)
    for r, d in enumerate(per_rank):
        out.update({f"{k}/r{r}": v for k, v in d.items() if k.endswith(LOCAL)})
    return out


def threads(p: int) -> dict[str, str]:
    from gradcomm.comm import run_ranks

    return _agree(run_ranks(p, run_transport, timeout=1200), f"threads p={p}")


# -- real launchers -----------------------------------------------------------------------
def _worker(wire: str, what: str) -> None:
    """Inside mpirun or a gloo process: print RESULT {json} of this rank's digests."""
    if wire == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    from gradcomm.comm import get_transport

    if what == "ddp":
        res = _ddp()
    else:
        t = get_transport(None, timeout=300)
        res = run_transport(t, large=True)
        if wire == "mpi":
            res.update(_wrap())
    print("RESULT " + json.dumps({"rank": t.rank if what != "ddp" else _rank(),
                                  "digests": res}), flush=True)
    if wire == "gloo":
        from gradcomm.integrations.ddp.lifecycle import end_process_group

        end_process_group()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _wrap() -> dict[str, str]:
    from mpi4py import MPI

    from gradcomm.integrations.mpi import wrap

    out: dict[str, str] = {}
    w = MPI.COMM_WORLD
    for algo in ("ring", "auto", "rabenseifner"):
        for comp, opts in (("none", {}), ("fp16", {}), ("int8", {}), ("topk", {"ratio": .05})):
            c = wrap(w, algorithm=algo, compressor=None if comp == "none" else comp, **opts)
            for n in _counts(w.size):
                x = _gauss(w.rank, n)
                y = np.empty_like(x)
                res = _guard(lambda: c.Allreduce(x, y, op=MPI.SUM))
                out[f"wrap/{algo}/{comp}/{n}"] = res if isinstance(res, str) else digest(y)
    return out


def _ddp() -> dict[str, str]:
    """Four DDP steps per codec with the gradcomm hook (EF on); parameters and state."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomm.integrations.ddp import make_comm_hook

    out: dict[str, str] = {}
    rank = _rank()
    states: list[Any] = []
    for name, opts in CODECS.items():
        for algo in ("auto", "ring"):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 33),
                                nn.ReLU(), nn.Linear(33, 5))
            model = DDP(net, bucket_cap_mb=0.01)
            # top-k and random-k compressed from the first step, as recorded (their
            # start_iter="auto" is 150 dense steps; PowerSGD's four steps were recorded
            # within its dense warm-up)
            first = {"start_iter": 0} if name in ("topk", "randomk") else {}
            state, hook = make_comm_hook(None if name == "none" else name, algorithm=algo,
                                         model=model, seed=5, **first, **opts)
            model.register_comm_hook(state, hook)
            states.append(state)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(100 + rank)
            for _ in range(4):
                x = torch.randn(16, 40, generator=g)
                y = torch.randint(0, 5, (16,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            out[f"ddp/{name}/{algo}"] = digest(*[p.detach().numpy()
                                                  for p in model.parameters()])
            out[f"ddp/{name}/{algo}/state{LOCAL}"] = digest(_flatten_state(state.state_dict()))
    for state in states:
        state.close()
    return out


def _flatten_state(sd: Any) -> np.ndarray:
    """A state_dict's arrays and scalars, in key order, as bytes."""
    parts: list[bytes] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], f"{path}/{k}")
        elif isinstance(v, (list, tuple)):
            for i, e in enumerate(v):
                walk(e, f"{path}/{i}")
        else:
            if hasattr(v, "detach"):
                v = v.detach().numpy()
            if isinstance(v, np.ndarray):
                parts.append(path.encode() + v.tobytes())
            else:
                parts.append(path.encode() + repr(v).encode())
    walk(sd, "")
    return np.frombuffer(b"".join(parts), np.uint8)


def launch(wire: str, p: int, what: str = "cases") -> dict[str, str]:
    from tests._launch import mpirun, torchrun

    args = ("--worker", wire, what)
    if wire == "mpi":
        run = mpirun(__file__, p, *args, timeout=1800)
    else:
        run = torchrun(__file__, p, *args, timeout=1800, grace=60, check=False)
        results = run.results()
        if len(results) != p:
            run.check()
        if any(run.returncodes):
            # every rank reported; torch's gloo teardown sometimes aborts at exit (issue 14)
            print(f"# warning: {wire} {what} p={p}: a rank exited with "
                  f"{run.returncodes} after reporting", file=sys.stderr)
    return _agree([r["digests"] for r in run.results()], f"{wire} {what} p={p}")


def compute(wires: list[str], ps: tuple[int, ...]) -> Iterator[tuple[str, dict[str, str]]]:
    """(group, digests) for the payloads, then every wire x rank count, then the DDP hook."""
    yield "payloads", payloads()
    for wire in wires:
        for p in ps:
            print(f"# {wire} p={p}", file=sys.stderr, flush=True)
            yield f"{wire}/{p}", threads(p) if wire == "threads" else launch(wire, p)
        if wire == "gloo":
            for p in DDP_PS:
                if p in ps:
                    print(f"# ddp p={p}", file=sys.stderr, flush=True)
                    yield f"ddp/{p}", launch("gloo", p, "ddp")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["record", "check"], nargs="?")
    ap.add_argument("--wires", default="threads,mpi,gloo")
    ap.add_argument("--ranks", default=",".join(map(str, PS)))
    ap.add_argument("--file", default=str(FILE))
    ap.add_argument("--worker", nargs=2, metavar=("WIRE", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    wires = [w for w in args.wires.split(",") if w]
    ps = tuple(int(x) for x in args.ranks.split(","))
    path = Path(args.file)
    if args.mode == "record":
        old = json.loads(path.read_text()) if path.exists() else {}
        n = 0
        for group, digests in compute(wires, ps):      # saved group by group
            old[group] = digests
            old.setdefault(MACHINE, {})[group] = machine(group)
            n += len(digests)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(old, indent=0, sort_keys=True) + "\n")
        print(f"recorded {n} digests to {path}")
        return 0
    want = json.loads(path.read_text())
    bad = total = skipped = 0
    for group, digests in compute(wires, ps):
        if group not in want:
            print(f"{group}: not recorded")
            bad += 1
            continue
        differ, skip = differences(group, digests, want)
        total += len(want[group].keys() | digests.keys()) - skip
        skipped += skip
        for k in differ:
            what = "MISSING" if k not in digests else "DIFF"
            if bad < 40:
                print(f"{what} {group} {k}: recorded {want[group].get(k)} now {digests.get(k)}")
            bad += 1
    if skipped:
        print(f"{skipped} {BLAS_BOUND} and ddp digests not compared: recorded on another "
              f"BLAS/CPU (here: {machine()}); tests/bench/test_replay.py holds them to the "
              "replay")
    print(f"{total} digests compared, {bad} differ")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
