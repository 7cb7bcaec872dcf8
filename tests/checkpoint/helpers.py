"""Small models, optimizers and file damage for the checkpoint tests (no pytest fixtures here).

Imported by the tests in this folder and by their gloo ranks (forked from the preloaded
interpreter, which imports it by name as the tests do).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import forked
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.launch.local import kill_tree
from ports import free_port

SPAWN_TIMEOUT_S = 150


class TinyNet(torch.nn.Module):
    """Two linear layers and a norm: matrices (decayed) and vectors (not), like the real model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def make_model(seed: int = 0) -> TinyNet:
    """A TinyNet whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return TinyNet()


def make_optimizer(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """Fused AdamW with two param groups (decay / no decay), as hpctrain builds it."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=True)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    """``n`` optimizer steps on fixed random data (fills the optimizer's moments)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What the trainer hands the manager: canonical model and optimizer state dicts."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def put_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load state dicts filled by ``CheckpointManager.load`` back into model and optimizer."""
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def manager(root: Path, **cfg: Any) -> CheckpointManager:
    """A manager over the default process group (which must be up)."""
    return CheckpointManager(CheckpointConfig(**cfg), root, rank=dist.get_rank(),
                             world_size=dist.get_world_size(), device=torch.device("cpu"),
                             group=dist.group.WORLD)


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Corrupt one byte in place (size unchanged): only a checksum can notice."""
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if offset is None else offset
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def flip_in_tensor(ckpt_dir: Path, tensor: torch.Tensor) -> Path:
    """Corrupt a byte inside ``tensor``'s saved bytes (found in whichever shard holds them), so
    that the checkpoint still loads, with a wrong value: only a checksum can notice. Returns
    the shard."""
    needle = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    for shard in sorted(ckpt_dir.glob("*.distcp")):
        at = shard.read_bytes().find(needle)
        if at >= 0:
            flip_byte(shard, at + len(needle) // 2)
            return shard
    raise AssertionError(f"no shard of {ckpt_dir} holds the tensor's bytes")


def tmp_dirs(root: Path) -> list[str]:
    """Leftover temporary/trash directories of a checkpoint root."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def on_disk_files(ckpt_dir: Path) -> set[str]:
    """Every file of a committed checkpoint except the manifest itself."""
    return {p.name for p in ckpt_dir.iterdir() if p.is_file() and p.name != "manifest.json"}


def init_env(rank: int, world_size: int, port: int) -> None:
    """Environment a gloo rank needs (RANK is also what fault injection reads)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))


def fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyNet under FSDP2 (each linear and the root sharded), trained 2 steps; call in a rank."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(0)
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model)
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    return model, opt


@contextmanager
def two_spawned_ranks(rank_main: Callable[[int, int, int, str], None], out: Path,
                      what: str) -> Iterator[Callable[[], tuple[Path, list[dict]]]]:
    """Start ``rank_main(rank, 2, port, out)`` on 2 ranks now, forked from the preloaded
    interpreter (tests/forked.py: no ~4 CPU-s of imports each); yield ``result()``, which joins
    them (once) and returns (out, each rank's ``rank-N.json``). Leftovers are killed."""
    port, logs = free_port(), [out / f"rank-{r}.log" for r in range(2)]
    procs = [forked.start(rank_main, (r, 2, port, str(out)), env=dict(os.environ), out=logs[r])
             for r in range(2)]
    ranks: list[dict] = []

    def result() -> tuple[Path, list[dict]]:
        if not ranks:
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while any(p.exitcode is None for p in procs):
                if time.monotonic() > deadline:
                    pytest.fail(f"2-rank {what} did not finish in {SPAWN_TIMEOUT_S} s")
                time.sleep(0.05)
            assert all(p.exitcode == 0 for p in procs), "\n".join(
                f"--- rank {r} (exit {p.exitcode}) ---\n{logs[r].read_text()[-3000:]}"
                for r, p in enumerate(procs))
            ranks.extend(json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
        return out, ranks

    try:
        yield result
    finally:
        for r, p in enumerate(procs):
            kill_tree(p.pid)
            forked.finish(p, logs[r])
