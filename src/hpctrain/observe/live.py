"""What a running trainer reports beyond its metrics lines: stragglers, profiles, trackers.

The trainer calls three hooks, none of which syncs the device or the ranks per step:

- ``step_start(step)`` / ``step_end(step)``: start and stop a planned profile;
- ``window(record)``: at each logging window (after the window's one host sync), add this
  rank's own time to its metrics record and exchange ``[own, step, data, forward, profile
  signal]`` with every rank in one all-gather of five floats on the CPU control group. Every
  rank then judges stragglers alike; rank 0 writes the events.

Each rank also writes an ``observe`` event at start: its pid (``kill -URG <pid>`` asks for a
profile), the profile signal, and what its own time measures (``data+forward`` or ``data``).
Rank 0 hands every metrics record to the TensorBoard/MLflow trackers (``track:``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hpctrain import faults
from hpctrain.config import JobConfig, dump_yaml, to_dict
from hpctrain.errors import ConfigError
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.profile import Profiler, install_oom_snapshot
from hpctrain.observe.stragglers import RankTimes, StragglerDetector
from hpctrain.observe.track import Tracker

log = logging.getLogger("hpctrain.observe")

# How long a hung run's watchdog waits for the trackers to write what they hold.
_HANG_FLUSH_S = 10.0


class ForwardTimer:
    """Seconds spent in a module's training forward passes: host clock, or CUDA events."""

    def __init__(self, module: torch.nn.Module, device: torch.device, rank: int):
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.step = 0
        self._host_s = 0.0
        self._t0: float | None = None
        self._open: Any = None
        self._pairs: list[tuple[Any, Any]] = []
        self._spare: list[Any] = []
        # Never traced: `module.compile()` (the task trainer's) compiles a module's hooks with
        # its forward, which recorded no CUDA event and recompiled on every clock reading.
        module.register_forward_pre_hook(torch.compiler.disable(self._before))
        module.register_forward_hook(torch.compiler.disable(self._after))

    def _event(self) -> Any:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _training(module: torch.nn.Module) -> bool:
        # Validation runs under no_grad (in train mode): not training time.
        return module.training and torch.is_grad_enabled()

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if not self._training(module):
            return
        if self.cuda:
            self._open = self._event()
        else:
            self._t0 = time.perf_counter()
        slow = faults.active("slow", self.step, self.rank)
        if slow:  # a slow rank, made on purpose (tests)
            time.sleep(float(slow.get("seconds", 0.5)))

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._training(module):
            return
        if self.cuda and self._open is not None:
            self._pairs.append((self._open, self._event()))
            self._open = None
        elif self._t0 is not None:
            self._host_s += time.perf_counter() - self._t0
            self._t0 = None

    def take(self) -> float:
        """Seconds of forward since the last call (call after the window's host sync)."""
        if not self.cuda:
            total, self._host_s = self._host_s, 0.0
            return total
        if self._pairs:
            self._pairs[-1][1].synchronize()  # already done: the window's sync came after it
        total = sum(start.elapsed_time(end) for start, end in self._pairs) / 1000.0
        for pair in self._pairs:
            self._spare.extend(pair)
        self._pairs.clear()
        return total


class RunObserver:
    """Stragglers, profiles and trackers for one rank of a training run."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, device: torch.device,
                 metrics: MetricsWriter, model: torch.nn.Module, hosts: list[str], *,
                 forward_is_local: bool, group: dist.ProcessGroup | None,
                 watchdog: Any = None):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.metrics = metrics
        self.group = group
        self.hosts = hosts
        run_dir = metrics.run_dir.root
        pc = cfg.profile
        if pc.signal and pc.signal in cfg.preempt.signals:
            raise ConfigError(f"profile.signal = {pc.signal} is also in preempt.signals",
                              hint="pick another profile.signal (SIGURG is the default), or "
                              "'' for none")
        self.profiler = Profiler(pc, run_dir, rank, device)
        self.profiler.install_signal()
        install_oom_snapshot(run_dir, rank, device, pc.memory_history)
        self.timer = None
        if forward_is_local:
            inner = model.module if isinstance(
                model, torch.nn.parallel.DistributedDataParallel) else model
            self.timer = ForwardTimer(inner, device, rank)
        mc = cfg.metrics
        self.detector = StragglerDetector(hosts, mc.straggler_threshold, mc.straggler_windows)
        self._exchange = world_size > 1 and (mc.straggler_windows > 0 or bool(pc.signal))
        self._buf = torch.zeros(5, dtype=torch.float64)
        self._gathered = [torch.zeros(5, dtype=torch.float64) for _ in range(world_size)]
        self._steps = 0
        self.tracker = None
        if rank == 0 and (cfg.track.tensorboard or cfg.track.mlflow):
            self.tracker = Tracker(cfg.track, run_dir, run_dir.name, to_dict(cfg),
                                   dump_yaml(cfg))
            metrics.add_sink(self.tracker)
            if watchdog is not None:
                watchdog.on_fire(lambda: self.tracker.close("FAILED", timeout=_HANG_FLUSH_S))
        measures = "data+forward" if self.timer else "data"
        metrics.write({"event": "observe", "pid": os.getpid(), "own_time": measures,
                       "profile_signal": pc.signal or None})
        if rank == 0 and pc.signal:
            log.info("profiles on demand: kill -%s <pid of any rank> (pids in the 'observe' "
                     "events; scancel --signal=%s <job> under Slurm) profiles the next %d "
                     "steps on every rank, from the next logging window",
                     pc.signal.removeprefix("SIG"), pc.signal.removeprefix("SIG"),
                     pc.signal_steps)

    def step_start(self, step: int) -> None:
        """Before training step ``step`` (1-based): start a profile planned for it."""
        if self.timer is not None:
            self.timer.step = step
        self.profiler.step_start(step)

    def step_end(self, step: int) -> None:
        """After training step ``step``: stop a profile that ends here."""
        self._steps += 1
        event = self.profiler.step_end(step)
        if event is not None:
            self.metrics.write(event)

    def window(self, record: dict[str, Any]) -> None:
        """At a logging window: own time into ``record``, then the exchange between ranks."""
        steps, self._steps = max(1, self._steps), 0
        forward = self.timer.take() / steps if self.timer is not None else None
        own = record["data_time_s"] + (forward or 0.0)
        record["fwd_time_s"] = forward
        record["own_time_s"] = own
        signalled = self.profiler.signalled
        if self._exchange:
            self._buf.copy_(torch.tensor([own, record["step_time_s"], record["data_time_s"],
                                          -1.0 if forward is None else forward,
                                          float(signalled)], dtype=torch.float64))
            dist.all_gather(self._gathered, self._buf, group=self.group)
            rows = [g.tolist() for g in self._gathered]
            signalled = any(row[4] for row in rows)
            if self.cfg.metrics.straggler_windows > 0:
                events = self.detector.update(
                    record["step"], [RankTimes(own=row[0], step=row[1]) for row in rows])
                if self.rank == 0:
                    for event in events:
                        self.metrics.write(event)
        if signalled:
            self.profiler.request(record["step"] + 1)

    def close(self, step: int) -> None:
        """The run ended at ``step``: write a profile still open, restore the signal."""
        event = self.profiler.close(step)
        if event is not None:
            self.metrics.write(event)
