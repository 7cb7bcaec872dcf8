"""The Qwen family under FSDP, tensor and pipeline parallelism on 2 gloo CPU ranks reproduces one
process, step for step, through the real entry point (``train.job.run_training``).

A 2-layer, 64-wide Qwen3-style decoder (q/k norms, 4 heads of 48 channels) and its Qwen2-style
twin (q/k/v biases): FSDP2 with the tied embedding (one Parameter: a copy trained apart would
change the losses), TP2 untied (q/k/v and their biases split by heads, the q/k norms applied to
each rank's heads with a replicated weight whose gradient is summed over the ranks) and PP2
untied (the embedding on the first stage, the output layer on the last); recomputation (selective
with FSDP, full with TP) changes nothing. One process runs the three references, one pair of
processes every layout on one process group.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY, RunResult, spawn_ranks

STEPS = 5
COMMON = [*QUIET, *TINY, "model.family=qwen", f"train.steps={STEPS}", "optim.lr=0.01",
          "checkpoint.interval=none", "checkpoint.save_at_end=false"]
UNTIED = "model.tie_embeddings=false"
QWEN2 = "model.size=tiny-qwen2"
# reference name -> its overrides (one process, global batch 4)
REFERENCES = {"one_tied": [], "one_untied": [UNTIED], "one_qwen2": [QWEN2, UNTIED]}
# layout name -> (its reference, overrides on 2 ranks with the same global batch)
LAYOUTS = {
    "fsdp_tied": ("one_tied", ["parallel.strategy=fsdp", "train.micro_batch=2",
                               "parallel.activation_checkpointing=selective"]),
    "tp_untied": ("one_untied", [UNTIED, "parallel.tp=2"]),
    "pp_untied": ("one_untied", [UNTIED, "parallel.pp=2", "parallel.pp_microbatches=2"]),
    "tp_qwen2": ("one_qwen2", [QWEN2, UNTIED, "parallel.tp=2",
                               "parallel.activation_checkpointing=full"]),
}


def _train(out: str, name: str, overrides: list[str]) -> tuple[list[float], list[float]]:
    """One run (in this process); its losses and gradient norms."""
    from hpctrain.config import load_config
    from hpctrain.train.job import run_training

    cfg = load_config(DEMO, [*COMMON, "parallel.strategy=none", "train.micro_batch=4",
                             *overrides, f"run.out_dir={out}", f"run.name={name}"])
    run_training(cfg)
    run = RunResult([], 0, "", "", Path(out) / name)
    return run.losses(), run.grad_norms()


def _references(rank: int, port: int, queue, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    queue.put((rank, {name: _train(out, name, o) for name, o in REFERENCES.items()}))


def _layouts(rank: int, port: int, queue, out: str) -> None:
    """Every layout in one pair of processes, on one process group (as tests/rank_jobs)."""
    import torch.distributed as dist

    import hpctrain.train.job as job

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    job.shutdown = lambda: None  # the group outlives each run
    runs = {name: _train(out, name, o) for name, (_, o) in LAYOUTS.items()}
    dist.destroy_process_group()
    queue.put((rank, runs))


class _Target:
    """A picklable ``target(rank, port, queue)`` for ``spawn_ranks`` carrying its arguments."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, rank: int, port: int, queue) -> None:
        self.fn(rank, port, queue, *self.args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = str(tmp_path_factory.mktemp("qwen_layouts"))
    [(_, references)] = spawn_ranks(_Target(_references, out), 1, timeout=600)
    layouts = dict(spawn_ranks(_Target(_layouts, out), 2, timeout=600))
    return {**references, **layouts[0]}


def test_the_references_learn(runs: dict) -> None:
    for name in REFERENCES:
        losses = runs[name][0]
        assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3, (name, losses)
    # The Qwen2-style twin is another network: another curve.
    assert runs["one_qwen2"][0] != pytest.approx(runs["one_untied"][0], rel=1e-3)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs: dict, name: str) -> None:
    reference = LAYOUTS[name][0]
    losses, norms = runs[name]
    assert losses == pytest.approx(runs[reference][0], rel=1e-5)
    assert norms == pytest.approx(runs[reference][1], rel=1e-4)
