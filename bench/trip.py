"""Which gradcomm files one DDP bucket visits, hook -> wire -> back (issue 11's "trip").

Run on 2 gloo ranks; every rank prints ``RESULT {json}``: the distinct files entered
(profiled on the backward pass of the third step, worker thread included) and the order.

    python bench/trip.py               # int8; CODEC=topk python bench/trip.py
"""
import json, os, sys, threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "RANK" not in os.environ:                       # start the two ranks
    from tests._launch import torchrun
    run = torchrun(__file__, 2, timeout=120)
    for r in run.results():
        print(f"rank {r['rank']}: {r['n']} files: {', '.join(r['files'])}")
    print("order (rank 0): " + " > ".join(run.results()[0]["seq"]))
    sys.exit(0)
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
from gradcomm.integrations.ddp import make_comm_hook
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
model = DDP(net, bucket_cap_mb=25)
seq = []
on = [False]
def prof(frame, event, arg):
    if on[0] and event == "call":
        f = frame.f_code.co_filename
        if "/gradcomm/" in f and "/bench/" not in f:
            rel = f.split("/gradcomm/", 1)[1]
            if not seq or seq[-1] != rel:
                seq.append(rel)
threading.setprofile(prof)
state, hook = make_comm_hook(os.environ.get("CODEC", "int8"), model=model)
def wrapped(st, bucket):
    return hook(st, bucket)
model.register_comm_hook(state, wrapped)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(8, 64); y = torch.randint(0, 4, (8,))
    if step == 2:
        on[0] = True; sys.setprofile(prof)
    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward()
    on[0] = False; sys.setprofile(None)
    opt.step()
files = sorted(set(seq))
print("RESULT " + json.dumps({"rank": dist.get_rank(), "files": files, "n": len(files), "seq": seq[:400]}), flush=True)
state.close()
dist.barrier(); dist.destroy_process_group()
