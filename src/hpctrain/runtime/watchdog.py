"""Hang watchdog: a step that outlives ``watchdog.timeout`` ends the process with evidence.

A hung collective is silent: every live rank waits for the one that died or stalled, and the
allocation burns until walltime. Each rank beats once per step (a local timestamp, plus its
step number in the job's key-value store). When a beat is overdue, the watchdog thread dumps all
thread stacks and the phase the rank was in into its log, reads the other ranks' last steps
from the store to name the rank that fell behind, writes ``exit_info.json`` and exits with
code 124, so a launcher or Slurm can restart the job from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hpctrain.errors import ConfigError
from hpctrain.runtime.exit_codes import HUNG
from hpctrain.runtime.rundir import RunDir

log = logging.getLogger("hpctrain.watchdog")


@dataclass
class WatchdogConfig:
    """Config section ``watchdog:``."""

    enabled: bool = True
    # Seconds one step (data, forward/backward, update, control exchange) may take.
    timeout: float = 600.0

    def validate(self) -> None:
        """A positive timeout."""
        if self.timeout <= 0:
            raise ConfigError(f"watchdog.timeout = {self.timeout} must be positive (seconds)")


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
                       "heartbeat_steps": steps},
            )
        os._exit(HUNG)

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
