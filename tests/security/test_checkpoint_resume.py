"""A hostile checkpoint in a real run: ``resume auto`` falls back past it, ``--resume PATH``
refuses it (exit 2, naming the file and the global); nothing runs either way.

One uninterrupted run of the tiny demo saves steps 2, 4 and 6. Copies of it get a payload in
step 6 (manifest resealed, as anyone who can write to the folder can do), and the same command
runs again. Each payload would create a marker file next to the runs.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY, RunResult, run_cli


def _load(name: str):
    """Import ``tests/checkpoint/<name>.py`` by path (the test folders are not packages)."""
    key = f"_ckpt_test_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "checkpoint" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


hostile = _load("hostile")

BASE = [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4", "data.source=stdlib",
        "checkpoint.every=2", "checkpoint.keep_last=5"]
NEWEST = "step-00000006"


def _train(out: Path, name: str, steps: int, *flags: str) -> RunResult:
    args = ["train", DEMO, *BASE, f"train.steps={steps}", f"run.out_dir={out}",
            f"run.name={name}", *flags]
    done = run_cli(args)
    return RunResult(args, done.returncode, done.stdout, done.stderr, out / name)


def _plant(reference: RunResult, out: Path, name: str, where: str) -> tuple[Path, str, Path]:
    """Copy the reference run and plant a payload in step 6 (in the index, or in a value of
    a shard); returns (run dir, the file holding it, the marker it would create)."""
    run_dir = out / name
    shutil.copytree(reference.run_dir, run_dir)
    ckpt = run_dir / "checkpoints" / NEWEST
    marker = out / f"pwned-{name}"
    payload = hostile.PopenPayload(marker) if where == "metadata" else \
        hostile.ShellPayload(marker)
    if where == "metadata":
        hostile.write_resealed(ckpt, ".metadata",
                               hostile.nested_metadata_pickle(ckpt, payload))
        return run_dir, ".metadata", marker
    lr = hostile.item_named(ckpt, ".lr")  # a pickled value: the optimizer's learning rate
    shard = hostile.replace_item(ckpt, lr, hostile.torch_pickle(payload))
    return run_dir, shard, marker


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         run_pool: ThreadPoolExecutor) -> dict[str, Future]:
    """The reference run, then the hostile reruns (auto and explicit) side by side."""
    out = tmp_path_factory.mktemp("hostile_resume")
    reference = run_pool.submit(_train, out, "reference", 6)

    def auto(ref: RunResult) -> tuple[RunResult, str, Path]:
        run_dir, culprit, marker = _plant(ref.ok(), out, "auto", "metadata")
        return _train(out, run_dir.name, 8), culprit, marker

    def explicit(ref: RunResult) -> tuple[RunResult, str, Path]:
        run_dir, culprit, marker = _plant(ref.ok(), out, "explicit", "shard")
        ckpt = run_dir / "checkpoints" / NEWEST
        return _train(out, "explicit-new", 8, "--resume", str(ckpt)), culprit, marker

    return {"auto": _then(run_pool, reference, auto),
            "explicit": _then(run_pool, reference, explicit)}


def _then(pool: ThreadPoolExecutor, first: Future, fn) -> Future:
    """``fn(first.result())`` on the pool once ``first`` is done (chained by a callback, so no
    pool worker blocks on another job)."""
    chained: Future = Future()

    def start(done: Future) -> None:
        def job() -> None:
            try:
                chained.set_result(fn(done.result()))
            except BaseException as e:  # delivered to the test that waits for it
                chained.set_exception(e)
        pool.submit(job)

    first.add_done_callback(start)
    return chained


def test_resume_auto_falls_back_past_a_hostile_index(runs: dict[str, Future]) -> None:
    run, culprit, marker = runs["auto"].result()
    run.ok()
    log = (run.run_dir / "logs" / "rank-000.log").read_text()
    skipped = [line for line in log.splitlines() if f"skipping checkpoint {NEWEST}" in line]
    assert skipped and culprit in skipped[0] and "subprocess.Popen is not allowed" in skipped[0], \
        log[-3000:]
    assert "resumed from step-00000004" in log
    assert (run.run_dir / "checkpoints" / "damaged" / NEWEST / culprit).is_file()
    hostile.settle()
    assert not marker.exists(), "resuming ran code from the checkpoint"


def test_resume_path_with_a_hostile_shard_is_exit_2(runs: dict[str, Future]) -> None:
    run, culprit, marker = runs["explicit"].result()
    assert run.returncode == 2, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    assert culprit in run.stderr and "posix.system is not allowed" in run.stderr, run.describe()
    assert "weights_only=False" not in run.stderr  # torch's advice to load it unsafely
    assert run.exit_info()["exit_code"] == 2
    hostile.settle()
    assert not marker.exists(), "resuming ran code from the checkpoint"
