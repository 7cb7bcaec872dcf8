"""The global gradient norm over every axis of the mesh, and clipping by it.

Sharded gradients (FSDP, tensor parallelism) are DTensors: their norm is reduced over the axes
they are sharded on. Pipeline stages hold disjoint parameters, so their squared norms add up
across the ``pp`` axis. The result is one value, the same on every rank: what one process holding
the whole model would compute, which the bad-step guard and clipping need.

Clipping either scales the gradients in place (``clip_grads_``) or hands the fused AdamW kernel
a divisor it applies as it reads each gradient (``clip_divisor``), which saves a pass over them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None
                     ) -> torch.Tensor:
    """L2 norm of all gradients of the whole model (every stage and shard)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        # Each tensor's norm in fp32 whatever the gradients' dtype: bf16 gradients
        # (train.master_weights=bf16) would otherwise give a norm of 3 significant digits.
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        norm = torch.linalg.vector_norm(torch.stack(norms))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
    else:  # a stage whose parameters got no gradient still joins the pipeline's sum
        norm = torch.zeros((), device=params[0].device if params else None)
    if pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm


def clip_grads_(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm ``norm`` is at most ``max_norm``."""
    grads = [p for p in params if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by so that their global norm ``norm`` is at most
    ``max_norm`` (1 where it is already): clipping as a fused optimizer's ``grad_scale``."""
    return ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
