"""Hang watchdog: a step that outlives ``watchdog.timeout`` ends the process with evidence.

A hung collective is silent: every live rank waits for the one that died or stalled, and the
allocation burns until walltime. Each rank beats once per step (a local timestamp, plus its
step number in the job's key-value store). When a beat is overdue, the watchdog thread dumps all
thread stacks and the phase the rank was in into its log, reads the other ranks' last steps
from the store to name the rank that fell behind, writes ``exit_info.json`` and exits with
code 124, so a launcher or Slurm can restart the job from its last checkpoint.

Before that, every rank dumps PyTorch's flight recorder: the ring buffer of the last
``watchdog.flight_recorder`` collectives per process group (NCCL's own recorder on GPUs, the
generic one that gloo writes on CPUs), sized through ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and
``TORCH_FR_BUFFER_SIZE`` before the process group starts (``enable_flight_recorder``). The
firing rank waits briefly for its peers' dumps and names, per process group, the newest
collective some ranks entered and others did not (:func:`unjoined_collective`).

Run directory (documented contract):

    forensics/fr-rank-000.json   {"rank", "host", "step", "phase", "entries": [flight recorder
                                 entries: process_group, collective_seq_id, profiling_name,
                                 state, ...]} written by each rank whose watchdog fired

``exit_info.json``'s ``extra`` gains ``collective``: {"process_group", "seq", "op", "joined",
"missing"} when the dumps tell it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.errors import ConfigError
from hpctrain.runtime.exit_codes import HUNG
from hpctrain.runtime.rundir import RunDir, write_json_atomic

if TYPE_CHECKING:
    import torch.distributed as dist

# torch is imported where it is used: `hpctrain runs` and `report` read this module's records
# and should not wait for torch to load.

log = logging.getLogger("hpctrain.watchdog")


@dataclass
class WatchdogConfig:
    """Config section ``watchdog:``."""

    enabled: bool = True
    # Seconds one step (data, forward/backward, update, control exchange) may take.
    timeout: float = 600.0
    # Collectives kept per process group by PyTorch's flight recorder (0: off). Recording is
    # a few microseconds per collective; the dump happens only when the watchdog fires.
    flight_recorder: int = 2000
    # Seconds the firing rank waits for its peers' flight-recorder dumps before it judges.
    peer_dump_wait_s: float = 10.0

    def validate(self) -> None:
        """A positive timeout; no negative buffer or wait."""
        if self.timeout <= 0:
            raise ConfigError(f"watchdog.timeout = {self.timeout} must be positive (seconds)")
        if self.flight_recorder < 0:
            raise ConfigError(f"watchdog.flight_recorder = {self.flight_recorder} must be >= 0")
        if self.peer_dump_wait_s < 0:
            raise ConfigError(f"watchdog.peer_dump_wait_s = {self.peer_dump_wait_s} must be >= 0")


FORENSICS_DIR = "forensics"


def enable_flight_recorder(cfg: WatchdogConfig) -> None:
    """Size PyTorch's flight recorder (read when a process group starts); a user's value wins."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    if not cfg.enabled or cfg.flight_recorder <= 0 or any(n in os.environ for n in names):
        return
    import torch

    # PyTorch 2.8 renamed the variable (the old name still works there, with a warning).
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    os.environ[names[0] if (major, minor) >= (2, 8) else names[1]] = str(cfg.flight_recorder)


