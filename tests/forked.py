"""Processes forked from one preloaded interpreter: test ranks and CLI runs without the import tax.

A fresh ``python`` that imports torch and hpctrain's training code spends ~4 CPU-s before it
does anything, more than most of the tests' tiny runs then train. multiprocessing's fork server
imports them once per test process. It is single-threaded and has run no torch op, so a process
forked from it starts as clean as a new interpreter; ``start`` then gives it what a
``subprocess`` child would have had: a session of its own, the environment, the working
directory, stdout and stderr to files; and at its end it waits for its threads and runs the
``atexit`` handlers, as an interpreter's exit does.

``command()`` does the same for the ``hpctrain`` a bash script runs (the README's recipes): an
exported bash function hands each call's arguments, environment, working directory and output
to a server thread here, which runs it forked and answers its exit status.

What this cannot show is what happens *while* Python imports (a signal then, an import-time
warning): tests of that start a fresh interpreter (``run_cli(..., fresh=True)``).

A forked process is the fork server's child, not the test's, so ``getrusage`` of the test does
not see it: each one leaves its CPU seconds in a file that ``finish`` adds to ``forked_cpu_s``
(the per-test CPU accounting of tests/conftest.py reads it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# CPU seconds of the forked processes finished so far (user + system, their children included).
forked_cpu_s = 0.0


def start(target: Callable[..., Any], args: tuple, *, env: dict[str, str], out: Path,
          err: Path | None = None, name: str | None = None) -> BaseProcess:
    """Run ``target(*args)`` in a process forked from the fork server, in a session of its own,
    with exactly ``env``, the repository as working directory, stdout to ``out`` and stderr to
    ``err`` (``out`` too when None)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload())  # takes effect when this process starts its server
    proc = ctx.Process(target=_child, name=name,
                       args=(target, args, env, str(out), str(err or out)))
    proc.start()
    return proc


def preload() -> list[str]:
    """What the fork server imports before it forks the first process: torch, training, and
    every command's module (the CLI imports one only when it runs that command)."""
    # Imported here: command()'s client runs this file without site-packages (-S).
    from hpctrain.cli import command_modules

    return ["torch", "hpctrain.cli", *command_modules(), "hpctrain.train.job", "forked",
            "rank_jobs"]


def finish(proc: BaseProcess, out: Path, timeout: float | None = 10) -> None:
    """Join ``proc`` (started with stdout to ``out``) and count the CPU seconds it left."""
    global forked_cpu_s
    proc.join(timeout=timeout)
    cpu = Path(f"{out}.cpu")
    if cpu.is_file():  # absent when the process was killed or left through os._exit
        forked_cpu_s += float(cpu.read_text() or 0)
        cpu.unlink()


def cli(argv: list[str]) -> None:
    """``python -m hpctrain ARGV`` in this process (a ``start`` target)."""
    sys.argv = ["-m", *argv]  # run_module puts the module's path first, as `python -m` does
    runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)


def script(path: str, argv: list[str]) -> None:
    """``python PATH ARGV`` in this process (a ``start`` target): a user's script."""
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))  # as python puts the script's folder first
    runpy.run_path(path, run_name="__main__")


class Popen:
    """``python -m hpctrain ARGV`` forked, with the part of ``subprocess.Popen`` (text mode,
    stdout and stderr piped, a new session) that the tests use: ``pid``, ``args``, ``poll``,
    ``wait``, ``send_signal``, ``communicate`` and ``returncode``."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="cli-")
        self._out = Path(self._tmp.name) / "stdout"
        self._err = Path(self._tmp.name) / "stderr"
        self.args = [sys.executable, "-m", "hpctrain", *argv]
        self._proc = start(cli, (argv,), env=env, out=self._out, err=self._err)
        self.pid = self._proc.pid
        self._output: tuple[str, str] | None = None

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (minus the signal that ended it)."""
        return self._proc.exitcode

    def poll(self) -> int | None:
        """The exit status, None while it runs."""
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process (not its group), as Popen does; nothing once it ended."""
        if self._proc.exitcode is None:
            os.kill(self.pid, signal.Signals(sig))

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end, then (stdout, stderr); ``subprocess.TimeoutExpired`` as ``wait``."""
        if self._output is None:
            self.wait(timeout)
            finish(self._proc, self._out)
            self._output = (self._out.read_text(errors="replace"),
                            self._err.read_text(errors="replace"))
            self._tmp.cleanup()
        return self._output


