"""Survive: preemption, rank death, hangs, damaged checkpoints, failed saves and bad steps — each
caused for real (signals, kill -9, HPCTRAIN_FAULTS) in real CLI runs, and recovered from.

Every run is the tiny demo (see conftest) on CPU with deterministic kernels, so "resumed exactly"
can be asserted bit for bit against an uninterrupted run. Independent runs go to the shared pool
(2 at a time); a run that needs another's checkpoint is chained after it with ``_then``. Runs
read only from their folders (the reference, DDP -> FSDP, the NaN runs) share launches through
conftest's ``train_together``; those whose exit code, console or signals are checked go
through the CLI.

Timing without races: a signal or a kill must land while the run is still going, and a tiny
step takes ~50 ms. The ``hang@step=S,seconds=T`` fault (all ranks unless ``rank=``) sleeps T s
before step S without touching any numbers, which holds the run at a known step while the test
acts; a resumed run starts past S, so it does not sleep again.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import (
    DEMO,
    QUIET,
    TINY,
    RunResult,
    cli_command,
    cli_env,
    kill_group,
    one_of,
    processes_mentioning,
    run_cli,
    train_together,
)
from hpctrain.checkpoint.manifest import read_manifest, verify_files
from hpctrain.observe.metrics import read_metrics

TIMEOUT_S = 180.0
# Parity tolerance between layouts of one global batch (see tests/train/test_parity.py).
LOSS_RTOL = 1e-6
STEPS = 12
# 2 ranks x micro_batch 2 = global batch 4; one process uses micro_batch 4.
# check_every=1: a signal is answered at the next step, which the assertions name exactly.
BASE = [*TINY, "data.source=stdlib", *QUIET, "preempt.grace_s=10", "preempt.check_every=1"]
TWO_DDP = ["parallel.strategy=ddp", "train.micro_batch=2"]
TWO_FSDP = ["parallel.strategy=fsdp", "train.micro_batch=2"]
ONE = ["parallel.strategy=none", "train.micro_batch=4"]


# -- running the CLI ---------------------------------------------------------------------------

def _args(out: Path, name: str, *overrides: str, steps: int = STEPS,
          nproc: int | None = None, flags: tuple[str, ...] = ()) -> list[str]:
    args = ["train", DEMO, *BASE, f"train.steps={steps}", f"run.out_dir={out}",
            f"run.name={name}", *overrides, *flags]
    return args + (["--nproc", str(nproc)] if nproc else [])


def _popen(args: list[str], faults: str | None) -> subprocess.Popen:
    env = cli_env()
    env.pop("HPCTRAIN_FAULTS", None)
    if faults:
        env["HPCTRAIN_FAULTS"] = faults
    return subprocess.Popen(cli_command(args), cwd=Path(__file__).resolve().parents[2], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _kill_tree(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's group *and* every rank of this run.

    The elastic agent starts every worker in a session of its own, so killing the launcher's
    process group alone leaves the ranks running (holding our pipes open forever); ranks
    orphaned by a launcher that already died are found by their unique run directory.
    """
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    marker = (f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}")
    kids += [p for p in processes_mentioning(marker[0])
             if marker[1] in " ".join(p.info.get("cmdline") or [])]
    kill_group(proc)
    for kid in kids:
        with suppress(psutil.Error):
            kid.kill()


def _finish(proc: subprocess.Popen, args: list[str], run_dir: Path,
            timeout: float = TIMEOUT_S) -> RunResult:
    """Wait for the run; on timeout kill its whole process tree and report (never raise)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc, run_dir)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        err += f"\n[test] TIMEOUT after {timeout:.0f} s: process tree killed"
    finally:
        _kill_tree(proc, run_dir)
    return RunResult(args, proc.returncode, out, err, run_dir)


def _run(out: Path, name: str, *overrides: str, faults: str | None = None,
         timeout: float = TIMEOUT_S, **kw: Any) -> RunResult:
    """A run that nothing signals or kills from outside, through conftest's run_cli."""
    args = _args(out, name, *overrides, **kw)
    done = run_cli(args, timeout, env={"HPCTRAIN_FAULTS": faults})
    return RunResult(args, done.returncode, done.stdout, done.stderr, out / name)


