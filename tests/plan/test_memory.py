"""Memory estimator: exact state sizes against real modules + AdamW, calibration against H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelArgs, Transformer, count_params
from hpctrain.plan.memory import estimate_memory, n_param_tensors, state_bytes
from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes, resolve_model

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64,
                 max_seq_len=16)


@pytest.mark.parametrize("args", [TINY, dataclasses.replace(TINY, tie_embeddings=True)])
def test_states_exact_against_real_module_and_adamw(args: ModelArgs) -> None:
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, args.vocab_size, (2, 8))).float().mean().backward()
    opt.step()
    real_params = sum(p.numel() * p.element_size() for p in model.parameters())
    real_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    real_opt = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    params, grads, optimizer = state_bytes(args, MemoryOptions(strategy="none"))
    assert (params, grads, optimizer) == (real_params, real_grads, real_opt)
    assert n_param_tensors(args) == len(list(model.parameters()))


def test_fsdp_shards_states_n_ways() -> None:
    one = state_bytes(TINY, MemoryOptions(strategy="none"))
    four = state_bytes(TINY, MemoryOptions(strategy="fsdp", gpus=4))
    assert four[0] == one[0] / 4 and four[1] == one[1] / 4


# Every measured peak (torch.cuda.max_memory_allocated) in benchmarks/RESULTS.md, H200.
MEASURED = [
    ("1b", dict(strategy="none", micro_batch=4), 28.0),
    ("1b", dict(strategy="none", micro_batch=4, compile=False), 35.0),
    ("1b", dict(strategy="none", micro_batch=8), 40.6),
    ("1b", dict(strategy="fsdp", gpus=4, micro_batch=4), 15.3),
    ("1b", dict(strategy="fsdp", gpus=4, micro_batch=4, zero=2), 17.5),
    ("1b", dict(strategy="fsdp", gpus=4, micro_batch=4, ac="full"), 5.9),
    ("1b", dict(strategy="ddp", gpus=4, micro_batch=4), 35.9),
    ("8b", dict(strategy="fsdp", gpus=4, micro_batch=2, ac="full"), 37.5),
]


@pytest.mark.parametrize("size, opts, measured_gb", MEASURED)
def test_within_five_percent_of_measured_peaks(size: str, opts: dict, measured_gb: float) -> None:
    """The README's promise: `plan memory` is within 5% of every measured peak."""
    plan = estimate_memory(PRESETS[size], MemoryOptions(seq_len=2048, **opts))
    assert plan.peak / 1e9 == pytest.approx(measured_gb, rel=0.05)


def test_fits_and_suggestions() -> None:
    h100 = gpu_memory_bytes("h100")
    ok = estimate_memory(PRESETS["1b"], MemoryOptions(strategy="fsdp", gpus=4, micro_batch=4),
                         h100)
    assert ok.fits and not ok.suggestions
    big = estimate_memory(PRESETS["8b"], MemoryOptions(strategy="ddp", gpus=4, micro_batch=2),
                          h100)
    assert big.fits is False
    assert any("FSDP" in s for s in big.suggestions)


def test_activation_checkpointing_shrinks_activations() -> None:
    base = MemoryOptions(strategy="fsdp", gpus=4, micro_batch=2)
    none = estimate_memory(PRESETS["8b"], base)
    full = estimate_memory(PRESETS["8b"], dataclasses.replace(base, ac="full"))
    assert full.activations < none.activations / 5


def test_fsdp_prefetch_holds_each_further_block_gathered() -> None:
    """Prefetching one block ahead is what the model assumed already (current + next); each
    block further holds one more block's bf16 parameters."""
    args = PRESETS["1b"]
    base = MemoryOptions(strategy="fsdp", gpus=4, micro_batch=4)
    block = 2 * (count_params(dataclasses.replace(args, n_layers=1, vocab_size=0),
                              include_embedding=True) - args.dim)
    plans = [estimate_memory(args, dataclasses.replace(base, fsdp_prefetch=k)) for k in range(4)]
    assert plans[0].working == plans[1].working
    assert plans[3].working - plans[1].working == pytest.approx(2 * block)
    # No more than the model's other blocks can be ahead of the one computing.
    many = estimate_memory(args, dataclasses.replace(base, fsdp_prefetch=1000))
    assert many.working - plans[1].working == pytest.approx((args.n_layers - 2) * block)
    # ZeRO-2 keeps every block gathered already: nothing more.
    zero2 = dataclasses.replace(base, zero=2)
    assert (estimate_memory(args, dataclasses.replace(zero2, fsdp_prefetch=2)).working
            == estimate_memory(args, zero2).working)


def test_fsdp_units_of_several_blocks_are_gathered_whole() -> None:
    """Under ZeRO-3 the unit computing and the one prefetched are gathered: units of k blocks
    hold 2k blocks (no more than the model has); ZeRO-2 holds all of them either way."""
    args = PRESETS["1b"]
    base = MemoryOptions(strategy="fsdp", gpus=4, micro_batch=4)
    block = 2 * (count_params(dataclasses.replace(args, n_layers=1, vocab_size=0),
                              include_embedding=True) - args.dim)
    one = estimate_memory(args, base)
    two = estimate_memory(args, dataclasses.replace(base, fsdp_group_blocks=2))
    assert two.working - one.working == pytest.approx(2 * block)
    whole = estimate_memory(args, dataclasses.replace(base, fsdp_group_blocks=100))
    assert whole.working - one.working == pytest.approx((args.n_layers - 2) * block)
    zero2 = dataclasses.replace(base, zero=2)
    assert (estimate_memory(args, dataclasses.replace(zero2, fsdp_group_blocks=2)).working
            == estimate_memory(args, zero2).working)


@pytest.mark.parametrize("call, message", [
    (lambda: resolve_model("3b"), "unknown model size"),
    (lambda: gpu_memory_bytes("v100x"), "unknown GPU"),
    (lambda: estimate_memory(TINY, MemoryOptions(strategy="zero9")), "strategy"),
    (lambda: estimate_memory(TINY, MemoryOptions(tp=3)), "tp = 3"),
    (lambda: estimate_memory(TINY, MemoryOptions(strategy="none", gpus=2)), "none"),
    (lambda: estimate_memory(TINY, MemoryOptions(strategy="ddp", fsdp_prefetch=1)),
     "fsdp_prefetch = 1 with strategy 'ddp'"),
    (lambda: estimate_memory(TINY, MemoryOptions(strategy="ddp", fsdp_group_blocks=2)),
     "fsdp_group_blocks = 2 with strategy 'ddp'"),
    (lambda: estimate_memory(TINY, MemoryOptions(fsdp_group_blocks=0)), "must be >= 1"),
])
def test_bad_inputs(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()
