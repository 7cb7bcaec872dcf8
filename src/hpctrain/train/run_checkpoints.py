"""The training loop's side of checkpointing: when to save, what a save costs, resuming.

The Trainer owns one :class:`RunCheckpoints` and calls it between steps, at the end of the run,
on resume and to roll back past bad steps. What a checkpoint
holds and how it is put back is :mod:`hpctrain.train.checkpointing`. Nothing here knows the
Trainer: the training state is read through ``state`` and a loaded step handed back through
``loaded``, both called only once the model exists.

Metrics events written here: ``checkpoint`` (each save once its commit is known),
``checkpoint_stall`` (what a save blocked the loop), ``checkpoint_writer`` (once, when the
writer's buffers are staged) and ``checkpoint_load``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from hpctrain.checkpoint.manager import CheckpointManager, Loader, step_dir_name
from hpctrain.checkpoint.schedule import SaveSchedule
from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.observe.goodput import GoodputClock
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.runtime.dist import Distributed
from hpctrain.runtime.time_limit import job_end_time
from hpctrain.runtime.watchdog import Watchdog
from hpctrain.train import checkpointing
from hpctrain.train.preemption import ControlChannel, Preempted, PreemptionFlag

log = logging.getLogger("hpctrain.train")


class RunCheckpoints:
    """Saves, resumes and restores one run's checkpoints for its training loop."""

    def __init__(self, cfg: JobConfig, ckpt: CheckpointManager, dist_ctx: Distributed, *,
                 metrics: MetricsWriter, goodput: GoodputClock, watchdog: Watchdog,
                 preempt: PreemptionFlag, control: ControlChannel,
                 state: Callable[[], checkpointing.TrainState],
                 loaded: Callable[[int], None]):
        self.cfg = cfg
        self.ckpt = ckpt
        self.rank, self.world_size, self.device = (dist_ctx.rank, dist_ctx.world_size,
                                                   dist_ctx.device)
        self.metrics = metrics
        self.goodput = goodput
        self.watchdog = watchdog
        self.preempt = preempt
        self.control = control
        self.state = state
        self.loaded = loaded
        if self._saves_in_background():
            # Started first: the writer's interpreter starts while the model is built.
            ckpt.start_writer()
        if cfg.checkpoint.resume != "never":
            # The checkpoint to resume is read (and checked) while the model is built.
            ckpt.prefetch(None if cfg.checkpoint.resume == "auto"
                          else Path(cfg.checkpoint.resume))
        # Rank 0 decides time-based saves, so only it asks Slurm when the job ends (once).
        end_time = (job_end_time() if self.rank == 0 and cfg.checkpoint.saves_before_limit
                    else None)
        self.schedule = SaveSchedule(cfg.checkpoint, dist_ctx.world_size, end_time=end_time)

    def save(self, step: int, *, blocking: bool, final: bool = False) -> None:
        """Checkpoint the state at ``step`` (collective); records the stall for the schedule.

        A step already committed (an async save that finished) is not saved again. The time
        the loop is blocked — waiting for the previous save, staging, a blocking write — is
        charged to the checkpoint part of goodput; ``checkpoint_stall`` records it, and
        ``wait_s`` the part spent waiting for the previous save to finish writing. The
        ``final`` save at the end goes to goodput's flush, not the cost of a periodic save.
        """
        with self.goodput.part("flush" if final else "checkpoint"), \
                self.watchdog.paused("checkpoint save"):
            start = time.perf_counter()
            self.ckpt.wait()  # raises a failed background save
            waited = time.perf_counter() - start
            self.report()
            if self.ckpt.last_committed == step_dir_name(step):
                return
            state = self.state()
            tensors = checkpointing.tensor_state(state)
            meta = checkpointing.meta_state(state, self.cfg, step=step,
                                            world_size=self.world_size)
            self.ckpt.save(step, tensors, meta, blocking=blocking)
            waited += self.ckpt.last_wait_s
            stall = time.perf_counter() - start
            self.ckpt.record_stall(step, stall, waited)
        self.goodput.saved(step, background=not blocking, periodic=not final)
        # The interval (checkpoint.interval=auto) follows what a save costs the run: the
        # stall plus the slowdown of the steps beside background writes, as measured so far.
        self.schedule.saved(self.goodput.checkpoint_cost() or stall)
        self.metrics.write({"event": "checkpoint_stall", "step": step, "stall_s": stall,
                            "wait_s": waited, "async": not blocking})
        self.report()

    def _saves_in_background(self) -> bool:
        """Whether the loop will make background saves through a writer process
        (``checkpoint.writer``: auto is a process on GPUs)."""
        c = self.cfg.checkpoint
        if not c.async_save or c.cadence == "none":
            return False
        if c.writer == "thread" or (c.writer == "auto" and self.device.type != "cuda"):
            return False
        return c.cadence != "steps" or c.every_steps < self.cfg.train.steps

    def report(self) -> None:
        """Write a metrics event for each save committed since the last report."""
        while self.ckpt.completed:
            record = self.ckpt.completed.pop(0)
            # Start to commit: how far ahead of the time limit the last save must start.
            self.schedule.committed(record.get("stall_s", 0.0) + record.get("write_s", 0.0))
            self.metrics.write({"event": "checkpoint", **record})

    def between_steps(self, step: int) -> None:
        """Raise a failed background save, agree on preemption and saves, save if due."""
        self.ckpt.poll()
        self.report()
        if not self.ckpt.prepared:
            # Once, after the first step (the optimizer's state exists now): the writer's
            # buffers are allocated and pinned here, so the first save costs what later ones do.
            start = time.perf_counter()
            with self.goodput.part("startup"), self.watchdog.paused("checkpoint writer start"):
                self.ckpt.prepare(checkpointing.tensor_state(self.state()))
            self.metrics.write({"event": "checkpoint_writer", "step": step,
                                "writer": self.ckpt.mode, "staged_bytes": self.ckpt.staged_bytes,
                                "prepare_s": time.perf_counter() - start})
        preempt = save = False
        # The exchange aligns the ranks' host threads; every few steps is soon enough for a
        # signal that comes minutes ahead of the kill (and for a time-based save).
        if step % self.cfg.preempt.check_every == 0 or step == self.cfg.train.steps:
            # Postponed while a save is still writing: never more often than the writer can go.
            due_by_time = self.rank == 0 and self.schedule.due_by_time(self.ckpt.in_flight)
            preempt, save = self.control.exchange(self.preempt.requested is not None,
                                                  due_by_time)
        if preempt:
            reason = self.preempt.requested or "a signal on another rank"
            log.warning("preemption (%s): checkpointing at step %d and stopping", reason, step)
            self.save(step, blocking=True)  # after the save in flight, if any; once per step
            raise Preempted(f"preempted by {reason} at step {step}; checkpoint "
                            f"{self.ckpt.last_committed} committed")
        if save or self.schedule.due_by_step(step):
            self.save(step, blocking=not self.cfg.checkpoint.async_save)

    def start_final(self, step: int) -> None:
        """Start the final save in the background (``checkpoint.async_save``), so that what the
        run does before :meth:`finish` (the last validation) overlaps with its write."""
        c = self.cfg.checkpoint
        if c.save_at_end and c.async_save and self.ckpt.last_committed != step_dir_name(step):
            self.save(step, blocking=False, final=True)

    def finish(self, step: int) -> None:
        """At the end of the run: the final save (``checkpoint.save_at_end``) unless
        :meth:`start_final` made it, then wait for the writes in flight and close the writer.
        Goodput's flush (``final_save_s``) is what the loop waited for them."""
        if self.cfg.checkpoint.save_at_end and self.ckpt.last_committed != step_dir_name(step):
            self.save(step, blocking=True, final=True)
        with self.goodput.part("flush"):
            self.ckpt.close()
        self.report()

    def resume(self, how: str) -> None:
        """Start from a checkpoint: ``auto`` (the newest that verifies and loads; damaged ones
        are skipped, and refused when all are), ``never``, or a path (damage is an error)."""
        if how == "never":
            if self.ckpt.committed():
                raise ConfigError(
                    f"{self.ckpt.root} already holds checkpoints and checkpoint.resume=never",
                    hint="use --resume auto to continue, or a new run.name to start over "
                    "(starting fresh here would overwrite them)",
                )
            return
        if how == "auto":
            if self.ckpt.restore_newest(self.loader(data=True)) is None:
                log.info("no checkpoint to resume from in %s: starting at step 0", self.ckpt.root)
            return
        path = Path(how)
        if not path.is_dir():
            raise ConfigError(f"--resume {how}: no such checkpoint directory",
                              expected="a step-NNNNNNNN directory, 'auto' or 'never'")
        self.ckpt.restore(path, self.loader(data=True))

    def roll_back(self, step: int) -> Path | None:
        """Restore the newest checkpoint that verifies and loads, keeping the data position (the
        batches since it are skipped); None when there is none. Damaged ones are passed over as
        on resume; the steps lost since ``step`` are charged to goodput."""
        with self.goodput.part("checkpoint"):
            self.ckpt.wait()
        start = time.perf_counter()
        with self.goodput.part("lost_work"):
            found = self.ckpt.restore_newest(self.loader(data=False))
        if found is None:
            return None
        path, manifest = found
        # The step the loader handed back (checkpointing.restore returns the manifest's).
        self.goodput.rolled_back(step, manifest["step"], time.perf_counter() - start)
        return path

    def loader(self, *, data: bool) -> Loader:
        """What the checkpoint manager calls to fill the training state from a verified
        checkpoint (``data``: the data position too; a rollback keeps the current one)."""

        def load(path: Path, manifest: dict) -> None:
            start = time.perf_counter()
            with self.watchdog.paused("checkpoint load"):
                step = checkpointing.restore(self.state(), self.ckpt, path, manifest, self.cfg,
                                             data=data)
                self.loaded(step)
            self.metrics.write({"event": "checkpoint_load", "checkpoint": path.name,
                                "step": step, "load_s": time.perf_counter() - start})
            log.info("resumed from %s: step %d, %s tokens seen (saved with %s on %d ranks)",
                     path.name, step, f"{manifest['tokens_seen']:,}", manifest["strategy"],
                     manifest["world_size"])

        return load
