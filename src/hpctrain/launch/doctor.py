"""``hpctrain doctor``: check the nodes before a job burns GPU-hours; exit 1 with one line per
problem and its fix.

    hpctrain doctor configs/llama-1b.yaml                  # this node, one process
    srun python -m hpctrain doctor configs/llama-1b.yaml   # every task of an allocation
    hpctrain submit configs/llama-1b.yaml --nodes 4 --tasks-per-node 4 --gpus-per-node 4 \\
        --preflight                                        # the job's first step

Run as every task of a job (``--preflight`` makes it the first step of the generated script),
each rank gathers its own facts, rank 0 compares them and prints, and every rank exits with the
verdict (0 healthy, 1 problems), so the job stops before training starts.

The checks, in order:

- versions: Python, torch, CUDA, NCCL and hpctrain identical on every rank;
- gpus: each task sees a GPU of its own (when the config wants GPUs);
- affinity: the cores a task holds include some on its GPU's NUMA node; threads per node
  (tasks x OMP_NUM_THREADS) within the node's cores;
- network: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces the node has, NCCL_IB_HCA
  HCAs it has; a multi-node GPU job without InfiniBand names its socket interface;
- allreduce: a short all_reduce over all ranks returns the right sum, at no less than
  ``--expect-busbw`` GB/s bus bandwidth when given;
- disk: free space where checkpoints go >= the planned checkpoint (fp32 weights and AdamW
  moments: 12 bytes per parameter) x (checkpoint.keep_last + 1 being written);
- lustre: on Lustre (``lfs getstripe``), files of 1 GiB or more (checkpoint shards, data
  shards) in a folder striped over one OST: recommend ``lfs setstripe``;
- small_files: at most ``--max-small-files`` files under 1 MiB in the data path;
- ulimits: ``ulimit -n`` >= 4096; ``ulimit -l`` unlimited for multi-node GPU jobs (RDMA);
- gpu_health: each GPU's GEMM and memory bandwidth against its siblings across the job and the
  datasheet (``hpctrain bench node``'s checks, quick sizes).

``HPCTRAIN_DOCTOR_INJECT='{"1": {"torch": "2.10.0"}}'`` replaces facts of rank 1 before the
checks: the tests use it, and it shows what a check says about a fault you do not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import hpctrain
from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError, HpctrainError, RuntimeEnvError
from hpctrain.runtime.env import ProcessEnv, detect_env, export_torch_env

INJECT_ENV = "HPCTRAIN_DOCTOR_INJECT"
MIN_NOFILE = 4096
SMALL_FILE = 1 << 20
BIG_FILE = 1 << 30
# fp32 master weights (4 bytes) and AdamW's two fp32 moments (8 bytes) per parameter.
CKPT_BYTES_PER_PARAM = 12


class DoctorFailed(HpctrainError):
    """At least one check found a problem."""

    exit_code = 1


@dataclass
class Facts:
    """What one rank knows about itself and its node."""

    rank: int = 0
    local_rank: int = 0
    host: str = ""
    python: str = ""
    torch: str = ""
    cuda: str | None = None
    nccl: str | None = None
    hpctrain: str = ""
    cuda_visible: str | None = None
    gpus: int = 0
    gpu: int | None = None
    gpu_pci: str | None = None
    gpu_numa: int | None = None
    numa_cpus: list[int] = field(default_factory=list)
    affinity: list[int] = field(default_factory=list)
    omp_threads: int = 1
    net_ifaces: list[str] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    net_env: dict[str, str] = field(default_factory=dict)
    memlock: int = -1  # soft limit in bytes, -1 = unlimited
    nofile: int = -1


@dataclass
class Storage:
    """Rank 0's view of where checkpoints go and where data comes from."""

    ckpt_dir: str = ""
    free_bytes: int | None = None
    ckpt_bytes: int = 0  # one checkpoint, all ranks
    keep: int = 1
    params: int = 0
    data_dir: str | None = None
    small_files: int = 0
    big_data_files: int = 0
    # folder -> (filesystem type, stripe count or None, or an error)
    fs: dict[str, dict] = field(default_factory=dict)


@dataclass
class Problem:
    """One thing to fix before the job runs."""

    check: str
    what: str
    fix: str

    def line(self) -> str:
        """One line: the check, what is wrong, and the fix."""
        return f"PROBLEM {self.check}: {self.what} -- fix: {self.fix}"


