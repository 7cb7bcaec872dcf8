"""Processes forked from one preloaded interpreter: test ranks and CLI runs without the import tax.

A fresh ``python`` that imports torch and hpctrain's training code spends ~4 CPU-s before it
does anything, more than most of the tests' tiny runs then train. multiprocessing's fork server
imports them once per test process. It is single-threaded and has run no torch op, so a process
forked from it starts as clean as a new interpreter; ``start`` then gives it what a
``subprocess`` child would have had: a session of its own, the environment, the working
directory, stdout and stderr to files; and at its end it waits for its threads and runs the
``atexit`` handlers, as an interpreter's exit does.

What this cannot show is what happens *while* Python imports (a signal then, an import-time
warning): tests of that start a fresh interpreter (``run_cli(..., fresh=True)``).

A forked process is the fork server's child, not the test's, so ``getrusage`` of the test does
not see it: each one leaves its CPU seconds in a file that ``finish`` adds to ``forked_cpu_s``
(the per-test CPU accounting of tests/conftest.py reads it).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import resource
import runpy
import sys
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# What the fork server imports before it forks the first process.
PRELOAD = ["torch", "hpctrain.cli", "hpctrain.train.job", "forked", "rank_jobs"]
# CPU seconds of the forked processes finished so far (user + system, their children included).
forked_cpu_s = 0.0


def start(target: Callable[..., Any], args: tuple, *, env: dict[str, str], out: Path,
          err: Path | None = None, name: str | None = None) -> BaseProcess:
    """Run ``target(*args)`` in a process forked from the fork server, in a session of its own,
    with exactly ``env``, the repository as working directory, stdout to ``out`` and stderr to
    ``err`` (``out`` too when None)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when this process starts its server
    proc = ctx.Process(target=_child, name=name,
                       args=(target, args, env, str(out), str(err or out)))
    proc.start()
    return proc


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
