"""Shared helpers for the end-to-end tests: drive the real ``hpctrain`` CLI as subprocesses.

Every run goes through ``python -m hpctrain train configs/demo.yaml ...`` from the repository root,
in its own session with a timeout, so a hung or failing run is killed with its whole process group
and never outlives the test. Runs are tiny (a 2-layer, 64-wide decoder on 32-token windows) so the
machine's 2 cores finish each in a few seconds; independent runs can overlap through `run_pool`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue as queues
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import forked
from hpctrain.observe.metrics import read_metrics
from ports import free_port  # noqa: F401 - tests import it from here

REPO = Path(__file__).resolve().parents[1]


def spawn_ranks(target, nranks: int, timeout: float = 120) -> list:
    """Start ``target(rank, port, queue)`` in ``nranks`` processes forked from the preloaded
    interpreter (tests/forked.py) and return what they put on the queue, in arrival order; a
    rank that dies fails the test at once (with its log) rather than after the timeout, and
    every rank must exit 0."""
    results_queue, port = multiprocessing.get_context("forkserver").Queue(), free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        logs = [Path(tmp) / f"rank-{r}.log" for r in range(nranks)]
        procs = [forked.start(target, (r, port, results_queue), env=dict(os.environ),
                              out=logs[r]) for r in range(nranks)]

        def account() -> str:
            return "\n".join(f"--- rank {r} (exit {p.exitcode}) ---\n"
                             f"{logs[r].read_text()[-3000:]}" for r, p in enumerate(procs))

        results, deadline = [], time.monotonic() + timeout
        try:
            while len(results) < nranks:
                try:
                    results.append(results_queue.get(timeout=1))
                except queues.Empty:
                    assert all(p.exitcode in (None, 0) for p in procs), account()
                    assert time.monotonic() < deadline, "the ranks never reported\n" + account()
            for p in procs:
                p.join(timeout=60)
            assert all(p.exitcode == 0 for p in procs), account()
        finally:
            from hpctrain.launch.local import kill_tree

            for r, p in enumerate(procs):
                kill_tree(p.pid)
                forked.finish(p, logs[r])
    return results


def fork_spawn(fn, args: tuple, nprocs: int, timeout: float = 300) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, the processes forked from
    the preloaded interpreter (tests/forked.py): ``fn(rank, *args)`` in each; fails the test,
    with every rank's log, when one exits non-zero or they outlast ``timeout``."""
    from hpctrain.launch.local import kill_tree

    with tempfile.TemporaryDirectory(prefix="spawn-") as tmp:
        logs = [Path(tmp) / f"rank-{r}.log" for r in range(nprocs)]
        procs = [forked.start(fn, (r, *args), env=dict(os.environ), out=logs[r])
                 for r in range(nprocs)]
        deadline = time.monotonic() + timeout
        try:
            while (any(p.exitcode is None for p in procs) and time.monotonic() < deadline
                   and all(p.exitcode in (None, 0) for p in procs)):
                time.sleep(0.05)
            assert all(p.exitcode == 0 for p in procs), "\n".join(
                f"--- rank {r} (exit {p.exitcode}) ---\n{logs[r].read_text()[-3000:]}"
                for r, p in enumerate(procs))
        finally:
            for r, p in enumerate(procs):
                kill_tree(p.pid)
                forked.finish(p, logs[r])