def flight_record_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its flight-recorder dump."""
    return Path(run_dir) / FORENSICS_DIR / f"fr-rank-{rank:03d}.json"


def dump_flight_recorder(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """This process's flight-recorder entries (NCCL's and the generic recorder's), or [].

    The NCCL dump asks the communicators for their state and could block on a broken one: it
    runs in a helper thread, abandoned after ``timeout_s``.
    """
    result: list[dict[str, Any]] = []

    def collect() -> None:
        import torch

        c10d = torch._C._distributed_c10d
        for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
            dump = getattr(c10d, name, None)
            if dump is None:
                continue
            try:
                data = json.loads(dump(includeCollectives=True, onlyActive=False))
            except Exception as e:  # a recorder that is off or broken: the other may work
                log.warning("watchdog: %s failed: %s", name, e)
                continue
            for entry in data.get("entries") or []:
                entry["recorder"] = "nccl" if "nccl" in name else "generic"
                result.append(entry)

    helper = threading.Thread(target=collect, name="hpctrain-fr-dump", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        log.error("watchdog: the flight-recorder dump did not return in %.0f s", timeout_s)
        return []
    return list(result)


def _group_key(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, list | tuple) and group:
        return str(group[0])
    return str(group if group is not None else entry.get("pg_id"))


def unjoined_collective(dumps: dict[int, list[dict[str, Any]]], world_size: int
                        ) -> dict[str, Any] | None:
    """The newest collective that some ranks entered and others did not, from their dumps.

    Per process group, each rank's newest collective sequence number is compared: ranks whose
    newest is older than the group's newest never entered it. Where every dumping rank is
    level, ranks that left no dump (dead, or stuck where their watchdog could not run) are the
    missing ones of the newest collective still open. Point-to-point entries are left out
    (their sequence numbers count per peer pair).
    """
    newest: dict[str, dict[int, int]] = {}
    entries: dict[tuple[str, int], dict[str, Any]] = {}
    for rank, records in dumps.items():
        for entry in records:
            seq = entry.get("collective_seq_id")
            if entry.get("is_p2p") or not isinstance(seq, int) or seq <= 0:
                continue
            key = _group_key(entry)
            ranks = newest.setdefault(key, {})
            ranks[rank] = max(ranks.get(rank, 0), seq)
            entries.setdefault((key, seq), entry)
    no_dump = sorted(set(range(world_size)) - set(dumps))
    found = None
    for key, ranks in newest.items():
        top = max(ranks.values())
        missing = sorted(r for r, seq in ranks.items() if seq < top)
        entry = entries[(key, top)]
        if not missing:
            if not no_dump or entry.get("retired"):
                continue
            missing = no_dump
        candidate = {"process_group": key, "seq": top, "op": entry.get("profiling_name"),
                     "state": entry.get("state"), "input_sizes": entry.get("input_sizes"),
                     "joined": sorted(r for r, seq in ranks.items() if seq == top),
                     "missing": missing, "no_dump": no_dump,
                     "time_created_ns": entry.get("time_created_ns")}
        # Of several groups, the one whose collective was entered last is where the ranks
        # wait now (an earlier group's gap is an older, finished story only if retired).
        if found is None or (candidate["time_created_ns"] or 0) > (found["time_created_ns"] or 0):
            found = candidate
    return found


def read_flight_records(run_dir: Path, since: float = 0.0) -> dict[int, list[dict[str, Any]]]:
    """The flight-recorder dumps in ``<run>/forensics`` written at or after ``since`` (Unix
    time), by rank; unreadable ones are skipped."""
    dumps: dict[int, list[dict[str, Any]]] = {}
    folder = Path(run_dir) / FORENSICS_DIR
    for path in sorted(folder.glob("fr-rank-*.json")) if folder.is_dir() else []:
        try:
            if path.stat().st_mtime < since:
                continue  # an earlier attempt's
            data = json.loads(path.read_text())
            dumps[int(data["rank"])] = list(data.get("entries") or [])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return dumps


def describe_collective(found: dict[str, Any]) -> str:
    """One line naming the collective and the ranks that did not join it."""
    missing = ", ".join(str(r) for r in found["missing"])
    return (f"collective {found['op']} #{found['seq']} of process group {found['process_group']}"
            f" was entered by rank(s) {', '.join(str(r) for r in found['joined'])} but not by "
            f"rank(s) {missing}")


class Watchdog:
    """Per-rank deadline on step progress, checked by a daemon thread."""

    def __init__(self, cfg: WatchdogConfig, run_dir: RunDir, rank: int, hosts: list[str],
                 store: dist.Store | None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = rank
        self.hosts = hosts  # host of each rank, by rank
        self.store = store
        self._deadline_paused = True  # armed by the first beat after start-up/compilation
        self._started = time.time()
        self._last = time.monotonic()
        self._step = 0
        self._phase = "start-up"
        self._stop = threading.Event()
        self._on_fire: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog",
                                        daemon=True)
        if cfg.enabled:
            self._thread.start()

    def beat(self, step: int, phase: str) -> None:
        """Record progress: this rank is at ``step`` doing ``phase``."""
        self._last = time.monotonic()
        self._step, self._phase = step, phase
        self._deadline_paused = False
        if self.store is not None and phase == "data":  # once per step
            self.store.set(f"hpctrain/hb/{self.rank}", str(step))

    @contextlib.contextmanager
    def paused(self, phase: str):
        """No deadline inside (checkpoint load, blocking save): their length is not a hang."""
        self._phase, self._deadline_paused = phase, True
        try:
            yield
        finally:
            self._last, self._deadline_paused = time.monotonic(), False

    def stop(self) -> None:
        """End the watch (normal exit)."""
        self._stop.set()

    def on_fire(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the watchdog fires, before the process exits."""
        self._on_fire.append(callback)

    def _watch(self) -> None:
        interval = min(5.0, self.cfg.timeout / 4)
        while not self._stop.wait(interval):
            if not self._deadline_paused and time.monotonic() - self._last > self.cfg.timeout:
                self._fire()

    def _fire(self) -> None:
        waited = time.monotonic() - self._last
        log.error("watchdog: step %d exceeded %.0f s (%.0f s in phase %r); thread stacks follow",
                  self._step + 1, self.cfg.timeout, waited, self._phase)
        for handler in logging.getLogger("hpctrain").handlers:
            stream = getattr(handler, "stream", None)
            if stream is not None and hasattr(stream, "fileno"):
                with contextlib.suppress(Exception):
                    stream.flush()
                    faulthandler.dump_traceback(file=stream, all_threads=True)
                    stream.flush()
        suspect, steps = self._suspect()
        named = (f"suspected rank {suspect} on {self._host(suspect)}" if suspect is not None
                 else "no heartbeats readable (the store's host is gone)")
        log.error("watchdog: %s; heartbeats %s", named, steps)
        collective = self._flight_records()
        if collective is not None:
            named += f"; {describe_collective(collective)}"
        for callback in self._on_fire:
            with contextlib.suppress(Exception):
                callback()
        # The first rank to fire still reached the store and names the laggard; a later one
        # (whose store may have left with that rank) must not overwrite its account.
        if self.run_dir.failure_since(self._started) is None:
            self.run_dir.write_exit_info(
                exit_code=HUNG,
                reason=f"watchdog: rank {self.rank} waited {waited:.0f} s in {self._phase!r} at "
                f"step {self._step + 1}; {named}",
                last_checkpoint=None,
                extra={"rank": self.rank, "suspect_rank": suspect,
                       "suspect_host": self._host(suspect), "phase": self._phase,
                       "heartbeat_steps": steps, "collective": collective},
            )
        os._exit(HUNG)

    def _flight_records(self) -> dict[str, Any] | None:
        """Dump this rank's flight recorder, wait for the peers' dumps, name the collective."""
        if self.cfg.flight_recorder <= 0:
            return None
        entries = dump_flight_recorder()
        path = flight_record_path(self.run_dir.root, self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"rank": self.rank, "host": socket.gethostname(),
                                     "step": self._step + 1, "phase": self._phase,
                                     "entries": entries})
        except OSError as e:
            log.error("watchdog: could not write %s: %s", path, e)
        world = len(self.hosts)
        deadline = time.monotonic() + self.cfg.peer_dump_wait_s
        dumps = read_flight_records(self.run_dir.root, self._started)
        while len(dumps) < world and time.monotonic() < deadline:
            time.sleep(0.5)
            dumps = read_flight_records(self.run_dir.root, self._started)
        found = unjoined_collective(dumps, world)
        if found is None:
            log.error("watchdog: flight recorder (%d entries here, dumps from ranks %s): no "
                      "collective that some ranks entered and others did not", len(entries),
                      sorted(dumps))
        else:
            log.error("watchdog: flight recorder: %s", describe_collective(found))
        return found

    def _host(self, rank: int | None) -> str | None:
        return self.hosts[rank] if rank is not None and rank < len(self.hosts) else None

    def _suspect(self) -> tuple[int | None, dict[int, int | None]]:
        """The rank whose last beat is the oldest step (a dead or stuck rank stops beating)."""
        steps: dict[int, int | None] = {}
        if self.store is None:
            return self.rank, steps
        with contextlib.suppress(Exception):
            self.store.set_timeout(timedelta(seconds=5))
        for rank in range(len(self.hosts)):
            try:
                steps[rank] = int(self.store.get(f"hpctrain/hb/{rank}"))
            except Exception:
                steps[rank] = None  # never beat, or the store is gone
        known = {r: s for r, s in steps.items() if s is not None}
        if not known:
            return None, steps
        missing = [r for r, s in steps.items() if s is None]
        if missing:
            return missing[0], steps
        return min(known, key=known.get), steps