@dataclass
class Verdict:
    """A check's outcome: what it saw when healthy, else its problems."""

    check: str
    ok: str
    problems: list[Problem] = field(default_factory=list)


@dataclass
class Inputs:
    """Everything the checks judge: every rank's facts, rank 0's storage, measurements."""

    facts: list[Facts]
    storage: Storage | None = None
    cfg: JobConfig | None = None
    allreduce: dict | None = None
    gpu_health: list | None = None  # bench.node.DeviceResult per GPU
    expect_busbw: float | None = None
    max_small_files: int = 10_000

    @property
    def hosts(self) -> list[str]:
        """Distinct hosts in rank order."""
        return list(dict.fromkeys(f.host for f in self.facts))

    @property
    def want_gpu(self) -> bool:
        """True when the job will train on GPUs."""
        device = self.cfg.run.device if self.cfg else "auto"
        return device == "cuda" or (device == "auto" and any(f.gpus for f in self.facts))


# -- facts --------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for item in filter(None, text.strip().split(",")):
        lo, _, hi = item.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``0-3,8``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _limit(kind: int) -> int:
    soft, _ = resource.getrlimit(kind)
    return -1 if soft == resource.RLIM_INFINITY else soft


def gather_facts(env: ProcessEnv, sys_root: Path = Path("/sys")) -> Facts:
    """This rank's facts (versions, GPU, cores, network, limits)."""
    f = Facts(rank=env.rank, local_rank=env.local_rank,
              host=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
              python=platform.python_version(), torch=torch.__version__,
              cuda=torch.version.cuda, hpctrain=hpctrain.__version__,
              cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
              affinity=sorted(os.sched_getaffinity(0)),
              omp_threads=int(os.environ.get("OMP_NUM_THREADS") or 0) or len(
                  os.sched_getaffinity(0)),
              net_ifaces=sorted(p.name for p in (sys_root / "class/net").glob("*")),
              ib_devices=sorted(p.name for p in (sys_root / "class/infiniband").glob("*")),
              net_env={k: v for k, v in os.environ.items()
                       if k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME")},
              memlock=_limit(resource.RLIMIT_MEMLOCK), nofile=_limit(resource.RLIMIT_NOFILE))
    if torch.cuda.is_available():
        f.gpus = torch.cuda.device_count()
        f.nccl = ".".join(map(str, torch.cuda.nccl.version()))
        f.gpu = 0 if f.gpus == 1 else (env.local_rank if env.local_rank < f.gpus else None)
    if f.gpu is not None:
        props = torch.cuda.get_device_properties(f.gpu)
        try:
            f.gpu_pci = (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                         f"{props.pci_device_id:02x}.0")
        except AttributeError:  # older torch: no PCI address, no NUMA check
            f.gpu_pci = None
        numa = _read(sys_root / "bus/pci/devices" / str(f.gpu_pci) / "numa_node")
        if f.gpu_pci and numa is not None:
            f.gpu_numa = max(int(numa), 0)  # -1 on single-node machines
            cpus = _read(sys_root / f"devices/system/node/node{f.gpu_numa}/cpulist")
            f.numa_cpus = parse_cpulist(cpus) if cpus else []
    return f


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def filesystem(path: Path, mounts: Path = Path("/proc/mounts")) -> str:
    """The type of the filesystem holding `path` (longest mount point that contains it)."""
    real = os.path.realpath(_existing(path))
    best, kind = "", "unknown"
    for line in (_read(mounts) or "").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def stripe_count(folder: Path) -> int | str:
    """The default stripe count of a Lustre folder (``lfs getstripe -d -c``), or an error."""
    lfs = shutil.which("lfs")
    if lfs is None:
        return "lfs not found on PATH"
    try:
        done = subprocess.run([lfs, "getstripe", "-d", "-c", str(folder)], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"lfs getstripe failed: {e}"
    words = done.stdout.split()
    if done.returncode != 0 or not words or not words[0].lstrip("-").isdigit():
        return f"lfs getstripe said: {(done.stderr or done.stdout).strip()[:200]}"
    return int(words[0])


def gather_storage(cfg: JobConfig, world_size: int, mounts: Path = Path("/proc/mounts")
                   ) -> Storage:
    """Rank 0: free space where checkpoints go, data-path file sizes, filesystem layout."""
    from hpctrain.models.flops import count_params

    ckpt = Path(cfg.run.out_dir).absolute()
    params = count_params(cfg.model.resolve(), include_embedding=True)
    s = Storage(ckpt_dir=str(ckpt), params=params, ckpt_bytes=params * CKPT_BYTES_PER_PARAM,
                keep=cfg.checkpoint.keep_last + 1)
    s.free_bytes = shutil.disk_usage(_existing(ckpt)).free
    folders = {"checkpoints": (ckpt, s.ckpt_bytes // max(world_size, 1))}
    data = cfg.data.path if cfg.data.source == "shards" else None
    if data:
        s.data_dir = str(Path(data).absolute())
        sizes = []
        for i, item in enumerate(Path(data).rglob("*")):
            if i >= 200_000:  # enough to judge; a full walk of a huge tree takes minutes
                break
            if item.is_file():
                size = item.stat().st_size
                sizes.append(size)
                s.small_files += size < SMALL_FILE
                s.big_data_files += size >= BIG_FILE
        folders["data"] = (Path(data), int(statistics.median(sizes)) if sizes else 0)
    for label, (folder, file_bytes) in folders.items():
        kind = filesystem(folder, mounts)
        entry: dict = {"path": str(folder.absolute()), "fs": kind, "file_bytes": file_bytes}
        if kind == "lustre":
            entry["stripes"] = stripe_count(_existing(folder))
        s.fs[label] = entry
    return s


# -- checks -------------------------------------------------------------------------------------


def _where(facts: list[Facts]) -> str:
    by_host: dict[str, list[int]] = {}
    for f in facts:
        by_host.setdefault(f.host, []).append(f.rank)
    return "; ".join(f"{h} (rank{'s' if len(r) > 1 else ''} {format_cpus(r)})"
                     for h, r in by_host.items())


def check_versions(x: Inputs) -> Verdict:
    """Python, torch, CUDA, NCCL and hpctrain are the same on every rank."""
    keys = ("python", "torch", "cuda", "nccl", "hpctrain")
    groups: dict[tuple, list[Facts]] = {}
    for f in x.facts:
        groups.setdefault(tuple(getattr(f, k) for k in keys), []).append(f)
    first = next(iter(groups))
    ok = ", ".join(f"{k} {v or '-'}" for k, v in zip(keys, first, strict=True))
    if len(groups) == 1:
        return Verdict("versions", f"{ok} on every rank")
    differ = [i for i in range(len(keys)) if len({g[i] for g in groups}) > 1]
    said = " vs ".join(
        f"{_where(fs)}: " + ", ".join(f"{keys[i]} {g[i] or '-'}" for i in differ)
        for g, fs in groups.items())
    return Verdict("versions", ok, [Problem(
        "versions", f"versions differ across the job: {said}",
        "run every node from one environment: one venv on a shared filesystem (--venv), or "
        "one container image (--container)")])


def check_gpus(x: Inputs) -> Verdict:
    """Each task sees a GPU of its own when the job trains on GPUs."""
    if not x.want_gpu:
        return Verdict("gpus", "CPU run: no GPU wanted")
    problems = []
    if not any(f.gpus for f in x.facts):
        problems.append(Problem("gpus", "run.device is cuda but no task sees a GPU",
                                "submit to a GPU partition with --gpus-per-node equal to "
                                "--tasks-per-node"))
        return Verdict("gpus", "", problems)
    seen: dict[tuple[str, str], list[int]] = {}
    for f in x.facts:
        if f.gpus == 0 or f.gpu is None:
            problems.append(Problem(
                "gpus", f"rank {f.rank} (local rank {f.local_rank}) on {f.host} has no GPU: "
                f"{f.gpus} visible (CUDA_VISIBLE_DEVICES={f.cuda_visible or 'unset'})",
                "one task per GPU: --gpus-per-node equal to --tasks-per-node; do not set "
                "CUDA_VISIBLE_DEVICES by hand"))
            continue
        seen.setdefault((f.host, f.gpu_pci or f"{f.cuda_visible}/{f.gpu}"), []).append(f.rank)
    for (host, gpu), ranks in seen.items():
        if len(ranks) > 1:
            problems.append(Problem(
                "gpus", f"ranks {format_cpus(ranks)} on {host} share GPU {gpu}",
                "one task per GPU: --ntasks-per-node equal to --gpus-per-node"))
    return Verdict("gpus", f"{len(x.facts)} ranks, one GPU each", problems)


def check_affinity(x: Inputs) -> Verdict:
    """Tasks hold cores near their GPU, and no node runs more threads than it has cores."""
    problems = []
    for f in x.facts:
        if f.gpu_numa is not None and f.numa_cpus and not set(f.affinity) & set(f.numa_cpus):
            problems.append(Problem(
                "affinity", f"rank {f.rank} on {f.host} holds cores {format_cpus(f.affinity)}, "
                f"none on NUMA node {f.gpu_numa} of its GPU {f.gpu_pci} (cores "
                f"{format_cpus(f.numa_cpus)})",
                "bind each task near its GPU: srun --cpu-bind=cores --gpu-bind=closest (or "
                "ask the admins for TaskPlugin=task/affinity)"))
    for host in x.hosts:
        ranks = [f for f in x.facts if f.host == host]
        cores = set().union(*(f.affinity for f in ranks))
        threads = sum(f.omp_threads for f in ranks)
        if cores and threads > len(cores):
            problems.append(Problem(
                "affinity", f"{host}: {len(ranks)} tasks x OMP_NUM_THREADS run {threads} "
                f"threads on {len(cores)} cores",
                "lower OMP_NUM_THREADS, or give each task more cores (--cpus-per-task; the "
                "generated script sets OMP_NUM_THREADS from it)"))
    numa = [f for f in x.facts if f.gpu_numa is not None]
    ok = (f"{len(numa)} GPU tasks hold cores on their GPU's NUMA node" if numa
          else "threads within each node's cores")
    return Verdict("affinity", ok, problems)


def _names(value: str) -> list[str] | None:
    """Interface/HCA names of an NCCL list (``=eth0,ib`` or ``mlx5_0:1``); None for ``^...``."""
    if value.startswith("^"):
        return None  # an exclusion list: anything else may match
    return [v.split(":")[0] for v in value.lstrip("=").split(",") if v]


def check_network(x: Inputs) -> Verdict:
    """The socket interfaces and HCAs named for NCCL/gloo exist on every node."""
    problems = []
    for host in x.hosts:
        f = next(f for f in x.facts if f.host == host)
        for var, have, what in (("NCCL_SOCKET_IFNAME", f.net_ifaces, "interface"),
                                ("GLOO_SOCKET_IFNAME", f.net_ifaces, "interface"),
                                ("NCCL_IB_HCA", f.ib_devices, "HCA")):
            value = f.net_env.get(var)
            names = _names(value) if value else None
            if names and not any(h.startswith(n) for n in names for h in have):
                problems.append(Problem(
                    "network", f"{var}={value} on {host}: no such {what} (it has "
                    f"{', '.join(have) or 'none'})",
                    f"set {var} to {what}s every node has (`ip -br link`, `ibv_devinfo`), "
                    "or unset it"))
    if len(x.hosts) > 1 and x.want_gpu:
        for host in x.hosts:
            f = next(f for f in x.facts if f.host == host)
            if not f.ib_devices and "NCCL_SOCKET_IFNAME" not in f.net_env:
                problems.append(Problem(
                    "network", f"{host} has no InfiniBand HCA and NCCL_SOCKET_IFNAME is unset: "
                    "NCCL falls back to TCP on whichever interface it finds first",
                    "set NCCL_SOCKET_IFNAME to the fast interface; check the IB driver "
                    "(ibv_devinfo) if the node should have one"))
    f0 = x.facts[0]
    ok = (f"HCAs {', '.join(f0.ib_devices)}" if f0.ib_devices else "no InfiniBand") + (
        f"; {', '.join(f'{k}={v}' for k, v in sorted(f0.net_env.items()))}" if f0.net_env
        else "")
    return Verdict("network", ok, problems)


def check_allreduce(x: Inputs) -> Verdict:
    """The all_reduce over all ranks returned the right sum, fast enough when a floor is set."""
    r = x.allreduce
    if r is None:
        return Verdict("allreduce", "one rank: nothing to reduce")
    where = f"all_reduce of {r['mb']:g} MB over {r['ranks']} ranks ({r['backend']})"
    fix = ("check NCCL_SOCKET_IFNAME / NCCL_IB_HCA (NCCL_DEBUG=INFO shows the transport), then "
           "`hpctrain bench collective` for the whole curve")
    if r.get("error"):
        return Verdict("allreduce", "", [Problem("allreduce", f"{where} failed: {r['error']}",
                                                 fix)])
    if r["wrong"]:
        return Verdict("allreduce", "", [Problem(
            "allreduce", f"{where}: {r['wrong']} wrong elements", "a bad GPU, link or NCCL "
            "build: run `hpctrain bench node` on each node and exclude the one that fails")])
    ok = f"{where}: busbw {r['busbw_gbps']:,.2f} GB/s"
    if x.expect_busbw is not None and r["busbw_gbps"] < x.expect_busbw:
        return Verdict("allreduce", ok, [Problem(
            "allreduce", f"{where}: busbw {r['busbw_gbps']:,.2f} GB/s, below the expected "
            f"{x.expect_busbw:g}", fix)])
    return Verdict("allreduce", ok)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def check_disk(x: Inputs) -> Verdict:
    """Room for the checkpoints kept plus the one being written."""
    s = x.storage
    if s is None or s.free_bytes is None:
        return Verdict("disk", "no config: checkpoint size unknown")
    need = s.ckpt_bytes * s.keep
    ok = (f"{s.ckpt_dir}: {_gb(s.free_bytes)} free for {s.keep} x {_gb(s.ckpt_bytes)} "
          "checkpoints")
    if s.free_bytes >= need:
        return Verdict("disk", ok)
    return Verdict("disk", ok, [Problem(
        "disk", f"{s.ckpt_dir}: {_gb(s.free_bytes)} free, the checkpoints need ~{_gb(need)} "
        f"({s.keep} x {_gb(s.ckpt_bytes)}: fp32 weights and AdamW moments of "
        f"{s.params / 1e6:,.1f}M parameters)",
        "free space, point run.out_dir at a larger filesystem (scratch), or lower "
        "checkpoint.keep_last")])


def check_lustre(x: Inputs) -> Verdict:
    """On Lustre, big files are striped over more than one OST."""
    s = x.storage
    if s is None:
        return Verdict("lustre", "no config: no folders to check")
    problems = []
    for label, e in s.fs.items():
        if e["fs"] != "lustre":
            continue
        stripes = e.get("stripes")
        if isinstance(stripes, str):
            problems.append(Problem("lustre", f"{label} folder {e['path']} is on Lustre but "
                                    f"its striping is unknown: {stripes}",
                                    "run where `lfs` works (module load lustre), or check by "
                                    "hand: lfs getstripe -d DIR"))
        elif stripes == 1 and e["file_bytes"] >= BIG_FILE:
            problems.append(Problem(
                "lustre", f"{label} folder {e['path']}: stripe count 1 for files of "
                f"~{_gb(e['file_bytes'])}: one storage target serves each whole file",
                f"lfs setstripe -c 4 {e['path']} (files written afterwards inherit it; -c -1 "
                "stripes over every target)"))
    kinds = ", ".join(f"{label} on {e['fs']}" + (f" (stripes {e['stripes']})"
                                                 if "stripes" in e else "")
                      for label, e in s.fs.items())
    return Verdict("lustre", kinds, problems)


def check_small_files(x: Inputs) -> Verdict:
    """The data path holds few small files (each open is a metadata round trip)."""
    s = x.storage
    if s is None or s.data_dir is None:
        return Verdict("small_files", "no data path (built-in corpus)")
    ok = f"{s.data_dir}: {s.small_files} files under 1 MiB"
    if s.small_files <= x.max_small_files:
        return Verdict("small_files", ok)
    return Verdict("small_files", ok, [Problem(
        "small_files", f"{s.data_dir} holds {s.small_files:,} files under 1 MiB (more than "
        f"{x.max_small_files:,}): on a parallel filesystem each open waits on the metadata "
        "server", "pack them into large shards: hpctrain data prepare (text) or hpctrain data "
        "pack (any files)")])


def check_ulimits(x: Inputs) -> Verdict:
    """Enough open files; unlimited locked memory where RDMA needs it."""
    problems = []
    rdma = x.want_gpu and (len(x.hosts) > 1 or any(f.ib_devices for f in x.facts))
    for host in x.hosts:
        f = next(f for f in x.facts if f.host == host)
        if f.nofile != -1 and f.nofile < MIN_NOFILE:
            problems.append(Problem(
                "ulimits", f"ulimit -n is {f.nofile} on {host}: data workers, checkpoint files "
                "and NCCL sockets need thousands", "ulimit -n $(ulimit -Hn) before training "
                "(in the job script), or ask the admins to raise the hard limit"))
        if rdma and f.memlock != -1:
            problems.append(Problem(
                "ulimits", f"ulimit -l is {f.memlock // 1024} KiB on {host}: RDMA (NCCL over "
                "InfiniBand) cannot pin its buffers",
                "run `ulimit -l unlimited` on the login node before submitting (Slurm "
                "propagates limits), or ask the admins for memlock unlimited"))
    f0 = x.facts[0]
    ok = f"open files {f0.nofile if f0.nofile != -1 else 'unlimited'}, locked memory " + (
        "unlimited" if f0.memlock == -1 else f"{f0.memlock // 1024} KiB")
    return Verdict("ulimits", ok, problems)


def check_gpu_health(x: Inputs) -> Verdict:
    """Every GPU's speed against its siblings across the job and the datasheet."""
    if not x.gpu_health:
        return Verdict("gpu_health", "no GPU measured")
    from hpctrain.bench.node import assess

    report = assess(x.gpu_health, None)
    ok = f"{len(x.gpu_health)} GPUs within tolerance of each other and the datasheet"
    return Verdict("gpu_health", ok, [Problem(
        "gpu_health", f.message, "keep the job off that node (--exclude=NODE) and tell the "
        "admins; `hpctrain bench node` on it shows the details") for f in report.findings])


CHECKS: list[Callable[[Inputs], Verdict]] = [
    check_versions, check_gpus, check_affinity, check_network, check_allreduce, check_disk,
    check_lustre, check_small_files, check_ulimits, check_gpu_health]


def judge(x: Inputs) -> list[Verdict]:
    """Every check's verdict."""
    return [check(x) for check in CHECKS]


# -- running across the job ---------------------------------------------------------------------


def inject(facts: Facts, environ: dict[str, str] | os._Environ = os.environ) -> Facts:
    """Facts with the values HPCTRAIN_DOCTOR_INJECT gives this rank replaced."""
    raw = environ.get(INJECT_ENV)
    if not raw:
        return facts
    try:
        changes = json.loads(raw).get(str(facts.rank), {})
        return dataclasses.replace(facts, **changes)
    except (ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"{INJECT_ENV}={raw!r} cannot be applied: {e}",
                          expected='{"RANK": {"field": value}}, e.g. {"1": {"torch": "x"}}'
                          ) from None


def measure_allreduce(device: torch.device, world: int, mb: float) -> dict:
    """A short all_reduce over the default group: correctness and bus bandwidth."""
    n = max(1, int(mb * 1e6) // 4)
    result = {"ranks": world, "mb": n * 4 / 1e6, "backend": dist.get_backend(), "wrong": 0}
    try:
        x = torch.empty(n, dtype=torch.float32, device=device)
        times = []
        for i in range(7):
            x.fill_(dist.get_rank() + 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # two warm-up rounds
                times.append(time.perf_counter() - t0)
        expected = world * (world + 1) / 2
        result["wrong"] = int((x != expected).sum().item())
        t = statistics.median(times)
        # nccl-tests' bus bandwidth for all_reduce: algbw x 2(n-1)/n.
        result["busbw_gbps"] = n * 4 / t / 1e9 * 2 * (world - 1) / world
    except Exception as e:  # a broken fabric raises from the collective: report it
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def _measure_gpu(facts: Facts):
    from hpctrain.bench.node import measure_device

    result = measure_device(torch.device("cuda", facts.gpu), quick=True)
    result.device = f"{facts.host} GPU {facts.gpu}"
    return result


def run_doctor(cfg: JobConfig | None, env: ProcessEnv, *, expect_busbw: float | None = None,
               allreduce_mb: float = 64.0, max_small_files: int = 10_000,
               gpu_health: bool = True) -> tuple[list[Verdict], str]:
    """Gather facts on every rank, judge them on rank 0; every rank gets the verdicts (and
    a line saying who took part)."""
    facts = inject(gather_facts(env))
    distributed = env.world_size > 1 and not dist.is_initialized()
    if distributed:
        timeout = datetime.timedelta(seconds=cfg.run.timeout_s if cfg else 600)
        os.environ.update(export_torch_env(env))
        backend = "gloo"
        if facts.gpu is not None:
            torch.cuda.set_device(facts.gpu)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    try:
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone = [facts]
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, dataclasses.asdict(facts))
            everyone = [Facts(**g) for g in gathered]
        device = torch.device("cuda", facts.gpu) if facts.gpu is not None else torch.device(
            "cpu")
        allreduce = measure_allreduce(device, world, allreduce_mb) if world > 1 else None
        health = [_measure_gpu(facts)] if gpu_health and facts.gpu is not None else []
        if world > 1:
            all_health: list = [None] * world
            dist.all_gather_object(all_health, health)
            health = [h for part in all_health for h in part]
        hosts = list(dict.fromkeys(f.host for f in everyone))
        who = (f"{world} rank{'s' if world > 1 else ''} on {len(hosts)} "
               f"node{'s' if len(hosts) > 1 else ''}: {', '.join(hosts)}")
        verdicts = None
        if env.rank == 0:
            storage = gather_storage(cfg, world) if cfg is not None else None
            verdicts = judge(Inputs(everyone, storage, cfg, allreduce, health, expect_busbw,
                                    max_small_files))
        if world > 1:
            box = [verdicts]
            dist.broadcast_object_list(box, src=0)
            verdicts = box[0]
        return verdicts, who
    finally:
        if distributed:
            dist.destroy_process_group()


def report(verdicts: list[Verdict], who: str) -> str:
    """The printed report: one line per healthy check, one per problem with its fix."""
    lines = [f"hpctrain doctor ({who})"]
    for v in verdicts:
        if v.problems:
            lines += [p.line() for p in v.problems]
        else:
            lines.append(f"ok      {v.check}: {v.ok}")
    n = sum(len(v.problems) for v in verdicts)
    lines.append(f"doctor: {len(verdicts)} checks, "
                 + (f"{n} problem{'s' if n != 1 else ''}" if n else "no problems"))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain doctor`` on the top-level parser's ``sub``."""
    d = sub.add_parser("doctor", help="preflight: check nodes, GPUs, network, disk before a job",
                       description=__doc__.splitlines()[0])
    d.add_argument("config", nargs="?", type=Path, default=None,
                   help="the training config (disk, data and GPU checks use it)")
    d.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    d.add_argument("--expect-busbw", type=float, default=None, metavar="GBPS",
                   help="all_reduce bus bandwidth below this is a problem")
    d.add_argument("--allreduce-mb", type=float, default=64.0,
                   help="size of the all_reduce across ranks (default 64 MB)")
    d.add_argument("--max-small-files", type=int, default=10_000,
                   help="files under 1 MiB allowed in the data path (default 10000)")
    d.add_argument("--no-gpu-health", action="store_true",
                   help="skip the per-GPU GEMM and bandwidth check")
    d.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain doctor``."""
    from hpctrain.config import load_config

    if args.config is None and args.overrides:
        raise ConfigError("overrides without a config", hint="hpctrain doctor CONFIG k=v ...")
    cfg = load_config(args.config, args.overrides) if args.config is not None else None
    if args.allreduce_mb <= 0 or args.max_small_files < 0:
        raise ConfigError("--allreduce-mb must be > 0 and --max-small-files >= 0")
    env = detect_env()  # before run_doctor exports torch's rank variables
    try:
        verdicts, who = run_doctor(cfg, env, expect_busbw=args.expect_busbw,
                              allreduce_mb=args.allreduce_mb,
                              max_small_files=args.max_small_files,
                              gpu_health=not args.no_gpu_health)
    except (RuntimeError, OSError) as e:  # the ranks could not meet: that is the finding
        raise RuntimeEnvError(f"doctor: the ranks could not run together: {e}",
                              hint="check that every task started (srun), MASTER_ADDR "
                              "resolves on every node, and the network settings") from None
    if env.rank != 0:
        if any(v.problems for v in verdicts):
            sys.exit(DoctorFailed.exit_code)
        return
    print(report(verdicts, who), flush=True)
    n = sum(len(v.problems) for v in verdicts)
    if n:
        raise DoctorFailed(f"doctor found {n} problem{'s' if n != 1 else ''}: fix "
                           f"{'them' if n != 1 else 'it'} before the job runs",
                           hint="each PROBLEM line above names its fix")
