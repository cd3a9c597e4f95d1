"""Which gradcomm files one DDP bucket visits, hook -> wire -> back (issue 11's "trip").

Run on 2 gloo ranks. For each configuration ``codec[:algorithm[:option=value...]]``
(default ``int8:auto``; options go to ``make_comm_hook``, values read as JSON:
``int8:auto:guard=false``) a fresh model trains four steps with the gradcomm hook; the
backward pass of the fourth is profiled (``sys.setprofile`` / ``threading.setprofile``:
the hook's worker thread too). The fourth is the steady state: DDP rebuilds its buckets
after the first step, the hook folds the first layout's hop residuals into the
parameters' at the end of the second, so the third lays the residual buffer out anew.
Every rank prints ``RESULT {json}`` with, per configuration:

- ``files``: the distinct gradcomm files whose functions were entered (``n``);
- ``data``: those whose functions received the bucket's data: an argument that is an
  array (numpy, torch), bytes or a codec Payload, or a list/tuple of them (``n_data``);
  the other files only decided something (sizes, seeds, routes);
- ``climbs``: calls into ``gradcomm/integrations/`` made while a function of a lower
  floor (anything in gradcomm outside integrations/) was on the stack, i.e. the
  collective calling back into the hook (``where``: the first few, callee < caller);
- ``spine``: the distinct gradcomm files on the call stack at the moments the transport is
  entered (a call into ``comm/`` from outside it: every send, receive and wait), united
  over the trip (``n_spine``; ``spine_max``: the most on one such stack). The others are
  leaf helpers, visited and left (arrays, kernels, payload format, seeds);
- ``entries``: per bucket (the hook's calls), how often ``arrays/``, ``error_feedback/``
  and ``integrations/ddp/residuals.py`` were entered from outside themselves
  (``arrays_from``: the callers of ``arrays/``, ``file:function``, with their counts);
- ``seq``: the order of files entered (first 400 changes).

The model is ``layers`` linear layers (a ``layers=N`` option, default 2: four
parameters); the entries per bucket must not grow with it.

    python bench/trip.py                      # int8, algorithm="auto"
    python bench/trip.py int8:auto topk:ring  # several in one launch
    python bench/trip.py int8:auto:guard=false   # without the divergence guard's check
    python bench/trip.py int8:auto:layers=8      # a model of 16 parameters
"""
import json, os, sys, threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = [a for a in sys.argv[1:] if not a.startswith("-")] or ["int8:auto"]
if "RANK" not in os.environ:                       # start the two ranks
    from tests._launch import torchrun
    run = torchrun(__file__, 2, *CONFIGS, timeout=120)
    for r in run.results():
        for cfg, res in r["trips"].items():
            print(f"rank {r['rank']} {cfg}: {res['n']} files, {res['n_data']} on the data "
                  f"path, {len(res['climbs'])} climbs back into integrations/; spine "
                  f"{res['n_spine']} (most on one stack {res['spine_max']}); entries per "
                  f"bucket: " + ", ".join(f"{k} {v:g}" for k, v in res["entries"].items()))
            print(f"  files: {', '.join(res['files'])}")
            print(f"  spine: {', '.join(res['spine'])}")
            print("  arrays/ entered from: " + ", ".join(
                f"{k} {v}" for k, v in res["arrays_from"].items()))
            print(f"  data path: {', '.join(res['data'])}")
            for c in res["climbs"][:5]:
                print(f"  climb: {c}")
    for cfg, res in run.results()[0]["trips"].items():
        print(f"order (rank 0, {cfg}): " + " > ".join(res["seq"]))
    sys.exit(0)
import numpy as np
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
from gradcomm.compressors.payload import Payload
from gradcomm.integrations.ddp import make_comm_hook

DATA = (np.ndarray, torch.Tensor, bytes, bytearray, memoryview, Payload)
ON = [False]
LOG: dict = {}
#: the rooms whose entries per bucket are counted (a prefix of the file's path)
ROOMS = ("arrays/", "error_feedback/", "integrations/ddp/residuals.py")


def _rel(filename: str) -> str | None:
    if "/gradcomm/" not in filename:
        return None
    rel = filename.split("/gradcomm/", 1)[1]
    return None if rel.startswith("bench/") else rel