@contextmanager
def command() -> Iterator[dict[str, str]]:
    """Environment variables under which bash runs ``hpctrain ARGV`` forked (see ``cli``),
    while the block lasts: the one found on PATH must still exist, as bash would run it.

    The forked process writes to the caller's stdout and stderr, runs in its working directory
    with its environment and ends, killed with its descendants, when the caller goes (a timeout
    killing the script's process group)."""
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        address = str(Path(tmp) / "socket")
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        threading.Thread(target=_serve, args=(server, Path(tmp)), daemon=True).start()
        client = f'"{sys.executable}" -I -S "{Path(__file__)}" "{address}"'
        body = ('exe=$(type -P hpctrain) || { echo "hpctrain: command not found" >&2; '
                f'return 127; }}; {client} "$exe" "$@"')
        try:
            yield {"BASH_FUNC_hpctrain%%": f"() {{ local exe; {body}; }}"}
        finally:
            server.close()


def _serve(server: socket.socket, tmp: Path) -> None:
    """Accept ``command()``'s calls until the socket closes, each in a thread of its own."""
    calls = 0
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # closed: the block ended
            return
        calls += 1
        threading.Thread(target=_answer, args=(conn, tmp / f"call-{calls}.log"),
                         daemon=True).start()


def _answer(conn: socket.socket, log: Path) -> None:
    """Run one call forked; answer its exit status (128 + N for a signal N, as a shell says)."""
    from hpctrain.launch.local import kill_tree

    with conn:
        call = json.loads(conn.makefile("rb").readline())
        proc = start(_cli_for, (call["argv"], call["cwd"], call["pid"]), env=call["env"],
                     out=log)
        try:
            while proc.exitcode is None:
                ready, _, _ = select.select([conn, proc.sentinel], [], [])
                if conn in ready and not conn.recv(1):  # the caller is gone
                    break
        finally:
            kill_tree(proc.pid)
            finish(proc, log)
        code = proc.exitcode
        with contextlib.suppress(OSError):
            conn.sendall(f"{128 - code if code < 0 else code}\n".encode())


def _cli_for(argv: list[str], cwd: str, pid: int) -> None:
    """``cli(argv)`` in ``cwd``, writing to process ``pid``'s stdout and stderr."""
    os.chdir(cwd)
    for fd in (1, 2):
        theirs = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        os.dup2(theirs, fd)
        os.close(theirs)
    cli(argv)


def _call(address: str, argv: list[str]) -> int:
    """The caller's side of ``command()``: this process's call, then its exit status."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(address)
        conn.sendall(json.dumps({"argv": argv, "cwd": os.getcwd(), "pid": os.getpid(),
                                 "env": dict(os.environ)}).encode() + b"\n")
        answer = conn.makefile("rb").read()
    return int(answer) if answer.strip() else 1


def _child(target: Callable[..., Any], args: tuple, env: dict[str, str], out: str,
           err: str) -> None:
    try:
        os.setsid()
        _redirect(out, err)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(REPO)
        if "OMP_NUM_THREADS" in env:
            import torch

            # Read when torch starts its thread pool in a fresh process; the server had not.
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        target(*args)
    finally:
        # An interpreter's exit: wait for the threads, then the atexit handlers (multiprocessing
        # would leave through os._exit without them).
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        used = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        Path(f"{out}.cpu").write_text(str(used.ru_utime + used.ru_stime
                                          + kids.ru_utime + kids.ru_stime))


def _redirect(out: str, err: str) -> None:
    """Point file descriptors 1 and 2 at ``out`` and ``err`` (one file when they are equal)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(out, flags, 0o644)
    os.dup2(fd, 1)
    if err != out:
        os.close(fd)
        fd = os.open(err, flags, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":  # command()'s client: ADDRESS EXE ARGV...
    sys.exit(_call(sys.argv[1], sys.argv[3:]))
