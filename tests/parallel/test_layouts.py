"""Tensor, pipeline and data parallelism composed on 4 ranks reproduce one process, step for step.

Two launches run side by side (gloo, CPU, a 4-layer 64-wide decoder, fp32, deterministic):

- 1 process: the reference, micro-batch 8 for 7 steps, saving at step 3, validating after step
  4 and at the end;
- 4 ranks, one launch for all of these jobs (``rank_jobs.py``), each the same global batch of 8
  for the reference's first 4 steps: TP2 x FSDP2 with gradient accumulation, HSDP 2x2, and under
  every pipeline schedule offered PP2 x FSDP2 (pipeline micro-batches cut from one loader
  micro-batch) and PP2 x TP2 (the accumulated loader micro-batches are the pipeline's; PP2 x
  FSDP2 1F1B so too, with its parameters resharded after each forward, not the default); then a
  resume chain across layouts: the reference's step-3 checkpoint -> PP2 x TP2 (steps 4-5) ->
  FSDP4 (step 6) -> TP2 x FSDP2 (step 7).
- the bad-step guard through a pipeline, one job in each launch: with the loss of step 2
  poisoned (``HPCTRAIN_FAULTS=nan@step=2``), PP2 x TP2 skips that step on every stage exactly
  as one process does.

Every job logs the global loss, the global gradient norm (all stages and shards) and, at the
end, the validation loss through the same layout (through the pipeline for PP). The reference
and the jobs differ only in how float32 sums are split and ordered. Measured with PyTorch 2.13:
below 1e-6 relative for losses and grad norms; with 2.11 grad norms up to 1.9e-5 (PP2 x TP2). We
assert the issue's 1e-5 on the loss trajectories, 1e-4 on grad norms (a missing or doubled
gradient moves them by far more), and 1e-6 on the loss after each cross-layout resume.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import DEMO, QUIET, TINY
from hpctrain.observe.metrics import read_metrics
from hpctrain.parallel.config import PP_SCHEDULES
from hpctrain.parallel.pipeline import schedule_supported
from rank_jobs import launch
from run_records import assert_close, checkpoint_dir

# Seven steps: the resume chain below needs them (3 -> 5 -> 6 -> 7) and the loss falls by ~0.9
# over them (0.3 asserted). The layouts train four: the first step checks forward and backward,
# the next three the sharded optimizer's updates (the AdamW moments of step 1 onwards); TP is
# slow on CPU and the launch runs 13 of them.
STEPS = 7
PARITY_STEPS = 4
RTOL = 1e-5
NORM_RTOL = 1e-4
RESUME_RTOL = 1e-6
LAUNCH_TIMEOUT_S = 1500.0

COMMON = [*TINY, "model.n_layers=4", *QUIET, f"train.steps={STEPS}", "optim.schedule=constant",
          "data.val_fraction=0.005", "checkpoint.async_save=false",
          "checkpoint.save_at_end=false", "checkpoint.interval=none"]
REFERENCE = ["parallel.strategy=none", "train.micro_batch=8", "checkpoint.interval=steps",
             "checkpoint.every=3", "checkpoint.keep_every=3", f"train.val_every={PARITY_STEPS}"]
# The guard jobs: 4 steps, the default schedule (1F1B), no validation split.
GUARD = ["train.steps=4", "train.micro_batch=4", "data.val_fraction=0"]
GUARD_FAULT = "nan@step=2"
# Every schedule offered that this PyTorch runs on CPU (zbv needs 2.13 with gloo).
SCHEDULES = tuple(s for s in PP_SCHEDULES if schedule_supported(s, "cpu"))


def _parity_jobs() -> dict[str, list[str]]:
    """Layout name -> overrides; every one trains the reference's global batch of 8.

    Each job costs a rank start-up's worth of mesh, model and data set-up on 4 ranks sharing 2
    cores, so each factor is covered once rather than in every combination: per pipeline
    schedule, FSDP with the pipeline's micro-batches cut from one loader micro-batch and TP with
    them accumulated from several loader micro-batches.
    """
    fsdp, tp2, pp2 = "parallel.strategy=fsdp", "parallel.tp=2", "parallel.pp=2"
    jobs = {
        # Recomputation changes nothing numerically: two jobs run with it.
        "tp2_fsdp2_accum": [fsdp, tp2, "train.micro_batch=2", "train.grad_accum=2",
                            "parallel.activation_checkpointing=full"],
        "hsdp2x2": [fsdp, "parallel.dp_replicate=2", "train.micro_batch=2"],
    }
    for s in SCHEDULES:
        sched = f"parallel.pp_schedule={s}"
        # Two pipeline micro-batches per step (zbv needs 2 x pp - 1: four), either cut from one
        # loader micro-batch or the accumulated loader micro-batches themselves.
        m = 4 if s == "zbv" else 2
        jobs[f"pp2_fsdp2_{s}"] = [fsdp, pp2, sched, "train.micro_batch=4",
                                  f"parallel.pp_microbatches={m}"]
        jobs[f"pp2_tp2_{s}_accum"] = ["parallel.strategy=none", pp2, tp2, sched,
                                      f"train.micro_batch={8 // m}", f"train.grad_accum={m}"]
    # Recomputation under a zero-bubble schedule (its backward split in two); with FSDP, not TP:
    # TP x zero-bubble x recomputation took 17 s of 4 ranks, the FSDP job 4 s.
    jobs["pp2_fsdp2_interleaved_zb"].append("parallel.activation_checkpointing=full")
    # Inside a pipeline FSDP keeps the stage's parameters gathered unless told otherwise.
    jobs["pp2_fsdp2_1f1b_accum_reshard"] = [fsdp, pp2, "parallel.pp_schedule=1f1b",
                                            "train.micro_batch=2", "train.grad_accum=2",
                                            "parallel.reshard_after_forward=true"]
    return jobs


PARITY = _parity_jobs()


def _resume_chain(out: Path) -> list[dict[str, Any]]:
    """Each job resumes the previous one's last checkpoint under another layout."""
    save = ["checkpoint.save_at_end=true"]
    return [
        {"name": "resume_pp2_tp2", "wait_for": checkpoint_dir(out, "reference", 3),
         "overrides": ["parallel.strategy=none", "parallel.pp=2", "parallel.tp=2",
                       "train.micro_batch=8", "parallel.pp_microbatches=2", "train.steps=5",
                       *save, f"checkpoint.resume={checkpoint_dir(out, 'reference', 3)}"]},
        {"name": "resume_fsdp4",
         "overrides": ["parallel.strategy=fsdp", "train.micro_batch=2", "train.steps=6", *save,
                       f"checkpoint.resume={checkpoint_dir(out, 'resume_pp2_tp2', 5)}"]},
        {"name": "resume_tp2_fsdp2",
         "overrides": ["parallel.strategy=fsdp", "parallel.tp=2", "train.micro_batch=4",
                       "train.steps=7", *save,
                       f"checkpoint.resume={checkpoint_dir(out, 'resume_fsdp4', 6)}"]},
    ]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run both launches (concurrently) once for the module; the run directories' parent."""
    root = tmp_path_factory.mktemp("layouts")
    runs = root / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    reference = {**spec, "jobs": [
        {"name": "reference", "overrides": REFERENCE},
        {"name": "guard_one", "overrides": ["parallel.strategy=none", *GUARD],
         "faults": GUARD_FAULT}]}
    layouts = {**spec, "jobs": [{"name": n, "overrides": [*o, f"train.steps={PARITY_STEPS}"]}
                                for n, o in PARITY.items()]
               + _resume_chain(runs)
               + [{"name": "guard_pp2_tp2", "overrides": [
                   "parallel.strategy=none", "parallel.pp=2", "parallel.tp=2",
                   "parallel.pp_microbatches=2", *GUARD], "faults": GUARD_FAULT}]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(launch, 1, reference, root / "launch-1", LAUNCH_TIMEOUT_S)
        four = pool.submit(launch, 4, layouts, root / "launch-4", LAUNCH_TIMEOUT_S)
        ref.result()
        four.result()
    return runs


def _records(out: Path, name: str, rank: int = 0) -> list[dict[str, Any]]:
    return read_metrics(out / name / "metrics" / f"rank-{rank:03d}.jsonl")


def _steps(out: Path, name: str, rank: int = 0) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in _records(out, name, rank) if "loss" in r}