def _steps_logged(run_dir: Path, rank: int = 0) -> int:
    path = run_dir / "metrics" / f"rank-{rank:03d}.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"event"' not in line)


def _wait_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _steps_logged(run_dir) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"run never logged {n} steps (exit {proc.poll()}); "
                                 f"logged {_steps_logged(run_dir)}")
        time.sleep(0.05)


def _wait_hang(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until every rank logs that it hangs before ``step``: by then the ranks have agreed on
    the previous step (a signal sent once its metrics line exists may still reach that
    agreement on a loaded machine, and the save lands one step early)."""
    said = re.compile(rf"HPCTRAIN_FAULTS: hanging \d+ s before step {step}\b")
    logs = [run_dir / "logs" / f"rank-{rank:03d}.log" for rank in range(2)]
    deadline = time.monotonic() + timeout
    while not all(p.is_file() and said.search(p.read_text()) for p in logs):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the ranks never logged the hang before step {step} "
                                 f"(exit {proc.poll()})")
        time.sleep(0.05)


def _records(run: RunResult, rank: int = 0) -> list[dict]:
    return read_metrics(run.run_dir / "metrics" / f"rank-{rank:03d}.jsonl")


def _losses_by_step(run: RunResult) -> dict[int, float]:
    """The last logged loss of each step (a restarted run logs some steps twice)."""
    return {r["step"]: r["loss"] for r in _records(run) if "event" not in r}


def _rank_log(run: RunResult, rank: int = 0) -> str:
    return (run.run_dir / "logs" / f"rank-{rank:03d}.log").read_text()


def _committed(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step-*")) if root.is_dir() else []


def _verify(ckpt: Path) -> dict:
    """Manifest check of every file (what resume does), raising CheckpointError if damaged."""
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest["files"], sorted(manifest["files"]))
    return manifest


def _leftovers(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def _then(pool: ThreadPoolExecutor, first: Future, fn: Callable[[Any], Any]) -> Future:
    """A future for ``fn(first.result())``, run on the pool once ``first`` is done.

    Chained through a callback, never by blocking a pool worker on another job's future, so a
    2-worker pool cannot deadlock.
    """
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


# -- the runs ------------------------------------------------------------------------------------

def _preempt_and_rerun(out: Path) -> tuple[RunResult, dict, list[str], RunResult]:
    """2 DDP ranks, 12 cosine steps, SIGUSR2 twice to the launcher after step 4, then the
    same command again. Returns (preempted run, its exit_info, checkpoints after it, resumed
    run); exit_info is read before the rerun overwrites it."""
    args = _args(out, "preempt", *TWO_DDP, nproc=2)
    # All ranks sleep 4 s before step 5: both signals land inside that window.
    faults = "hang@step=5,seconds=4"
    proc = _popen(args, faults)
    try:
        _wait_hang(proc, out / "preempt", 5)
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.1)
        proc.send_signal(signal.SIGUSR2)  # a second signal during the same preemption
    finally:
        first = _finish(proc, args, out / "preempt")
    info = first.exit_info() if (first.run_dir / "exit_info.json").is_file() else {}
    after_first = _committed(out / "preempt")
    # Keep the first run's checkpoints as they were: the rerun adds and prunes its own.
    shutil.copytree(out / "preempt" / "checkpoints", out / "preempt-first-checkpoints")
    second = _finish(_popen(args, faults), args, out / "preempt")
    return first, info, after_first, second


def _kill_rank_and_restart(out: Path) -> RunResult:
    """kill -9 rank 1 while every rank sleeps before step 8; the launcher restarts the group."""
    args = _args(out, "kill9", *TWO_DDP, "checkpoint.every=3", nproc=2,
                 flags=("--max-restarts", "1"))
    proc = _popen(args, "hang@step=8,seconds=3")
    try:
        _wait_steps(proc, out / "kill9", 7)
        # The async save of step 6 must have committed (a kill mid-save is a different case:
        # the restart would then resume from step 3).
        latest = out / "kill9" / "checkpoints" / "latest"
        deadline = time.monotonic() + 30
        while not (latest.is_file() and latest.read_text().strip() == "step-00000006"):
            assert time.monotonic() < deadline and proc.poll() is None, "step 6 never committed"
            time.sleep(0.02)
        victims = []
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == "1" and "hpctrain" in " ".join(
                        child.cmdline()):
                    victims.append(child)
            except psutil.Error:
                continue
        assert len(victims) == 1, f"expected one rank-1 worker, found {victims}"
        victims[0].send_signal(signal.SIGKILL)
    finally:
        # Bounded: a restarted group that cannot form hangs in gloo for run.timeout_s.
        result = _finish(proc, args, out / "kill9", timeout=120)
    return result


def _corrupt_and_rerun(reference: RunResult, out: Path) -> tuple[str, RunResult]:
    """A copy of the finished reference run; damage the shards of its newest checkpoint."""
    run_dir = out / "corrupt"
    shutil.copytree(reference.run_dir, run_dir)
    newest = run_dir / "checkpoints" / "step-00000012"
    for shard in sorted(newest.glob("*.distcp")):
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 3] ^= 0xFF
        shard.write_bytes(bytes(raw))
    return "step-00000012", _run(out, "corrupt", *ONE, "optim.schedule=constant", steps=14)


def _resume_never(reference: RunResult, out: Path) -> RunResult:
    shutil.copytree(reference.run_dir, out / "never")
    return _run(out, "never", *ONE, flags=("--resume", "never"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         run_pool: ThreadPoolExecutor) -> dict[str, Future]:
    """Submit every run of this module at once; each test waits only for what it checks."""
    out = tmp_path_factory.mktemp("resilience")
    pool = run_pool

    def submit(fn: Callable[..., Any], *a: Any, **kw: Any) -> Future:
        return pool.submit(fn, *a, **kw)

    f: dict[str, Future] = {}
    # The uninterrupted reference: 2 DDP ranks, 12 cosine steps, checkpoints at 6 and 12; then
    # in the same 2 ranks, FSDP resumes its step 6 (and saves at 9). Both are read from their
    # folders only, so they share one launch (conftest's train_together).
    ref_ckpt = out / "reference" / "checkpoints"
    two = submit(train_together, out, {
        "reference": [*TWO_DDP, f"train.steps={STEPS}", "checkpoint.every=6"],
        "ddp_to_fsdp": [*TWO_FSDP, f"train.steps={STEPS}", "checkpoint.every=9",
                        f"checkpoint.resume={ref_ckpt / 'step-00000006'}"],
    }, nproc=2, common=BASE)
    f["reference"], f["ddp_to_fsdp"] = one_of(two, "reference"), one_of(two, "ddp_to_fsdp")
    f["preempt"] = submit(_preempt_and_rerun, out)
    f["kill9"] = submit(_kill_rank_and_restart, out)
    f["watchdog"] = submit(_run, out, "watchdog", *TWO_DDP, "watchdog.timeout=5", nproc=2,
                           faults="hang@step=4,rank=1,seconds=600")
    for mode in ("true", "false"):
        f[f"io_error_async_{mode}"] = submit(
            _run, out, f"io_error_{mode}", *ONE, "checkpoint.every=3",
            f"checkpoint.async_save={mode}", steps=9, faults="save_io_error@step=6")
    # Read from their folders too: one process runs both.
    nan = submit(train_together, out, {
        "nan_skip": [*ONE, "train.steps=8"],
        "nan_rollback": [*ONE, "guard.max_consecutive=3", "checkpoint.every=2",
                         "train.steps=14"],
    }, common=BASE, faults={"nan_skip": "nan@step=5", "nan_rollback": "nan@step=4-12"})
    f["nan_skip"], f["nan_rollback"] = one_of(nan, "nan_skip"), one_of(nan, "nan_rollback")
    f["nan_no_ckpt"] = submit(_run, out, "nan_no_ckpt", *ONE, "checkpoint.interval=none",
                              steps=8, faults="nan@step=1-100")
    f["resume_missing"] = submit(_run, out, "missing", *ONE, steps=2,
                                 flags=("--resume", str(out / "nonexistent")))
    # Saved by DDP on 2 ranks at step 6 -> FSDP on 2 ranks (which saves at 9) -> 1 process.
    f["fsdp_to_one"] = _then(pool, f["ddp_to_fsdp"], lambda prev: _run(
        out, "fsdp_to_one", *ONE,
        flags=("--resume", str(prev.run_dir / "checkpoints" / "step-00000009"))))
    f["corrupt"] = _then(pool, f["reference"], lambda ref: _corrupt_and_rerun(ref, out))
    f["never"] = _then(pool, f["reference"], lambda ref: _resume_never(ref, out))
    return f


def _reference(runs: dict[str, Future]) -> RunResult:
    ref = runs["reference"].result().ok()
    assert _committed(ref.run_dir) == ["step-00000006", "step-00000012"]
    return ref


# -- tests -------------------------------------------------------------------------------------

def test_preemption_checkpoints_once_and_exits_75(runs: dict[str, Future]) -> None:
    """Two SIGUSR2 to the launcher 0.1 s apart: the ranks agree on one step, save once, exit 75."""
    first, info, committed, _ = runs["preempt"].result()
    assert first.returncode == 75, first.describe()
    assert info["exit_code"] == 75 and "preempted" in info["reason"], info
    assert "SIGUSR2" in info["reason"], info
    assert committed == ["step-00000005"], committed  # hang@5 holds the run at step 5
    assert info["last_checkpoint"] == "step-00000005"
    assert info["extra"]["requeued"] is False  # not under Slurm
    saved = first.run_dir.parent / "preempt-first-checkpoints"
    manifest = _verify(saved / "step-00000005")
    assert manifest["step"] == 5 and manifest["world_size"] == 2
    assert (saved / "latest").read_text().strip() == "step-00000005"
    assert [p.name for p in saved.iterdir() if p.name.startswith((".tmp-", ".trash-"))] == []
    assert "preempted" in first.stderr


def test_rerun_after_preemption_resumes_bit_identically(runs: dict[str, Future]) -> None:
    ref = _reference(runs)
    _, _, _, second = runs["preempt"].result()
    second.ok()
    assert "resumed from step-00000005" in _rank_log(second)
    # Steps 1-4 come from the first run, 6-12 from the resumed one (metrics append). Step 5
    # ran and was checkpointed, but the preemption stops the loop before its record is written.
    reference = {r["step"]: r for r in ref.metrics()}
    got = {r["step"]: r for r in second.metrics()}
    assert set(range(6, STEPS + 1)) <= set(got) and set(range(1, 5)) <= set(got), sorted(got)
    for step, record in got.items():
        for key in ("loss", "grad_norm", "lr"):  # lr: the cosine schedule resumed too
            assert record[key] == reference[step][key], (step, key, record, reference[step])
    assert second.exit_info()["extra"]["final_loss"] == ref.exit_info()["extra"]["final_loss"]


def test_rank_killed_restarts_group_and_resumes(runs: dict[str, Future]) -> None:
    """kill -9 of rank 1 after step 7: restart, resume from step 6, finish as if uninterrupted."""
    ref = _reference(runs)
    run = runs["kill9"].result()
    run.ok()
    log = _rank_log(run)
    assert "resumed from step-00000006" in log, log[-3000:]
    # Deterministic CPU kernels, the same data position and RNG: exactly the reference's numbers.
    assert run.exit_info()["extra"]["final_loss"] == ref.exit_info()["extra"]["final_loss"]
    assert _losses_by_step(run) == dict(enumerate(ref.losses(), start=1))
    # Steps 7 ran twice (before the kill and after the restart): the log shows both.
    steps = [r["step"] for r in _records(run) if "event" not in r]
    assert steps.count(7) == 2 and steps[-1] == STEPS, steps


@pytest.mark.parametrize("name,resumed_at,first_new", [("ddp_to_fsdp", 6, 7),
                                                        ("fsdp_to_one", 9, 10)])
def test_resume_on_other_world_size_and_strategy(runs: dict[str, Future], name: str,
                                                 resumed_at: int, first_new: int) -> None:
    """DDP x2 -> FSDP x2 -> 1 process (same global batch): the reference's losses, to rtol."""
    ref = _reference(runs)
    run = runs[name].result().ok()
    log = _rank_log(run)
    assert f"resumed from step-{resumed_at:08d}" in log, log[-3000:]
    got = _losses_by_step(run)
    assert sorted(got) == list(range(first_new, STEPS + 1)), sorted(got)
    expected = ref.losses()
    for step, loss in got.items():
        want = expected[step - 1]
        assert abs(loss - want) <= LOSS_RTOL * abs(want), (name, step, loss, want)


def test_corrupted_newest_checkpoint_falls_back(runs: dict[str, Future]) -> None:
    bad, run = runs["corrupt"].result()
    run.ok()
    log = _rank_log(run)
    assert "resumed from step-00000006" in log, log[-3000:]
    skipped = [line for line in log.splitlines() if "skipping checkpoint" in line]
    assert skipped and bad in skipped[0] and ".distcp" in skipped[0] \
        and "checksum" in skipped[0], skipped
    assert min(_losses_by_step(run)) == 1  # the copied metrics
    assert [r["step"] for r in _records(run) if "event" not in r][-8:] == list(range(7, 15))


@pytest.mark.parametrize("mode", ["true", "false"], ids=["async", "sync"])
def test_failed_save_keeps_previous_checkpoint(runs: dict[str, Future], mode: str) -> None:
    run = runs[f"io_error_async_{mode}"].result()
    assert run.returncode not in (0, None), run.describe()
    assert "checkpoint at step 6 was not committed" in run.stderr, run.describe()
    assert "step-00000003 is intact" in run.stderr, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    root = run.run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert _committed(run.run_dir) == ["step-00000003"]
    assert _leftovers(run.run_dir) == []
    assert _verify(root / "step-00000003")["step"] == 3
    info = run.exit_info()
    assert info["exit_code"] == run.returncode and "step 6" in info["reason"], info


def test_nan_step_is_skipped_and_training_goes_on(runs: dict[str, Future]) -> None:
    run = runs["nan_skip"].result().ok()
    events = [r for r in _records(run) if r.get("event") == "bad_steps"]
    assert events == [{**events[0], "step": 5, "skipped": 1}], events
    losses = run.losses()
    assert len(losses) == 8
    assert math.isnan(losses[4]), losses  # step 5's loss (left out of the mean: none left)
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != 4), losses


