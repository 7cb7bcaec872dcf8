"""Save, commit, find and load checkpoints of one run.

Layout under ``<run>/checkpoints/``::

    step-00000100/            committed: renamed into place only after its manifest is written
      .metadata  __0_0.distcp  __1_0.distcp  ...   PyTorch DCP shards, one file per rank
      rng-rank-00000.pt ...                        each rank's RNG states (tensors only)
      manifest.json                                sizes + xxh3 of every file, trainer state
    .tmp-step-00000200/       a save in progress (or a failed one, removed on the next save)
    latest                    name of the newest committed checkpoint
    damaged/step-00000300/    a checkpoint resume found damaged, moved aside (never deleted)

Resume takes the newest checkpoint that verifies *and* loads; each damaged one it passes is
logged with why and, once an older one has loaded, moved to ``damaged/``. Anything else in the
folder (``step-abc``, a ``.bak`` copy) is ignored with a warning and left alone by retention.

Every rank writes its own shards (nothing is gathered to rank 0); DCP reshards on load, so a
checkpoint saved with FSDP on 4 ranks loads with DDP on 1. All collectives of saving and loading
run on a dedicated gloo group, so a background save never interleaves with training traffic.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
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
    DamagedCheckpoint,
    describe,
    read_manifest,
    step_dir_name,
    step_of,
    verify_files,
    write_manifest,
)
from hpctrain.checkpoint.safe_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_weights_only,
)
from hpctrain.runtime.rundir import fsync_dir

log = logging.getLogger("hpctrain.checkpoint")

LATEST = "latest"
DAMAGED = "damaged"

# Fills the caller's state from a verified checkpoint; raises DamagedCheckpoint when the
# checkpoint cannot be used (the caller's own checks of the manifest's values included).
Loader = Callable[[Path, dict[str, Any]], None]


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
        # The newest checkpoint known to be committed: set when a save's commit is known (by
        # the thread that committed it) and by a resume; never when a save merely starts.
        self.last_committed: str | None = None
        # Size of the last checkpoint committed or loaded: what the next save will need.
        self._last_bytes: int | None = None
        self._warned: set[str] = set()

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *,
             blocking: bool) -> float:
        """Checkpoint ``state`` (model/optimizer state dicts) with ``meta`` (JSON) at ``step``.

        Blocking: returns after the commit. Otherwise returns once the state is staged in host
        memory and writes in a background thread; its failure is raised by ``poll``/``wait``.
        Returns the seconds the caller was blocked. When the size of the previous checkpoint is
        known, a file system without room for another is refused before anything is written.
        """
        self.wait()  # at most one save in flight
        start = time.perf_counter()
        self._check_free_space(step)
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

    def _check_free_space(self, step: int) -> None:
        """Refuse a save the file system has no room for (rank 0 looks, every rank agrees)."""
        message = [None]
        if self.rank == 0:
            need = self._expected_bytes()
            free = _free_bytes(self.root)
            if need is not None and free is not None and free < need:
                message[0] = self._no_space(need)
        dist.broadcast_object_list(message, src=0, group=self.group)
        if message[0]:
            raise CheckpointError(f"the checkpoint at step {step} was not started: "
                                  f"{message[0]}", hint=self._intact_hint())

    def _write(self, step: int, state: dict, meta: dict, rng: dict) -> Path:
        """Write shards into a temporary directory, verify, then commit on rank 0."""
        start = time.perf_counter()
        name = step_dir_name(step)
        tmp = self.root / f".tmp-{name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        error, full, mine = None, False, {}
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
            # torch.save reports a full disk as "unexpected pos" (the errno is lost): judge by
            # what is left now, before the partial files are removed.
            full = _is_disk_full(e) or _less_free_than(tmp, _state_bytes(state))
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, (error, full, mine, _state_bytes(state)),
                               group=self.group)
        errors = [err for err, _, _, _ in results if err]
        full = any(f for _, f, _, _ in results)
        total = sum(v["size"] for _, _, part, _ in results for v in part.values())
        if self.rank == 0:
            if not errors:
                files = {k: v for _, _, part, _ in results for k, v in part.items()}
                try:
                    self._commit(tmp, name, files, meta)
                except OSError as e:
                    errors.append(f"commit: {type(e).__name__}: {e}")
                    full = full or _is_disk_full(e)
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
        outcome = [(errors, full)]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        errors, full = outcome[0]
        if errors:
            why = errors[0]
            if full:
                need = self._expected_bytes() or sum(b for _, _, _, b in results)
                why = f"{self._no_space(need)} ({why})"
            raise CheckpointError(f"the checkpoint at step {step} was not committed: {why}",
                                  hint=self._intact_hint())
        self.last_committed, self._last_bytes = name, total
        write_s = time.perf_counter() - start
        self.completed.append({"step": step, "write_s": write_s, "bytes": total,
                               "gb_per_s": total / write_s / 1e9})
        log.info("checkpoint %s committed: %.2f GB in %.2f s (%.2f GB/s)", name, total / 1e9,
                 write_s, total / write_s / 1e9)
        return self.root / name

    def _no_space(self, need: int) -> str:
        free = _free_bytes(self.root)
        have = f"{_gb(free)} GB free" if free is not None else "free space unknown"
        return f"no space left on {self.root}: this checkpoint needs ~{_gb(need)} GB, {have}"

    def _intact_hint(self) -> str:
        previous = self.latest_name()
        return (f"the previous checkpoint {previous or '(none)'} is intact and is what a restart "
                "resumes from; check free space and the file system (checkpoint.keep_last "
                "bounds how many are kept)")

    def _expected_bytes(self) -> int | None:
        """The size of the last checkpoint committed or loaded, else of the newest on disk."""
        if self._last_bytes is None:
            for path in reversed(self.committed()):
                try:
                    self._last_bytes = _manifest_bytes(read_manifest(path))
                    break
                except DamagedCheckpoint:
                    continue
        return self._last_bytes

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
        self._point_latest(name)
        self._prune()

    def _point_latest(self, name: str) -> None:
        """Atomically make ``latest`` name ``name`` (a committed checkpoint)."""
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(name + "\n")
        os.replace(pointer, self.root / LATEST)
        fsync_dir(self.root)

    def _prune(self) -> None:
        """Keep the last ``keep_last``, every ``keep_every``-th step, and ``latest``.

        Only ``step-NNNNNNNN`` directories are candidates: ``damaged/`` and anything the run did
        not write itself are never touched.
        """
        done = self.committed()
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if step_of(p.name) % self.cfg.keep_every == 0}
        latest = self.latest_name()
        for path in done:
            if path not in keep and path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
                log.info("checkpoint %s removed (retention)", path.name)

    # -- finding and loading ------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first; anything else is warned about once."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            step = step_of(path.name)
            if step is not None and path.is_dir():
                found.append((step, path))
            elif not path.name.startswith(".") and path.name not in (LATEST, DAMAGED):
                self._warn_once(path.name, "ignoring %s: not a checkpoint of this run (expected "
                                "step-NNNNNNNN directories); it is left as it is", path)
        return [path for _, path in sorted(found)]

    def latest_name(self) -> str | None:
        """The name ``latest`` points to, if it holds a checkpoint name."""
        try:
            raw = (self.root / LATEST).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn_once(LATEST, "ignoring %s: %s", self.root / LATEST, e)
            return None
        name = raw.decode("utf-8", "replace").strip()
        if step_of(name) is None:
            self._warn_once(LATEST, "ignoring %s: it holds %r, not a checkpoint name",
                            self.root / LATEST, name[:60])
            return None
        return name

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def verify(self, path: Path) -> dict[str, Any]:
        """Check the manifest and every file of a checkpoint (split over ranks); return the
        manifest, or raise DamagedCheckpoint on every rank naming what is wrong."""
        error, manifest = None, {}
        try:
            manifest = read_manifest(path)
            names = sorted(manifest["files"])
            verify_files(path, manifest["files"], names[self.rank::self.world_size])
        except DamagedCheckpoint as e:
            error = e.what
        self._agree(error)
        return manifest

    def restore(self, path: Path, load: Loader) -> dict[str, Any]:
        """Verify ``path`` and ``load`` it; damage is an error here (the user chose it)."""
        manifest = self.verify(path)
        load(path, manifest)
        self.last_committed, self._last_bytes = path.name, _manifest_bytes(manifest)
        return manifest

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
                self._point_latest(path.name)
            dist.barrier(group=self.group)
            return path, manifest
        if damaged:
            listing = "\n".join(f"  {p.name}: {why}" for p, why in damaged)
            raise DamagedCheckpoint(
                f"every checkpoint in {self.root} is damaged, none can be resumed:\n{listing}",
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
        """Fill ``state`` (current model/optimizer state dicts) in place from ``path``.

        Raises DamagedCheckpoint on every rank when the checkpoint's content is at fault.
        """
        manifest = self._agreed_manifest(path)
        reader = SafeFileSystemReader(path, files=manifest["files"])
        self._agree_on(reader.read_metadata)
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                     process_group=self.group)
        except CheckpointException as e:  # a BaseException carrying each rank's failure
            raise _load_failure(path, e) from None
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
            error = e.what
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            raise DamagedCheckpoint(bad[0])

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


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and, for DCP's wrapper, each rank's own exception."""
    if isinstance(e, CheckpointException) and e.failures:
        return [inner for inner, _trace in e.failures.values()]
    return [e]


