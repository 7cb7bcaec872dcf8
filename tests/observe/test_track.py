"""TensorBoard and MLflow trackers, read back with the libraries' own readers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hpctrain.config import dump_yaml, load_config, to_dict
from hpctrain.errors import ConfigError
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.track import TrackConfig, Tracker, metric_items
from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.rundir import RunDir

RECORDS = [
    {"ts": 1.0, "rank": 0, "host": "h", "step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0,
     "tokens_per_s": 100.0, "mfu": None},
    {"ts": 2.0, "rank": 0, "host": "h", "step": 2, "loss": 5.0, "lr": 2e-3, "grad_norm": 1.5,
     "tokens_per_s": 110.0, "mfu": None},
    {"ts": 3.0, "rank": 0, "host": "h", "step": 2, "val_loss": 5.2, "val_ppl": 181.0},
    {"ts": 4.0, "rank": 0, "host": "h", "event": "checkpoint_stall", "step": 2,
     "stall_s": 0.25, "async": False},
    {"ts": 5.0, "rank": 0, "host": "h", "step": 3, "loss": float("nan"), "lr": 3e-3},
]


def test_metric_items_names_every_finite_number_by_kind() -> None:
    assert metric_items(RECORDS[0]) == (1, {"train/loss": 5.5, "train/lr": 1e-3,
                                            "train/grad_norm": 2.0,
                                            "train/tokens_per_s": 100.0})
    assert metric_items(RECORDS[2]) == (2, {"val/val_loss": 5.2, "val/val_ppl": 181.0})
    assert metric_items(RECORDS[3]) == (2, {"checkpoint_stall/stall_s": 0.25})
    assert metric_items(RECORDS[4]) == (3, {"train/lr": 3e-3})  # NaN left out


def _env() -> ProcessEnv:
    from hpctrain.runtime.env import detect_env

    return detect_env()


def test_both_trackers_read_back(tmp_path: Path) -> None:
    cfg = load_config("configs/demo.yaml", ["track.tensorboard=true", "track.mlflow=true",
                                            "track.experiment=exp-a"])
    run_dir = RunDir(tmp_path / "run-a")
    run_dir.create()
    with MetricsWriter(run_dir, _env()) as metrics:
        metrics.add_sink(Tracker(cfg.track, run_dir.root, "run-a", to_dict(cfg),
                                 dump_yaml(cfg)))
        for record in RECORDS:
            metrics.write({k: v for k, v in record.items() if k not in ("ts", "rank", "host")})

    events = list((run_dir.root / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # hparams went into the run's own event file, no sub-folder
    acc = EventAccumulator(str(run_dir.root / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/val_loss",
            "checkpoint_stall/stall_s"} <= set(tags["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 5.5), (2, 5.0)]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3]
    assert math.isclose(acc.Scalars("val/val_loss")[0].value, 5.2, rel_tol=1e-6)
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "strategy: ddp" in text and "exp-a" in text

    client = MlflowClient(tracking_uri=(run_dir.root / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("exp-a")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 5.5), (2, 5.0)]
    assert client.get_metric_history(run.info.run_id, "val/val_loss")[0].value == 5.2
    assert run.data.params["parallel.strategy"] == "ddp"
    assert run.data.params["optim.lr"] == str(cfg.optim.lr)
    local = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(local).read_text())["track"]["experiment"] == "exp-a"


@pytest.mark.parametrize("error, status", [(None, "FINISHED"), (KeyboardInterrupt, "KILLED"),
                                           (RuntimeError, "FAILED")])
def test_sinks_close_with_the_runs_outcome(tmp_path: Path, error, status: str) -> None:
    closed: list[str] = []

    class Sink:
        def __call__(self, record: dict) -> None:
            seen.append(record)

        def close(self, how: str) -> None:
            closed.append(how)

    seen: list[dict] = []
    run_dir = RunDir(tmp_path)
    with pytest.raises(error) if error else _nothing(), MetricsWriter(run_dir, _env()) as m:
        m.add_sink(Sink())
        m.write({"step": 1, "loss": 2.0})
        if error:
            raise error()
    assert closed == [status] and seen[0]["loss"] == 2.0 and seen[0]["rank"] == 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_an_unreachable_tracking_server_never_blocks_training(tmp_path: Path, caplog) -> None:
    """MLflow's client retries a refused server for minutes, in the background thread only:
    records queue without waiting, and closing gives up after its timeout with a warning."""
    cfg = TrackConfig(mlflow=True, mlflow_uri="http://127.0.0.1:9/")  # discard port: refused
    tracker = Tracker(cfg, tmp_path, "r", {}, "")
    for step in range(1, 1001):
        tracker({"step": step, "loss": 1.0})
    tracker.close("FINISHED", timeout=0.5)
    assert "gave up waiting" in caplog.text


def test_a_missing_tracker_package_is_refused_before_training(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(None, ["track.tensorboard=true"])
    assert "pip install 'hpctrain[track]'" in err.value.hint


def test_a_uri_without_mlflow_is_refused() -> None:
    with pytest.raises(ConfigError, match="track.mlflow is off"):
        load_config(None, ["track.mlflow_uri=http://x:5000"])


@pytest.mark.parametrize("status, wait", [("FINISHED", 60.0), ("KILLED", 10.0),
                                          ("FAILED", 10.0)])
def test_a_preempted_or_failed_run_waits_less_for_its_trackers(tmp_path: Path, status: str,
                                                               wait: float) -> None:
    """A requeue and the grace period before SIGKILL come before a slow tracking server."""
    tracker = Tracker(TrackConfig(), tmp_path, "r", {}, "")  # no sink: the thread just ends
    waited: list[float] = []
    join = tracker._thread.join
    tracker._thread.join = lambda timeout: (waited.append(timeout), join(timeout))
    tracker.close(status)
    assert waited == [wait]