def test_nan_streak_rolls_back_and_completes(runs: dict[str, Future]) -> None:
    run = runs["nan_rollback"].result().ok()
    rollbacks = [r for r in _records(run) if r.get("event") == "rollback"]
    assert rollbacks, _records(run)
    first = rollbacks[0]
    assert first["bad_streak"] == 3 and first["from_step"] == 6, first
    assert first["checkpoint"].startswith("step-") and first["step"] <= first["from_step"]
    info = run.exit_info()
    assert info["exit_code"] == 0 and info["extra"]["steps"] == 14
    final = info["extra"]["final_loss"]
    # Neither NaN nor +-inf, however exit_info.json happens to encode them.
    assert isinstance(final, float) and math.isfinite(final), info
    assert "rollback" in _rank_log(run)


def test_nan_streak_without_checkpoint_fails(runs: dict[str, Future]) -> None:
    run = runs["nan_no_ckpt"].result()
    assert run.returncode not in (0, None), run.describe()
    assert "no checkpoint to roll back to" in run.stderr, run.describe()
    assert "no checkpoint to roll back to" in run.exit_info()["reason"]


def test_hang_watchdog_names_the_stuck_rank(runs: dict[str, Future]) -> None:
    run = runs["watchdog"].result()
    assert run.returncode not in (0, None), run.describe()
    assert "TIMEOUT" not in run.stderr, run.describe()
    info = run.exit_info()
    assert info["extra"].get("suspect_rank") == 1, json.dumps(info, indent=2)
    logs = {r: _rank_log(run, r) for r in (0, 1)}
    dumped = [r for r, text in logs.items()
              if "watchdog" in text and "Thread" in text and 'File "' in text]
    assert dumped, {r: t[-2000:] for r, t in logs.items()}


def test_resume_never_refuses_existing_checkpoints(runs: dict[str, Future]) -> None:
    run = runs["never"].result()
    assert run.returncode == 2, run.describe()
    assert "checkpoint.resume=never" in run.stderr and "HINT" in run.stderr, run.describe()
    assert "Traceback" not in run.stderr
    # Nothing was overwritten.
    assert _committed(run.run_dir) == ["step-00000006", "step-00000012"]


def test_resume_from_missing_path_is_a_usage_error(runs: dict[str, Future]) -> None:
    run = runs["resume_missing"].result()
    assert run.returncode == 2, run.describe()
    assert "no such checkpoint directory" in run.stderr, run.describe()
    assert "Traceback" not in run.stderr
