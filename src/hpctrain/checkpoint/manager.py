"""Save, commit, find and load checkpoints of one run.

Layout under ``<run>/checkpoints/``::

    step-00000100/            committed: renamed into place only after its manifest is written
      .metadata  __0_0.distcp  __1_0.distcp  ...   PyTorch DCP shards, one file per rank
      rng-rank-00000.pt ...                        each rank's RNG states (tensors only)
      manifest.json                                sizes + xxh3 of every file, trainer state
    .tmp-step-00000200/       a save in progress (or a failed one, removed on the next save)
    .retired-step-00000000/   one retention removed, being deleted by a thread after the commit
    latest                    name of the newest committed checkpoint
    damaged/step-00000300/    a checkpoint resume found damaged, moved aside (never deleted)

Resume takes the newest checkpoint that verifies *and* loads; each damaged one it passes is
logged with why and, once an older one has loaded, moved to ``damaged/``. Anything else in the
folder (``step-abc``, a ``.bak`` copy) is ignored with a warning and left alone by retention.

Every rank writes its own shards (nothing is gathered to rank 0); DCP reshards on load, so a
checkpoint saved with FSDP on 4 ranks loads with DDP on 1. All collectives of saving and loading
run on a dedicated gloo group, so a background save never interleaves with training traffic.

Who writes a background save: the rank's writer process (``start_writer``; ``writer.py``): the
loop copies the state into shared host buffers laid out once by ``prepare`` and goes on, the
writer process serialises, writes, hashes and commits (the same protocol, ``store.py``, as an
in-process save). Where that cannot be used (no memfd, not enough host memory, a DTensor with
several local chunks) every rank falls back, with a warning, to a thread of the training
process. Blocking saves go through the writer when there is one, else run inline.

Metrics events the trainer writes from here (rank-local, ``metrics/rank-NNN.jsonl``):

- ``checkpoint_stall``: step, stall_s (the loop blocked: waiting for the previous save, state
  dicts, staging; a blocking save's whole write), wait_s (the part spent waiting for the
  previous save to finish writing), async;
- ``checkpoint``: one per committed save: step, write_s (background write to commit), bytes,
  gb_per_s, stall_s, wait_s, writer (process, thread or inline);
- ``checkpoint_writer``: once, when the writer's buffers are laid out: step, writer,
  staged_bytes, prepare_s.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manifest import (
    CheckpointError,
    DamagedCheckpoint,
    Verification,
    read_manifest,
    step_dir_name,
    verification_share,
)
from hpctrain.checkpoint.safe_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_weights_only,
)
from hpctrain.checkpoint.staging import SharedStaging, StagingUnavailable
from hpctrain.checkpoint.store import (
    DAMAGED,
    LATEST,
    CheckpointStore,
    causes,
    first_line,
    free_bytes,
    manifest_bytes,
    write_threads,
)
from hpctrain.checkpoint.writer import WriterDied, WriterProcess
from hpctrain.errors import ConfigError
from hpctrain.runtime.rundir import fsync_dir

log = logging.getLogger("hpctrain.checkpoint")

__all__ = ["LATEST", "CheckpointManager", "Loader", "step_dir_name"]

# Fills the caller's state from a checkpoint through ``CheckpointManager.load`` (which returns
# only once every file has verified); raises DamagedCheckpoint when the checkpoint cannot be
# used (the caller's own checks of the manifest's values included).
Loader = Callable[[Path, dict[str, Any]], None]


class CheckpointManager:
    """Checkpoints of one run directory; every method is collective over ``group``."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int,
                 device: torch.device, group: dist.ProcessGroup, timeout_s: float = 1800.0):
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        self.timeout_s = timeout_s
        self.store = CheckpointStore(cfg, root, rank=rank, world_size=world_size)
        # Thread writer (the fallback): on CUDA the staging buffers are pinned and reused.
        self._stager = BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Process writer (``start_writer``): its handle and the shared staging buffers.
        self._writer: WriterProcess | None = None
        self._staging: SharedStaging | None = None
        self._writer_died: WriterDied | None = None
        # Who writes background saves: "process", "thread" (fallback), or None before it is
        # decided (``start_writer``/``prepare``); blocking saves without a writer: "inline".
        self.mode = "thread"
        # Stall and wait of each save in flight or not yet reported, by step.
        self._pending: dict[int, dict[str, Any]] = {}
        # How long the last save waited for the one before it to finish writing.
        self.last_wait_s = 0.0
        # One record per committed save (step, write_s, bytes, gb_per_s, stall_s, wait_s,
        # writer), for the caller to report; appended by whichever thread committed.
        self.completed: list[dict[str, Any]] = []
        # The newest checkpoint known to be committed: set when a save's commit is known (by
        # the thread that committed it) and by a resume; never when a save merely starts.
        self.last_committed: str | None = None
        # The checks of the checkpoint about to be loaded (started by ``prefetch`` or
        # ``restore``, taken by ``load``): its path, the manifest's files, the checks.
        self._verifying: tuple[Path, dict[str, Any], Verification] | None = None

    # -- the writer process -------------------------------------------------------------------

    def start_writer(self) -> None:
        """Start this rank's writer process (collective); background saves go through it once
        ``prepare`` has laid out the staging buffers. Only on Linux (memfd, PDEATHSIG)."""
        if not hasattr(os, "memfd_create"):
            log.warning("checkpoint writer: no memfd on this system; background saves are "
                        "written by a thread of the training process")
            return
        self._writer = WriterProcess(self.cfg, self.root, rank=self.rank,
                                     world_size=self.world_size, group=self.group,
                                     timeout_s=self.timeout_s)
        self.mode = "process"

    @property
    def staged_bytes(self) -> int:
        """Bytes of the writer process's staging buffers on this rank (0 without them)."""
        return self._staging.nbytes if self._staging is not None else 0

    @property
    def prepared(self) -> bool:
        """Whether background saves are ready to go (buffers laid out, or no writer)."""
        return self._writer is None or self._staging is not None

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate (and pin) the staging buffers for ``state`` and hand them to the writer
        (collective). Any rank that cannot makes every rank fall back to the thread writer."""
        if self._writer is None:
            return
        self.wait()
        staging, why = None, None
        try:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            staging = SharedStaging.allocate(state, self.device)
            self._writer.attach(staging)
        except StagingUnavailable as e:
            why = f"rank {self.rank}: {e}"
        except WriterDied as e:
            why = e.what
        whys: list[Any] = [None] * self.world_size
        dist.all_gather_object(whys, why, group=self.group)
        failed = [w for w in whys if w]
        if not failed:
            self._staging = staging
            log.info("checkpoint writer process ready: %.2f GB of %sstaging buffers",
                     staging.nbytes / 1e9, "pinned " if self.device.type == "cuda" else "")
            return
        log.warning("checkpoint writer process not used (%s): background saves are written by "
                    "a thread of the training process", failed[0])
        if staging is not None:
            staging.close()
        self._writer.stop()
        self._writer, self.mode = None, "thread"

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *,
             blocking: bool) -> float:
        """Checkpoint ``state`` (model/optimizer state dicts) with ``meta`` (JSON) at ``step``.

        Blocking: returns after the commit. Otherwise returns once the state is staged in host
        memory and is written by the writer process (or a background thread); its failure is
        raised by ``poll``/``wait``. Returns the seconds the caller was blocked, waiting for the
        previous save included (that part alone is ``last_wait_s``). When the size of the
        previous checkpoint is known, a file system without room for another is refused before
        anything is written.
        """
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        waited = time.perf_counter() - start
        if self._writer_died is not None:
            raise CheckpointError(f"the checkpoint at step {step} was not started: "
                                  f"{self._writer_died.what}", hint=self.store.intact_hint())
        self.last_wait_s = waited
        self._check_free_space(step)
        rng = _capture_rng(self.device)
        if self._writer is not None and self._any_rank(
                self._staging is None or not self._staging.matches(state)):
            # Normally done once before the first save (``prepare``); here when the state's
            # tensors changed since, and then this save pays for the allocation.
            log.info("checkpoint staging buffers laid out again at step %d", step)
            self.prepare(state)
        if self._writer is not None:
            skeleton = self._staging.stage(state)
            stall = time.perf_counter() - start
            self._pending[step] = {"stall_s": stall, "wait_s": waited, "writer": "process"}
            rng_bytes = {k: v.numpy().tobytes() for k, v in rng.items()}
            self._through_writer(lambda: self._writer.submit(
                step, skeleton, meta, rng_bytes, self.store.expected_bytes()))
            if blocking:
                self.wait()
                return time.perf_counter() - start
            return stall
        if blocking:
            record = self.store.write(step, state, meta, rng, group=self.group)
            total = time.perf_counter() - start
            self._committed({**record, "stall_s": total, "wait_s": waited, "writer": "inline"})
            return total
        staged = self._stager.stage(state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stall = time.perf_counter() - start
        self._pending[step] = {"stall_s": stall, "wait_s": waited, "writer": "thread"}
        self._thread = threading.Thread(target=self._background, args=(step, staged, meta, rng),
                                        name="hpctrain-checkpoint", daemon=True)
        self._thread.start()
        return stall

    def record_stall(self, step: int, stall_s: float, wait_s: float) -> None:
        """The caller's own account of how long the save of ``step`` blocked it (state dicts
        and waiting for the previous save included), for the save's record."""
        for record in (self._pending.get(step), *self.completed):
            if record is not None and record.get("step", step) == step:
                record.update(stall_s=stall_s, wait_s=wait_s)

    def poll(self) -> None:
        """Raise the failure of a finished background save (called once per step)."""
        if self._writer is not None:
            if self._writer.step is None:
                self._through_writer(self._writer.check)
            else:
                self._take(self._through_writer(lambda: self._writer.result(block=False)))
        elif self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has committed; raise its failure."""
        if self._writer is not None and self._writer.step is not None:
            self._take(self._through_writer(lambda: self._writer.result(block=True)))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still writing."""
        if self._writer is not None:
            return self._writer.step is not None
        return self._thread is not None and self._thread.is_alive()

    def _through_writer(self, call: Callable[[], Any]) -> Any:
        """``call`` on the writer; when the writer is found dead, no save can use it again."""
        try:
            return call()
        except WriterDied as e:
            self._writer.kill()
            self._writer = None
            self._writer_died = WriterDied(e.what, hint=self.store.intact_hint())
            raise self._writer_died from None

    def _take(self, outcome: tuple | None) -> None:
        """Act on the writer's answer about the save in flight."""
        if outcome is None:
            return
        if outcome[0] == "committed":
            self._committed(outcome[1])
            return
        _, what, hint = outcome
        raise CheckpointError(what, hint=hint)

    def _committed(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.last_committed = step_dir_name(step)
        self.store.last_bytes = record["bytes"]
        record = {**record, **self._pending.pop(step, {})}
        self.completed.append(record)
        log.info("checkpoint %s committed: %.2f GB in %.2f s (%.2f GB/s, %s writer)",
                 self.last_committed, record["bytes"] / 1e9, record["write_s"],
                 record["gb_per_s"], record.get("writer"))

    def _background(self, step: int, staged: dict, meta: dict, rng: dict) -> None:
        try:
            self._committed(self.store.write(step, staged, meta, rng, group=self.group))
        except BaseException as e:  # re-raised in the training thread by poll()/wait()
            self._pending.pop(step, None)
            self._error = e

    def _any_rank(self, flag: bool) -> bool:
        flags: list[Any] = [None] * self.world_size
        dist.all_gather_object(flags, flag, group=self.group)
        return any(flags)

    def _check_free_space(self, step: int) -> None:
        """Refuse a save the file system has no room for (rank 0 looks, every rank agrees)."""
        message = [None]
        if self.rank == 0:
            need = self.store.expected_bytes()
            free = free_bytes(self.root)
            if need is not None and free is not None and free < need:
                message[0] = self.store.no_space(need)
        dist.broadcast_object_list(message, src=0, group=self.group)
        if message[0]:
            raise CheckpointError(f"the checkpoint at step {step} was not started: "
                                  f"{message[0]}", hint=self.store.intact_hint())

    # -- finding and loading ------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first; anything else is warned about once."""
        return self.store.committed()

    def latest_name(self) -> str | None:
        """The name ``latest`` points to, if it holds a checkpoint name."""
        return self.store.latest_name()

    def verify(self, path: Path) -> dict[str, Any]:
        """Check the manifest and every file of a checkpoint (split over ranks); return the
        manifest, or raise DamagedCheckpoint on every rank naming what is wrong."""
        manifest = self._agreed_manifest(path)
        self._agree_verified(self._verification(path, manifest))
        return manifest

    def restore(self, path: Path, load: Loader) -> dict[str, Any]:
        """Load ``path`` with ``load`` while its files verify; damage is an error here (the
        user chose it).

        The checksums are checked in threads from the start, while the caller builds its
        state and ``load`` reads it: one pass over the checkpoint's bytes where the page cache
        holds them, not a verification and then a load. ``load`` fills the state through
        :meth:`load`, which returns only once every rank's files have verified, so nothing the
        loader does after it (schedule, data position, "resumed") happens for a damaged one.
        """
        manifest = self._agreed_manifest(path)
        self._verifying_now(path, manifest)
        try:
            load(path, manifest)
        except (DamagedCheckpoint, ConfigError):
            # The loader refused the manifest's values before loading (the same on every rank):
            # damage found by the checksums, as before the loader ran, is the reason given.
            self._settle(path)
            raise
        except BaseException:
            self._abandon()
            raise
        self._settle(path)  # a loader that did not call ``load``: verified before returning
        self.last_committed, self.store.last_bytes = path.name, manifest_bytes(manifest)
        return manifest

    def prefetch(self, path: Path | None = None) -> None:
        """Start checking ``path`` (by default the newest committed checkpoint) in threads now,
        so that the restore of it that follows finds its files checked and in the page cache:
        a resume reads its checkpoint while the model is built. Not collective; nothing starts
        where there is nothing to read (the restore will say why)."""
        if path is None:
            committed = self.committed()
            if not committed:
                return
            path = committed[-1]
        try:
            self._verifying_now(path, read_manifest(path))
        except DamagedCheckpoint:
            return

    def _verifying_now(self, path: Path, manifest: dict[str, Any]) -> Verification:
        """The checks of ``path`` in flight (``prefetch``'s, for the same files) or new ones."""
        if self._verifying is not None:
            where, files, verification = self._verifying
            if where == path and files == manifest["files"]:
                return verification
            self._abandon()
        verification = self._verification(path, manifest)
        self._verifying = (path, manifest["files"], verification)
        return verification

    def _verification(self, path: Path, manifest: dict[str, Any]) -> Verification:
        """This rank's share of ``path``'s files, verifying from now on."""
        return Verification(path, manifest["files"], verification_share(
            manifest["files"], self.rank, self.world_size))

    def _settle(self, path: Path) -> None:
        """Wait for the verification ``restore`` started for ``path``, if ``load`` has not
        (collective); DamagedCheckpoint on every rank if any rank found a bad file."""
        if self._verifying is not None and self._verifying[0] == path:
            verification = self._verifying[2]
            self._verifying = None
            self._agree_verified(verification)

    def _abandon(self) -> None:
        """Stop a verification nobody will wait for (the load failed otherwise)."""
        if self._verifying is not None:
            self._verifying[2].cancel()
            self._verifying = None

    def cancel_prefetch(self) -> None:
        """Stop the checks ``prefetch`` started if no restore took them (not collective): a run
        that fails before it resumes must not hash the whole checkpoint on its way out."""
        self._abandon()

    def restore_newest(self, load: Loader) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest checkpoint that verifies and loads, falling back past damaged ones.

        Each damaged checkpoint passed is logged with why and, once an older one has loaded,
        moved to ``damaged/`` (so a later restart does not trip over it again). Returns None
        when there is no checkpoint at all; when every one is damaged, raises DamagedCheckpoint
        naming each and why, and leaves them where they are.
        """
        damaged: list[tuple[Path, str]] = []
        for path in reversed(self.committed()):
            try:
                manifest = self.restore(path, load)
            except DamagedCheckpoint as e:
                log.warning("skipping checkpoint %s: %s; falling back to an older one",
                            path.name, e.what)
                damaged.append((path, e.what))
                continue
            for bad, why in damaged:
                self._set_aside(bad, why)
            if self.rank == 0 and self.latest_name() != path.name:
                self.store.point_latest(path.name)
            dist.barrier(group=self.group)
            return path, manifest
        if damaged:
            raise DamagedCheckpoint(
                f"every checkpoint in {self.root} is damaged, none can be resumed:",
                lines=[f"  {p.name}: {why}" for p, why in damaged],
                hint="nothing was deleted or moved; repair or move them out of the folder to "
                "start this run from step 0, or use a new run.name",
            )
        return None

    def _set_aside(self, path: Path, why: str) -> None:
        """Rank 0 renames a damaged checkpoint into ``damaged/``, never over an earlier one."""
        if self.rank != 0:
            return
        aside = self.root / DAMAGED
        aside.mkdir(exist_ok=True)
        for i in itertools.count():
            target = aside / (path.name if i == 0 else f"{path.name}.{i}")
            try:
                target.mkdir()  # claims the name; the rename below replaces this empty folder
                break
            except FileExistsError:
                continue
        os.rename(path, target)
        fsync_dir(self.root)
        fsync_dir(aside)
        log.warning("checkpoint %s moved to %s (damaged: %s)", path.name, target, why)

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill ``state`` (current model/optimizer state dicts) in place from ``path``, every
        file's checksum verified (split over ranks) while it loads; returns once all have.

        Raises DamagedCheckpoint on every rank when the checkpoint's content is at fault: a bad
        checksum is named first (before a load failure it caused). Until then ``state`` may
        hold some of the damaged checkpoint's tensors; the RNG is put back only after.
        """
        manifest = self._agreed_manifest(path)
        verification = self._verifying_now(path, manifest)  # restore's, prefetch's or new
        self._verifying = None
        failure: CheckpointError | None = None
        try:
            # A verdict already in (a file missing or cut short) is acted on before the load.
            self._agree(verification.known)
            # As many threads as a save (checkpoint.write_threads); left to auto, two at least,
            # so that one thread's read overlaps another's copy.
            threads = self.cfg.write_threads or max(2, write_threads(0))
            reader = SafeFileSystemReader(path, files=manifest["files"], threads=threads,
                                          ahead=verification.wait_read)
            self._agree_on(reader.read_metadata)
            try:
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=self.group)
            except CheckpointException as e:  # a BaseException carrying each rank's failure
                if isinstance(e.failures.get(self.rank, (None,))[0], KeyboardInterrupt):
                    raise KeyboardInterrupt from None  # Ctrl-C here, not damage
                raise _load_failure(path, e) from None
        except CheckpointError as e:  # agreed by every rank (``_agree_on``, DCP's gather)
            failure = e
        except BaseException:
            verification.cancel()
            raise
        try:
            self._agree_verified(verification)
        except BaseException:
            verification.cancel()  # Ctrl-C while waiting: no thread goes on hashing
            raise
        if failure is not None:
            raise failure
        rng_path = path / f"rng-rank-{self.rank:05d}.pt"
        if manifest.get("world_size") == self.world_size and rng_path.name in manifest["files"]:
            self._agree_on(lambda: _restore_rng(rng_path, self.device))
        else:
            # Another world size: RNG streams do not map one to one; derive fresh ones.
            torch.manual_seed(manifest["step"] * 1_000_003 + self.rank)

    def _agreed_manifest(self, path: Path) -> dict[str, Any]:
        """The checked manifest of ``path``, agreed on by every rank."""
        result: list[dict[str, Any]] = []
        self._agree_on(lambda: result.append(read_manifest(path)))
        return result[0]

    def _agree_on(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on every rank; if it raised DamagedCheckpoint on any, raise it on all."""
        try:
            fn()
            error = None
        except DamagedCheckpoint as e:
            error = e
        self._agree(error)

    def _agree_verified(self, verification: Verification) -> None:
        """Wait for this rank's checks; DamagedCheckpoint on every rank if any found damage."""
        self._agree(verification.problem())

    def _agree(self, error: CheckpointError | None) -> None:
        """Raise on every rank what any rank found: damage, unless a rank could not tell (a
        CheckpointError that is not damage, which must not set a good checkpoint aside)."""
        errors: list[Any] = [None] * self.world_size
        mine = None if error is None else (isinstance(error, DamagedCheckpoint), error.what)
        dist.all_gather_object(errors, mine, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            damaged, what = next((e for e in bad if not e[0]), bad[0])
            raise (DamagedCheckpoint if damaged else CheckpointError)(what)

    def close(self) -> None:
        """Finish the in-flight save (raising its error), then stop the writer process."""
        self._abandon()
        try:
            self.wait()
        finally:
            self.store.wait_removed()
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
            if self._staging is not None:
                self._staging.close()
                self._staging = None


def _load_failure(path: Path, e: CheckpointException) -> CheckpointError:
    """DCP's load failure as ours: damage unless the machine ran out of memory."""
    inner = causes(e)[0]
    if isinstance(inner, DamagedCheckpoint):
        return DamagedCheckpoint(inner.what)
    if any(isinstance(cause, KeyboardInterrupt) for cause in causes(e)):
        return CheckpointError(f"loading {path} was interrupted on another rank")
    if isinstance(inner, MemoryError | torch.OutOfMemoryError):
        return CheckpointError(f"loading {path} failed: {first_line(e)}")
    return DamagedCheckpoint(f"loading {path} failed: {first_line(e)}")


def _capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _restore_rng(path: Path, device: torch.device) -> None:
    """Put back this rank's RNG states from ``path`` (checked: byte tensors of the right size)."""
    rng = load_weights_only(path)
    current = _capture_rng(device)

    def fits(key: str) -> bool:
        value = rng.get(key)
        return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                and value.shape == current[key].shape)

    if not (isinstance(rng, dict) and fits("cpu")
            and ("cuda" not in current or "cuda" not in rng or fits("cuda"))):
        raise DamagedCheckpoint(f"{path} does not hold RNG states of this process")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in current and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)
