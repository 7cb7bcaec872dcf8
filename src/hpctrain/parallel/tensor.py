"""Tensor parallelism with sequence parallelism (Megatron-style), on PyTorch's DTensor.

The model family says how its modules split (``ModelFamily.tensor_plan``: Llama's in
``models/llama/tp_plan.py``): for a language model the residual stream between blocks is
``[B, T / tp, dim]`` per rank, each block gathers the sequence before its column-split matmuls
and reduce-scatters the partial sums of its row-split ones, and the output layer's logits stay
split along the vocabulary: ``vocab_parallel_cross_entropy`` computes the loss from the shards
(Megatron's vocabulary-parallel cross entropy: one all-reduce of a max and one of two sums per
token), so the ``[tokens, vocab]`` logits are never gathered.

With ``parallel.async_tp`` (``enable_async_tp``) inductor rewrites, inside each compiled block,
every all-gather that feeds a matmul and every matmul that feeds a reduce-scatter into one fused
op over symmetric memory, which overlaps the transfer of one chunk with the matmul of the next.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch
import torch._inductor.config
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hpctrain.data.loader import IGNORE_INDEX
from hpctrain.errors import ConfigError
from hpctrain.models.registry import family_of


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` (a whole model or a pipeline stage of one) over ``tp_mesh`` by its
    family's tensor-parallel plan."""
    family = family_of(model)
    if family.tensor_plan is None:
        raise ConfigError(f"parallel.tp = {tp_mesh.size()} with model family {family.name!r}",
                          expected="a family with a tensor-parallel plan",
                          hint="set parallel.tp=1 (FSDP and pipelines need no plan)")
    root = {name: style for name, style in family.tensor_plan().root.items()
            if getattr(model, name.split(".", 1)[0]) is not None}  # a stage may lack it
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in family.block_list(model):
        if block is None:  # a block of another pipeline stage
            continue
        # A fresh plan per block: a ParallelStyle is applied to one module.
        parallelize_module(block, tp_mesh, dict(family.tensor_plan().block))


def enable_async_tp(tp_mesh: DeviceMesh, device: torch.device) -> None:
    """Let inductor micro-pipeline the TP collectives of the blocks it compiles from now on."""
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.async_tp = true on {device.type}",
            expected="async_tp on CUDA GPUs: its fused collectives move data through symmetric "
            "memory (peer-to-peer NVLink)",
            hint="drop parallel.async_tp for this run",
        )
    group = tp_mesh.get_group()
    members: list = [None] * tp_mesh.size()
    dist.all_gather_object(members, (socket.gethostname(), device.index), group=group)
    obstacle = async_tp_obstacle(members, torch.cuda.can_device_access_peer)
    if obstacle:
        raise ConfigError(
            f"parallel.async_tp = true but {obstacle}",
            expected="the ranks of each tensor-parallel group on one node, their GPUs connected "
            "peer to peer (NVLink): symmetric memory maps each other's buffers",
            hint="drop parallel.async_tp, or keep parallel.tp within the GPUs of one node")
    # Imported here: the module needs a CUDA build's symmetric-memory bindings.
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # The compiler pass leaves a collective alone unless its group has symmetric memory.
    enable_symm_mem_for_group(group.group_name)
    torch._inductor.config._micro_pipeline_tp = True


def async_tp_obstacle(members: list[tuple[str, int]],
                      can_access_peer: Callable[[int, int], bool]) -> str | None:
    """Why a TP group of ``members`` (host, CUDA device index) cannot share symmetric memory,
    or None. ``can_access_peer(i, j)``: whether this host's GPU i maps GPU j's memory."""
    hosts = sorted({host for host, _ in members})
    if len(hosts) > 1:
        return f"its tensor-parallel group spans {len(hosts)} hosts ({', '.join(hosts)})"
    indices = [index for _, index in members]
    if len(set(indices)) < len(indices):
        # Each rank sees only its own GPU (one CUDA_VISIBLE_DEVICES per task): the indices say
        # nothing about which GPUs these are, so there is nothing to ask the driver here.
        return None
    for i in indices:
        for j in indices:
            if i != j and not can_access_peer(i, j):
                return f"GPU {i} cannot access GPU {j} peer to peer on {hosts[0]}"
    return None


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients DTensor leaves as per-rank partial sums, in place of each parameter's.

    A replicated weight used on a slice of the sequence (the norms under sequence parallelism)
    gets on each tensor-parallel rank the gradient of its slice only. What the optimizer does
    with such a ``Partial`` gradient depends on the PyTorch version (2.11's fused AdamW applied
    the local part: the norm weights drifted apart from one process's), so it is summed here,
    once per step, before clipping and the update.
    """
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, p.placements)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of logits split along the vocabulary over ``group``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                vocab_start: int) -> torch.Tensor:
        # logits [N, V / tp] (fp32) hold vocabulary ids [vocab_start, vocab_start + V / tp).
        local_vocab = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max[:, None]
        local_ids = targets - vocab_start
        mine = (local_ids >= 0) & (local_ids < local_vocab)
        index = torch.where(mine, local_ids, torch.zeros_like(local_ids))[:, None]
        target_logit = shifted.gather(1, index).squeeze(1) * mine
        exp = shifted.exp_()
        # One all-reduce for both per-row sums: the target's logit (held by one rank) and the
        # softmax denominator.
        sums = torch.stack((target_logit, exp.sum(dim=-1)))
        dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums
        valid = targets != IGNORE_INDEX
        loss = ((sum_exp.log() - target_logit) * valid).sum()
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, index, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d loss / d logits = softmax - one_hot(target) on valid rows; no communication.
        softmax, index, hit, valid = ctx.saved_tensors
        grad_logits = softmax * valid[:, None].to(softmax.dtype)
        grad_logits.scatter_add_(1, index, -hit[:, None].to(softmax.dtype))
        return grad_logits * grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: dist.ProcessGroup, vocab_start: int) -> torch.Tensor:
    """Summed next-token cross entropy (fp32) of vocabulary-sharded ``logits [B, T, V / tp]``.

    ``targets [B, T]`` hold global vocabulary ids; ``IGNORE_INDEX`` targets add 0. Every rank of
    ``group`` gets the same, whole loss.
    """
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1).float(), targets.flatten(),
                                            group, vocab_start)


def tp_loss_fn(tp_mesh: DeviceMesh, vocab_size: int
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss function for this rank's vocabulary shard: ``loss(logits, targets)``."""
    group = tp_mesh.get_group()
    vocab_start = tp_mesh.get_local_rank() * (vocab_size // tp_mesh.size())

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, group, vocab_start)

    return loss
