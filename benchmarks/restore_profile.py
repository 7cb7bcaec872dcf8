"""Where a checkpoint restore's time goes: its parts timed inside, CPU seconds by thread.

    python benchmarks/restore_profile.py runs/bc --params 1.1e9

Saves the state ``hpctrain bench checkpoint`` uses (bf16 parameters, two fp32 moments; on the
GPU where there is one) once under the path, then restores it through ``CheckpointManager`` as
a resume does: cold (the files' pages dropped first), then warm (from the page cache), each into
the state's device and, with ``--cpu-too``, into CPU tensors. For each restore it prints the wall
time and GB/s, the CPU seconds of the main thread, the loading threads and the checksum threads,
and the summed wall time inside the load's parts (finding the tensors' bytes, the bulk read,
each piece's read system calls, a GPU piece's wait for its buffer and its copy, the
load's waits for the checks to read ahead, the pinned
buffers' set-up and release, the checksums, DCP's load as a whole). The parts are timed by
wrapping ``hpctrain.checkpoint.safe_io``'s functions: a research tool, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpctrain.bench.checkpoint import model_state
from hpctrain.bench.disk import drop_cached
from hpctrain.checkpoint import manifest, safe_io
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.staging import tensors_of

_spent: collections.Counter[str] = collections.Counter()
_cpu: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _spent[name] += time.perf_counter() - start
    return wrapper


def _instrument() -> None:
    """Wrap the load's parts (and count each thread's CPU time by its name's prefix)."""
    reader = safe_io.SafeFileSystemReader
    reader.read_data = _timed("reader.read_data", reader.read_data)
    reader._read_direct = _timed("reader._read_direct (whole tensors)", reader._read_direct)
    reader._direct_span = _timed("  finding a tensor's bytes (sum)", reader._direct_span)
    manifest.Verification.wait_read = _timed("  waiting for the checks to read ahead (sum)",
                                             manifest.Verification.wait_read)
    safe_io._read_into = _timed("  pread (sum over threads)", safe_io._read_into)
    staging = safe_io._Staging
    staging.fill = _timed("  gpu piece: wait+pread+copy (sum)", staging.fill)
    staging.__init__ = _timed("staging set-up (pin)", staging.__init__)
    staging.close = _timed("staging close (sync, unpin)", staging.close)
    manifest.checksum = _timed("checksum (sum over files)", manifest.checksum)
    dcp.load = _timed("dcp.load", dcp.load)
    run = threading.Thread.run

    def counted(self):
        start = time.thread_time()
        try:
            run(self)
        finally:
            with _lock:
                _cpu[self.name.split("_")[0]] += time.thread_time() - start
    threading.Thread.run = counted


def _restore(m: CheckpointManager, ckpt: Path, state: dict, nbytes: int, label: str,
             cold: bool) -> None:
    for t in tensors_of(state):
        t.zero_()
    if cold:
        for f in ckpt.iterdir():
            drop_cached(f)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _spent.clear()
    _cpu.clear()
    main0 = time.thread_time()
    start = time.perf_counter()
    m.restore(ckpt, lambda p, _m: m.load(p, state))
    wall = time.perf_counter() - start
    main = time.thread_time() - main0
    threads = ", ".join(f"{k} {v:.2f}" for k, v in sorted(_cpu.items()))
    print(f"\n{label}: {wall:.2f} s, {nbytes / wall / 1e9:.2f} GB/s; CPU s: main {main:.2f}, "
          f"{threads}")
    for name, seconds in _spent.items():
        print(f"    {name:40s} {seconds:7.2f} s")


def main() -> None:
    """Save once, restore cold and warm, print the parts."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--params", type=float, default=1.1e9)
    ap.add_argument("--threads", type=int, default=0, help="checkpoint.write_threads")
    ap.add_argument("--cpu-too", action="store_true", help="also restore into CPU tensors")
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix=".restore-profile-", dir=args.path))
    try:
        state = model_state(int(args.params), device=device)
        m = CheckpointManager(CheckpointConfig(keep_last=1, write_threads=args.threads), work,
                              rank=0, world_size=1, device=device, group=dist.group.WORLD)
        m.save(1, state, {"step": 1}, blocking=True)
        ckpt = m.committed()[-1]
        nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
        print(f"{nbytes / 1e9:.2f} GB in {len(list(ckpt.iterdir()))} files; state on {device}")
        _instrument()
        _restore(m, ckpt, state, nbytes, f"cold, into {device.type}", cold=True)
        _restore(m, ckpt, state, nbytes, f"warm, into {device.type}", cold=False)
        _restore(m, ckpt, state, nbytes, f"warm again, into {device.type}", cold=False)
        if args.cpu_too and device.type != "cpu":
            del state
            cpu_state = model_state(int(args.params))
            _restore(m, ckpt, cpu_state, nbytes, "warm, into cpu", cold=False)
            _restore(m, ckpt, cpu_state, nbytes, "cold, into cpu", cold=True)
        m.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
