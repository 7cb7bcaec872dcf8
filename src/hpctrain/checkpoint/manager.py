"""Save, commit, find and load checkpoints of one run.

Layout under ``<run>/checkpoints/``::

    step-00000100/            committed: renamed into place only after its manifest is written
      .metadata  __0_0.distcp  __1_0.distcp  ...   PyTorch DCP shards, one file per rank
      rng-rank-00000.pt ...                        each rank's RNG states (tensors only)
      manifest.json                                sizes + xxh3 of every file, trainer state
    .tmp-step-00000200/       a save in progress (or a failed one, removed on the next save)
    latest                    name of the newest committed checkpoint

Every rank writes its own shards (nothing is gathered to rank 0); DCP reshards on load, so a
checkpoint saved with FSDP on 4 ranks loads with DDP on 1. All collectives of saving and loading
run on a dedicated gloo group, so a background save never interleaves with training traffic.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from hpctrain import faults
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manifest import (
    CheckpointError,
    describe,
    read_manifest,
    verify_files,
    write_manifest,
)
from hpctrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from hpctrain.runtime.rundir import fsync_dir

log = logging.getLogger("hpctrain.checkpoint")

LATEST = "latest"


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def step_of(path: Path) -> int:
    """The step a committed checkpoint directory was taken at."""
    return int(path.name.split("-", 1)[1])


class CheckpointManager:
    """Checkpoints of one run directory; every method is collective over ``group``."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int,
                 device: torch.device, group: dist.ProcessGroup):
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        # On CUDA the staging buffers are pinned and reused: the copy runs at full PCIe speed
        # and no allocation happens per save.
        self._stager = BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # One record per committed save (step, seconds blocked, seconds writing, bytes), for
        # the caller to report; appended by whichever thread committed.
        self.completed: list[dict[str, float]] = []

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *,
             blocking: bool) -> float:
        """Checkpoint ``state`` (model/optimizer state dicts) with ``meta`` (JSON) at ``step``.

        Blocking: returns after the commit. Otherwise returns once the state is staged in host
        memory and writes in a background thread; its failure is raised by ``poll``/``wait``.
        Returns the seconds the caller was blocked.
        """
        self.wait()  # at most one save in flight
        start = time.perf_counter()
        rng = _capture_rng(self.device)
        if blocking:
            self._write(step, state, meta, rng)
            return time.perf_counter() - start
        staged = self._stager.stage(state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stall = time.perf_counter() - start
        self._thread = threading.Thread(target=self._background, args=(step, staged, meta, rng),
                                        name="hpctrain-checkpoint", daemon=True)
        self._thread.start()
        return stall

    def poll(self) -> None:
        """Raise the failure of a finished background save (called once per step)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has committed; raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still writing."""
        return self._thread is not None and self._thread.is_alive()

    def _background(self, step: int, staged: dict, meta: dict, rng: dict) -> None:
        try:
            self._write(step, staged, meta, rng)
        except BaseException as e:  # re-raised in the training thread by poll()/wait()
            self._error = e

    def _write(self, step: int, state: dict, meta: dict, rng: dict) -> Path:
        """Write shards into a temporary directory, verify, then commit on rank 0."""
        start = time.perf_counter()
        name = step_dir_name(step)
        tmp = self.root / f".tmp-{name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        error, mine = None, {}
        try:
            dcp.save(state, storage_writer=_Writer(tmp, step), process_group=self.group)
            rng_path = tmp / f"rng-rank-{self.rank:05d}.pt"
            _save_durable(rng, rng_path)
            # Each rank hashes the files it wrote itself, in parallel with the others.
            own = [rng_path, *tmp.glob(f"__{self.rank}_*.distcp")]
            if self.rank == 0:
                own.append(tmp / ".metadata")
            mine = {p.name: describe(p) for p in own}
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            error = f"rank {self.rank}: {_first_line(e)}"
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, (error, mine), group=self.group)
        errors = [err for err, _ in results if err]
        if self.rank == 0:
            if not errors:
                files = {k: v for _, part in results for k, v in part.items()}
                try:
                    self._commit(tmp, name, files, meta)
                except OSError as e:
                    errors.append(f"commit: {type(e).__name__}: {e}")
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
        total = sum(v["size"] for _, part in results for v in part.values())
        outcome = [errors]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0]:
            previous = self.latest_name()
            raise CheckpointError(
                f"the checkpoint at step {step} was not committed: {outcome[0][0]}",
                hint=f"the previous checkpoint {previous or '(none)'} is intact and is what a "
                "restart resumes from; check free space and the file system",
            )
        write_s = time.perf_counter() - start
        self.completed.append({"step": step, "write_s": write_s, "bytes": total,
                               "gb_per_s": total / write_s / 1e9})
        log.info("checkpoint %s committed: %.2f GB in %.2f s (%.2f GB/s)", name, total / 1e9,
                 write_s, total / write_s / 1e9)
        return self.root / name

    def _commit(self, tmp: Path, name: str, files: dict, meta: dict) -> None:
        """Manifest, rename into place, move ``latest``, then prune: in this order."""
        write_manifest(tmp, files, {**meta, "name": name})
        fsync_dir(tmp)
        final = self.root / name
        if final.exists():  # the same step saved again after a rollback
            trash = self.root / f".trash-{name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(name + "\n")
        os.replace(pointer, self.root / LATEST)
        fsync_dir(self.root)
        self._prune()

    def _prune(self) -> None:
        """Keep the last ``keep_last``, every ``keep_every``-th step, and ``latest``."""
        done = self.committed()
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if step_of(p) % self.cfg.keep_every == 0}
        latest = self.latest_name()
        for path in done:
            if path not in keep and path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
                log.info("checkpoint %s removed (retention)", path.name)

    # -- finding and loading ------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.glob("step-*") if p.is_dir()]
        return sorted(dirs, key=step_of)

    def latest_name(self) -> str | None:
        """The name ``latest`` points to, if any."""
        try:
            return (self.root / LATEST).read_text().strip() or None
        except FileNotFoundError:
            return None

    def verify(self, path: Path) -> dict[str, Any]:
        """Check every file of a checkpoint (split over ranks); return its manifest."""
        manifest = read_manifest(path)
        names = sorted(manifest["files"])
        error = None
        try:
            verify_files(path, manifest["files"], names[self.rank::self.world_size])
        except CheckpointError as e:
            error = e.what
        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            raise CheckpointError(bad[0])
        return manifest

    def find_resumable(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies; each newer one skipped is logged with why."""
        for path in reversed(self.committed()):
            try:
                return path, self.verify(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s; falling back to an older one",
                            path.name, e.what)
        return None

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill ``state`` (current model/optimizer state dicts) in place from ``path``."""
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     process_group=self.group)
        except CheckpointException as e:  # a BaseException carrying each rank's traceback
            raise CheckpointError(f"loading {path} failed: {_first_line(e)}") from None
        rng_path = path / f"rng-rank-{self.rank:05d}.pt"
        manifest = read_manifest(path)
        if manifest.get("world_size") == self.world_size and rng_path.is_file():
            _restore_rng(torch.load(rng_path, weights_only=True), self.device)
        else:
            # Another world size: RNG streams do not map one to one; derive fresh ones.
            torch.manual_seed(int(manifest.get("step", 0)) * 1_000_003 + self.rank)

    def close(self) -> None:
        """Finish the in-flight save (raising its error) before the process exits."""
        self.wait()


class _Writer(FileSystemWriter):
    """DCP's file writer (fsync on) with the injected-fault seam inside the write phase, where
    DCP reports a rank's I/O error to every rank, as it does for a real full disk."""

    def __init__(self, path: Path, step: int):
        super().__init__(path, sync_files=True)
        self._step = step

    def write_data(self, plan, planner):
        faults.maybe_fail_save(self._step)
        return super().write_data(plan, planner)


def _first_line(e: BaseException) -> str:
    """The root cause of an error in one line (DCP wraps each rank's traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        inner, _trace = next(iter(e.failures.values()))
        return f"{type(inner).__name__}: {inner}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _save_durable(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
