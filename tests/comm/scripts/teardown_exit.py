"""A gloo script whose DDP model outlives ``end_process_group`` and becomes garbage in a
reference cycle only when ``main`` returns: the threads left at exit, after gradcomm's
exit handlers, are printed (``AT_EXIT {json}``). Run by
tests/comm/test_torch_teardown.py under torchrun's variables:

    python tests/comm/scripts/teardown_exit.py
"""

from __future__ import annotations

import atexit
import gc
import json
import os

from tests._launch import gloo_threads


def _at_exit() -> None:
    # registered before gradcomm's handlers, so it runs after them
    print("AT_EXIT " + json.dumps({"rank": int(os.environ["RANK"]), "threads": gloo_threads()}),
          flush=True)


def main() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomm
    from gradcomm.integrations.ddp.lifecycle import end_process_group

    dist.init_process_group("gloo")
    gc.disable()                    # no automatic collection before exit: only gradcomm's
    model = DDP(torch.nn.Linear(4, 4))
    trainer: list = [model]
    trainer.append(trainer)         # the model is freed by the garbage collector only
    total = gradcomm.allreduce(np.arange(3.0))
    before = gloo_threads()
    rank = dist.get_rank()
    end_process_group()             # the model still holds the group here
    print("RESULT " + json.dumps({"rank": rank, "total": total.tolist(),
                                  "before": before, "after": gloo_threads()}), flush=True)


if __name__ == "__main__":
    atexit.register(_at_exit)
    main()
