"""Users' tasks trained for real: the examples on 2 DDP (or FSDP) ranks through the CLI, killed with
kill -9 mid-run and rerun, resume bit-identically; a rank whose step raises ends the job with
the user's file and line; ``hpctrain.fit`` from a script, on an iterable without a position.

Tiny sizes (6 steps, micro-batch 4): each launch is mostly the ranks' start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, cli_command, cli_env
from lifecycle import kill_tree_of, start
from run_records import logged

STEPS = 6
RUN = ["--nproc", "2", f"train.steps={STEPS}", "train.micro_batch=4", "train.precision=fp32",
       "train.deterministic=true", "metrics.log_every=1", "metrics.progress=false",
       "run.suffix=none", "checkpoint.every=3", "optim.warmup_steps=2", "optim.lr=3e-3"]
# (example, strategy): the MLP and the classifier under DDP, the transformer under FSDP2 (per
# block); each case is three launches, so DDP is not repeated for the transformer.
CASES = (("mlp_parquet", "ddp"), ("tiny_transformer", "fsdp"), ("image_classifier", "ddp"))


def _argv(case: tuple[str, str], out: Path, name: str) -> list[str]:
    example, strategy = case
    return ["train", f"examples/{example}.py", *RUN, f"parallel.strategy={strategy}",
            f"run.out_dir={out}", f"run.name={name}"]


def _name(case: tuple[str, str]) -> str:
    return "-".join(case)


def _env(out: Path) -> dict[str, str]:
    return {"MLP_TABLE": str(out / "table.parquet")}


def _run(argv: list[str], out: Path, log: Path, timeout: float = 240) -> str:
    env = {**cli_env(), **_env(out)}
    env.pop("HPCTRAIN_FAULTS", None)
    done = subprocess.run(cli_command(argv), cwd=REPO, env=env, text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.write_text(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def _kill_and_rerun(case: tuple[str, str], out: Path) -> str:
    """Hang before step 5 once step 3's checkpoint is committed; kill -9 it all; rerun."""
    name = _name(case)
    argv = _argv(case, out, f"{name}-killed")
    run = start(argv, out / f"{name}-killed.log", out / f"{name}-killed",
                env={**_env(out), "HPCTRAIN_FAULTS": "hang@step=5,seconds=600"})
    try:
        run.wait_for("step 4 and the checkpoint of step 3",
                     lambda: run.steps() >= 4 and run.latest() == "step-00000003", timeout=200)
    finally:
        kill_tree_of(run)
    return _run(argv, out, out / f"{name}-rerun.log")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each example's uninterrupted reference and its killed-and-rerun twin (in parallel)."""
    out = tmp_path_factory.mktemp("tasks")
    # The Parquet table is written once here rather than raced for by six ranks.
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'examples'); "
                    f"import mlp_parquet, pathlib; mlp_parquet.write_table(pathlib.Path("
                    f"{str(out / 'table.parquet')!r}))"], cwd=REPO, check=True)
    with ThreadPoolExecutor(2) as pool:
        futures = {}
        for case in CASES:
            name = _name(case)
            futures[f"{name}-ref"] = pool.submit(
                _run, _argv(case, out, f"{name}-ref"), out, out / f"{name}-ref.log")
            futures[f"{name}-rerun"] = pool.submit(_kill_and_rerun, case, out)
        return {"out": out, **{k: f.result() for k, f in futures.items()}}


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_example_resumes_bit_identically_after_kill_9(runs, case: tuple[str, str]) -> None:
    out, example = runs["out"], _name(case)
    ref = logged(out, f"{example}-ref")
    assert sorted(ref) == list(range(1, STEPS + 1))
    # The rerun resumed from step 3 and wrote steps 4-6 again after the killed run's 1-4.
    assert "resumed from step-00000003" in (out / f"{example}-killed" / "logs" /
                                            "rank-000.log").read_text(errors="replace")
    after = logged(out, f"{example}-killed")  # the last record of each step wins
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert after[step] == ref[step], (step, after[step], ref[step])
    info = json.loads((out / f"{example}-killed" / "exit_info.json").read_text())
    assert info["exit_code"] == 0 and info["last_checkpoint"] == f"step-{STEPS:08d}"


def test_metrics_report_samples_and_task_metrics(runs) -> None:
    out = runs["out"]
    records = [r for r in _records(out / "tiny_transformer-fsdp-ref") if "loss" in r]
    last = records[-1]
    assert last["samples_per_s"] > 0
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 64)
    assert 0 <= last["accuracy"] <= 1  # the step's own metric, over the window
    val = [r for r in _records(out / "tiny_transformer-fsdp-ref") if "val_loss" in r]
    assert val and val[-1]["val_samples"] == 256 and "val_accuracy" in val[-1]
    layout = next(r for r in _records(out / "image_classifier-ddp-ref")
                  if r.get("event") == "layout")
    assert layout["flops_per_sample"] > 0  # counted by PyTorch's flop counter


def _records(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics" / "rank-000.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


RANK_FAILS = """\
import os

import torch
from torch import nn

from hpctrain.task import Task

calls = 0


def step(model, batch):
    global calls
    calls += 1
    if os.environ["RANK"] == "1" and calls == 3:
        raise RuntimeError("rank 1 gives up at its third step")
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def task():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Linear(4, 1), step=step,
                data=torch.utils.data.TensorDataset(x, x[:, :1]))
"""


def test_one_ranks_exception_ends_the_job_naming_the_users_line(tmp_path: Path) -> None:
    """Also the config's way in: a YAML whose task: names the file and function."""
    path = tmp_path / "rank_fails.py"
    path.write_text(RANK_FAILS)
    config = tmp_path / "job.yaml"
    config.write_text(f"task: {path}:task\nrun: {{name: rank_fails, suffix: none, out_dir: "
                      f"{tmp_path}}}\nparallel: {{strategy: ddp}}\n"
                      "train: {steps: 20, micro_batch: 2}\nmetrics: {progress: false}\n")
    argv = ["train", str(config), "--nproc", "2"]
    done = subprocess.run(cli_command(argv), cwd=REPO, env=cli_env(), text=True, timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode != 0
    # Which rank the launcher blames first is a race (rank 0 fails too, its peer gone).
    assert "training failed: rank" in done.stdout, done.stdout[-2000:]
    log = (tmp_path / "rank_fails" / "logs" / "rank-001.log").read_text()
    assert "rank 1 gives up at its third step" in log
    assert f"{path}:15 (in step)" in log
    info = json.loads((tmp_path / "rank_fails" / "exit_info.json").read_text())
    assert info["exit_code"] != 0


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
        done = subprocess.run([sys.executable, str(script), str(tmp_path), str(steps)],
                              cwd=tmp_path, env=cli_env(), text=True, timeout=300,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert done.returncode == 0, done.stdout[-3000:]
        assert f"RESULT {steps} True" in done.stdout
        return done.stdout

    first = fit(3)
    assert first.count("cannot report its position") == 1
    assert "the resume will not be exact" in first
    assert sorted(logged(tmp_path, "fitted")) == [1, 2, 3]
    # Run again with more steps: the script's run resumes from its last checkpoint.
    assert "resumed from step-00000003" in fit(5)
    info = json.loads((tmp_path / "fitted" / "exit_info.json").read_text())
    assert info["exit_code"] == 0
    assert sorted(logged(tmp_path, "fitted")) == [1, 2, 3, 4, 5]
