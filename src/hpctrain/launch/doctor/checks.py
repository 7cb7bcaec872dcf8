"""The doctor's checks: each judges every rank's facts and returns a verdict (problems, fixes)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.launch.doctor.facts import BIG_FILE, Facts, Storage, format_cpus

MIN_NOFILE = 4096


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
    job_ranks: int | None = None  # the ranks the job trains with (--nproc); None: the doctor's

    @property
    def hosts(self) -> list[str]:
        """Distinct hosts in rank order."""
        return list(dict.fromkeys(f.host for f in self.facts))

    @property
    def want_gpu(self) -> bool:
        """True when the job will train on GPUs."""
        device = self.cfg.run.device if self.cfg else "auto"
        return device == "cuda" or (device == "auto" and any(f.gpus for f in self.facts))


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
        refused = _refused_on_cpu(x.cfg)
        if refused is not None:
            return Verdict("gpus", "", [refused])
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


def _refused_on_cpu(cfg: JobConfig | None) -> Problem | None:
    """What `hpctrain train` would refuse about this config on a node without a GPU."""
    if cfg is None:
        return None
    from hpctrain.train.job import check_device_fits  # the very check training runs first

    try:
        check_device_fits(cfg)
    except ConfigError as e:
        return Problem("gpus", f"train would refuse this config here: {e.what}",
                       e.hint or "run on a GPU node")
    return None


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


def check_auto(x: Inputs) -> Verdict:
    """What the config's ``auto`` values resolve to for the job's ranks (``--nproc``, else the
    doctor's own), on this rank's GPU (hpctrain.plan.auto), as training will resolve them."""
    from hpctrain.plan.auto import leaves_to_auto, resolve_auto

    if x.cfg is None or not leaves_to_auto(x.cfg):
        return Verdict("auto", "nothing left to auto")
    cfg = copy.deepcopy(x.cfg)  # the judged config stays as given
    ranks = x.job_ranks or len(x.facts)
    try:
        res = resolve_auto(cfg, ranks)
    except ConfigError as e:
        expected = f" (expected: {e.expected})" if e.expected else ""
        return Verdict("auto", "", [Problem(
            "auto", f"train would refuse on {ranks} rank(s): {e.what}{expected}",
            e.hint or "set the values yourself")])
    why = f" ({res.reasons[0]})" if res.reasons else ""
    return Verdict("auto", f"on {ranks} rank(s): {res.summary()}{why}")


CHECKS: list[Callable[[Inputs], Verdict]] = [
    check_versions, check_gpus, check_affinity, check_network, check_allreduce, check_disk,
    check_lustre, check_small_files, check_ulimits, check_gpu_health, check_auto]


def judge(x: Inputs) -> list[Verdict]:
    """Every check's verdict."""
    return [check(x) for check in CHECKS]


