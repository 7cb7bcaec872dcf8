"""Real Slurm clusters for the test suite: ``slurm_cluster`` (one node, the whole session) and
``slurm_two_nodes`` (two nodes on this machine, per test module).

    scripts/install-slurm.sh                 # as root: Debian's slurmctld, slurmd, client, munge
    .venv/bin/pytest tests/slurm -q          # `make test` does both

The fixture writes ``slurm.conf`` under a temporary directory (state, spool, logs and pid files
live there too, so /etc/slurm is never touched), starts munged (or reuses a running one),
slurmctld and ``slurmd -N localhost``, waits for the node to be idle and hands the tests a
:class:`SlurmCluster` whose ``env`` points clients at that config. At the end it cancels what is
left and stops the daemons it started by their pid files (never by name), even when tests failed.

Ports are picked free on every start, so a cluster left behind by a killed session, or a session
running beside this one, does not clash. Where a cluster cannot be started (not root, Slurm not
installed) the tests skip with the reason; under ``CI=true`` that is a failure instead, so CI
never goes green without having run them.

Settings worth knowing (see FIELD_NOTES "A real Slurm on one Debian 12 machine"): no cgroups
(proctrack/linuxproc, task/none), no accounting (``sacct`` fails: read ``scontrol show job``),
``AuthInfo=cred_expire=5`` (Slurm's least) so a requeued job may run again after ~6 s instead
of ~121 s, and ``KillWait=30``: the grace between SIGTERM and SIGKILL that a preemption save
relies on.

The two-node cluster runs two slurmd on this one machine, ``hpctrain-n1`` on 127.0.0.1 and
``hpctrain-n2`` on 127.0.0.2, each with its own port, spool, pid and log files
(``SlurmdParameters=config_overrides``, ``%n`` in the paths). Jobs find rank 0 by the first name
of ``SLURM_JOB_NODELIST``, so both names must resolve: the fixture appends
``127.0.0.1 hpctrain-n1`` / ``127.0.0.2 hpctrain-n2`` to /etc/hosts when they do not (once;
the lines carry the tag ``# hpctrain test cluster``, nothing else is changed; remove them with
``sed -i '/# hpctrain test cluster/d' /etc/hosts``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .jobs import ReferenceLosses

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "munge")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
MUNGE_DIR = Path("/run/munge")
MUNGE_PID = MUNGE_DIR / "munged.pid"
MUNGE_LOG = Path("/var/log/munge/munged.log")

TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# `scontrol show job -o` prints `Key=Value` pairs separated by spaces; a value may itself hold
# spaces (Command=, WorkDir=, Reason=) or '=' (TRES=cpu=1,...), so a value runs up to the next
# space that is followed by something shaped like a key.
_PAIR = re.compile(r"([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)")


def parse_scontrol(line: str) -> dict[str, str]:
    """Parse one line of ``scontrol show <entity> -o`` into a dict."""
    return {m.group(1): m.group(2) for m in _PAIR.finditer(line.strip())}


def in_ci() -> bool:
    """True where a skip must count as a failure (CI=true)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> None:
    """Skip the Slurm tests with `reason`, or fail them under CI=true."""
    hint = "run scripts/install-slurm.sh as root (make test does), then the tests as root"
    if in_ci():
        pytest.fail(f"real Slurm cluster unavailable under CI=true (a skip would hide it): "
                    f"{reason}\nHINT: {hint}", pytrace=False)
    pytest.skip(f"real Slurm cluster unavailable: {reason} (HINT: {hint})")


def find_binary(name: str) -> str | None:
    """Path of a Slurm/munge binary on PATH or in an sbin directory (not always on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free right now on all interfaces."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def pid_alive(pid: int, name: str) -> bool:
    """True while `pid` runs and is the daemon `name` (guards against a reused pid)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie has exited; its parent (init, for a daemon) reaps it.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return comm == name and state != "Z"


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, or None."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_by_pidfile(pidfile: Path, name: str, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the daemon whose pid `pidfile` holds, wait, then SIGKILL it."""
    pid = read_pid(pidfile)
    if pid is None or not pid_alive(pid, name):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, name):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log file, or a note that it is missing."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<{path}: {exc.strerror}>"