# Signals whose handler a test may change in the worker's own process (an in-process launcher or
# trainer; torch's elastic agent installs handlers it never puts back).
_GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def signal_handlers_put_back() -> Iterator[None]:
    """Each test starts with the handlers the worker had: a SIGINT handler left by an earlier
    test's launcher swallowed the Ctrl-C of tests/checkpoint/test_restore_fast.py, which then
    waited forever (seen in full runs only, where a launcher test ran first on that worker)."""
    saved = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def own_config_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs with compile on create the user's compile-cache key under $XDG_CONFIG_HOME: the
    tests' runs (and the processes they start, which inherit it) use a folder of their own,
    never the real ~/.config of whoever runs the suite."""
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A newcomer's project folder holding configs/demo.yaml, as the working directory."""
    root = tmp_path / "proj"
    (root / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", root / "configs" / "demo.yaml")
    monkeypatch.chdir(root)
    return root


# The order xdist hands the groups out in: longest first, so that none is left running alone at
# the end. The Slurm tests (mostly waiting on the scheduler and their jobs) start at once on
# one worker; then every group of 8 s or more, by its wall seconds in a full run at -n 2 (the
# lead's 422 s run of 2026-11-28: both workers ended within a second of each other); every
# other group after them, in collection order. The "workers" section at the end of a run
# shows when each worker ran its long files: re-sort when one ends well before the other.
LONGEST_GROUPS = (
    "slurm",  # 168 then; alone (-n 0, load 1-2) 135 s then, 80-100 s now: mostly waits
    "task/test_task_runs.py",  # 41: a kill -9 chain per strategy + 3
    "parallel/test_layouts.py",  # 41: 13 layouts on 4 ranks beside the 1-process reference
    "test_readme_recipes.py",  # 40: twenty commands one after another, forked
    "launch/test_launcher_signals.py",  # 31
    "train/test_resilience.py",  # 30
    "images/test_digits.py",  # 25: one kill -9 chain on 2 ranks
    "observe/test_observe_runs.py",  # 24
    "train/test_goodput_runs.py",  # 21
    "launch/test_rerun_resumes.py",  # 18
    "train/test_resume_fallback.py",  # 18
    "launch/test_orphans.py",  # 17
    "bench/test_fp8_loss.py",  # 14
    "launch/test_local_launcher.py",  # 13
    "security/test_checkpoint_pickle.py",  # 13
    "bench/test_tune.py",  # 13
    "checkpoint/test_writer.py",  # 13
    "parallel/test_float8.py",  # 11
    "security/test_run_lock_cli.py",  # 11
    "train/test_trainer_cpu.py",  # 11
    "bench/test_model.py",  # 11
    "train/test_parity.py",  # 11
    "runtime/test_cpu_guard.py",  # 10
    "parallel/test_mixed_precision.py",  # 9
    "bench/test_node.py",  # 9
    "launch/test_k8s.py",  # 9
    "bench/test_bench_cli.py",  # 9
)


def pytest_configure(config: pytest.Config) -> None:
    """Keep LONGEST_GROUPS' order: pytest-xdist would otherwise hand the groups out by their
    number of tests, most first (``--loadscope-reorder``, its default for --dist loadgroup),
    which puts the Slurm tests and the layouts launch in the middle and a long group last."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (`make test` runs three workers with ``--dist loadgroup``).

    Each test file is one group, so its module fixtures (often a multi-rank launch shared by
    all its tests) run once; all of tests/slurm are one group, because each worker session would
    start its own test cluster and the two would share one munged.
    """
    tests = REPO / "tests"
    groups = {}
    for item in items:
        rel = Path(item.fspath).relative_to(tests)
        groups[item] = "slurm" if rel.parts[0] == "slurm" else rel.as_posix()
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # xdist hands out groups in this order; a stable sort keeps each group's own order.
    rank = {g: i for i, g in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item], len(rank)))


# Per-test CPU accounting. On a shared machine wall times say more about the neighbours than
# about the test; CPU seconds (this process plus every child it reaped: CLI runs, their ranks,
# spawned gloo ranks) are what an idle machine will spend. A session fixture is charged to the
# test that first needs it; processes forked from the fork server (tests/forked.py), whose
# children they are, report their own. Processes nobody here reaps (the Slurm daemons and
# their jobs) are not seen. Each phase's seconds travel on the report, so pytest-xdist brings
# them back.
_CPU_MARK = "_cpu_mark"


