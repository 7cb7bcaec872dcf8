"""The checkpoint writer process: one per rank, so the training loop only copies tensors.

Measured on one H200 (FIELD_NOTES): with serialisation, file writes and checksums in a thread of
the training process, the steps that ran beside a background save were ~10x slower (GIL, host
memory bandwidth) although the loop was "blocked" only 0.26 s. Here the training process copies
its tensors into shared host buffers (``staging.py``) and hands the writer a small message; the
writer process — its own interpreter, its own gloo group with the other ranks' writers — runs
DCP's save, the fsyncs, the xxh3 hashes, the manifest, the commit and retention
(``CheckpointStore.write``, the same protocol as an in-process save).

Protocol over a pipe (the training process is the parent)::

    parent -> writer   ("attach", nbytes, specs) then the memfd (SCM_RIGHTS)
                       ("save", step, skeleton, meta, rng, last_bytes)       one at a time
                       ("stop",)
    writer -> parent   ("ready",)                  its process group is up
                       ("attached",)
                       ("committed", record)       the save's record (step, write_s, bytes, ...)
                       ("failed", what, hint)      every rank failed this save alike; it goes on
                       ("fatal", what)             it cannot go on (its group broke); it exits

The writer dies with its parent (``PR_SET_PDEATHSIG``: a killed rank leaves no orphan writing
into the run) and ignores the preemption signals, which Slurm and the launchers send to every
process of a step: the save they ask for is the writer's job.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import signal
import socket
from dataclasses import dataclass
from multiprocessing import get_context, reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manifest import CheckpointError, step_dir_name
from hpctrain.checkpoint.staging import Attached, SharedStaging
from hpctrain.runtime.logs import EscapingFormatter
from hpctrain.runtime.orphans import die_with_parent

log = logging.getLogger("hpctrain.checkpoint")

_IGNORED = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
# How long a writer that was asked to stop may take to exit before it is killed.
_STOP_S = 5.0


@dataclass(frozen=True)
class _Init:
    cfg: CheckpointConfig
    root: Path
    rank: int
    world_size: int
    store: tuple[str, int] | None  # rank 0's rendezvous store for the writers' group
    timeout_s: float
    parent_pid: int


class WriterDied(CheckpointError):
    """The writer process is gone; no save can be made through it any more."""


class WriterProcess:
    """The training process's handle on its writer (every method is per rank, not collective,
    except the constructor, which shares rank 0's rendezvous address)."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, timeout_s: float):
        self.rank = rank
        self._server = None
        address: list[Any] = [None]
        if world_size > 1:
            if rank == 0:
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                # Port 0: the OS picks a free one, no race with other jobs on the node.
                self._server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=timeout_s))
                address = [(host, self._server.port)]
            dist.broadcast_object_list(address, src=0, group=group)
        ctx = get_context("spawn")
        self._conn, child = ctx.Pipe()
        init = _Init(cfg, root, rank, world_size, address[0], timeout_s, os.getpid())
        self._proc = ctx.Process(target=serve, args=(child, init), daemon=True,
                                 name=f"hpctrain-checkpoint-writer-{rank}")
        with _no_gpus_for_children():
            self._proc.start()
        child.close()
        self._ready = False
        self._stopping = False
        self.step: int | None = None  # the save in flight
        # multiprocessing's exit handler joins its children after SIGTERM, which the writer
        # ignores: stop it first (atexit runs handlers last-registered first).
        atexit.register(self.kill)

    @property
    def pid(self) -> int | None:
        """The writer's process id."""
        return self._proc.pid

    def attach(self, staging: SharedStaging) -> None:
        """Hand the writer the staging buffers (waits for it to be up)."""
        self._await_ready()
        self._conn.send(("attach", staging.nbytes, staging.specs))
        reduction.send_handle(self._conn, staging.fd, self._proc.pid)
        self._expect("attached")

    def submit(self, step: int, skeleton: Any, meta: dict, rng: dict[str, bytes],
               last_bytes: int | None) -> None:
        """Start writing the staged state of ``step`` (one save at a time)."""
        assert self.step is None, "one save in flight at a time"
        self._await_ready()
        self.step = step
        try:
            self._conn.send(("save", step, skeleton, meta, rng, last_bytes))
        except OSError:
            raise self._died(None) from None

    def check(self) -> None:
        """Raise WriterDied if the idle writer process is gone (cheap: called every step)."""
        if self.step is None and not self._proc.is_alive():
            raise self._died(None)

    def result(self, block: bool) -> tuple | None:
        """The in-flight save's outcome ("committed", record) / ("failed", what, hint), once
        there is one; None while it runs (``block=False``). Raises WriterDied."""
        if self.step is None:
            return None
        if not block and not self._conn.poll() and self._proc.is_alive():
            return None
        message = self._receive()
        if message[0] == "fatal":
            raise self._died(message[1])
        self.step = None
        return message

    def stop(self) -> None:
        """Ask the writer to exit; it has nothing left to write (the caller waited for the last
        save), so it is not waited for here: ``kill`` reaps it at exit."""
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop",))
        self._stopping = True

    def kill(self) -> None:
        """Reap the writer (at exit): one asked to stop gets a few seconds, any other is
        SIGKILLed at once (what it may be writing was not committed; the previous is)."""
        if self._proc.pid is not None and self._proc.is_alive():
            if self._stopping:
                self._proc.join(_STOP_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        atexit.unregister(self.kill)
        self._conn.close()
        self._server = None  # the writers' rendezvous store lives as long as they do

    # -- helpers ------------------------------------------------------------------------------

    def _await_ready(self) -> None:
        if not self._ready:
            self._expect("ready")
            self._ready = True

    def _expect(self, kind: str) -> None:
        message = self._receive()
        if message[0] != kind:
            raise self._died(message[1] if message[0] == "fatal" else f"unexpected {message}")

    def _receive(self) -> tuple:
        """The next message; WriterDied when the writer is gone (a dead pipe or process)."""
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                break
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died(None) from None

    def _died(self, why: str | None) -> WriterDied:
        self._proc.join(5)
        with contextlib.suppress(EOFError, OSError):
            if why is None and self._conn.poll():
                message = self._conn.recv()  # its last word, if it said one
                why = message[1] if message[0] == "fatal" else None
        code = self._proc.exitcode
        if why is None:
            why = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
        during = (f" during the save of {step_dir_name(self.step)}" if self.step is not None
                  else "")
        return WriterDied(f"the checkpoint writer process of rank {self.rank} (pid "
                          f"{self._proc.pid}) died{during}: {why}")


@contextlib.contextmanager
def _no_gpus_for_children():
    """The writer sees no GPU: it only handles host memory, and a CUDA context there (DCP's file
    writer opens a stream when CUDA is visible) would take GPU memory on device 0 per rank. The
    environment is the spawned interpreter's from its first line; this process's CUDA is up
    already and does not read the variable again."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


# -- the writer process ---------------------------------------------------------------------------

def serve(conn: Connection, init: _Init) -> None:
    """The writer process's main loop (the target of the spawned process)."""
    die_with_parent(init.parent_pid, "the training process")
    for name in _IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # Fault injection (and DCP's logs) read the rank from the environment.
    os.environ["RANK"] = str(init.rank)
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(f"%(asctime)s [checkpoint writer of rank {init.rank}] "
                                           "%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    torch.set_num_threads(1)
    # torch.save's zip CRC-32 of every tensor cost ~1 s per GB here; the manifest's xxh3 of
    # every file (checked before any load) already guards these bytes. Only this process, which
    # writes nothing but checkpoints, turns it off.
    torch.serialization.set_crc32_options(False)
    try:
        _init_group(init)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the run
        _send(conn, ("fatal", f"its process group did not start: {type(e).__name__}: {e}"))
        return
    from hpctrain.checkpoint.store import CheckpointStore

    store = CheckpointStore(init.cfg, init.root, rank=init.rank, world_size=init.world_size)
    attached: Attached | None = None
    _send(conn, ("ready",))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if message[0] == "stop":
                store.wait_removed()
                return
            if message[0] == "attach":
                if attached is not None:
                    attached.close()
                attached = Attached(reduction.recv_handle(conn), message[1], message[2])
                _send(conn, ("attached",))
            elif message[0] == "save":
                _, step, skeleton, meta, rng, last_bytes = message
                store.last_bytes = last_bytes
                try:
                    state = attached.rebuild(skeleton)
                    record = store.write(step, state, meta, _rng_tensors(rng), group=None,
                                         planner=attached.planner())
                except CheckpointError as e:
                    _send(conn, ("failed", e.what, e.hint))
                    continue
                _send(conn, ("committed", record))
    except BaseException as e:  # noqa: BLE001 - a collective broke: this writer cannot go on
        _send(conn, ("fatal", f"{type(e).__name__}: {e}".splitlines()[0]))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _send(conn: Connection, message: tuple) -> None:
    with contextlib.suppress(OSError):
        conn.send(message)


def _init_group(init: _Init) -> None:
    timeout = datetime.timedelta(seconds=init.timeout_s)
    if init.store is None:
        store: dist.Store = dist.HashStore()
    else:
        host, port = init.store
        store = dist.PrefixStore("hpctrain-writer", dist.TCPStore(
            host, port, is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=init.rank, world_size=init.world_size,
                            timeout=timeout)


def _rng_tensors(rng: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in rng.items()}



