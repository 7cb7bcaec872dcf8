"""Users' tasks trained for real: every example on 2 ranks, under DDP and under FSDP2, killed with
kill -9 mid-run and rerun, resumes bit-identically; a rank whose step raises ends the job with the
user's file and line; ``hpctrain.fit`` from a script, on an iterable without a position.

The examples train together as one task (``all_examples.py``: each example's model, data and step,
each one's loss logged), so one chain per strategy covers all of them: the killed run is the
uninterrupted reference for the steps its rerun computes again (killed after step 5, resumed from
step 3's checkpoint, steps 4 and 5 must come out bit-identical). Tiny sizes (6 steps,
micro-batch 4): each launch is mostly the ranks' start-up.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import forked
from conftest import REPO, cli_env, run_cli
from hpctrain.checkpoint.safe_io import SafeFileSystemReader
from hpctrain.launch.local import kill_tree
from lifecycle import kill_tree_of, start
from run_records import logged

STEPS, SAVED, KILLED_AT = 6, 3, 6  # checkpoint at step 3; held (then killed) before step 6
TASK = "tests/task/all_examples.py"
RUN = ["--nproc", "2", f"train.steps={STEPS}", "train.micro_batch=4", "train.precision=fp32",
       "train.deterministic=true", "metrics.log_every=1", "metrics.progress=false",
       "run.suffix=none", f"checkpoint.every={SAVED}", "optim.warmup_steps=2",
       "optim.lr=3e-3"]
STRATEGIES = ("ddp", "fsdp")
EXAMPLES = ("mlp_parquet", "tiny_transformer", "image_classifier")


def _argv(strategy: str, out: Path) -> list[str]:
    return ["train", TASK, *RUN, f"parallel.strategy={strategy}", f"run.out_dir={out}",
            f"run.name={strategy}"]


def _kill_and_rerun(strategy: str, out: Path) -> dict[str, object]:
    """Hang before step 6 once step 3's checkpoint is committed; kill -9 it all; rerun.
    Returns the metrics of both attempts, by step (each step's last record wins)."""
    env = {"MLP_TABLE": str(out / "table.parquet")}
    run = start(_argv(strategy, out), out / f"{strategy}-killed.log", out / strategy,
                env={**env, "HPCTRAIN_FAULTS": f"hang@step={KILLED_AT},seconds=600"})
    try:
        run.wait_for(f"step {KILLED_AT - 1} and the checkpoint of step {SAVED}",
                     lambda: run.steps() >= KILLED_AT - 1
                     and run.latest() == f"step-{SAVED:08d}", timeout=200)
    finally:
        kill_tree_of(run)
    killed = {r: _by_step(out / strategy, r) for r in (0, 1)}
    done = run_cli(_argv(strategy, out), timeout=240, env=env)
    (out / f"{strategy}-rerun.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"killed": killed, "rerun": {r: _by_step(out / strategy, r) for r in (0, 1)}}


def _by_step(run_dir: Path, rank: int) -> dict[int, dict]:
    """Rank ``rank``'s training records by step (a step logged twice: the later one)."""
    text = (run_dir / "metrics" / f"rank-{rank:03d}.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    return {r["step"]: r for r in records if "loss" in r and "event" not in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each strategy's killed run and its rerun (the two chains in parallel)."""
    out = tmp_path_factory.mktemp("tasks")
    # The Parquet table is written once here rather than raced for by four ranks.
    spec = importlib.util.spec_from_file_location("mlp_parquet", REPO / "examples" /
                                                  "mlp_parquet.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.write_table(out / "table.parquet")
    with ThreadPoolExecutor(2) as pool:
        chains = {s: pool.submit(_kill_and_rerun, s, out) for s in STRATEGIES}
        return {"out": out, **{s: f.result() for s, f in chains.items()}}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_examples_resume_bit_identically_after_kill_9(runs, strategy: str) -> None:
    out, chain = runs["out"], runs[strategy]
    killed, rerun = chain["killed"][0], chain["rerun"][0]
    assert sorted(killed) == list(range(1, KILLED_AT))
    assert sorted(rerun) == list(range(1, STEPS + 1))
    assert f"resumed from step-{SAVED:08d}" in (out / strategy / "logs" / "rank-000.log"
                                                 ).read_text(errors="replace")
    # Steps 4 and 5, trained again from step 3's checkpoint: the same losses, bit for bit, of
    # every example (and the global loss), as the uninterrupted first attempt's.
    again = range(SAVED + 1, KILLED_AT)
    for step in again:
        for key in ("loss", *(f"{name}_loss" for name in EXAMPLES)):
            assert rerun[step][key] == killed[step][key], (strategy, step, key)
    info = json.loads((out / strategy / "exit_info.json").read_text())
    assert info["exit_code"] == 0 and info["last_checkpoint"] == f"step-{STEPS:08d}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load, one process
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batchnorm_statistics_agree_across_ranks_and_checkpoints(runs, strategy: str) -> None:
    """Each rank normalises its own samples, so its running statistics would drift from the
    others'; rank 0's are every rank's after each step, and the checkpoint holds them."""
    import torch.distributed.checkpoint as dcp

    out, chain = runs["out"], runs[strategy]
    for attempt in ("killed", "rerun"):
        ranks = chain[attempt]
        both = sorted(ranks[0].keys() & ranks[1].keys())  # rank 1 may not have logged step 5
        assert len(both) >= KILLED_AT - 2, (attempt, both)
        for step in both:
            assert ranks[0][step]["bn_stats"] == ranks[1][step]["bn_stats"], (attempt, step)
    stats = [chain["rerun"][0][s]["bn_stats"] for s in sorted(chain["rerun"][0])]
    assert len(set(stats)) == len(stats)  # they move every step
    # Step 3's checkpoint holds what every rank held at the start of step 4.
    sys.path.insert(0, str(Path(__file__).parent))
    from all_examples import EXAMPLES as modules

    model = modules["image_classifier"].ResNet()
    saved = {"model": {f"parts.image_classifier.{k}": v for k, v in model.state_dict().items()
                       if "running" in k}}
    dcp.load(saved, storage_reader=SafeFileSystemReader(
        out / strategy / "checkpoints" / f"step-{SAVED:08d}"), no_dist=True)
    total = sum(v.double().sum() for v in saved["model"].values())
    assert float(torch.as_tensor(total).float()) == chain["killed"][0][SAVED + 1]["bn_stats"]


def test_metrics_report_samples_and_task_metrics(runs) -> None:
    out = runs["out"]
    last = runs["fsdp"]["rerun"][0][STEPS]
    assert last["samples_per_s"] > 0
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 64)
    assert 0 <= last["tiny_transformer_accuracy"] <= 1  # the step's own metric
    records = _records(out / "fsdp")
    val = [r for r in records if "val_loss" in r]
    assert val and val[-1]["val_samples"] == 256 and "val_image_classifier_top1" in val[-1]
    layout = next(r for r in records if r.get("event") == "layout")
    assert layout["flops_per_sample"] > 0  # counted by PyTorch's flop counter


def _records(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics" / "rank-000.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


RANK_FAILS = """\
import os
import time

import torch
from torch import nn

from hpctrain.task import Task

calls = 0


def step(model, batch):
    global calls
    calls += 1
    if calls == 3 and os.environ["RANK"] == "0":
        raise RuntimeError("rank 0 gives up at its third step")
    if calls == 3:
        time.sleep(300)  # busy (a long kernel, a slow read): it outlives the agent's SIGTERM
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def task():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Linear(4, 1), step=step,
                data=torch.utils.data.TensorDataset(x, x[:, :1]))
"""


def test_one_ranks_exception_ends_the_job_naming_the_users_line(tmp_path: Path) -> None:
    """Rank 0 raises; rank 1, busy, outlives the agent's SIGTERM and is SIGKILLed 30 s later:
    the launcher blames rank 0 with its exception, rank 1 only as stopped by the launcher.
    Also the config's way in: a YAML whose task: names the file and function."""
    path = tmp_path / "rank_fails.py"
    path.write_text(RANK_FAILS)
    config = tmp_path / "job.yaml"
    config.write_text(f"task: {path}:task\nrun: {{name: rank_fails, suffix: none, out_dir: "
                      f"{tmp_path}}}\nparallel: {{strategy: ddp}}\n"
                      "train: {steps: 20, micro_batch: 2}\nmetrics: {progress: false}\n")
    done = run_cli(["train", str(config), "--nproc", "2"], timeout=300)
    assert done.returncode == 1
    output = done.stdout + done.stderr
    # The launcher's own line (not only rank 0's copy of its error on the shared console).
    failed = output[output.find("hpctrain: error: training failed:"):]
    assert failed.startswith("hpctrain: error: training failed: rank 0 exited with code 2: "
                             "TaskError: the step function raised RuntimeError: rank 0 gives "
                             "up at its third step\n"), output[-3000:]
    assert f"{path}:16 (in step)" in failed, failed
    assert "rank 1 stopped by the launcher (SIGKILL)" in failed, failed
    log = (tmp_path / "rank_fails" / "logs" / "rank-000.log").read_text()
    assert "rank 0 gives up at its third step" in log
    assert f"{path}:16 (in step)" in log
    info = json.loads((tmp_path / "rank_fails" / "exit_info.json").read_text())
    # Rank 0's own account stays (the launcher must not replace it with rank 1's SIGKILL).
    assert info["exit_code"] == 2 and info["extra"]["rank"] == 0, info
    assert "rank 0 gives up at its third step" in info["reason"], info


FIT_SCRIPT = """\
import sys

import torch
from torch import nn

import hpctrain
from hpctrain.task import Task


class Numbers:
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(1000):
            x = torch.randn(4, generator=g)
            yield x, x[:1] * 2


def task():
    return Task(model=lambda: nn.Linear(4, 1), data=Numbers(), loss=nn.functional.mse_loss)


if __name__ == "__main__":
    result = hpctrain.fit(task, overrides={"run.out_dir": sys.argv[1], "run.name": "fitted",
                                           "train.steps": int(sys.argv[2]),
                                           "train.micro_batch": 4,
                                           "metrics.progress": False, "metrics.log_every": 1})
    print("RESULT", result.steps, result.final_loss > 0)
"""


def test_fit_from_a_script_on_an_iterable_without_position(tmp_path: Path) -> None:
    script = tmp_path / "train_it.py"
    script.write_text(textwrap.dedent(FIT_SCRIPT))
    def fit(steps: int) -> str:
        # `python train_it.py OUT STEPS`, forked from the preloaded interpreter (tests/forked.py).
        log = tmp_path / f"fit-{steps}.log"
        proc = forked.start(forked.script, (str(script), [str(tmp_path), str(steps)]),
                            env=cli_env(), out=log)
        try:
            proc.join(timeout=300)
        finally:
            kill_tree(proc.pid)
            forked.finish(proc, log)
        output = log.read_text()
        assert proc.exitcode == 0, output[-3000:]
        assert f"RESULT {steps} True" in output
        return output

    first = fit(3)
    assert first.count("cannot report its position") == 1
    assert "the resume will not be exact" in first
    assert sorted(logged(tmp_path, "fitted")) == [1, 2, 3]
    # Run again with more steps: the script's run resumes from its last checkpoint.
    assert "resumed from step-00000003" in fit(5)
    info = json.loads((tmp_path / "fitted" / "exit_info.json").read_text())
    assert info["exit_code"] == 0
    assert sorted(logged(tmp_path, "fitted")) == [1, 2, 3, 4, 5]