def _cpu_now() -> float:
    """CPU seconds (user + system) of this process and its children so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + forked.forked_cpu_s


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--cpu-top N``: how many tests and files the end-of-run CPU list shows (0: all)."""
    parser.addoption("--cpu-top", type=int, default=25,
                     help="tests and files to list by CPU seconds at the end (0: all; default 25)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Mark the CPU clock as the test starts; its phases are charged from here."""
    setattr(item, _CPU_MARK, _cpu_now())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """Attach the CPU seconds of the phase just ended (setup, call or teardown) to its report."""
    outcome = yield
    now = _cpu_now()
    outcome.get_result().user_properties.append(("cpu_s", now - getattr(item, _CPU_MARK, now)))
    setattr(item, _CPU_MARK, now)


_cpu_by_test: dict[str, float] = {}
# Per xdist worker ("main" without xdist), the files it ran in order: [file, start, stop] (wall
# clock of their tests' phases). The suite's wall time is the last worker's end: this shows
# which one it was and what it ran last.
_files_by_worker: dict[str, list[list[Any]]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each test's phases (in the controller, whichever worker ran it)."""
    for key, value in report.user_properties:
        if key == "cpu_s":
            _cpu_by_test[report.nodeid] = _cpu_by_test.get(report.nodeid, 0.0) + value
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    files = _files_by_worker.setdefault(getattr(gateway, "id", "main"), [])
    path = report.nodeid.split("::")[0]
    if files and files[-1][0] == path:
        files[-1][2] = report.stop
    else:
        files.append([path, report.start, report.stop])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The tests and files that cost the most CPU seconds, next to --durations' wall times."""
    if not _cpu_by_test:
        return
    top = config.getoption("cpu_top") or None
    by_file: dict[str, float] = {}
    for nodeid, cpu in _cpu_by_test.items():
        path = nodeid.split("::")[0]
        by_file[path] = by_file.get(path, 0.0) + cpu
    write = terminalreporter.write_line
    total = sum(_cpu_by_test.values())
    terminalreporter.section(f"most CPU (this process + reaped children; {total:.0f} s in all)")
    for name, table in (("test", _cpu_by_test), ("file", by_file)):
        write(f"by {name}:")
        for key, cpu in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            write(f"{cpu:8.2f}s  {key}")
    _worker_summary(terminalreporter)


def _worker_summary(terminalreporter: Any, least_s: float = 10.0) -> None:
    """When each worker began and ended, its busy seconds, and its files of `least_s` or more
    (s from the first test's start), so the worker that ends the suite and why is in view."""
    starts = [files[0][1] for files in _files_by_worker.values() if files]
    if not starts:
        return
    zero = min(starts)
    terminalreporter.section("workers (wall s from the first test's start; files >= 10 s)")
    for worker, files in sorted(_files_by_worker.items()):
        busy = sum(stop - start for _, start, stop in files)
        long = [f"{path} {start - zero:.0f}-{stop - zero:.0f}"
                for path, start, stop in files if stop - start >= least_s]
        terminalreporter.write_line("; ".join([
            f"{worker}: {files[0][1] - zero:.0f}-{files[-1][2] - zero:.0f}, "
            f"{len({path for path, _, _ in files})} files, busy {busy:.0f}", *long]))


DEMO = "configs/demo.yaml"

# Shrinks the demo's tiny preset further: ~50k parameters, 32-token samples, a 200 kB corpus.
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "data.max_bytes=200000",
]
# Every step logged, no progress display, fp32 and deterministic kernels, a short warmup.
QUIET = [
    "metrics.log_every=1",
    "metrics.progress=false",
    "run.suffix=none",
    "train.precision=fp32",
    "train.deterministic=true",
    "optim.warmup_steps=2",
]
STEPS = 6
# The single-process reference every parity comparison is made against: global batch 4.
REFERENCE = ["parallel.strategy=none", "train.micro_batch=4"]
# The same global batch on 2 DDP ranks (the demo's own strategy).
DDP = ["parallel.strategy=ddp", "train.micro_batch=2"]

METRIC_FIELDS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_time_s", "mfu",
    "mem_gb", "ts", "rank", "host", "host_wait_s",
}

RUN_TIMEOUT_S = 180.0


