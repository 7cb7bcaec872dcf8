"""Apply activation checkpointing, compile and the data-parallel strategy, in one fixed order.

Order, as in torchtitan: activation checkpointing wraps each block, then each block is compiled
(so the compiled graph includes the recomputation), then FSDP shards each block and finally the
root (or DDP wraps the whole model). The model itself knows none of this.

Parameters live on the meta device until here. FSDP shards them first and each rank then
materialises only its shard, so an 8B model never exists whole on one rank; DDP needs whole
tensors, so it materialises first and wraps after.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from hpctrain.parallel.config import ParallelConfig
from hpctrain.parallel.materialize import materialize

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parallelize(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh, device: torch.device,
                precision: str, seed: int) -> nn.Module:
    """Return the model ready to train: transformed, sharded or replicated, and initialised."""
    blocks: nn.ModuleList = model.layers
    for i, block in enumerate(list(blocks)):
        if _checkpointed(i, cfg):
            # preserve_rng_state=False: the blocks hold no dropout, so no RNG state to replay.
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if cfg.compile:
            # Per block, not the whole model: one graph compiled once and reused by every
            # block of the same shape, and FSDP's hooks stay between graphs.
            block.compile(fullgraph=True)
        blocks[i] = block

    if cfg.strategy == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)
        shard_mesh = mesh["dp_shard"]
        for block in blocks:
            fully_shard(block, mesh=shard_mesh, mp_policy=mp,
                        reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=shard_mesh, mp_policy=mp,
                    reshard_after_forward=cfg.reshard_after_forward)
        materialize(model, device, seed)
        return model

    materialize(model, device, seed)
    if cfg.strategy == "ddp":
        return DistributedDataParallel(
            model,
            device_mesh=mesh["dp_replicate"],
            device_ids=[device.index] if device.type == "cuda" else None,
            # Gradients are written into the communication buckets directly: one copy fewer.
            gradient_as_bucket_view=True,
            # The only buffer (the RoPE table) is derived, identical on every rank: broadcasting
            # it before every forward would be a collective per step for nothing.
            broadcast_buffers=False,
        )
    return model


def autocast_dtype(cfg: ParallelConfig, precision: str) -> torch.dtype | None:
    """The autocast dtype the forward needs, or None where FSDP already casts parameters."""
    if precision == "fp32" or cfg.strategy == "fsdp":
        return None
    return _DTYPES[precision]


def _checkpointed(index: int, cfg: ParallelConfig) -> bool:
    if cfg.activation_checkpointing == "full":
        return True
    if cfg.activation_checkpointing == "every_k":
        return index % cfg.ac_every == 0
    return False