def node_hardware(slurmd: str) -> dict[str, str]:
    """This machine as slurmd sees it (``slurmd -C``): CPUs, sockets, cores, RealMemory."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30, check=True)
    info = parse_scontrol(out.stdout.splitlines()[0])
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    return {k: info[k] for k in keys if k in info}


@dataclass(frozen=True)
class Node:
    """One slurmd of the test cluster: its node name, address and port."""

    name: str
    addr: str
    port: int


# The two "nodes" of the multi-node cluster, one machine: names resolved through /etc/hosts.
TWO_NODES = (("hpctrain-n1", "127.0.0.1"), ("hpctrain-n2", "127.0.0.2"))
HOSTS = Path("/etc/hosts")
HOSTS_TAG = "# hpctrain test cluster (tests/slurm/conftest.py)"


# CPUs the one-node cluster's node claims at least, whatever the machine has: the jobs of
# test_training_jobs.py (2 + 2 + 1 tasks) run at once, as they spend most of their time waiting
# (for a signal, a requeue, Slurm's time-limit check) rather than computing.
SINGLE_NODE_CPUS = 6


def write_config(root: Path, ctld_port: int, nodes: Sequence[Node], hw: dict[str, str]) -> Path:
    """Write slurm.conf (+ an empty-of-cgroups cgroup.conf) under `root`; return slurm.conf.

    One node is ``localhost`` with at least SINGLE_NODE_CPUS CPUs; with several, every slurmd
    runs on this machine under its own name, address and port, with its own spool, pid and log
    files (``%n``). ``SlurmdParameters=config_overrides``: each slurmd claims the CPUs the
    config gives it, not what it finds.
    """
    for sub in ("state", "log", "run", *(f"spool{'-' + n.name if len(nodes) > 1 else ''}"
                                         for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    if len(nodes) == 1 and int(hw.get("CPUs", 0)) < SINGLE_NODE_CPUS:
        hw = {**hw, "CPUs": str(SINGLE_NODE_CPUS), "Boards": "1", "SocketsPerBoard": "1",
              "CoresPerSocket": str(SINGLE_NODE_CPUS), "ThreadsPerCore": "1"}
    node = " ".join(f"{k}={v}" for k, v in hw.items())
    per_node = "-%n" if len(nodes) > 1 else ""
    node_lines = "\n".join(
        f"NodeName={n.name} NodeAddr={n.addr}{f' Port={n.port}' if len(nodes) > 1 else ''} "
        f"{node} State=UNKNOWN" for n in nodes)
    names = ",".join(n.name for n in nodes)
    conf = f"""\
# Test cluster written by tests/slurm/conftest.py; nothing here is for production.
ClusterName=hpctrain-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={nodes[0].port}
SlurmdParameters=config_overrides
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire+1 s after it ended (default 120 -> ~2 min waits);
# 5 is the least Slurm takes (a step's credential must outlive its launch, well under 1 s here).
AuthInfo=cred_expire=5
MpiDefault=none
MailProg=/bin/true
# No cgroups: works in containers and without systemd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
JobRequeue=1
JobFileAppend=1
ReturnToService=2
# Grace between SIGTERM and SIGKILL on cancel/timeout: a preemption save runs in it.
KillWait=30
OverTimeLimit=0
MinJobAge=600
SchedulerType=sched/backfill
# A pending job (after a requeue, a dependency) waits for the next pass: one per second.
SchedulerParameters=sched_interval=1,bf_interval=1,kill_invalid_depend
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node}
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
    path = root / "slurm.conf"
    path.write_text(conf)
    # Read by slurmd/slurmstepd in 22.05 even with proctrack/linuxproc + task/none; keep it inert.
    (root / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\n"
                                      "ConstrainRAMSpace=no\nConstrainDevices=no\n")
    return path


