"""Checkpoint save and restore GB/s of a model-sized state, beside ``bench disk`` on the same path.

    hpctrain bench checkpoint /scratch/$USER --params 1e9     # 10 GB: bf16 + two fp32 moments

The state is what Adam training holds per rank: bf16 parameters and two fp32 moments per
parameter (10 bytes), in tensors of a transformer's sizes, random bytes, on the GPU where there
is one (as training holds it: a save copies it to the host, a restore to the GPU). It goes through
``CheckpointManager`` as training does: the save is timed from the call until the background
writer has committed it (staging, serialisation, fsync, checksums, manifest, rename: what the
user pays before the next save can start; ``write`` is the writer's part alone, from its start
to the commit, the number to hold against the disk's), the restore from the call until the state
is filled (DCP's load, with every checksum verified meanwhile), with the page cache of the
checkpoint's files dropped first where the file system has one. Everything is written to a
temporary folder under the path and removed afterwards. ``cpu_s`` is the CPU time this process
and the writer process spent on the operation: on a busy shared machine a steadier comparison
than the wall time.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from hpctrain.bench.common import Results
from hpctrain.bench.disk import check_folder, drop_cached, fs_type, read_cold, run_disk
from hpctrain.runtime.mounts import in_memory

COLUMNS = ["op", "size", "seconds", "gbps", "pct_of_disk", "cpu_s", "method"]
# Elements per tensor: a 2048 x 2048 projection of a 1b-class model.
_TENSOR = 2048 * 2048


def model_state(params: int, seed: int = 0, device: torch.device | None = None
                ) -> dict[str, Any]:
    """Model and Adam state of ``params`` bf16 parameters (fp32 moments), random values, on
    ``device`` (the CPU by default)."""
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    left, i = params, 0
    while left > 0:
        n = min(_TENSOR, left)
        name = f"tensors.{i}"
        model[name] = torch.rand(n, generator=g).to(device, torch.bfloat16).view(
            -1, 2048 if n % 2048 == 0 else 1)
        moments[name] = {"step": torch.tensor(10.0),
                         "exp_avg": torch.rand(model[name].shape, generator=g).to(device),
                         "exp_avg_sq": torch.rand(model[name].shape, generator=g).to(device)}
        left, i = left - n, i + 1
    return {"model": model, "optimizer": {"state": moments, "param_groups": [
        {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(model)}]}}


def run_checkpoint_bench(path: Path, params: int, *, saves: int = 2, write_threads: int = 0,
                         writer: str = "process", disk: bool = True,
                         echo: Callable[[str], None] | None = None) -> Results:
    """Time ``saves`` saves and one restore of a ``params``-parameter state under ``path``."""
    from hpctrain.checkpoint.config import CheckpointConfig
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.checkpoint.manifest import CheckpointError
    from hpctrain.checkpoint.staging import tensors_of
    from hpctrain.checkpoint.store import state_bytes
    from hpctrain.checkpoint.store import write_threads as auto_threads

    check_folder(path)
    say = echo or (lambda _line: None)
    threads = auto_threads(write_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = model_state(params, device=device)
    nbytes = state_bytes(state)
    res = Results("checkpoint", COLUMNS, meta={
        "path": str(path), "fs_type": fs_type(path), "params": params, "writer": writer,
        "state_on": device.type,
        "write_threads": threads, "gb": "1e9 bytes",
        "save": "call to commit (staging, write, fsync, xxh3, manifest, rename)",
        "write": "the writer's part of the save (write to commit), best of the saves",
        "restore": "call to filled state (DCP load, every checksum verified meanwhile)"})
    disk_gbps: dict[str, float] = {}
    if disk:
        for r in run_disk(path, nbytes, threads=threads, echo=say):
            disk_gbps[r.op] = r.gbps
            res.add(op=f"disk {r.op}", size=r.size, seconds=r.seconds, gbps=r.gbps,
                    pct_of_disk=None, method=r.method)
    owned_group = not dist.is_initialized()
    work: Path | None = None
    manager: CheckpointManager | None = None
    # Everything made from here on is undone in the finally, whichever step fails.
    try:
        if owned_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        work = Path(tempfile.mkdtemp(prefix=".hpctrain-bench-checkpoint-", dir=path))
        cfg = CheckpointConfig(keep_last=1, write_threads=threads)
        manager = CheckpointManager(cfg, work, rank=0, world_size=1,
                                    device=device, group=dist.group.WORLD)
        if writer == "process":
            manager.start_writer()
            manager.prepare(state)
        best, best_cpu = None, None
        for i in range(saves):
            say(f"bench checkpoint: save {i + 1}/{saves} of {nbytes / 1e9:.2f} GB ({writer})")
            cpu = _cpu_s()
            start = time.perf_counter()
            manager.save(i + 1, state, {"step": i + 1}, blocking=writer == "inline")
            manager.wait()
            seconds = time.perf_counter() - start
            if best is None or seconds < best:
                best, best_cpu = seconds, _cpu_s() - cpu
        written = manager.completed[-1]["bytes"]
        res.add(op="save", size=written, seconds=best, gbps=written / best / 1e9,
                pct_of_disk=_pct(written / best / 1e9, disk_gbps.get("write")), cpu_s=best_cpu,
                method=f"{writer} writer, {threads} files, best of {saves}")
        # The writer's own part of it, against the same disk number: the staging copy before
        # it is memory bandwidth (on a GPU, the device-to-host copy), not the disk's.
        write = min(r["write_s"] for r in manager.completed)
        res.add(op="write", size=written, seconds=write, gbps=written / write / 1e9,
                pct_of_disk=_pct(written / write / 1e9, disk_gbps.get("write")), cpu_s=None,
                method="the writer alone: write, fsync, xxh3, manifest, commit")
        ckpt = work / manager.latest_name()
        # A tensor of each kind, the last one short: each must come back bit for bit.
        last = list(state["model"])[-1]
        expected = {k: v.clone() for k, v in [*list(state["model"].items())[:2],
                                              (last, state["model"][last])]}
        moment = state["optimizer"]["state"][last]["exp_avg"].clone()
        for t in tensors_of(state):
            t.zero_()
        memory_fs = in_memory(path)
        for f in ckpt.iterdir():
            drop_cached(f)
        _wait_retired(work)
        say(f"bench checkpoint: restore of {written / 1e9:.2f} GB")
        cpu = _cpu_s()
        start = time.perf_counter()
        manager.restore(ckpt, lambda p, _m: manager.load(p, state))
        seconds = time.perf_counter() - start
        cpu = _cpu_s() - cpu
        wrong = [k for k, v in expected.items() if not torch.equal(state["model"][k], v)]
        if not torch.equal(state["optimizer"]["state"][last]["exp_avg"], moment):
            wrong.append(f"{last}.exp_avg")
        if wrong:
            raise CheckpointError(
                f"bench checkpoint: {', '.join(wrong)} restored with other values than saved",
                expected="a bit-exact round trip of the saved state",
                hint=f"the file system at {path} returned other bytes than were written, "
                "or the checkpoint code has a bug: run `hpctrain bench disk` on the same "
                "path and report it with this output")
        res.add(op="restore", size=written, seconds=seconds, gbps=written / seconds / 1e9,
                pct_of_disk=_pct(written / seconds / 1e9, disk_gbps.get("read")), cpu_s=cpu,
                method=f"load + verify at once into {device.type} tensors, "
                + ("page cache (tmpfs)" if memory_fs else "page cache dropped first"))
        _where_the_restore_goes(res, manager, ckpt, state, written, disk_gbps.get("read"), say)
        return res
    finally:
        if manager is not None:
            manager.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if owned_group and dist.is_initialized():
            dist.destroy_process_group()


def _where_the_restore_goes(res: Results, manager: Any, ckpt: Path, state: dict[str, Any],
                            written: int, disk_read: float | None,
                            say: Callable[[str], None]) -> None:
    """Two rows that split a restore slower than the disk: the checkpoint's own files read
    cold through the page cache, a file a thread (the restore's way of reading, against the
    disk's O_DIRECT), and the restore again from the page cache they filled (the loading's
    own cost, the disk out of it)."""
    from hpctrain.checkpoint.staging import tensors_of

    files = sorted(f for f in ckpt.iterdir() if f.is_file())
    say(f"bench checkpoint: reading the checkpoint's {len(files)} files, page cache dropped")
    seconds = read_cold(files)
    res.add(op="read files", size=written, seconds=seconds, gbps=written / seconds / 1e9,
            pct_of_disk=_pct(written / seconds / 1e9, disk_read), cpu_s=None,
            method=f"the checkpoint's {len(files)} files, a thread each, buffered, "
            "page cache dropped first")
    for t in tensors_of(state):
        t.zero_()
    say("bench checkpoint: restore again, from the page cache")
    cpu = _cpu_s()
    start = time.perf_counter()
    manager.restore(ckpt, lambda p, _m: manager.load(p, state))
    seconds = time.perf_counter() - start
    res.add(op="restore warm", size=written, seconds=seconds, gbps=written / seconds / 1e9,
            pct_of_disk=None, cpu_s=_cpu_s() - cpu,
            method="the same restore, the files in the page cache")


def _wait_retired(root: Path, timeout_s: float = 120.0) -> None:
    """Wait until the writer has deleted the checkpoints retention retired (a thread of the
    writer process does it after the commit), so that the restore is timed alone."""
    from hpctrain.checkpoint.store import RETIRED

    deadline = time.monotonic() + timeout_s
    while any(p.name.startswith(RETIRED) for p in root.iterdir()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)


def _cpu_s() -> float:
    """CPU seconds used so far by this process and its children (the writer process): on a
    shared machine the wall time depends on the neighbours, this much less."""
    total = 0.0
    me = psutil.Process()
    for p in (me, *me.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _pct(gbps: float, disk: float | None) -> float | None:
    return 100 * gbps / disk if disk else None

