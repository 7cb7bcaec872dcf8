"""Observation in real runs: 2 CPU ranks (gloo, DDP) through the real CLI, two runs side by side.

- ``observed``: rank 1 is slow on purpose (``slow@`` fault: 0.5 s inside each forward pass)
  and is named a straggler, with its host, in the log, the metrics and the report; a profile
  planned by ``profile.steps`` and one asked for with SIGURG (sent to rank 1 only) are both
  written by both ranks; TensorBoard and MLflow are read back with their own readers.
- ``hung``: rank 1 is held before step 3; the watchdog fires on both ranks, each dumps its
  flight recorder, and the collective rank 1 never joined is named, in exit_info.json and by
  ``hpctrain report``; rank 0's tracker wrote what it had before the exit; ``hpctrain runs``
  says hung.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import forked
from conftest import DEMO, QUIET, TINY, RunResult, cli_env, kill_group, train
from hpctrain.cli import main
from hpctrain.observe.metrics import read_metrics

TIMEOUT_S = 240.0
TWO = ["parallel.strategy=ddp", "train.micro_batch=2", "run.device=cpu"]
OBSERVED = [*TWO, "train.steps=9", "metrics.straggler_threshold=0.05", "profile.steps=[7,8]",
            "profile.signal_steps=2", "track.tensorboard=true", "track.mlflow=true",
            "checkpoint.interval=none", "checkpoint.save_at_end=false"]
# Rank 1 sleeps 0.5 s in each forward pass; every rank holds before step 2 until the test has
# sent SIGURG (once the ranks have written their pids) and created the file `until` names, so
# the signal lands before step 2 ends.
OBSERVED_FAULTS = "slow@step=1-9,rank=1,seconds=0.5;hang@step=2,seconds=120,until={signalled}"


def _observed(out: Path) -> RunResult:
    args = ["train", DEMO, *TINY, *QUIET, f"run.out_dir={out}", "run.name=observed",
            *OBSERVED, "--nproc", "2"]
    env = cli_env()
    sent = out / "sigurg-sent"
    env["HPCTRAIN_FAULTS"] = OBSERVED_FAULTS.format(signalled=sent)
    proc = forked.Popen(args, env)
    metrics = out / "observed" / "metrics" / "rank-001.jsonl"
    signalled = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while signalled is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [r["pid"] for r in (read_metrics(metrics) if metrics.exists() else [])
                    if r.get("event") == "observe"]
            if pids:  # written after the handler is installed: the signal is never lost
                os.kill(pids[-1], signal.SIGURG)
                signalled = pids[-1]
                sent.touch()
        out_text, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out_text, err = proc.communicate()
        err += "\n[test] TIMEOUT"
    finally:
        kill_group(proc)
    return RunResult(args, proc.returncode, out_text, err + f"\n[test] SIGURG to {signalled}",
                     out / "observed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    out = tmp_path_factory.mktemp("observe")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"observed": pool.submit(_observed, out)}
        env_faults = "hang@step=3,rank=1,seconds=600"

        def hung() -> RunResult:
            os_env = dict(os.environ)
            try:
                os.environ["HPCTRAIN_FAULTS"] = env_faults
                return train(out, "hung", *TWO, "watchdog.timeout=4", "track.tensorboard=true",
                             "checkpoint.interval=none", nproc=2, steps=6, timeout=TIMEOUT_S)
            finally:
                os.environ.clear()
                os.environ.update(os_env)

        futures["hung"] = pool.submit(hung)
        yield futures


def _events(run: RunResult, kind: str, rank: int = 0) -> list[dict]:
    return [r for r in read_metrics(run.run_dir / "metrics" / f"rank-{rank:03d}.jsonl")
            if r.get("event") == kind]


def test_slow_rank_is_named_with_its_host(runs: dict[str, Future]) -> None:
    run = runs["observed"].result().ok()
    named = _events(run, "straggler")
    assert [e["straggler_rank"] for e in named] == [1], run.describe()
    host = run.metrics(1)[0]["host"]
    assert named[0]["straggler_host"] == host and named[0]["slower_by"] > 0.05
    assert f"straggler: rank 1 on {host} is slower" in (run.run_dir / "logs" / "rank-000.log"
                                                         ).read_text()
    for rank in (0, 1):  # every rank records its own time; rank 1's holds the sleep
        assert all("own_time_s" in r and r["fwd_time_s"] is not None for r in run.metrics(rank))
    assert run.metrics(1)[-1]["fwd_time_s"] > 0.4 > run.metrics(0)[-1]["fwd_time_s"]


def test_profiles_by_config_and_by_signal_on_every_rank(runs: dict[str, Future]) -> None:
    run = runs["observed"].result().ok()
    for rank in (0, 1):
        profiles = {e["trigger"]: e for e in _events(run, "profile", rank)}
        assert set(profiles) == {"config", "signal"}, run.describe()
        assert (profiles["config"]["first_step"], profiles["config"]["last_step"]) == (7, 8)
        sig = profiles["signal"]
        # Rank 0 was not signalled: the ranks agreed at a logging window, so both profile
        # the same two steps.
        assert sig["last_step"] - sig["first_step"] == 1 and sig["first_step"] in (2, 3)
        for e in profiles.values():
            trace = json.loads((run.run_dir / e["trace"]).read_text())
            assert trace["traceEvents"], e["trace"]
            assert e["memory_snapshot"] is None  # CPU: no CUDA memory snapshot
    assert _events(run, "profile", 0)[0]["first_step"] == _events(run, "profile", 1)[0][
        "first_step"]


def test_trackers_read_back(runs: dict[str, Future], monkeypatch) -> None:
    run = runs["observed"].result().ok()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks it of a file store
    acc = EventAccumulator(str(run.run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 10))
    assert [e.step for e in acc.Scalars("straggler/slower_by")] == [
        _events(run, "straggler")[0]["step"]]
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").resolve().as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("hpctrain").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "observed"
    losses = [m.value for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
    assert losses == pytest.approx(run.losses())


def test_report_and_runs_of_the_observed_run(runs: dict[str, Future], capsys) -> None:
    run = runs["observed"].result().ok()
    main(["report", str(run.run_dir)])
    html = (run.run_dir / "report.html").read_text()
    host = run.metrics(1)[0]["host"]
    assert f"rank 1 on host <b>{host}</b>" in html
    assert "profiles/step-000007-000008/rank-001.trace.json" in html
    main(["runs", str(run.run_dir.parent), "--json"])
    rows = {r["run"]: r for r in map(json.loads, capsys.readouterr().out.splitlines()[1:])}
    assert rows["observed"]["state"] == "done" and rows["observed"]["step"] == 9


def test_hang_names_the_collective_rank_1_never_joined(runs: dict[str, Future],
                                                       capsys) -> None:
    run = runs["hung"].result()
    assert run.returncode not in (0, None) and "TIMEOUT" not in run.stderr, run.describe()
    info = run.exit_info()
    extra = info["extra"]
    assert info["exit_code"] == 124 and extra["suspect_rank"] == 1, json.dumps(info, indent=2)
    collective = extra["collective"]
    assert collective["missing"] == [1] and collective["joined"] == [0], collective
    assert collective["op"].startswith("gloo:"), collective
    assert "not by rank(s) 1" in info["reason"]
    for rank in (0, 1):
        dump = json.loads((run.run_dir / "forensics" / f"fr-rank-{rank:03d}.json").read_text())
        assert dump["rank"] == rank and dump["entries"]
    # The rank whose watchdog fired first wrote the account (and logged it); the other may be
    # ended by the launcher before its own watchdog fires.
    fired = run.run_dir / "logs" / f"rank-{extra['rank']:03d}.log"
    assert "flight recorder: collective" in fired.read_text()

    main(["report", str(run.run_dir)])
    html = (run.run_dir / "report.html").read_text()
    assert "Hang forensics" in html and "rank <b>1</b> on host" in html
    assert "but not by rank(s) 1" in html
    main(["runs", str(run.run_dir), "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["state"] == "hung"
    # Rank 0's tracker wrote what it held before the watchdog ended the process.
    acc = EventAccumulator(str(run.run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