def _val_loss(out: Path, name: str, step: int) -> float:
    (val,) = [r["val_loss"] for r in _records(out, name) if "val_loss" in r and r["step"] == step]
    return val


def test_reference_learns(out: Path) -> None:
    """The curve compared is a moving one: the loss falls over the STEPS steps."""
    losses = [r["loss"] for r in _steps(out, "reference").values()]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("name", list(PARITY))
def test_layout_matches_single_process(out: Path, name: str) -> None:
    """Loss and global grad norm of every step, and the validation loss after the last, equal
    the reference's."""
    ref, run = _steps(out, "reference"), _steps(out, name)
    assert sorted(run) == list(range(1, PARITY_STEPS + 1))
    for step in range(1, PARITY_STEPS + 1):
        assert_close(run[step]["loss"], ref[step]["loss"], RTOL, f"{name} loss at {step}")
        assert_close(run[step]["grad_norm"], ref[step]["grad_norm"], NORM_RTOL,
                      f"{name} grad norm at {step}")
    assert_close(_val_loss(out, name, PARITY_STEPS), _val_loss(out, "reference", PARITY_STEPS),
                  RTOL,
                  f"{name} validation loss")
    # Every rank reports the same global values.
    for rank in (1, 2, 3):
        other = _steps(out, name, rank)
        assert [other[s]["loss"] for s in other] == [run[s]["loss"] for s in run]
    # Throughput counts each token once per model replica: every GPU is credited the global
    # batch's 8 x 32 tokens over the 4 GPUs, whatever the layout.
    (event,) = [r for r in _records(out, name) if r.get("event") == "layout"]
    assert event["tokens_per_step_per_gpu"] == 8 * 32 / 4


