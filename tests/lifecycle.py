"""Helpers for tests that act on a *running* ``hpctrain train``: start it, wait for a step or a
checkpoint, signal it, collect its exit and output, and make sure nothing of it is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

import forked
from conftest import DEMO, QUIET, REPO, TINY, cli_env, kill_group

TIMEOUT_S = 180.0


def train_argv(out: Path, name: str, *extra: str) -> list[str]:
    """``train`` arguments of the tiny demo in ``out/name``; `extra` goes last, in any order."""
    return ["train", DEMO, *TINY, *QUIET, f"run.out_dir={out}", f"run.name={name}", *extra]


@dataclass
class Running:
    """A CLI process started in its own session, its output going to a file."""

    proc: subprocess.Popen | ForkedCli
    log: Path
    run_dir: Path

    def output(self) -> str:
        """Everything it printed so far (stdout and stderr interleaved)."""
        return self.log.read_text(errors="replace")

    def steps(self, rank: int = 0) -> int:
        """Training steps logged so far by `rank`."""
        path = self.run_dir / "metrics" / f"rank-{rank:03d}.jsonl"
        if not path.is_file():
            return 0
        return sum(1 for line in path.read_text().splitlines() if '"event"' not in line)

    def latest(self) -> str | None:
        """The committed checkpoint ``checkpoints/latest`` names, if any."""
        path = self.run_dir / "checkpoints" / "latest"
        return path.read_text().strip() if path.is_file() else None

    def wait_for(self, what: str, check, timeout: float = 120.0) -> None:
        """Poll `check()` until true; fail if the run exits or the time is up."""
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                kill_tree_of(self)
                raise AssertionError(f"{what} never happened (exit {self.proc.poll()}):\n"
                                     f"{self.output()[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        """Wait for the exit code; on timeout kill everything and fail."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree_of(self)
            raise AssertionError(f"still running after {timeout:.0f} s:\n"
                                 f"{self.output()[-3000:]}") from None

    def exit_info(self) -> dict:
        """The run's exit_info.json."""
        return json.loads((self.run_dir / "exit_info.json").read_text())

    def workers(self) -> list[psutil.Process]:
        """Live descendants of the launcher."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def rank_process(self, rank: int) -> psutil.Process:
        """The worker process of `rank` (read from its environment)."""
        for child in self.workers():
            try:
                if child.environ().get("RANK") == str(rank) and "hpctrain" in " ".join(
                        child.cmdline()):
                    return child
            except psutil.Error:
                continue
        raise AssertionError(f"no worker with RANK={rank} among {self.workers()}")


def start(argv: list[str], log: Path, run_dir: Path, *, env: dict[str, str] | None = None,
          module: str = "hpctrain", fresh: bool = False) -> Running:
    """Start ``python -m hpctrain <argv>`` (or another `module`, e.g. torch.distributed.run)
    from the repository root.

    Like conftest.run_cli it is forked from the preloaded interpreter (tests/forked.py), ~4 CPU-s
    less than a new one; the ranks a launcher starts are new interpreters either way.
    ``fresh=True`` starts a new interpreter, for what happens while it imports.
    """
    full_env = cli_env()
    full_env.pop("HPCTRAIN_FAULTS", None)
    full_env.update(env or {})
    if not fresh:
        return Running(ForkedCli(module, argv, log, full_env), log, run_dir)
    handle = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=full_env,
                            text=True,
                            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_default_sigint)
    handle.close()
    return Running(proc, log, run_dir)


class ForkedCli:
    """``python -m MODULE ARGV`` forked from the fork server, with the part of
    ``subprocess.Popen``'s interface that Running uses (``pid``, ``poll``, ``wait``,
    ``send_signal``)."""

    def __init__(self, module: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self._log = log
        self._proc = forked.start(_run_module, (module, argv), env=env, out=log)
        self._counted = False
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs (a signal's death is -signum, as Popen's)."""
        code = self._proc.exitcode
        if code is not None and not self._counted:
            self._counted = True
            forked.finish(self._proc, self._log)  # its CPU seconds, for the per-test list
        return code

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` if it still runs after `timeout`."""
        self._proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(["hpctrain"], timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the process (not its group)."""
        if self.poll() is None:
            os.kill(self.pid, sig)


def _run_module(module: str, argv: list[str]) -> None:
    """``python -m MODULE ARGV`` in this process, with Ctrl-C raising KeyboardInterrupt as in a
    terminal's foreground job (see _default_sigint): the fork server keeps SIGINT ignored when
    the tests were started so."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["-m", *argv]  # run_module puts the module's path first, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _default_sigint() -> None:
    # A shell without job control starts background commands (`make test &`, some CI runners)
    # with SIGINT ignored, and Python then keeps it ignored: the run under test would never see
    # the Ctrl-C a test sends. A terminal's foreground job has the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_tree_of(run: Running) -> None:
    """SIGKILL the process, its group and all descendants, and every process of its run."""
    kids = run.workers()
    kill_group(run.proc)
    marker = f"run.name={run.run_dir.name}"
    out = f"run.out_dir={run.run_dir.parent}"
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.pid != os.getpid() and marker in cmd and out in cmd:
            kids.append(p)
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            kid.kill()
    if run.proc.poll() is None:
        run.proc.wait(timeout=15)
