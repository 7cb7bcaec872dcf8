"""Copy a prepared directory once per node to node-local disk (``data.stage_to``).

    data:
      path: /lustre/proj/data/web
      stage_to: $SLURM_TMPDIR          # environment variables are expanded

Local rank 0 of each node stages; the other local ranks of the job wait for its decision:

1. the copy lives in ``STAGE_TO/hpctrain-stage/<name>-<manifest hash>/``, so jobs sharing a node
   share one copy, and a changed dataset gets a new directory;
2. ``<key>.lock`` (``fcntl.flock``) serializes the jobs: a second job waits instead of copying too;
3. an existing copy is verified (every checksum) before it is used; a corrupted one is removed and
   staged again;
4. a new copy is written to ``.<key>.tmp-<pid>``, verified against the manifest, then renamed into
   place (atomic: a reader sees a whole copy or none);
5. when the disk lacks the space (``shutil.disk_usage``), or ``stage_to`` names an unset variable
   or an unwritable directory, it logs a warning and training reads the shared path;
6. the decision (the directory to read) goes into ``<key>.<job tag>.ready``, which the other local
   ranks poll for (timeout: ``timeout_s``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from hpctrain.data.shards import MANIFEST, atomic_write, load_manifest
from hpctrain.data.tar_samples import TAR_FORMAT, load_tar_manifest, verify_tar
from hpctrain.errors import DataError, HpctrainError
from hpctrain.runtime.rundir import fsync_dir

log = logging.getLogger("hpctrain.data")

STAGE_SUBDIR = "hpctrain-stage"
# Free space kept in reserve beyond the copy itself (the local disk is shared with others).
SPACE_MARGIN = 1.05
DEFAULT_TIMEOUT_S = 4 * 3600.0

_staged: dict[tuple[str, str], Path] = {}


def stage_key(manifest_dir: str | Path) -> str:
    """``<name>-<first 16 hex of the manifest's SHA-256>``: one directory per dataset version."""
    root = Path(manifest_dir)
    try:
        digest = hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()[:16]
    except OSError as e:
        raise DataError(f"cannot read {str(root / MANIFEST)!r}: {e.strerror}") from None
    return f"{root.resolve().name}-{digest}"


def job_tag(environ: Mapping[str, str] | None = None) -> str:
    """What the local ranks of one job (and only them) share: launcher ids and the master port."""
    env = os.environ if environ is None else environ
    parts = [env.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID",
                                      "MASTER_PORT")]
    tag = "_".join(p for p in parts if p) or "local"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)


def _expand(stage_to: str) -> Path | None:
    """``stage_to`` with variables and ``~`` expanded; None if a variable is unset."""
    expanded = os.path.expanduser(os.path.expandvars(stage_to))
    if "$" in expanded or not expanded.strip():
        return None
    return Path(expanded)


def _is_tar(manifest_dir: Path) -> bool:
    """Whether ``manifest_dir`` holds tar shards (`data pack`, `data pack-images`), not tokens."""
    try:
        return json.loads((manifest_dir / MANIFEST).read_text()).get("format") == TAR_FORMAT
    except (OSError, ValueError, AttributeError):
        return False  # load_manifest reports what is wrong with it


def _dataset_files(manifest_dir: Path) -> list[str]:
    if _is_tar(manifest_dir):
        return [s[kind] for s in load_tar_manifest(manifest_dir)["shards"]
                for kind in ("tar", "idx")]
    m = load_manifest(manifest_dir)
    return [s[kind] for s in m.shards for kind in ("bin", "idx", "mask") if kind in s]


def _verify(manifest_dir: Path) -> None:
    """Every file of a prepared or packed directory against its manifest's checksums."""
    if _is_tar(manifest_dir):
        verify_tar(manifest_dir)
    else:
        load_manifest(manifest_dir).verify()


def _bytes_needed(manifest_dir: Path, files: list[str]) -> int:
    return sum((manifest_dir / f).stat().st_size for f in files) + (
        manifest_dir / MANIFEST).stat().st_size


def _copy_verified(src: Path, base: Path, key: str, files: list[str]) -> Path:
    """Copy into a temporary directory, verify, rename to ``base/key``; return it."""
    tmp = base / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in files:
            shutil.copyfile(src / name, tmp / name)
        shutil.copyfile(src / MANIFEST, tmp / MANIFEST)
        _verify(tmp)
        for name in (*files, MANIFEST):  # durable before it becomes visible
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, base / key)
        fsync_dir(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return base / key


def _lead(src: Path, base: Path, key: str) -> tuple[Path, bool]:
    """Local rank 0: (directory to read, whether this call copied), under the node-wide lock."""
    final = base / key
    with open(base / f"{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second job on the node waits here
        try:
            if final.is_dir():
                try:
                    _verify(final)
                    return final, False
                except HpctrainError as e:
                    log.warning("staged copy %s is damaged (%s); staging it again", final, e.what)
                    trash = base / f".{key}.bad-{os.getpid()}"
                    os.rename(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
            files = _dataset_files(src)
            need = _bytes_needed(src, files)
            free = shutil.disk_usage(base).free
            if free < need * SPACE_MARGIN:
                log.warning("not staging %s to %s: %.2f GB free, %.2f GB needed; reading the "
                            "shared path", src, base, free / 1e9, need * SPACE_MARGIN / 1e9)
                return src, False
            t0 = time.perf_counter()
            out = _copy_verified(src, base, key, files)
            log.info("staged %s to %s (%.2f GB, %.1f s)", src, out, need / 1e9,
                     time.perf_counter() - t0)
            return out, True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _base(stage_to: str, src: Path) -> Path | None:
    """The staging directory, created; None (with a warning) when it cannot be used."""
    root = _expand(stage_to)
    if root is None:
        log.warning("data.stage_to = %r names an unset variable; reading %s", stage_to, src)
        return None
    base = root / STAGE_SUBDIR
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cannot create %s (%s); reading %s", base, e.strerror, src)
        return None
    return base


def stage_dataset(manifest_dir: str | Path, stage_to: str, local_rank: int, *,
                  tag: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  poll_s: float = 0.2) -> Path:
    """The directory this rank should read ``manifest_dir`` from: a node-local copy or itself."""
    src = Path(manifest_dir)
    cache_key = (str(src.resolve()), stage_to)
    if cache_key in _staged:
        return _staged[cache_key]
    base = _base(stage_to, src)
    if base is None:
        return src
    key = stage_key(src)
    ready = base / f"{key}.{tag or job_tag()}.ready"
    if local_rank == 0:
        out, _ = _lead(src, base, key)
        atomic_write(ready, [str(out).encode()])
    else:
        out = _wait(ready, timeout_s, poll_s)
    _staged[cache_key] = out
    return out


def _wait(ready: Path, timeout_s: float, poll_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = Path(ready.read_text())
            if (out / MANIFEST).is_file():
                return out
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise DataError(f"waited {timeout_s:.0f} s for local rank 0 to stage the data "
                            f"({str(ready)!r} did not appear)",
                            hint="check local rank 0's log; unset data.stage_to to read the "
                            "shared path")
        time.sleep(poll_s)


def clear_cache() -> None:
    """Forget this process's staging decisions (tests; a new job in the same process)."""
    _staged.clear()
