"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine LR schedule."""

from __future__ import annotations

import math

import torch

from hpctrain.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float):
    """AdamW over the model's parameters, fused (one kernel for all tensors) on CPU and CUDA.

    Fused also matters for correctness: only the fused kernel takes a device-side
    ``found_inf`` flag, which the bad-step guard uses to skip an update without a host sync.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # Norm gains are vectors; decaying them pulls the activations' scale toward zero.
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )


def lr_factor(step: int, *, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier on the peak LR for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    # The last trained step is total_steps - 1: it is the one that reaches the floor.
    decay_steps = max(1, total_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    """A LambdaLR whose state_dict is a step counter, so it checkpoints and resumes exactly."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps=total_steps, cfg=cfg)
    )
