"""Process group, device binding and the device mesh every parallelism axis is cut from.

The mesh always has the axes ``pp, dp_replicate, dp_shard, tp`` (size 1 when unused), so that
tensor and pipeline parallelism add sizes, not a new way of building groups.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.errors import ConfigError, RuntimeEnvError
from hpctrain.parallel.config import ParallelConfig
from hpctrain.parallel.layout import mesh_degrees
from hpctrain.runtime.config import RunConfig
from hpctrain.runtime.env import ProcessEnv, export_torch_env

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Distributed:
    """This process's place in the job: environment, device, and the mesh over all ranks."""

    env: ProcessEnv
    device: torch.device
    backend: str
    mesh: DeviceMesh
    # CPU groups beside the training one: checkpoint I/O runs on its own (possibly in a
    # background thread) and the per-step control message on another, so neither ever
    # interleaves with the other or with training collectives.
    checkpoint_group: dist.ProcessGroup
    control_group: dist.ProcessGroup

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.env.world_size

    def axis(self, name: str) -> tuple[int, int]:
        """(this rank's index, size) along mesh axis ``name``."""
        return self.mesh.get_local_rank(name), self.mesh.size(MESH_AXES.index(name))

    @property
    def dp(self) -> tuple[int, int]:
        """(rank, size) among the data-parallel replicas: ranks that see different batches.

        Ranks of one tensor-parallel group or one pipeline share the same coordinate.
        """
        rep, n_rep = self.axis("dp_replicate")
        shard, n_shard = self.axis("dp_shard")
        return rep * n_shard + shard, n_rep * n_shard


def select_device(cfg: RunConfig, env: ProcessEnv) -> torch.device:
    """The device of this rank: ``cuda:<local rank>`` when CUDA is used, else the CPU."""
    return pick_device(cfg.device, env.local_rank, setting="run.device", host=env.hostname)


def pick_device(name: str, local_rank: int, *, setting: str, host: str) -> torch.device:
    """The device ``name`` (auto, cpu, cuda or cuda:N) means for local rank ``local_rank``, made
    the current one: GPU N, else the rank's own GPU; the CPU for cpu, and for auto without CUDA.
    ``setting`` names the option in errors (``run.device``, ``--device``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise ConfigError(f"{setting} = {name!r}: unknown device",
                          expected="auto, cpu, cuda or cuda:N",
                          hint="cuda:1 names the second GPU; cuda gives each rank its own")
    if not torch.cuda.is_available():
        raise RuntimeEnvError(
            f"{setting} = {name!r} but no CUDA device is visible",
            expected="a GPU node with the NVIDIA driver loaded",
            hint=f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; "
            f"set {setting} to cpu (or auto) to run on the CPU",
        )
    count = torch.cuda.device_count()
    if match.group(1) is not None:
        index = int(match.group(1))
        if index >= count:
            raise RuntimeEnvError(f"{setting} = {name}: only {count} GPUs visible on {host}",
                                  expected=f"cuda:0..cuda:{count - 1}")
    elif count == 1:
        # Slurm with --gpus-per-task (or a per-task CUDA_VISIBLE_DEVICES) shows each task only
        # its own GPU: it is device 0 whatever the local rank.
        index = 0
    elif local_rank >= count:
        raise RuntimeEnvError(
            f"local rank {local_rank} has no GPU: only {count} visible on {host}",
            expected="one rank per GPU (local ranks 0..GPUs-1)",
            hint="match --nproc / --ntasks-per-node to the GPUs per node, and check that Slurm "
            "does not hide GPUs from tasks (--gpus-per-task vs --gpus-per-node)",
        )
    else:
        index = local_rank
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def init_distributed(cfg: RunConfig, env: ProcessEnv, parallel: ParallelConfig) -> Distributed:
    """Bind the device, start the process group (nccl on CUDA, gloo on CPU) and build the mesh."""
    shape = mesh_degrees(parallel, env.world_size)  # a bad layout fails before any rendezvous
    device = select_device(cfg, env)
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        # device_id binds NCCL eagerly to this rank's GPU; one rank has no peers to bind.
        kwargs = {"device_id": device} if device.type == "cuda" and env.world_size > 1 else {}
        start_process_group(backend, env, timeout, **kwargs)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_AXES)
    checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    return Distributed(env=env, device=device, backend=backend, mesh=mesh,
                       checkpoint_group=checkpoint_group, control_group=control_group)


def start_process_group(backend: str, env: ProcessEnv, timeout: datetime.timedelta,
                        **kwargs) -> None:
    """Start the default process group of ``env``'s job: env:// rendezvous, or none for one
    rank; ``kwargs`` go to ``init_process_group`` (``device_id``)."""
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it
    # is first imported (torch._dynamo and torch.distributed.checkpoint import it). Imported
    # while a default group is up, it holds that group for the life of the process:
    # destroy_process_group cannot free it, and its gloo worker threads are still releasing
    # work while the interpreter finalizes, which aborts the process now and then (SIGABRT,
    # "terminate called without an active exception": the doctor's rank 0 after its report,
    # whose gpus check imports training). Imported before the group exists, it binds None.
    import torch.distributed.nn  # noqa: F401
    if env.world_size == 1:
        # A one-rank group needs no rendezvous: an in-process store avoids port clashes
        # between single-process runs on one machine.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **kwargs)
        return
    os.environ.update(export_torch_env(env))
    store = _agent_store(env, timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **kwargs)
        return
    dist.init_process_group(backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=timeout, **kwargs)


def _agent_store(env: ProcessEnv, timeout: datetime.timedelta) -> dist.Store | None:
    """The elastic agent's store (torchrun, ``--nproc``), seen under a prefix of this attempt
    of the group; None where no agent hosts one (rank 0 then hosts it, env://).

    The agent hosts one store for its whole life and every restart of the group meets there.
    torch's env:// rendezvous uses it without a per-attempt prefix, so a group restarted after
    a rank died read the dead attempt's keys (its peers' addresses, barrier counts) and never
    formed; each attempt's keys are its own here.

    Only where one agent runs the whole group (``--nproc``, single-node torchrun): the restart
    count is each agent's own, and an agent restarted for a membership change does not count
    up, so the agents of a multi-node job can name one attempt differently and their ranks
    would wait for each other under two prefixes until the timeout. There torch's env://
    rendezvous on the agent store stays as it was."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"hpctrain/attempt-{attempt}", client)


def shutdown() -> None:
    """Destroy the process group if one is up (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
