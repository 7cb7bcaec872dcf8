"""Selective (per-op) activation checkpointing: same gradients, fewer recomputed matmuls.

In-process on CPU (fp32, a tiny model): gradients equal no checkpointing and full checkpointing,
eager and compiled (aot_eager: the partitioner applies the policy in the graph); counting the
matmuls backward runs shows what the policy saves. The planner and HFU know the mode.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.bench.model import hfu_factor
from hpctrain.models import ModelArgs, Transformer, flops_per_token
from hpctrain.parallel.selective_ac import recomputed_flops_per_token, selective_checkpoint
from hpctrain.plan.memory import activation_bytes, estimate_memory
from hpctrain.plan.memory_options import MemoryOptions

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61,
                  max_seq_len=64)


class _CountMatmuls(TorchDispatchMode):
    """Counts the mm/addmm calls that reach the kernels (a saved output is not recomputed)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _wrapped(model: Transformer, mode: str) -> Transformer:
    model = copy.deepcopy(model)
    for i, block in enumerate(model.layers):
        if mode == "full":
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode != "none":
            model.layers[i] = selective_checkpoint(block, mode)
    return model


def _grads(model: Transformer, tokens: torch.Tensor) -> tuple[dict, int]:
    """Parameter gradients and the matmuls run in backward."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    with _CountMatmuls() as counter:
        loss.backward()
    names = {n.replace("._checkpoint_wrapped_module", ""): p.grad
             for n, p in model.named_parameters()}
    return names, counter.count


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_selective_grads_equal_none_and_full(qkv_bias: bool) -> None:
    torch.manual_seed(0)
    base = Transformer(dataclasses.replace(SMALL, qkv_bias=qkv_bias))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    ref, mm_none = _grads(_wrapped(base, "none"), tokens)
    full, mm_full = _grads(_wrapped(base, "full"), tokens)
    # Per block full AC re-runs 6 of the 7 forward matmuls: w2's output is needed by nothing
    # in backward, and the recomputation stops once it has what backward needs.
    assert mm_full - mm_none == 6 * SMALL.n_layers
    # every_other keeps wq, wv, w1 (and w2): wk, wo and w3 are recomputed.
    for save_mm, recomputed in (("every_other", 3), ("all", 0)):
        grads, mm = _grads(_wrapped(base, save_mm), tokens)
        assert mm - mm_none == recomputed * SMALL.n_layers, save_mm
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(full[name], g, rtol=0, atol=0, msg=name)


def test_selective_compiled_grads_equal_eager() -> None:
    """The policy inside a compiled block (AC -> compile, as parallelize orders them)."""
    torch.manual_seed(0)
    base = Transformer(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    ref, _ = _grads(_wrapped(base, "none"), tokens)
    model = _wrapped(base, "every_other")
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    grads, _ = _grads(model, tokens)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_memory_plan_puts_selective_between_none_and_full() -> None:
    from hpctrain.models import PRESETS

    args = PRESETS["1b"]
    for tp in (1, 2):
        acts = {ac: activation_bytes(args, MemoryOptions(ac=ac, tp=tp, micro_batch=4))
                for ac in ("none", "full", "selective")}
        keep_all = activation_bytes(args, MemoryOptions(ac="selective", ac_save_mm="all",
                                                        tp=tp, micro_batch=4))
        assert acts["full"] < acts["selective"] < keep_all < acts["none"], tp
    assert estimate_memory(args, MemoryOptions(ac="selective")).peak > 0


def test_hfu_counts_the_recomputed_matmuls() -> None:
    from hpctrain.models import PRESETS

    args, seq = PRESETS["1b"], 2048
    share = args.n_layers * recomputed_flops_per_token(args, "every_other") / flops_per_token(
        args, seq)
    assert hfu_factor("selective", args.n_layers, args=args, seq_len=seq) == pytest.approx(
        1 + share)
    assert 1 < hfu_factor("selective", args.n_layers, args=args, seq_len=seq) < 4 / 3
    assert hfu_factor("selective", args.n_layers, args=args, seq_len=seq,
                      ac_save_mm="all") == 1.0