@dataclass
class SlurmCluster:
    """A running single-node cluster: its config, a client environment and job helpers."""

    root: Path
    conf: Path
    env: dict[str, str]
    bins: dict[str, str]
    # (pid file, daemon name, the process we started) for each daemon this fixture started.
    started: list[tuple[Path, str, subprocess.Popen]] = field(default_factory=list)

    # -- plumbing ----------------------------------------------------------------------------
    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 30.0,
            cwd: Path | None = None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """Run a Slurm client (``sbatch``, ``scontrol``, ...) against this cluster (`env`
        replaces the client environment, which must then carry SLURM_CONF itself)."""
        cmd = [self.bins.get(tool, tool), *args]
        done = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or self.root)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}\n"
                               f"stdout: {done.stdout}\nstderr: {done.stderr}")
        return done

    def logs(self, lines: int = 25) -> str:
        """Tails of the slurmctld and slurmd logs, for error messages."""
        log = self.root / "log"
        text = f"--- slurmctld.log ---\n{tail(log / 'slurmctld.log', lines)}"
        for path in sorted(log.glob("slurmd*.log")):
            text += f"\n--- {path.name} ---\n{tail(path, lines)}"
        return text

    def diagnosis(self, job_id: str, *files: Path, lines: int = 40) -> str:
        """What a failed wait shows: the job's record, the tails of its own output file (where
        the ranks' stderr goes: a crash, its message) and of `files`, then the daemons' logs."""
        try:
            info = self.job_info(job_id)
        except RuntimeError as exc:
            info = {"JobId": job_id, "error": str(exc)}
        text = f"--- scontrol show job {job_id} ---\n{info}"
        out = [Path(info["StdOut"])] if info.get("StdOut") else []
        for path in [*out, *files]:
            text += f"\n--- {path} ---\n{tail(path, lines)}"
        return f"{text}\n{self.logs()}"

    # -- jobs --------------------------------------------------------------------------------
    def sbatch(self, script_path: str | os.PathLike[str], *args: str,
               script_args: Sequence[str] = (), cwd: Path | None = None,
               env: dict[str, str] | None = None) -> str:
        """Submit `script_path` with sbatch options `args`; return the job id."""
        done = self.run("sbatch", "--parsable", *args, str(script_path), *script_args, cwd=cwd,
                        env=env)
        return done.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job -o`` records for `job_id` (several for an array's base id)."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id))
        records = [parse_scontrol(line) for line in done.stdout.splitlines() if line.strip()]
        for record in records:
            # scontrol calls the restart count `Restarts`; SLURM_RESTART_COUNT in the job.
            record.setdefault("RestartCnt", record.get("Restarts", ""))
        return records

    def job_info(self, job_id: str) -> dict[str, str]:
        """One job's ``scontrol show job -o`` as a dict (JobState, RestartCnt, ExitCode, Reason,
        ...); for an array task pass ``"<array job id>_<task id>"``."""
        records = self.jobs(job_id)
        if len(records) != 1:
            raise RuntimeError(f"job {job_id}: expected one record, got {len(records)}: "
                               f"{[r.get('JobId') for r in records]} (use <id>_<task> for arrays)")
        return records[0]

    def wait(self, job_id: str, states: Iterable[str] = TERMINAL_STATES,
             timeout: float = 60.0, poll: float = 0.25) -> str:
        """Wait until the job's JobState is one of `states`; return it (TimeoutError if not)."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in wanted:
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} still {state} (Reason={info.get('Reason')}) after "
                    f"{timeout:.0f}s, waiting for {sorted(wanted)}\n{self.diagnosis(job_id)}")
            time.sleep(poll)

    def scancel(self, job_id: str, signal: str | None = None, *args: str) -> None:
        """``scancel`` the job; with `signal` (e.g. "USR2") only signal its steps."""
        opts = [f"--signal={signal}"] if signal else []
        self.run("scancel", *opts, *args, str(job_id))

    def cancel_all(self) -> None:
        """Cancel every job of this cluster at once (SIGKILL, no KillWait grace)."""
        self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip()
            if not out:
                return
            time.sleep(0.2)

    # -- lifecycle ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the daemons this fixture started, newest first, by their pid files."""
        for pidfile, name, proc in reversed(self.started):
            stop_by_pidfile(pidfile, name)
            # They ran in the foreground as our children: reap them (no zombies left behind).
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.started.clear()

    def start_daemon(self, name: str, argv: list[str], pidfile: Path) -> None:
        """Start a daemon in the foreground (as our child) and wait until it wrote its pid file."""
        log = open(self.root / "log" / f"{name}.stdout", "ab")  # noqa: SIM115 (child owns it)
        with log:
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append((pidfile, name, proc))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            pid = read_pid(pidfile)
            if pid is not None and pid_alive(pid, name):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(
            f"{name} did not start ({' '.join(argv)}; exit {proc.poll()}, no live pid in "
            f"{pidfile})\n--- {name}.stdout ---\n{tail(self.root / 'log' / f'{name}.stdout')}\n"
            f"{self.logs(40)}")


def munge_works(bins: dict[str, str]) -> bool:
    """True if a munged answers on the default socket (encode a credential and decode it)."""
    try:
        cred = subprocess.run([bins["munge"], "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        back = subprocess.run([bins["unmunge"]], input=cred.stdout, capture_output=True,
                              timeout=10)
        return back.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def munged_wanted(bins: dict[str, str]) -> bool:
    """Prepare /run/munge for a munged of our own; False if one already answers (reuse it)."""
    if munge_works(bins):
        return False
    try:
        pw = pwd.getpwnam("munge")
    except KeyError as exc:
        raise RuntimeError("no user 'munge' (is the munge package installed?)") from exc
    MUNGE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    for d in (MUNGE_DIR, Path("/var/log/munge"), Path("/var/lib/munge")):
        if d.is_dir():
            os.chown(d, pw.pw_uid, pw.pw_gid)
    return True


def wait_idle(cluster: SlurmCluster, timeout: float = START_TIMEOUT_S) -> None:
    """Wait until ``sinfo`` reports the node idle; raise with the daemons' log tails if not."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        done = cluster.run("sinfo", "-h", "-o", "%T", check=False, timeout=10)
        last = (done.stdout + done.stderr).strip()
        if done.returncode == 0 and last == "idle":
            return
        dead = [name for _, name, proc in cluster.started if proc.poll() is not None]
        # inval/drain do not clear by waiting (e.g. config claims more CPUs/memory than exist).
        if dead or any(word in last for word in ("inval", "drain")):
            break
        time.sleep(0.2)
    reason = cluster.run("sinfo", "-h", "-R", check=False, timeout=10).stdout.strip()
    dead = [name for _, name, proc in cluster.started if proc.poll() is not None]
    raise RuntimeError(f"Slurm node not idle (sinfo: {last!r}, reason: {reason!r}, "
                       f"exited daemons: {dead or 'none'})\n{cluster.logs(40)}")


def resolve_names(pairs: Sequence[tuple[str, str]]) -> None:
    """Make each (name, address) resolve: append the missing ones to /etc/hosts, once.

    The multi-node tests need it: ranks find rank 0 by the first name of SLURM_JOB_NODELIST.
    Idempotent (a name that already resolves to its address is left alone) and tagged, so the
    lines are easy to find and remove; nothing else in the file is touched.
    """
    missing = []
    for name, addr in pairs:
        try:
            found = socket.gethostbyname(name)
        except OSError:
            found = None
        if found == addr:
            continue
        if found is not None:
            unavailable(f"{name} resolves to {found}, not {addr}: the two-node test cluster "
                        f"needs it (fix or remove that line of {HOSTS})")
        missing.append(f"{addr} {name} {HOSTS_TAG}\n")
    if not missing:
        return
    try:
        with HOSTS.open("a") as f:
            f.write("".join(missing))
    except OSError as exc:
        unavailable(f"cannot add {', '.join(n for n, _ in pairs)} to {HOSTS}: {exc.strerror}")


def start_cluster(root: Path, node_names: Sequence[tuple[str, str]] = (("localhost",
                                                                          "127.0.0.1"),)
                  ) -> SlurmCluster:
    """Write the config under `root` and start munged, slurmctld and one slurmd per node."""
    bins: dict[str, str] = {}
    missing = []
    for name in (*DAEMONS, *CLIENTS, "unmunge", "runuser"):
        path = find_binary(name)
        if path is None:
            missing.append(name)
        else:
            bins[name] = path
    if missing:
        unavailable(f"missing binaries: {', '.join(missing)}")
    if os.geteuid() != 0:
        unavailable("not running as root (slurmd and munged need root on a single-node cluster)")

    if len(node_names) > 1:
        resolve_names(node_names)
    ctld_port, *slurmd_ports = free_ports(1 + len(node_names))
    nodes = [Node(name, addr, port) for (name, addr), port in zip(node_names, slurmd_ports,
                                                                   strict=True)]
    conf = write_config(root, ctld_port, nodes, node_hardware(bins["slurmd"]))
    # Clients read SLURM_CONF; drop SLURM_* inherited from an outer allocation (e.g. CI running
    # inside a Slurm job), which would otherwise leak into every job submitted here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    sbin = [d for d in ("/usr/sbin", "/sbin") if d not in env.get("PATH", "").split(":")]
    env["PATH"] = ":".join([env.get("PATH", "/usr/bin:/bin"), *sbin])
    cluster = SlurmCluster(root=root, conf=conf, env=env, bins=bins)
    run = root / "run"
    try:
        if munged_wanted(bins):
            cluster.start_daemon("munged", [bins["runuser"], "-u", "munge", "--", bins["munged"],
                                            "-F", f"--pid-file={MUNGE_PID}"], MUNGE_PID)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not munge_works(bins):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"munged does not answer\n{tail(MUNGE_LOG)}")
                time.sleep(0.05)
        # -D: foreground, as our child; -i: ignore saved state (each start has a fresh dir).
        cluster.start_daemon("slurmctld", [bins["slurmctld"], "-D", "-i", "-f", str(conf)],
                             run / "slurmctld.pid")
        for n in nodes:
            pid = run / (f"slurmd-{n.name}.pid" if len(nodes) > 1 else "slurmd.pid")
            cluster.start_daemon("slurmd", [bins["slurmd"], "-D", "-f", str(conf), "-N", n.name],
                                 pid)
        wait_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def running_cluster(request: pytest.FixtureRequest,
                    node_names: Sequence[tuple[str, str]] = (("localhost", "127.0.0.1"),)
                    ) -> Iterator[SlurmCluster]:
    """Start a cluster of these nodes, yield it, cancel its jobs and stop it (even on failure)."""
    # A short path: slurmstepd's unix sockets live in the spool dir (sun_path holds 108 bytes).
    root = Path(tempfile.mkdtemp(prefix="hpctrain-slurm-"))
    try:
        cluster = start_cluster(root, node_names)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        # Installed and root, yet it does not start: that is a bug, never a skip.
        pytest.fail(f"could not start the test Slurm cluster (files in {root}):\n{exc}",
                    pytrace=False)
    try:
        yield cluster
    finally:
        try:
            cluster.cancel_all()
        finally:
            cluster.stop()
            # Keep configs and logs of a failed session for a post-mortem.
            if request.session.testsfailed == 0:
                shutil.rmtree(root, ignore_errors=True)
            else:
                print(f"\nSlurm test cluster files kept in {root}")


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A running single-node Slurm cluster (skips where impossible; fails instead under CI)."""
    with running_cluster(request) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_two_nodes(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """Two nodes on this machine, ``hpctrain-n1`` (127.0.0.1) and ``hpctrain-n2`` (127.0.0.2),
    each with its own slurmd; their names are added to /etc/hosts if missing (tagged lines)."""
    with running_cluster(request, TWO_NODES) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceLosses]:
    """Uninterrupted reference runs, each computed once per session."""
    losses = ReferenceLosses(tmp_path_factory.mktemp("reference"))
    yield losses
    losses.close()