def _first_line(e: BaseException) -> str:
    """The root cause of an error in one line (DCP wraps each rank's traceback)."""
    inner = _causes(e)[0]
    if isinstance(inner, CheckpointError):
        return inner.what.splitlines()[0]
    return f"{type(inner).__name__}: {inner}".splitlines()[0]


def _is_disk_full(e: BaseException) -> bool:
    return any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)
               for c in _causes(e))


def _load_failure(path: Path, e: CheckpointException) -> CheckpointError:
    """DCP's load failure as ours: damage unless the machine ran out of memory."""
    inner = _causes(e)[0]
    if isinstance(inner, DamagedCheckpoint):
        return DamagedCheckpoint(inner.what)
    if isinstance(inner, MemoryError | torch.OutOfMemoryError):
        return CheckpointError(f"loading {path} failed: {_first_line(e)}")
    return DamagedCheckpoint(f"loading {path} failed: {_first_line(e)}")


def _less_free_than(path: Path, n: int) -> bool:
    free = _free_bytes(path)
    return free is not None and free < n


def _manifest_bytes(manifest: dict[str, Any]) -> int:
    return sum(entry["size"] for entry in manifest["files"].values())


def _state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in ``state`` (its shard of a DTensor)."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _state_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g}"


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


def _save_durable(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