def test_resume_across_layouts(out: Path) -> None:
    """One process -> PP2 x TP2 -> FSDP4 -> TP2 x FSDP2: each resumed step's loss is the one
    an uninterrupted run gets (model, AdamW moments, LR schedule and data position restored)."""
    ref = _steps(out, "reference")
    for name, steps in (("resume_pp2_tp2", (4, 5)), ("resume_fsdp4", (6,)),
                        ("resume_tp2_fsdp2", (7,))):
        run = _steps(out, name)
        assert sorted(run) == list(steps), name
        for step in steps:
            assert_close(run[step]["loss"], ref[step]["loss"], RESUME_RTOL,
                          f"{name} loss at step {step}")
            assert_close(run[step]["grad_norm"], ref[step]["grad_norm"], NORM_RTOL,
                          f"{name} grad norm at step {step}")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_layout_is_reported(out: Path, schedule: str) -> None:
    """Each rank's layout event names its stages, which together hold every block once; the
    bubble fraction is logged with every step."""
    held: list[int] = []
    for rank in range(4):
        (event,) = [r for r in _records(out, f"pp2_tp2_{schedule}_accum", rank)
                    if r.get("event") == "layout"]
        assert (event["pp"], event["tp"], event["schedule"]) == (2, 2, schedule)
        if event["coords"]["tp"] == 0:
            held += [i for lo, hi in event["stages"].values() for i in range(lo, hi)]
        assert 0 <= event["pp_bubble"] < 0.5
    assert sorted(held) == [0, 1, 2, 3]
    steps = _steps(out, f"pp2_tp2_{schedule}_accum")
    assert all(r["pp_bubble"] == event["pp_bubble"] for r in steps.values())


def test_nan_step_is_skipped_on_every_stage(out: Path) -> None:
    """The bad-step guard through a pipeline: a NaN loss on the last stage skips the step on
    every stage, exactly as one process skips it. If any stage applied its update the weights
    would split from the one-process run's and so would the losses of steps 3 and 4."""
    ref = [r["loss"] for r in _records(out, "guard_one") if "loss" in r]
    assert math.isnan(ref[1]) and all(math.isfinite(x) for x in ref[2:])
    for rank in range(4):
        recs = _records(out, "guard_pp2_tp2", rank)
        assert [r["step"] for r in recs if r.get("event") == "bad_steps"] == [2]
        losses = [r["loss"] for r in recs if "loss" in r]
        assert math.isnan(losses[1])
        for got, want in zip(losses[2:], ref[2:], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, losses, ref)
