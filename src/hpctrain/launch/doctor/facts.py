"""What each rank of a doctor run knows of itself, its node and its storage (not judged here)."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hpctrain
from hpctrain.config import JobConfig
from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.mounts import filesystem, nearest_existing

SMALL_FILE = 1 << 20
BIG_FILE = 1 << 30
# fp32 master weights (4 bytes) and AdamW's two fp32 moments (8 bytes) per parameter.
CKPT_BYTES_PER_PARAM = 12


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
    from hpctrain.models.registry import count_params

    ckpt = Path(cfg.run.out_dir).absolute()
    params = count_params(cfg.model.resolve(), include_embedding=True)
    s = Storage(ckpt_dir=str(ckpt), params=params, ckpt_bytes=params * CKPT_BYTES_PER_PARAM,
                keep=cfg.checkpoint.keep_last + 1)
    s.free_bytes = shutil.disk_usage(nearest_existing(ckpt)).free
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
            entry["stripes"] = stripe_count(nearest_existing(folder))
        s.fs[label] = entry
    return s


