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
- gpus: each task sees a GPU of its own (when the config wants GPUs); without GPUs, training's
  own check_device_fits accepts the config (a GPU-sized model is refused on a CPU node);
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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError, HpctrainError, RuntimeEnvError
from hpctrain.launch.doctor.checks import Inputs, Verdict, judge
from hpctrain.launch.doctor.facts import Facts, gather_facts, gather_storage
from hpctrain.numeric_args import count
from hpctrain.runtime.dist import shutdown, start_process_group
from hpctrain.runtime.env import ProcessEnv, detect_env

INJECT_ENV = "HPCTRAIN_DOCTOR_INJECT"


class DoctorFailed(HpctrainError):
    """At least one check found a problem."""

    exit_code = 1


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
               gpu_health: bool = True, job_ranks: int | None = None,
               show: Callable[[list[Verdict], str], None] | None = None
               ) -> tuple[list[Verdict], str]:
    """Gather facts on every rank, judge them on rank 0; every rank gets the verdicts (and
    a line saying who took part). Rank 0 calls ``show(verdicts, who)`` before any rank
    returns."""
    facts = inject(gather_facts(env))
    distributed = env.world_size > 1 and not dist.is_initialized()
    if distributed:
        timeout = datetime.timedelta(seconds=cfg.run.timeout_s if cfg else 600)
        backend = "gloo"
        if facts.gpu is not None:
            torch.cuda.set_device(facts.gpu)
            backend = "cpu:gloo,cuda:nccl"
        start_process_group(backend, env, timeout)
    agreed = False
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
                                    max_small_files, job_ranks))
        if world > 1:
            box = [verdicts]
            dist.broadcast_object_list(box, src=0)
            verdicts = box[0]
        # Every rank has the verdicts and goes to the closing barrier: rank 0 too when its
        # show() fails (else the others would wait there until the timeout).
        agreed = True
        if env.rank == 0 and show is not None:
            show(verdicts, who)
        return verdicts, who
    finally:
        if distributed:
            if agreed:
                # No rank leaves before rank 0 has shown the report: under srun
                # --kill-on-bad-exit a rank that exits 1 first gets rank 0 killed mid-report.
                dist.barrier()
            shutdown()


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
                       description="Check the nodes before a job burns GPU-hours: versions, "
                       "GPUs, CPU affinity, network, an all_reduce, disk, Lustre striping, "
                       "small files, ulimits and GPU health. Exit 1 with one line per problem "
                       "and its fix. Run it on a login node, or as every task of a job "
                       "(srun, or --preflight of hpctrain submit).")
    d.add_argument("config", nargs="?", type=Path, default=None,
                   help="the training config (disk, data and GPU checks use it)")
    d.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    d.add_argument("--expect-busbw", type=float, default=None, metavar="GBPS",
                   help="all_reduce bus bandwidth (GB/s) below this is a problem (default: "
                   "no bound)")
    d.add_argument("--allreduce-mb", type=float, default=64.0,
                   help="size of the all_reduce across ranks in MB (default %(default)s)")
    d.add_argument("--max-small-files", type=int, default=10_000,
                   help="files under 1 MiB allowed in the data path (default %(default)s)")
    d.add_argument("--no-gpu-health", action="store_true",
                   help="skip the per-GPU GEMM and bandwidth check")
    d.add_argument("--nproc", type=count(1, 1 << 20), default=None,
                   help="the ranks the job trains with, which the config's auto values are "
                   "chosen for (default: the doctor's own ranks)")
    d.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain doctor``."""
    from hpctrain.task import load_run_config

    if args.config is None and args.overrides:
        raise ConfigError("overrides without a config", hint="hpctrain doctor CONFIG k=v ...")
    env = detect_env()  # before run_doctor exports torch's rank variables
    # A task file (.py) is read as `hpctrain train` reads it (the batch script's --preflight).
    cfg = (load_run_config(args.config, args.overrides, env.world_size)
           if args.config is not None else None)
    if args.allreduce_mb <= 0 or args.max_small_files < 0:
        raise ConfigError("--allreduce-mb must be > 0 and --max-small-files >= 0")
    try:
        verdicts, who = run_doctor(cfg, env, expect_busbw=args.expect_busbw,
                                   allreduce_mb=args.allreduce_mb,
                                   max_small_files=args.max_small_files,
                                   gpu_health=not args.no_gpu_health,
                                   job_ranks=args.nproc,
                                   show=lambda v, w: print(report(v, w), flush=True))
    except (RuntimeError, OSError) as e:  # the ranks could not meet: that is the finding
        raise RuntimeEnvError(f"doctor: the ranks could not run together: {e}",
                              hint="check that every task started (srun), MASTER_ADDR "
                              "resolves on every node, and the network settings") from None
    if env.rank != 0:
        if any(v.problems for v in verdicts):
            sys.exit(DoctorFailed.exit_code)
        return
    n = sum(len(v.problems) for v in verdicts)
    if n:
        raise DoctorFailed(f"doctor found {n} problem{'s' if n != 1 else ''}: fix "
                           f"{'them' if n != 1 else 'it'} before the job runs",
                           hint="each PROBLEM line above names its fix")
