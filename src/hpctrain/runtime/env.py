"""Work out who this process is (rank, node, rendezvous address) from its launcher's variables.

Three launchers are recognised, checked in this order:

- ``torchrun`` (torch's elastic agent; our local launcher uses it too): RANK, WORLD_SIZE, ...
- ``slurm``: one task per GPU started by ``srun``: SLURM_STEP_ID, SLURM_PROCID, SLURM_NTASKS, ...
- ``local``: none of the above, a single process.

    env = detect_env()
    os.environ.update(export_torch_env(env))
    torch.distributed.init_process_group(backend, init_method="env://")
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import RuntimeEnvError
from hpctrain.runtime.hostlist import expand_hostlist

Launcher = Literal["local", "torchrun", "slurm"]

# Added to the environment of everything a benchmark starts on a GPU machine: NVLink multicast
# stays off on shared hosts (a program using it can take the host's GPUs out of service).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

LOCAL_MASTER_ADDR = "127.0.0.1"
LOCAL_MASTER_PORT = 29500

# Ports derived from the Slurm job id land in [20000, 30000): below Linux's default ephemeral
# range (32768-60999), so the kernel does not hand them out to outgoing connections.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 10000

# SLURM_TASKS_PER_NODE entries: "4" or "4(x2)" (four tasks on each of two nodes).
_TASKS_PER_NODE_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


@dataclass(frozen=True)
class ProcessEnv:
    """One process's place in the job: launcher, ranks, rendezvous address and Slurm ids."""

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    hostname: str
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.world_size > 1

    @property
    def is_rank0(self) -> bool:
        """True for the global rank 0, the process that prints and writes shared files."""
        return self.rank == 0