def cli_env() -> dict[str, str]:
    """Environment for a CLI subprocess: one intra-op thread per process.

    The launcher would pick cores // nproc itself; fixing it to 1 keeps results independent of
    how many runs overlap and lets two runs share the 2 cores without oversubscription.
    """
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def cli_command(args: list[str]) -> list[str]:
    """The argv that runs the ``hpctrain`` CLI with this interpreter."""
    return [sys.executable, "-m", "hpctrain", *args]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (started with start_new_session) and all its
    descendants (the elastic agent starts each worker in a session of its own)."""
    from hpctrain.launch.local import kill_tree

    kill_tree(proc.pid)


@contextmanager
def start_cli(args: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """Start the CLI in a new session; on leaving the block its whole process group is killed.

    Tests that check for orphaned workers must do so inside the block, before this cleanup.
    """
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cli_command(args), cwd=REPO, env=cli_env(), text=True,
                            start_new_session=True, **popen)
    try:
        yield proc
    finally:
        kill_group(proc)
        if proc.poll() is None:
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def run_cli(args: list[str], timeout: float = RUN_TIMEOUT_S, *, fresh: bool = False,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI to completion; on timeout kill its process group and fail the test.

    It runs forked from the preloaded interpreter (tests/forked.py), ~4 CPU-s less than a new
    one; ``fresh=True`` starts a new interpreter, for what happens while Python imports.
    ``env`` sets variables on top of cli_env() (None: unset)."""
    environ = cli_env()
    for name, value in (env or {}).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    if fresh:
        return _run_fresh(args, timeout, environ)
    with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = forked.start(forked.cli, (args,), env=environ, out=out, err=err)
        try:
            proc.join(timeout=timeout)
            timed_out = proc.exitcode is None
        finally:
            # Whatever happened, nothing of this group may outlive the call.
            from hpctrain.launch.local import kill_tree

            kill_tree(proc.pid)
            forked.finish(proc, out)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        pytest.fail(f"hpctrain {' '.join(args)} did not finish in {timeout:.0f}s\n"
                    f"stderr tail:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cli_command(args), proc.exitcode, stdout, stderr)


def _run_fresh(args: list[str], timeout: float,
               env: dict[str, str]) -> subprocess.CompletedProcess:
    """run_cli in a new interpreter."""
    proc = subprocess.Popen(
        cli_command(args), cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"hpctrain {' '.join(args)} did not finish in {timeout:.0f}s\n"
                    f"stderr tail:\n{err[-3000:]}")
    finally:
        # Whatever happened, nothing of this group may outlive the call.
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@dataclass
class RunResult:
    """One finished ``hpctrain train`` run: exit status, output and its run directory."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def describe(self) -> str:
        """Command and the tail of its output, for assertion messages."""
        return (f"hpctrain {' '.join(self.args)}\nexit {self.returncode}\n"
                f"stderr tail:\n{self.stderr[-4000:]}")

    def ok(self) -> RunResult:
        """Assert the run exited 0; return self so calls chain."""
        assert self.returncode == 0, self.describe()
        return self

    def metrics(self, rank: int = 0) -> list[dict[str, Any]]:
        """The per-step records of ``metrics/rank-NNN.jsonl`` (event records left out)."""
        records = read_metrics(self.run_dir / "metrics" / f"rank-{rank:03d}.jsonl")
        return [r for r in records if "event" not in r]

    def series(self, key: str, rank: int = 0) -> list[float]:
        """One metric per logged step, checking that steps 1..N were each logged once."""
        records = self.metrics(rank)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1)), self.describe()
        return [r[key] for r in records]

    def losses(self, rank: int = 0) -> list[float]:
        """Global mean loss per step."""
        return self.series("loss", rank)

    def grad_norms(self, rank: int = 0) -> list[float]:
        """Global gradient norm per step (before clipping)."""
        return self.series("grad_norm", rank)

    def exit_info(self) -> dict[str, Any]:
        """The run's exit_info.json."""
        return json.loads((self.run_dir / "exit_info.json").read_text())


def train(out_dir: Path, name: str, *overrides: str, nproc: int | None = None,
          steps: int = STEPS, timeout: float = RUN_TIMEOUT_S) -> RunResult:
    """Run ``hpctrain train`` on the demo config made tiny; the run dir is ``out_dir/name``."""
    args = ["train", DEMO, *TINY, *QUIET, f"train.steps={steps}", f"run.out_dir={out_dir}",
            f"run.name={name}", *overrides]
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    done = run_cli(args, timeout=timeout)
    return RunResult(args, done.returncode, done.stdout, done.stderr, out_dir / name)


def train_together(out_dir: Path, jobs: dict[str, list[str]], *, nproc: int = 1,
                   steps: int = STEPS, common: list[str] | None = None,
                   faults: dict[str, str] | None = None) -> dict[str, RunResult]:
    """Several `train` runs (name -> overrides) one after another in ONE launch of `nproc`
    ranks, through the ranks' real entry point (tests/rank_jobs.py): what `hpctrain train`
    runs, without starting and importing a launcher and `nproc` processes for each run.
    ``common`` (default: TINY, QUIET and `steps`) goes before each run's overrides;
    ``faults`` gives runs by name their HPCTRAIN_FAULTS.

    For runs compared by their numbers; what the CLI prints or exits with needs `train`."""
    from rank_jobs import launch

    common = common if common is not None else [*TINY, *QUIET, f"train.steps={steps}"]
    faults = faults or {}
    spec = {"config": DEMO, "common": common, "out": str(out_dir),
            "jobs": [{"name": name, "overrides": o,
                      **({"faults": faults[name]} if name in faults else {})}
                     for name, o in jobs.items()]}
    launch(nproc, spec, out_dir / f"launch-{nproc}", RUN_TIMEOUT_S * len(jobs))
    return {name: RunResult(["train", DEMO, *common, *o], 0, "", "", out_dir / name)
            for name, o in jobs.items()}


def one_of(runs: Future[dict[str, RunResult]], name: str) -> Future[RunResult]:
    """A future for run `name` of `train_together`'s runs (their error, if the launch failed)."""
    run: Future[RunResult] = Future()

    def done(launched: Future[dict[str, RunResult]]) -> None:
        error = launched.exception()
        if error is None:
            run.set_result(launched.result()[name])
        else:
            run.set_exception(error)

    runs.add_done_callback(done)
    return run


@pytest.fixture(scope="session")
def run_pool() -> Iterator[ThreadPoolExecutor]:
    """Runs independent CLI jobs side by side, at most as many as there are cores."""
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        yield pool


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory,
                  run_pool: ThreadPoolExecutor) -> Future[RunResult]:
    """The single-process reference (strategy none, micro_batch 4), run once per session."""
    out = tmp_path_factory.mktemp("reference")
    return run_pool.submit(train, out, "reference", *REFERENCE)


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory: pytest.TempPathFactory,
            run_pool: ThreadPoolExecutor) -> Future[RunResult]:
    """2 DDP ranks with micro_batch 2 (the reference's global batch), run once per session."""
    out = tmp_path_factory.mktemp("ddp")
    return run_pool.submit(train, out, "ddp", *DDP, nproc=2)


