"""Pick data/FSDP/tensor/pipeline degrees for a model on a cluster shape, the textbook way.

1. The model trains on one GPU (DDP's memory) → data parallel (DDP) on every GPU: no
   communication but one gradient all-reduce per step.
2. It fits once sharded over one node → FSDP (ZeRO-3) over all GPUs: parameters, gradients and
   optimizer state split n ways, gathered block by block.
3. It fits no node → tensor parallel inside the node (it all-reduces activations in every layer,
   so it must stay on NVLink; degree ≤ GPUs per node and dividing the heads) and pipeline
   parallel across nodes (only activations at stage borders cross InfiniBand), FSDP over what is
   left.

Within a choice the largest micro-batch that fits (8, 4, 2, 1) is taken, activation checkpointing
only when nothing fits without it. Memory comes from `hpctrain.plan.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError
from hpctrain.models import ModelArgs
from hpctrain.plan.memory import MemoryOptions, MemoryPlan, estimate_memory, fmt_gb

MICRO_BATCHES = (8, 4, 2, 1)


@dataclass
class ParallelPlan:
    """Degrees, micro-batch, AC, the memory estimate and a 2-3 line explanation."""

    strategy: str
    dp: int
    tp: int
    pp: int
    micro_batch: int
    ac: str
    memory: MemoryPlan
    explanation: list[str]


def _try(args: ModelArgs, gpu_bytes: float, **kw) -> tuple[MemoryOptions, MemoryPlan] | None:
    for ac in ("none", "full"):
        for mb in MICRO_BATCHES:
            opts = MemoryOptions(ac=ac, micro_batch=mb, **kw)
            try:
                plan = estimate_memory(args, opts, gpu_bytes, suggest=False)
            except ConfigError:
                return None
            if plan.fits:
                return opts, plan
    return None


def plan_parallel(args: ModelArgs, *, gpus_per_node: int, nodes: int, gpu_bytes: float,
                  seq_len: int = 2048, precision: str = "bf16") -> ParallelPlan:
    """Recommend a layout for training `args` on `nodes` x `gpus_per_node` GPUs."""
    if gpus_per_node < 1 or nodes < 1:
        raise ConfigError(f"{nodes} nodes x {gpus_per_node} GPUs", expected="positive counts")
    total = gpus_per_node * nodes
    common = {"seq_len": seq_len, "precision": precision}

    found = _try(args, gpu_bytes, strategy="ddp" if total > 1 else "none", gpus=total,
                 **common)
    if found:
        opts, mem = found
        return ParallelPlan(opts.strategy, total, 1, 1, opts.micro_batch, opts.ac, mem, [
            f"The model trains on one GPU ({fmt_gb(mem.peak)} at micro-batch "
            f"{opts.micro_batch}), so plain data parallel over all {total} GPUs is simplest.",
            "Each step costs one gradient all-reduce, overlapped with backward.",
        ])

    found = _try(args, gpu_bytes, strategy="fsdp", gpus=gpus_per_node, **common)
    if found:
        opts, _ = found
        _, mem = _try(args, gpu_bytes, strategy="fsdp", gpus=total, **common) or found
        return ParallelPlan("fsdp", total, 1, 1, opts.micro_batch, opts.ac, mem, [
            f"It does not fit one GPU but fits once sharded over a node's {gpus_per_node} GPUs "
            f"(FSDP/ZeRO-3: {fmt_gb(mem.peak)} per GPU over {total}).",
            "FSDP gathers one block at a time and overlaps the all-gathers with compute; "
            "no model changes needed.",
        ])

    tp_choices = [t for t in range(gpus_per_node, 0, -1) if gpus_per_node % t == 0
                  and args.n_heads % t == 0 and args.n_kv_heads % t == 0]
    tp = tp_choices[0]
    # Across nodes the layers are split into stages rather than sharding every layer's
    # parameters over InfiniBand: at least 2 stages when there is more than one node.
    first = 2 if nodes > 1 else 1
    for pp in [p for p in range(first, args.n_layers + 1) if args.n_layers % p == 0]:
        if tp * pp > total:
            break
        dp = total // (tp * pp)
        found = _try(args, gpu_bytes, strategy="fsdp" if dp > 1 else "none", gpus=dp, tp=tp,
                     pp=pp, **common)
        if found:
            opts, mem = found
            return ParallelPlan(opts.strategy, dp, tp, pp, opts.micro_batch, opts.ac, mem, [
                f"It fits no single node even sharded, so tensor parallel {tp} runs inside each "
                f"node (it all-reduces activations every layer: NVLink only).",
                f"Pipeline parallel {pp} splits the {args.n_layers} layers across nodes (only "
                f"stage-border activations cross the network); FSDP over the remaining {dp}.",
                f"Estimated {fmt_gb(mem.peak)} per GPU at micro-batch {opts.micro_batch}, "
                f"activation checkpointing {opts.ac}.",
            ])
    raise ConfigError(
        f"no layout fits: {nodes} nodes x {gpus_per_node} GPUs of {fmt_gb(gpu_bytes)}",
        expected="enough GPU memory for the model's states and activations",
        hint="use more nodes, GPUs with more memory, or a shorter sequence",
    )
