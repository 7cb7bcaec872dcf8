"""Experiment tracking on rank 0: TensorBoard event files and MLflow, on by config.

    track:
      tensorboard: true            # <run>/tensorboard/events.out.tfevents.*
      mlflow: true                 # <run>/mlruns (a file store), or:
      mlflow_uri: http://mlflow.example:5000   # no user:password@ (refused): credentials
      experiment: llama-sweeps                # come from MLFLOW_TRACKING_USERNAME/_PASSWORD
                                              # or MLFLOW_TRACKING_TOKEN in the environment

Every record rank 0 writes to its metrics file reaches the trackers: each number becomes a
scalar named ``<kind>/<key>`` at the record's step (``train/loss``, ``val/val_loss``,
``checkpoint/stall_s``, ``straggler/slower_by``). The resolved config goes in once, as text
(TensorBoard's "config" text, MLflow's ``config.yaml`` artifact) and as hyper-parameters
(flattened keys). Rank-wise metrics stay in ``metrics/rank-NNN.jsonl``.

A tracker never slows training or stops it: records go through a queue to one background
thread, which opens the writers (an MLflow server that does not answer delays only that thread)
and writes. A failure there is logged once and tracking stops; training goes on.

Run directory: ``tensorboard/`` (event files) and ``mlruns/`` (the local MLflow file store)
when enabled. MLflow 3 keeps the file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE=true``: that is set for this process when the store is a folder
(a file store needs no database, and Lustre/NFS hold it well); ``mlflow_uri`` takes any other
store (``sqlite:///...`` needs the full ``mlflow`` package, a server needs only the client).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.runtime.redact import redact_uri, uri_secrets

log = logging.getLogger("hpctrain.track")

# Keys of a metrics record that are bookkeeping, not metrics.
_NOT_METRICS = {"ts", "rank", "step", "event", "host"}
# How long closing waits for the queue to drain (an unreachable server must not hold the exit).
# A preempted or failed run waits less: its requeue and its grace period come first.
CLOSE_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_ABORTED_S = 10.0


@dataclass
class TrackConfig:
    """Config section ``track:``: TensorBoard and MLflow, written by rank 0."""

    tensorboard: bool = False
    mlflow: bool = False
    # None: a file store in <run>/mlruns. Else any MLflow tracking URI (http://, file:, ...).
    mlflow_uri: str | None = None
    experiment: str = "hpctrain"

    def validate(self) -> None:
        """A non-empty experiment name; a URI without credentials, only where MLflow is on."""
        if self.mlflow_uri is not None:
            refuse_credentials(self.mlflow_uri)
        if not self.experiment.strip():
            raise ConfigError("track.experiment is empty", expected="an experiment name")
        if self.mlflow_uri is not None and not self.mlflow:
            raise ConfigError(f"track.mlflow_uri = {self.mlflow_uri!r} but track.mlflow is off",
                              hint="set track.mlflow=true to log to it")
        check_installed(self)


def refuse_credentials(uri: str) -> None:
    """Refuse a tracking URI that carries a password or token: the config is written into the
    run directory, the run lock and the job scripts, where others can read it."""
    secrets = uri_secrets(uri)
    if secrets:
        raise ConfigError(
            f"track.mlflow_uri = {redact_uri(uri)!r} holds a credential "
            f"({', '.join(secrets)})",
            expected="a URI without credentials, e.g. https://mlflow.example:5000",
            hint="give them to MLflow through the environment, which hpctrain never records: "
            "export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
            "MLFLOW_TRACKING_TOKEN for a bearer token")


def check_installed(cfg: TrackConfig) -> None:
    """Refuse, before training, a tracker whose package is not installed."""
    wanted = [("tensorboard", "tensorboard")] if cfg.tensorboard else []
    wanted += [("mlflow", "mlflow-skinny")] if cfg.mlflow else []
    for module, package in wanted:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"track.{module}=true but the {module} package is not installed",
                hint=f"pip install 'hpctrain[track]' (or pip install {package}), or set "
                f"track.{module}=false")


def metric_items(record: dict[str, Any]) -> tuple[int | None, dict[str, float]]:
    """(step, {"<kind>/<key>": value}) for every finite number of a metrics record."""
    kind = record.get("event") or ("val" if "val_loss" in record else "train")
    step = record.get("step")
    values = {}
    for key, value in record.items():
        if key in _NOT_METRICS or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            values[f"{kind}/{key}"] = float(value)
    return (int(step) if isinstance(step, int | float) else None), values


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become their text."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif value is None or isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class _TensorBoard:
    def __init__(self, folder: Path, config: dict[str, Any], config_text: str):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=30)
        self.writer.add_text("config", f"```yaml\n{config_text}\n```", 0)
        # hparams() gives the three summaries add_hparams would write into a new sub-folder;
        # written here they belong to this run's own event file.
        hp = {k: ("null" if v is None else v) for k, v in flatten(config).items()}
        for summary in hparams(hp, {"train/loss": float("nan")}):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int | None, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


class _MLflow:
    def __init__(self, uri: str, experiment: str, run_name: str, config: dict[str, Any],
                 config_text: str):
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        # MLflow caps a parameter value at 6000 characters; a config value is far shorter.
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def log(self, step: int | None, values: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._metric(k, v, now, step or 0) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class Tracker:
    """Rank 0's trackers behind a queue; ``__call__`` takes a metrics record (never blocks)."""

    def __init__(self, cfg: TrackConfig, run_dir: Path, run_name: str, config: dict[str, Any],
                 config_text: str):
        check_installed(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._args = (run_name, config, config_text)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: list[Any] = []
        self._thread = threading.Thread(target=self._work, name="hpctrain-track", daemon=True)
        self._thread.start()

    def __call__(self, record: dict[str, Any]) -> None:
        """Queue one metrics record for the trackers."""
        self._queue.put(record)

    def close(self, status: str = "FINISHED", timeout: float | None = None) -> None:
        """Flush what is queued, end the run with ``status`` (FINISHED, FAILED, KILLED)."""
        if timeout is None:
            timeout = CLOSE_TIMEOUT_S if status == "FINISHED" else CLOSE_TIMEOUT_ABORTED_S
        self._queue.put(("close", status))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracking: gave up waiting %.0f s for the trackers to finish writing",
                        timeout)

    def _open(self) -> None:
        run_name, config, text = self._args
        if self.cfg.tensorboard:
            self._sinks.append(_TensorBoard(self.run_dir / "tensorboard", config, text))
        if self.cfg.mlflow:
            uri = self.cfg.mlflow_uri or (self.run_dir / "mlruns").resolve().as_uri()
            self._sinks.append(_MLflow(uri, self.cfg.experiment, run_name, config, text))

    def _work(self) -> None:
        try:
            self._open()
        except Exception as e:  # a tracker must never end the run
            log.warning("tracking disabled: could not open the trackers: %s: %s",
                        type(e).__name__, e)
            self._sinks = []
        while True:
            item = self._queue.get()
            if isinstance(item, tuple):
                for sink in self._sinks:
                    try:
                        sink.close(item[1])
                    except Exception as e:
                        log.warning("tracking: closing %s failed: %s", type(sink).__name__, e)
                return
            step, values = metric_items(item)
            for sink in list(self._sinks):
                try:
                    sink.log(step, values)
                except Exception as e:
                    log.warning("tracking: %s stopped after an error: %s: %s",
                                type(sink).__name__.strip("_"), type(e).__name__, e)
                    self._sinks.remove(sink)
