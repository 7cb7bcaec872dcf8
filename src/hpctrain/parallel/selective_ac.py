"""Selective (per-op) activation checkpointing: keep the matmul and attention outputs of each
block, recompute only the cheap pointwise work in backward (``activation_checkpointing:
selective``).

Full checkpointing keeps a block's input and re-runs its whole forward in backward (+1/3 of the
block's FLOPs). Here a policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
decides op by op, as torchtitan's "op" selective AC does:

- saved: the attention kernel's outputs (SDPA: the costliest op to redo), reduce-scatters of
  tensor parallelism (a collective), and the outputs of matmuls — every one
  (``ac_save_mm: all``: nothing but pointwise ops is recomputed) or every other one in the order
  the block runs them (``every_other``, the default: in a Llama block 4 of its 7 matmuls are kept);
- recomputed: the pointwise work (norms, RoPE, activations, residual adds), the skipped matmuls.

The matmuls are counted separately in the forward and in the recomputation, so both agree on
which ones were kept. The recomputed matmul FLOPs are ``recomputed_flops_per_token`` (HFU), as
the model family counts them (``ModelFamily.recomputed_flops``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hpctrain.models.registry import family_of_args

SAVE_MM = ("every_other", "all")

_aten = torch.ops.aten
# A Linear on [B, T, D] inputs dispatches to mm (addmm with a bias, e.g. Qwen's qkv).
MATMULS = {_aten.mm.default, _aten.addmm.default}
# Every SDPA kernel PyTorch may pick (CUDA flash / efficient / cuDNN, CPU flash, math).
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_attention_math.default,
}
SAVED = _ATTENTION | {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _policy(save_mm: str):
    counts: defaultdict[bool, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            keep = save_mm == "all" or counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint(block: nn.Module, save_mm: str = "every_other") -> nn.Module:
    """``block`` wrapped so that backward recomputes all but its matmul/attention outputs."""
    if save_mm not in SAVE_MM:
        raise ValueError(f"save_mm = {save_mm!r}, expected one of {SAVE_MM}")

    def context_fn():
        # A fresh count per block call: every call numbers its own matmuls from 1.
        return create_selective_checkpoint_contexts(_policy(save_mm))

    # preserve_rng_state=False: the blocks hold no dropout, so no RNG state to replay.
    return checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)


def recomputed_flops_per_token(args: Any, save_mm: str) -> float:
    """Matmul FLOPs per token that one block of the model of shape ``args`` recomputes in
    backward (pointwise work not counted); none with ``all``."""
    return family_of_args(args).recomputed_flops(args, save_mm)
