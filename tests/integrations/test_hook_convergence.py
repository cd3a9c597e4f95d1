"""Compressed DDP training converges and survives a bad step (issues 13 and 14 item 1).

Real gloo processes (``scripts/converge_checks.py``, several checks per launch). Not
timed: these are about where training ends, not how fast.

* A NaN planted in one rank's batch, the step skipped as AMP's GradScaler would: with the
  divergence guard every later step is finite on every rank, for topk, fp16, randomk,
  int8, onebit and powersgd, every rank counted the same resets; with ``guard=False``
  (the planted fault, run in the same launch) every later step is NaN, so the check can
  fail.
* A small teacher-student task (cross-entropy; uncompressed 0.68 after 120 steps, 1.38
  at the start), SGD with momentum 0.9, lr 0.1, 2 ranks: every codec with the defaults
  of ``make_comm_hook(name)`` (but the dense warm-up, see ``W0``; otherwise nothing
  passed: the hook finds the SGD optimizer at its
  first ``step()`` and turns on momentum correction for topk, randomk and onebit, and
  keeps TernGrad's error feedback) ends within ``TIGHT`` = 0.05 of the uncompressed loss
  (fp16, bf16, int8, qsgd, terngrad, top-k 1 %, powersgd: rank 4 after 50 dense steps,
  0.02 above; rank 1 from the start was 0.09 above; top-k 0.1 % after 100 dense steps
  then its sparsity ramp; its ramp from the first step, 0.01 above: without
  the ramp 0.14 above, after 100 dense steps without it 0.06) or ``LOOSE`` = 0.2
  (onebit: 0.07 above; random-k at the hook's default ratio 0.25, clipped at 1 once
  momentum correction is on: 0.03 above (clipped at 0.5 it was 0.09); at 1 %
  it is 0.64 above and only required not to diverge: it updates each coordinate about
  once per 100 steps, 120 steps cannot train it; see bench/RESULTS.md);
  onebit, randomk and topk without momentum correction (``mc=0``: ``optimizer=None``) do
  not diverge either (random-k 25 % then stays clipped at 0.1: at 1 it ended at 1.54,
  above the initial loss); top-k with error feedback beats top-k without, top-k 0.1 %'s
  ramp beats top-k 0.1 % from the first step, and top-k's
  default (momentum correction found) beats top-k with ``optimizer=None`` (0.67 against
  0.91), TernGrad's (error feedback) beats TernGrad without (0.68 against 0.80).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parent / "scripts" / "converge_checks.py"
#: final loss (cross-entropy on the whole task) at most this above the uncompressed one
TIGHT, LOOSE = 0.05, 0.2
#: the dense warm-up of ``start_iter="auto"`` (150 steps for topk, randomk and powersgd) is
#: longer than these runs: those codecs start compressing where the checks were measured
#: (from the first step; PowerSGD after 50, its earlier default; top-k 0.1 % after 100,
#: then its ramp)
W0, W50, W100 = "start_iter=0", "start_iter=50", "start_iter=100"
CLOSE = {"fp16": TIGHT, "bf16": TIGHT, "int8": TIGHT, "qsgd": TIGHT, f"topk:{W0}": TIGHT,
         "terngrad": TIGHT, f"powersgd:{W50}": TIGHT, "onebit": LOOSE,
         f"randomk:{W0}": LOOSE, f"topk:ratio=0.001;{W100}": TIGHT,
         f"topk:ratio=0.001;{W0}": TIGHT}
CODECS = ("fp16", "bf16", "int8", "qsgd", "terngrad", f"powersgd:{W50}", f"topk:{W0}",
          "onebit", f"randomk:{W0}", f"topk:ratio=0.001;{W100}", f"topk:ratio=0.001;{W0}",
          f"topk:ratio=0.001;ramp=null;{W0}",
          f"topk:ef=0;{W0}", f"randomk:ratio=0.01;{W0}", f"randomk:ratio=0.01;mc=0;{W0}",
          f"randomk:mc=0;{W0}", "onebit:mc=0", f"topk:mc=0;{W0}", "terngrad:ef=0")


@pytest.mark.timeout(200)
def test_a_nan_on_one_rank_leaves_later_steps_finite_on_every_rank():
    results = torchrun(CHECKS, 3, "nan", timeout=190).clean_results(3)
    for r in results:
        for name, v in r["info"]["nan"].items():
            codec, mode = name.split("/")
            later = v["finite"][3:]
            if mode == "guard":
                assert all(later) and v["resets"] >= 1, (name, v)
            else:
                assert not any(later), (name, v)      # the fault the guard removes
    decisions = {json.dumps({k: v["resets"] for k, v in r["info"]["nan"].items()})
                 for r in results}
    assert len(decisions) == 1, decisions


@pytest.mark.timeout(420)
def test_every_codec_trains_to_the_uncompressed_loss_and_none_diverges():
    results = torchrun(CHECKS, 2, "train=120@" + ",".join(CODECS), timeout=410)
    losses = results.clean_results(2)
    assert losses[0]["info"] == losses[1]["info"]           # the same model everywhere
    loss = losses[0]["info"]["train"]
    ref, initial = loss["none"], loss["initial"]
    for name in CODECS:
        assert math.isfinite(loss[name]) and loss[name] < initial, (name, loss)
        if name in CLOSE:
            assert loss[name] <= ref + CLOSE[name], (name, loss)
    assert loss[f"topk:{W0}"] < loss[f"topk:ef=0;{W0}"], loss
    assert loss[f"topk:{W0}"] < loss[f"topk:mc=0;{W0}"], loss
    assert loss["terngrad"] < loss["terngrad:ef=0"], loss
    assert loss[f"topk:ratio=0.001;{W0}"] < loss[f"topk:ratio=0.001;ramp=null;{W0}"], loss


ADAM_CODECS = ("onebit", "topk", "randomk", "terngrad")
#: the hook's Adam route against OneBitAdam: the same mechanism, rounded apart
SAME = 0.01


@pytest.mark.timeout(300)
def test_with_adamw_the_hooks_adam_route_trains_as_onebitadam_and_beats_adam_gradients():
    """Adam's route (issue 13) on the same task with AdamW (lr 0.01, 150 steps, 2 ranks;
    uncompressed 0.573). ``make_comm_hook(codec)`` finds the AdamW and takes its Adam route
    (``start_iter=20``: 20 dense steps, then the preconditioned momentum through the
    codec): every codec ends within ``LOOSE`` of the uncompressed loss (onebit 0.569,
    topk 0.638, randomk 0.597, terngrad 0.560), within ``SAME`` of
    ``OneBitAdam(compressor=codec, warmup_steps=20)`` (the same mechanism as an optimizer:
    equal to the bit for onebit, the others differ from the 7th digit on, where torch's
    Adam and OneBitAdam's warm-up round differently), and below the hook's gradient route
    (``optimizer=None``: Adam's gradients compressed from the first step; 0.689, 0.707,
    1.165, 0.605). Planted: the route off (``ADAM_CODECS`` empty) gives the gradient
    route's losses, which fail both."""
    results = torchrun(CHECKS, 2, "adam=150@" + ",".join(ADAM_CODECS), timeout=290)
    losses = results.clean_results(2)
    assert losses[0]["info"] == losses[1]["info"]
    loss = losses[0]["info"]["adam"]
    ref, initial = loss["none"], loss["initial"]
    for codec in ADAM_CODECS:
        hook = loss["hook:" + codec]
        assert math.isfinite(hook) and hook <= ref + LOOSE, (codec, loss)
        assert abs(hook - loss[codec]) <= SAME, (codec, loss)
        assert hook < loss["gradient:" + codec] < initial, (codec, loss)