def _is_data(v) -> bool:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return isinstance(v, DATA)


def _takes_data(frame) -> bool:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount + (1 if code.co_flags & 0x04 else 0)
    args = frame.f_locals
    return any(_is_data(args.get(name)) for name in code.co_varnames[:n])


def prof(frame, event, arg):
    if not ON[0] or event != "call":
        return
    rel = _rel(frame.f_code.co_filename)
    if rel is None:
        return
    seq = LOG["seq"]
    if not seq or seq[-1] != rel:
        seq.append(rel)
    LOG["files"].add(rel)
    if _takes_data(frame):
        LOG["data"].add(rel)
    caller = _caller(frame)
    for room in ROOMS:
        if rel.startswith(room) and not (caller or "").startswith(room):
            LOG["entries"][room] += 1
            if room == "arrays/":
                where = f"{caller}:{frame.f_back.f_code.co_name}"
                LOG["arrays_from"][where] = LOG["arrays_from"].get(where, 0) + 1
    if rel == "integrations/ddp/hook.py" and frame.f_code.co_name == "comm_hook":
        LOG["buckets"] += 1
    if rel.startswith("comm/") and not (caller or "").startswith("comm/"):
        stack, f = set(), frame
        while f is not None:
            up = _rel(f.f_code.co_filename)
            if up is not None:
                stack.add(up)
            f = f.f_back
        LOG["spine"] |= stack
        LOG["spine_max"] = max(LOG["spine_max"], len(stack))
    if rel.startswith("integrations/"):
        f = frame.f_back
        while f is not None:
            up = _rel(f.f_code.co_filename)
            if up is not None and not up.startswith("integrations/"):
                LOG["climbs"].append(f"{rel}:{frame.f_code.co_name} < "
                                     f"{up}:{f.f_code.co_name}")
                break
            f = f.f_back


def _caller(frame) -> str | None:
    """The file of the nearest gradcomm function that called ``frame``'s, or None."""
    f = frame.f_back
    while f is not None:
        up = _rel(f.f_code.co_filename)
        if up is not None:
            return up
        f = f.f_back
    return None


threading.setprofile(prof)


def _value(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def trip(cfg: str) -> dict:
    codec, algorithm, *opts = cfg.split(":") + [""]
    options = {k: _value(v) for k, _, v in (o.partition("=") for o in opts if o)}
    layers = int(options.pop("layers", 2))
    torch.manual_seed(0)
    hidden = [m for _ in range(layers - 1) for m in (nn.Linear(64, 64), nn.ReLU())]
    net = nn.Sequential(*hidden, nn.Linear(64, 4))
    model = DDP(net, bucket_cap_mb=25)
    # the bucket compressed from the first step (not after start_iter="auto"'s dense warm-up)
    state, hook = make_comm_hook(None if codec == "none" else codec,
                                 algorithm=algorithm or "auto", model=model,
                                 **{"start_iter": 0, **options})
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LOG.update(seq=[], files=set(), data=set(), climbs=[], spine=set(), spine_max=0,
               entries=dict.fromkeys(ROOMS, 0), arrays_from={}, buckets=0)
    with state:
        for step in range(4):
            x = torch.randn(8, 64)
            y = torch.randint(0, 4, (8,))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 3:
                ON[0] = True
                sys.setprofile(prof)
            loss.backward()
            ON[0] = False
            sys.setprofile(None)
            opt.step()
    files, data, spine = sorted(LOG["files"]), sorted(LOG["data"]), sorted(LOG["spine"])
    buckets = max(LOG["buckets"], 1)
    return {"files": files, "n": len(files), "data": data, "n_data": len(data),
            "climbs": LOG["climbs"], "spine": spine, "n_spine": len(spine),
            "spine_max": LOG["spine_max"], "buckets": LOG["buckets"],
            "entries": {k: v / buckets for k, v in LOG["entries"].items()},
            "arrays_from": dict(sorted(LOG["arrays_from"].items())),
            "seq": LOG["seq"][:400]}


trips = {cfg: trip(cfg) for cfg in CONFIGS}
print("RESULT " + json.dumps({"rank": dist.get_rank(), "trips": trips}), flush=True)
from gradcomm.integrations.ddp.lifecycle import end_process_group  # noqa: E402
end_process_group()