def wait_gone(procs: list[psutil.Process], timeout: float = 15.0) -> list[psutil.Process]:
    """Wait until every process has exited *and been reaped*; return those that have not.

    ``is_running`` is false once the pid is gone or reused (psutil compares creation times), and
    true for a zombie, so an exited but unreaped worker still counts as left behind.
    """
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running()]
        if alive:
            time.sleep(0.1)
    return alive


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains `marker` (e.g. a unique run name)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        cmdline = p.info.get("cmdline") or []
        if any(marker in part for part in cmdline):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def pg() -> Iterator[None]:
    """A 1-rank gloo group in this process (what a single-process run uses)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compare() -> Iterator[Any]:
    """benchmarks/peers/compare.py as a module (it needs no GPU until it runs a layout)."""
    import importlib.util

    path = REPO / "benchmarks" / "peers" / "compare.py"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location("compare_peers", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture()
def no_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """HPCTRAIN_FAULTS unset (and the parsed cache cleared) before and after the test."""
    from hpctrain import faults

    monkeypatch.delenv("HPCTRAIN_FAULTS", raising=False)
    faults._specs.cache_clear()
    yield monkeypatch
    monkeypatch.delenv("HPCTRAIN_FAULTS", raising=False)
    faults._specs.cache_clear()