def detect_env(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """Return the ProcessEnv described by `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    # torchrun's variables win even inside a Slurm job: when torchrun runs under srun, the
    # SLURM_* ranks count the torchrun agents (one per node), not the training processes.
    if any(name in env for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")):
        return _from_torchrun(env)
    # The batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS too, but it is no task of
    # a step: only srun's tasks carry SLURM_STEP_ID. Without this check `hpctrain train` run
    # straight in a batch script would wait forever for ranks that never start.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return _from_slurm(env)
    return _local(env)


def export_torch_env(env: ProcessEnv) -> dict[str, str]:
    """Return the variables `init_process_group(init_method="env://")` reads, for os.environ."""
    return {
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }


def slurm_master_port(job_id: str) -> int:
    """Return the rendezvous port derived from a Slurm job id (same on every rank of the job)."""
    # Deterministic so every rank computes the same port without talking to the others, and
    # different per job so two jobs sharing a node (e.g. two 4-GPU jobs on one 8-GPU node) do
    # not both bind 29500 and fail with EADDRINUSE.
    return _SLURM_PORT_BASE + _int_var("SLURM_JOB_ID", job_id) % _SLURM_PORT_SPAN


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (e.g. ``4(x2),3``) into one task count per node."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE_ITEM.match(item.strip())
        if match is None:
            raise RuntimeEnvError(
                f"SLURM_TASKS_PER_NODE={value!r} cannot be parsed (bad item {item!r})",
                expected="comma-separated counts with optional repeats, e.g. '4(x2),3'",
                hint="this variable is set by Slurm; do not set it by hand",
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _from_torchrun(env: Mapping[str, str]) -> ProcessEnv:
    rank = _require_int(env, "RANK", "torchrun")
    world_size = _require_int(env, "WORLD_SIZE", "torchrun")
    local_rank = _require_int(env, "LOCAL_RANK", "torchrun")
    local_world_size = _require_int(env, "LOCAL_WORLD_SIZE", "torchrun")
    node_rank = _require_int(env, "GROUP_RANK", "torchrun")
    master_addr = _require(env, "MASTER_ADDR", "torchrun")
    master_port = _port("MASTER_PORT", _require(env, "MASTER_PORT", "torchrun"))
    _check_below("RANK", rank, "WORLD_SIZE", world_size)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    _check_not_above("LOCAL_WORLD_SIZE", local_world_size, "WORLD_SIZE", world_size)
    return ProcessEnv(
        launcher="torchrun",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        hostname=socket.gethostname(),
        **_slurm_ids(env),
    )


def _from_slurm(env: Mapping[str, str]) -> ProcessEnv:
    rank = _require_int(env, "SLURM_PROCID", "slurm")
    world_size = _require_int(env, "SLURM_NTASKS", "slurm")
    local_rank = _require_int(env, "SLURM_LOCALID", "slurm")
    node_rank = _require_int(env, "SLURM_NODEID", "slurm")
    job_id = _require(env, "SLURM_JOB_ID", "slurm")
    _check_below("SLURM_PROCID", rank, "SLURM_NTASKS", world_size)
    local_world_size = _slurm_local_world_size(env, node_rank, world_size)
    _check_below("SLURM_LOCALID", local_rank, "this node's task count", local_world_size)

    if "MASTER_ADDR" in env:
        master_addr = env["MASTER_ADDR"]
    else:
        # srun exports the step's own node list; prefer it because a step may run on a subset
        # of the allocation, and rank 0 sits on the first node of the step, not of the job.
        name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
        master_addr = expand_hostlist(_require(env, name, "slurm"))[0]
    if "MASTER_PORT" in env:
        master_port = _port("MASTER_PORT", env["MASTER_PORT"])
    else:
        master_port = slurm_master_port(job_id)

    return ProcessEnv(
        launcher="slurm",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        hostname=socket.gethostname(),
        **_slurm_ids(env),
    )


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int, world_size: int) -> int:
    """Return how many tasks run on this node, from SLURM_TASKS_PER_NODE or its fixed twin."""
    if "SLURM_TASKS_PER_NODE" in env:
        counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if sum(counts) != world_size:
            raise RuntimeEnvError(
                f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r} adds up to {sum(counts)} "
                f"tasks but SLURM_NTASKS={world_size}",
                expected="the per-node task counts to sum to SLURM_NTASKS",
                hint="a step launched with a different --ntasks than the job inherits both; "
                "pass matching --ntasks/--ntasks-per-node to srun",
            )
        _check_below("SLURM_NODEID", node_rank, "nodes in SLURM_TASKS_PER_NODE", len(counts))
        return counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in env:
        per_node = _require_int(env, "SLURM_NTASKS_PER_NODE", "slurm")
        _check_not_above("SLURM_NTASKS_PER_NODE", per_node, "SLURM_NTASKS", world_size)
        return per_node
    raise RuntimeEnvError(
        "SLURM_PROCID is set but neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE is",
        expected="srun to set SLURM_TASKS_PER_NODE for every task",
        hint="start the training processes with `srun`, one task per GPU",
    )


def _local(env: Mapping[str, str]) -> ProcessEnv:
    # A Slurm batch script (or salloc shell) has SLURM_JOB_ID but is not one of the step's tasks:
    # run as a single process but keep the ids so run names and logs still point at the job.
    master_port = LOCAL_MASTER_PORT
    if "MASTER_PORT" in env:
        master_port = _port("MASTER_PORT", env["MASTER_PORT"])
    return ProcessEnv(
        launcher="local",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        master_addr=env.get("MASTER_ADDR", LOCAL_MASTER_ADDR),
        master_port=master_port,
        hostname=socket.gethostname(),
        **_slurm_ids(env),
    )


def _slurm_ids(env: Mapping[str, str]) -> dict[str, str | None]:
    return {
        "job_id": env.get("SLURM_JOB_ID"),
        "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
    }


def _require(env: Mapping[str, str], name: str, launcher: str) -> str:
    if name not in env:
        raise RuntimeEnvError(
            f"{name} is not set, but other {launcher} variables are",
            expected=f"{launcher} to set {name} together with its other variables",
            hint="start the job through the launcher instead of setting rank variables by hand, "
            "or unset the stray ones (a leftover RANK in your shell selects torchrun)",
        )
    return env[name]


def _require_int(env: Mapping[str, str], name: str, launcher: str) -> int:
    return _int_var(name, _require(env, name, launcher))


def _int_var(name: str, value: str) -> int:
    try:
        number: int | None = int(value)
    except ValueError:
        number = None
    if number is None or number < 0:
        raise RuntimeEnvError(
            f"{name}={value!r} is not a non-negative integer",
            expected=f"{name} to be a whole number such as 0 or 3",
            hint=f"check where {name} is set (job script, shell profile, container env)",
        )
    return number


def _port(name: str, value: str) -> int:
    port = _int_var(name, value)
    if not 1 <= port <= 65535:
        raise RuntimeEnvError(
            f"{name}={value!r} is not a TCP port",
            expected="a port between 1 and 65535",
            hint=f"unset {name} to use the default",
        )
    return port


def _check_below(name: str, value: int, limit_name: str, limit: int) -> None:
    if value >= limit:
        raise RuntimeEnvError(
            f"{name}={value} is not below {limit_name}={limit}",
            expected=f"0 <= {name} < {limit_name}",
            hint="the launcher variables disagree; a stale value exported in the job script or "
            "shell profile is the usual cause",
        )


def _check_not_above(name: str, value: int, limit_name: str, limit: int) -> None:
    if value < 1 or value > limit:
        raise RuntimeEnvError(
            f"{name}={value} is outside 1..{limit_name}={limit}",
            expected=f"1 <= {name} <= {limit_name}",
            hint="the launcher variables disagree; a stale value exported in the job script or "
            "shell profile is the usual cause",
        )
