"""Everything one run directory says about its run, read once for ``report`` and ``runs``.

Reads (all optional except that the folder must look like a run): ``config/config.yaml``,
``provenance/provenance.json``, ``exit_info.json``, ``goodput.json`` (observe/goodput.py),
``metrics/rank-*.jsonl``, ``logs/rank-000.log`` (preemption lines), ``forensics/fr-rank-*.json``
(runtime/watchdog.py), ``profiles/`` and ``run.lock``. A file that is missing or unreadable
leaves its part empty; nothing here raises for a damaged run except a folder that is no run.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from hpctrain.errors import HpctrainError
from hpctrain.observe.goodput import ACCOUNT_RECORD
from hpctrain.observe.metrics import read_metrics
from hpctrain.records import BadRecord
from hpctrain.runtime.exit_info import read_exit_info
from hpctrain.runtime.runlock import LOCK_NAME, JobAttempt, inspect_lock, stale_reason
from hpctrain.runtime.safe_open import UnsafeRunPath, open_read, read_bytes
from hpctrain.runtime.watchdog import read_flight_records, unjoined_collective
from hpctrain.shown import quoted

GOODPUT_FILE = "goodput.json"
GOODPUT_PARTS = ("startup", "checkpoint", "data_wait", "validation", "lost_work",
                 "restart_gap", "hang")
# "2026-11-26 10:32:05,759 [rank 0/2 host] WARNING hpctrain.train: preemption (SIGUSR2): ..."
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \[[^\]]*\] (\w+) [\w.]+: (.*)$")
_PREEMPTION = re.compile(r"preemption \((.*?)\): checkpointing at step (\d+)")


class NotARunError(HpctrainError):
    """A path given as a run directory is not one."""


@dataclass
class RunData:
    """One run directory, parsed."""

    root: Path
    config: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None
    exit_info: dict[str, Any] | None = None
    goodput: dict[str, Any] | None = None
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    log_events: list[dict[str, Any]] = field(default_factory=list)
    flight_records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    lock: dict[str, Any] | None = None
    lock_age_s: float | None = None
    # What was wrong with each damaged file read as absent (exit info, goodput account).
    damaged: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The run's folder name."""
        return self.root.name

    def train_records(self, rank: int = 0) -> list[dict[str, Any]]:
        """The training-window records of ``rank`` (no events, no validation)."""
        return [r for r in self.ranks.get(rank, [])
                if "event" not in r and "loss" in r and "val_loss" not in r]

    def val_records(self) -> list[dict[str, Any]]:
        """Validation records (rank 0)."""
        return [r for r in self.ranks.get(0, []) if "val_loss" in r]

    def events(self, kind: str | None = None, rank: int | None = 0) -> list[dict[str, Any]]:
        """Event records of ``rank`` (all ranks when None), of one ``kind`` if given."""
        ranks = self.ranks.values() if rank is None else [self.ranks.get(rank, [])]
        return [r for records in ranks for r in records
                if "event" in r and (kind is None or r["event"] == kind)]

    def hosts(self) -> dict[int, str]:
        """Host of each rank, from its metrics."""
        hosts = {}
        for rank, records in self.ranks.items():
            for r in records:
                if isinstance(r.get("host"), str):
                    hosts[rank] = r["host"]
                    break
        return hosts

    def start_ts(self) -> float | None:
        """Wall time of the first record of the run (any rank)."""
        stamps = [r["ts"] for records in self.ranks.values() for r in records[:1]
                  if isinstance(r.get("ts"), int | float)]
        return min(stamps) if stamps else None

    def collective(self) -> dict[str, Any] | None:
        """The collective that some ranks did not join in the last hang, if recorded."""
        extra = (self.exit_info or {}).get("extra") or {}
        if isinstance(extra.get("collective"), dict):
            return extra["collective"]
        if self.flight_records:
            world = max(len(self.ranks), max(self.flight_records) + 1)
            return unjoined_collective(self.flight_records, world)
        return None

    def lock_alive(self) -> bool:
        """Whether ``run.lock`` is held: a fresh heartbeat, or a live process on this host."""
        if self.lock_age_s is None:
            return False
        return stale_reason(self.lock or None, self.lock_age_s, JobAttempt(None, (0, 0))) is None


# Every file of a run directory is read through safe_open: a link or FIFO planted in a shared
# folder is read as unreadable, never followed or waited on.

def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(read_bytes(path))
    except (OSError, ValueError, UnsafeRunPath):
        return None
    return data if isinstance(data, dict) else None


def _read_account(path: Path) -> dict[str, Any] | None:
    """``goodput.json`` checked; None when missing, BadRecord when damaged."""
    try:
        data = json.loads(read_bytes(path))
    except FileNotFoundError:
        return None
    except UnsafeRunPath as e:
        raise BadRecord(e.what) from None
    except (OSError, ValueError) as e:
        raise BadRecord(f"{path} is unreadable ({quoted(str(e))})") from None
    return ACCOUNT_RECORD.check(data, path)


