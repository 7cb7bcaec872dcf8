"""The one function that spreads a model over the mesh, applying every transform in a fixed order.

Per model part (the whole model, or each pipeline stage this rank holds), as in torchtitan, with
what the model's family says (``hpctrain.models.spec``: its blocks, tensor-parallel plan, FSDP
units, stage costs):

0. with ``train.precision=fp8`` the blocks' Linears become float8 Linears (``parallel/float8.py``);
1. tensor parallelism (``parallel/tensor.py``) shards the model by its family's plan over ``tp``
   (with ``parallel.async_tp``, the compile of step 3 overlaps its collectives with the matmuls);
2. activation checkpointing wraps each block (whole, or op by op: ``parallel/selective_ac.py``);
3. each block is compiled (so the compiled graph includes the recomputation and the TP
   redistributions);
4. FSDP/HSDP shards each block and the part's root, or DDP wraps the part
   (``parallel/data.py``). Without data-parallel sharding, ``parallel.mixed_precision`` fsdp
   (auto's choice for TP/PP) applies FSDP over the ``dp_shard`` axis of size 1 all the same,
   for its parameter casts alone (``parallel/config.py``); otherwise autocast computes in bf16.

Pipeline parallelism (``parallel/pipeline.py``) comes first of all: it cuts the model into stages,
and each stage goes through 0-4. The model itself knows none of this.

Parameters live on the meta device until here. FSDP shards them first and each rank then
materialises only its shard, so an 8B model never exists whole on one rank; DDP needs whole
tensors, so it materialises first and wraps after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.models.registry import family_of
from hpctrain.models.spec import ModelFamily
from hpctrain.parallel.config import ParallelConfig
from hpctrain.parallel.data import DTYPES, apply_ddp, apply_fsdp
from hpctrain.parallel.float8 import (
    Float8Training,
    check_float8_device,
    compute_precision,
    convert_to_float8,
    float8_all_gather,
    precompute_float8_scales,
)
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.materialize import materialize
from hpctrain.parallel.pipeline import (
    Pipeline,
    StageUnion,
    autocast_forward,
    build_pipeline,
    split_model,
)
from hpctrain.parallel.selective_ac import selective_checkpoint
from hpctrain.parallel.stages import balance_stages
from hpctrain.parallel.tensor import apply_tensor_parallel, enable_async_tp

log = logging.getLogger("hpctrain.parallel")


@dataclass
class Parallelized:
    """A model spread over the mesh.

    ``model`` is what the optimizer and checkpoints see, under the model's own parameter names
    (for pipeline parallelism: this rank's stages together); without pipeline parallelism it is
    also what runs. ``pipeline`` runs the stages otherwise.
    """

    model: nn.Module
    pipeline: Pipeline | None = None
    # FSDP all-gathers float8 weights whose scales are computed once per update.
    float8_scales: bool = field(default=False, kw_only=True)
    # The dtype the trainer autocasts whole steps to (None where FSDP casts, or in fp32); a
    # pipeline's stages autocast their own forwards to it already.
    autocast: torch.dtype | None = field(default=None, kw_only=True)

    def after_update(self) -> None:
        """Refresh what derives from the weights, after an optimizer step or a checkpoint
        load: the scales of float8-gathered weights (one all-reduce), otherwise nothing."""
        if self.float8_scales:
            precompute_float8_scales(self.model)


def parallelize(model: nn.Module, cfg: ParallelConfig, layout: ParallelLayout, mesh: DeviceMesh,
                device: torch.device, precision: str, seed: int, *,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                seq_len: int = 0, microbatch_tokens: int = 0,
                fp8: Float8Training | None = None, master_weights: str = "fp32") -> Parallelized:
    """Transform, shard and initialise ``model`` (built on meta) for this rank of ``mesh``.

    With pipeline parallelism ``loss_fn(logits, targets)`` (summed token loss) runs on the last
    stage; ``seq_len`` and ``microbatch_tokens`` feed the stage-balancing cost model. With
    ``precision`` fp8, ``fp8`` says how the block Linears compute (default: tensorwise).
    ``master_weights`` bf16 keeps the parameters themselves in bf16 (pure bf16 training).
    """
    if precision == "fp8":
        fp8 = fp8 or Float8Training()
        check_float8_device(device, fp8.emulate)
    else:
        fp8 = None
    gather8 = float8_all_gather(fp8, cfg.strategy, layout.dp_shard)
    family = family_of(model)
    args = model.args
    params = family.count_params(args, include_embedding=True)
    # As the config's load does, for callers that skip it.
    cfg.check_precision(precision, params, master_weights)
    log.info("mixed precision: %s",
             describe_mixed_precision(cfg, precision, params, master_weights))
    casts = cfg.mixed_precision_path(precision, params, master_weights) == "fsdp"
    autocast = autocast_dtype(cfg, precision, params, master_weights)
    if master_weights == "bf16":
        # On meta, before any part is cut or sharded: every later step sees bf16 parameters.
        # Buffers (the RoPE table) stay fp32.
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    if cfg.async_tp and layout.tp > 1:
        # Before any part compiles (compilation runs at the first forward, with the flag set).
        enable_async_tp(mesh["tp"], device)
        log.info("async TP: the compiled blocks fuse their TP collectives into the matmuls "
                 "(symmetric memory on the %d-rank TP group)", layout.tp)
    if layout.pp == 1:
        return Parallelized(_parallelize_part(model, family, cfg, layout, mesh, device,
                                              precision, seed, fp8, gather8, casts),
                            float8_scales=gather8, autocast=autocast)
    if loss_fn is None:
        raise ValueError("pipeline parallelism needs the loss function")
    bounds = balance_stages(args.n_layers, layout.num_stages,
                            family.stage_costs(args, seq_len, microbatch_tokens))
    parts = split_model(model, layout, mesh.get_local_rank("pp"), bounds)
    stages = []
    for s, part in parts:
        if autocast is not None:
            autocast_forward(part, device.type, autocast)
        stages.append((s, _parallelize_part(part, family, cfg, layout, mesh, device, precision,
                                            seed, fp8, gather8, casts)))
    union = StageUnion([part for _, part in parts], args.n_layers, family)
    return Parallelized(union, build_pipeline(stages, layout, mesh["pp"], device, loss_fn,
                                              bounds), float8_scales=gather8, autocast=autocast)


def _parallelize_part(model: nn.Module, family: ModelFamily, cfg: ParallelConfig,
                      layout: ParallelLayout,
                      mesh: DeviceMesh, device: torch.device, precision: str,
                      seed: int, fp8: Float8Training | None, gather8: bool,
                      fsdp_casts: bool) -> nn.Module:
    if fp8 is not None:
        converted = convert_to_float8(model, fp8, all_gather=gather8)
        log.info("fp8 (%s%s): %d block Linears compute in float8%s", fp8.recipe,
                 ", emulated" if fp8.emulate else "", len(converted),
                 "; FSDP gathers their weights in float8" if gather8 else "")
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    blocks = family.block_list(model)
    for i, block in enumerate(list(blocks)):
        if block is None:  # held by another pipeline stage
            continue
        if cfg.activation_checkpointing == "selective":
            block = selective_checkpoint(block, cfg.ac_save_mm)
        elif _checkpointed(i, cfg):
            # preserve_rng_state=False: the blocks hold no dropout, so no RNG state to replay.
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if cfg.compile:
            # Per block, not the whole model: one graph compiled once and reused by every
            # block of the same shape, and FSDP's hooks stay between graphs.
            block.compile(fullgraph=True)
        blocks[i] = block

    if cfg.strategy == "fsdp":
        apply_fsdp(model, mesh, compute_precision(precision), cfg.reshards_after_forward,
                   cfg.reduce_precision, last_block_gathered=layout.pp == 1,
                   prefetch=cfg.fsdp_prefetch, group_blocks=cfg.fsdp_group_blocks)
        materialize(model, device, seed)
        return model
    if fsdp_casts:
        # FSDP over a shard group of one rank, for its parameter casts only: resharding
        # would free nothing (the shard is the whole parameter) and cost a second cast.
        apply_fsdp(model, mesh, compute_precision(precision), reshard_after_forward=False,
                   reduce_precision=cfg.reduce_precision)
        materialize(model, device, seed)
        return model
    materialize(model, device, seed)
    if cfg.strategy == "ddp":
        return apply_ddp(model, mesh, device)
    return model


def autocast_dtype(cfg: ParallelConfig, precision: str, params: int,
                   master: str = "fp32") -> torch.dtype | None:
    """The autocast dtype the forward of a model of ``params`` parameters needs, or None where
    FSDP casts the parameters, where they are bf16 themselves (``master`` bf16), or in fp32.

    One GPU and DDP (and ``parallel.mixed_precision=autocast``) compute in ``precision`` through
    autocast (fp32 master weights, bf16 matmuls): never silently in fp32. fp8 autocasts to bf16
    like bf16 (the float8 Linears cast their own operands).
    """
    if cfg.mixed_precision_path(precision, params, master) != "autocast":
        return None
    return DTYPES[compute_precision(precision)]


def describe_mixed_precision(cfg: ParallelConfig, precision: str, params: int,
                             master: str = "fp32") -> str:
    """One line for the log: which mixed-precision path this run computes through."""
    path = cfg.mixed_precision_path(precision, params, master)
    dtype = compute_precision(precision)
    if path == "none":
        return "none (fp32 throughout)"
    if path == "pure":
        return (f"none: parameters, gradients and AdamW moments in {dtype} "
                f"(train.master_weights={dtype}), no casts")
    if path == "autocast":
        return (f"autocast to {dtype} around each forward, fp32 parameters and residual "
                f"stream (parallel.mixed_precision={cfg.mixed_precision})")
    how = ("FSDP's policy" if cfg.strategy == "fsdp" else
           "FSDP over a 1-rank shard group, kept gathered from forward through backward")
    if master == "bf16":
        return (f"none: bf16 parameters, gradients and AdamW moments (train.master_weights="
                f"bf16), FSDP's policy reduces and accumulates gradients in "
                f"{cfg.reduce_precision}")
    return (f"FSDP2 casts the parameters to {dtype} ({how}), fp32 master weights, gradients "
            f"reduced and accumulated in {cfg.reduce_precision} "
            f"(parallel.mixed_precision={cfg.mixed_precision})")


def _checkpointed(index: int, cfg: ParallelConfig) -> bool:
    if cfg.activation_checkpointing == "full":
        return True
    if cfg.activation_checkpointing == "every_k":
        return index % cfg.ac_every == 0
    return False