def _checked(run: RunData, path: Path,
             read: Callable[[Path], dict[str, Any] | None]) -> dict[str, Any] | None:
    """``read(path)``; a damaged file is noted in ``run.damaged`` and read as absent."""
    try:
        return read(path)
    except BadRecord as e:
        run.damaged.append(e.render())
        return None


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a run directory (metrics, config or exit info in it)."""
    return path.is_dir() and any((path / p).exists()
                                 for p in ("metrics", "config/config.yaml", "exit_info.json"))


def load_run(path: Path, *, metrics: bool = True) -> RunData:
    """Read a run directory (``metrics=False``: leave the per-rank metrics unread)."""
    root = Path(path)
    if not is_run_dir(root):
        raise NotARunError(f"{root} is not a run directory",
                           expected="a folder with metrics/, config/config.yaml or "
                           "exit_info.json (what `hpctrain train` writes under run.out_dir)",
                           hint="pass runs/<name>; `hpctrain runs runs/` lists them")
    run = RunData(root=root)
    try:
        config = yaml.safe_load(read_bytes(root / "config" / "config.yaml").decode("utf-8"))
        run.config = config if isinstance(config, dict) else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError, UnsafeRunPath):
        pass
    if run.config is not None:
        _with_auto_values(run.config, root / "config" / "auto.yaml")
    run.provenance = _json(root / "provenance" / "provenance.json")
    run.exit_info = _checked(run, root / "exit_info.json", read_exit_info)
    run.goodput = _checked(run, root / GOODPUT_FILE, _read_account)
    if metrics:
        for file in sorted((root / "metrics").glob("rank-*.jsonl")):
            try:
                rank = int(file.stem.split("-")[1])
                run.ranks[rank] = read_metrics(file)
            except (ValueError, IndexError, OSError, UnicodeDecodeError, UnsafeRunPath):
                continue
        run.log_events = _log_events(root / "logs" / "rank-000.log")
        run.flight_records = read_flight_records(root)
    try:
        # The lock as `acquire` reads it: every field checked, the age by our own clock.
        holder, key, age = inspect_lock(root / LOCK_NAME)
    except (OSError, UnsafeRunPath):
        key = None  # a folder or link there: no run holds it (acquire refuses it)
    if key is not None:
        run.lock_age_s, run.lock = age, holder or {}
    return run


def _with_auto_values(config: dict[str, Any], path: Path) -> None:
    """Set the values auto chose for the run's ranks (config/auto.yaml) where its config.yaml
    keeps ``auto``: the runs and reports show what trained."""
    try:
        chosen = yaml.safe_load(read_bytes(path).decode("utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError, UnsafeRunPath):
        return
    values = chosen.get("values") if isinstance(chosen, dict) else None
    for key, value in (values or {}).items() if isinstance(values, dict) else ():
        section, _, name = str(key).partition(".")
        if isinstance(config.get(section), dict) and name:
            config[section][name] = value


def last_train_record(root: Path) -> dict[str, Any] | None:
    """Rank 0's newest training record, read from the end of its file (files grow large)."""
    path = Path(root) / "metrics" / "rank-000.jsonl"
    try:
        with open_read(path) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            tail = f.read().decode("utf-8", errors="replace").splitlines()
    except (OSError, UnsafeRunPath):
        return None
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record and "event" not in record:
            return record
    return None


def recorded_tokens_per_s(run: RunData) -> float | None:
    """The run's tokens/s per rank as its training recorded it when it ended (completed or
    preempted) in ``exit_info.json``: one number, defined by ``hpctrain.train.window.
    Throughput`` (tokens one rank trained in the logging windows after the first ÷ their wall
    time, validation and start-up left out). None when the run recorded none."""
    extra = (run.exit_info or {}).get("extra")
    rate = extra.get("tokens_per_s") if isinstance(extra, dict) else None
    return float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None


def _log_events(path: Path) -> list[dict[str, Any]]:
    """Preemptions as the rank-0 log tells them (exit_info keeps only the last one)."""
    events = []
    try:
        with io.TextIOWrapper(open_read(path), encoding="utf-8", errors="replace") as f:
            for line in f:
                if "preemption (" not in line:
                    continue
                m = _LOG_LINE.match(line.rstrip("\n"))
                p = _PREEMPTION.search(line)
                if m is None or p is None:
                    continue
                ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                events.append({"event": "preemption", "ts": ts + int(m.group(2)) / 1000,
                               "signal": p.group(1), "step": int(p.group(2))})
    except (OSError, UnsafeRunPath):
        pass
    return events


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for the config difference between runs)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
