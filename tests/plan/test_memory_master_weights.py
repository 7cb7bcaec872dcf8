"""`plan memory` sizes ``train.master_weights=bf16`` (pure bf16 training) as the trainer runs it.

The parameters, their gradients and AdamW's two moments are bf16 (2 + 2 + 4 B per parameter,
the fp32 ``step`` per tensor unchanged). Without FSDP the path is 'pure': no autocast copies, a
bf16 residual stream, bf16 ``.grad`` accumulators in a pipeline. With strategy fsdp the path stays
FSDP's, at the bf16 state sizes. fp32 master weights are sized as before.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelArgs, Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.pipeline import split_model
from hpctrain.parallel.stages import balance_stages, module_costs
from hpctrain.plan.memory import (
    activation_bytes,
    estimate_memory,
    n_param_tensors,
    rank_shares,
    state_bytes,
)
from hpctrain.plan.memory_options import MemoryOptions

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64,
                 max_seq_len=16)
SMALL = dataclasses.replace(TINY, n_layers=6, ffn_dim=64)
BF16 = dict(master_weights="bf16")


def _bf16_model(args: ModelArgs) -> Transformer:
    """The model as the trainer makes it for bf16 master weights: bf16 parameters, fp32
    buffers (the RoPE table)."""
    torch.manual_seed(0)
    model = Transformer(args)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("args", [TINY, dataclasses.replace(TINY, tie_embeddings=True)])
@pytest.mark.parametrize("impl", [dict(foreach=False), dict(foreach=True)])
def test_bf16_states_exact_against_real_module_and_adamw(args: ModelArgs, impl: dict) -> None:
    model = _bf16_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **impl)
    model(torch.randint(0, args.vocab_size, (2, 8))).float().mean().backward()
    opt.step()
    params = list(model.parameters())
    assert {p.dtype for p in params} == {p.grad.dtype for p in params} == {torch.bfloat16}
    real_params = sum(p.numel() * p.element_size() for p in params)
    real_grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    real_opt = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    moments = {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}
    assert moments == {torch.bfloat16}
    assert state_bytes(args, MemoryOptions(strategy="none", **BF16)) == (
        real_params, real_grads, real_opt)
    n = sum(p.numel() for p in params)
    assert real_opt == 4 * n + 4 * n_param_tensors(args)  # two bf16 moments, fp32 steps


def test_bf16_states_are_half_and_fsdp_shards_them() -> None:
    fp32 = state_bytes(TINY, MemoryOptions(strategy="none"))
    one = state_bytes(TINY, MemoryOptions(strategy="none", **BF16))
    four = state_bytes(TINY, MemoryOptions(strategy="fsdp", gpus=4, **BF16))
    steps = 4 * n_param_tensors(TINY)
    assert one[:2] == (fp32[0] / 2, fp32[1] / 2)
    assert one[2] - steps == (fp32[2] - steps) / 2
    assert four == (one[0] / 4, one[1] / 4, (one[2] - steps) / 4 + steps)


@pytest.mark.parametrize(("pp", "schedule"), [(2, "1f1b"), (3, "1f1b"), (2, "zbv")])
def test_pipeline_bf16_states_exact_against_the_split_model(pp: int, schedule: str) -> None:
    opts = MemoryOptions(strategy="none", pp=pp, pp_schedule=schedule, seq_len=8,
                         micro_batch=2, pp_microbatches=2 * pp, **BF16)
    with torch.device("meta"):
        model = Transformer(SMALL)
    layout = ParallelLayout(pp=pp, schedule=schedule, microbatches=opts.microbatches,
                            stages_per_rank=opts.stages_per_rank)
    bounds = balance_stages(SMALL.n_layers, layout.num_stages,
                            module_costs(SMALL, opts.seq_len, opts.micro_batch * opts.seq_len))
    for rank, share in enumerate(rank_shares(SMALL, opts)):
        real = [p for _, part in split_model(model, layout, rank, bounds)
                for p in part.parameters()]
        n = sum(p.numel() for p in real)
        assert state_bytes(SMALL, opts, share) == (2 * n, 2 * n, 4 * n + 4 * len(real))


@pytest.mark.parametrize(("opts", "path"), [
    (dict(strategy="none"), "pure"),
    (dict(strategy="none", tp=2), "pure"),
    (dict(strategy="none", pp=2), "pure"),
    (dict(strategy="none", tp=2, pp=2), "pure"),
    (dict(strategy="ddp", gpus=4), "pure"),
    (dict(strategy="fsdp", gpus=4), "fsdp"),
    (dict(strategy="fsdp", gpus=2, tp=2, pp=2), "fsdp"),
    (dict(strategy="none", precision="fp32", master_weights="fp32"), "none"),
])
def test_path_for_each_strategy(opts: dict, path: str) -> None:
    """8b: with fp32 masters auto would take FSDP's casts for TP/PP; bf16 parameters need none."""
    assert MemoryOptions(**{**BF16, **opts}).mixed_precision_path(PRESETS["8b"]) == path


@pytest.mark.parametrize("opts", [
    dict(strategy="none", micro_batch=4),
    dict(strategy="none", tp=2, micro_batch=4),
    dict(strategy="ddp", gpus=4, micro_batch=4),
])
def test_pure_has_no_working_copies_and_a_bf16_residual_stream(opts: dict) -> None:
    args = PRESETS["1b"]
    pure = MemoryOptions(**opts, **BF16)
    plan = estimate_memory(args, pure)
    assert plan.working == 0.0
    # The same activations as FSDP's casts (bf16 residual stream), less than autocast's.
    autocast = dataclasses.replace(pure, master_weights="fp32", mixed_precision="autocast")
    if pure.strategy == "none":
        casts = dataclasses.replace(pure, master_weights="fp32", mixed_precision="fsdp")
        assert activation_bytes(args, pure) == activation_bytes(args, casts)
    tokens = pure.micro_batch * pure.seq_len
    saved = activation_bytes(args, autocast) - activation_bytes(args, pure)
    assert saved == pytest.approx(tokens * args.n_layers * 2 * 2 * args.dim / pure.tp)
    params, grads, optimizer = state_bytes(args, pure)
    p = params / 2
    if pure.strategy == "ddp":  # buckets + a second copy, both bf16
        assert plan.grads == 4 * p
        assert plan.peak == params + optimizer + plan.grads + plan.activations
    else:
        assert plan.grads == grads == 2 * p
        assert plan.peak == max(params + optimizer + plan.activations,
                                params + optimizer + grads)


def test_pure_pipeline_holds_bf16_grad_accumulators_and_no_copies() -> None:
    args = PRESETS["8b"]
    opts = MemoryOptions(strategy="none", pp=2, pp_microbatches=8, micro_batch=1, **BF16)
    plan = estimate_memory(args, opts)
    share = rank_shares(args, opts)[plan.stage]
    params, _, optimizer = state_bytes(args, opts, share)
    assert plan.working == 0.0
    assert plan.grads == params  # 2 B per parameter, as the parameters
    assert plan.peak == params + optimizer + plan.grads + plan.activations
    # Smaller than the same layout on fp32 masters (auto: FSDP's casts for 8b).
    assert plan.peak < estimate_memory(args, dataclasses.replace(opts, master_weights="fp32")).peak


@pytest.mark.parametrize("reduce_precision", ["fp32", "bf16"])
@pytest.mark.parametrize("opts", [
    dict(strategy="fsdp", gpus=4, micro_batch=4),
    dict(strategy="fsdp", gpus=4, micro_batch=4, zero=2, grad_accum=4),
    dict(strategy="fsdp", gpus=2, pp=2, pp_microbatches=8, micro_batch=1),
])
def test_fsdp_with_bf16_masters_keeps_fsdps_buffers_at_bf16_state_sizes(
        opts: dict, reduce_precision: str) -> None:
    """Gathered bf16 parameters and accumulators in the reduce dtype, as with fp32 masters;
    only the sharded states shrink."""
    args = PRESETS["1b"]
    fp32 = MemoryOptions(**opts, reduce_precision=reduce_precision)
    bf16 = dataclasses.replace(fp32, **BF16)
    a, b = estimate_memory(args, fp32), estimate_memory(args, bf16)
    assert bf16.mixed_precision_path(args) == "fsdp"
    assert bf16.accumulator_bytes(args) == fp32.accumulator_bytes(args)
    assert (b.working, b.activations) == (a.working, a.activations)
    assert b.params == a.params / 2
    share = rank_shares(args, fp32)[a.stage or 0]
    assert b.optimizer == state_bytes(args, bf16, share)[2] < a.optimizer
    if fp32.pp > 1:  # the unsharded accumulators, in the reduce dtype
        assert b.grads == a.grads
    else:
        assert b.grads == a.grads / 2


def test_fp32_masters_are_sized_as_before() -> None:
    for opts in (dict(strategy="none", micro_batch=4), dict(strategy="ddp", gpus=4),
                 dict(strategy="fsdp", gpus=4), dict(strategy="none", pp=2, pp_microbatches=4)):
        default = estimate_memory(PRESETS["1b"], MemoryOptions(**opts))
        assert default == estimate_memory(PRESETS["1b"],
                                          MemoryOptions(**opts, master_weights="fp32"))


@pytest.mark.parametrize(("opts", "message"), [
    (dict(precision="fp16", **BF16), "train.master_weights = bf16 with train.precision = fp16"),
    (dict(precision="fp8", **BF16), "train.master_weights = bf16 with train.precision = fp8"),
    (dict(precision="fp32", **BF16), "train.master_weights = bf16 with train.precision = fp32"),
    (dict(master_weights="fp16"), "master weights 'fp16' is not known"),
    (dict(strategy="none", mixed_precision="autocast", **BF16), "train.master_weights"),
    (dict(strategy="none", reduce_precision="bf16", **BF16), "reduce_precision = bf16"),
])
def test_refused_combinations(opts: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        estimate_memory(PRESETS["1b"], MemoryOptions(**opts))
    assert info.value.expected  # and a hint, but for unknown names
    assert info.value.hint or "is not known" in message


def test_cli_plan_memory_master_weights(capsys: pytest.CaptureFixture) -> None:
    base = ["plan", "memory", "model.size=1b", "parallel.strategy=none", "train.micro_batch=4",
            "data.seq_len=2048", "parallel.compile=true"]
    main([*base, "train.master_weights=bf16"])
    out = capsys.readouterr().out
    assert "bf16 (pure bf16: bf16 parameters, gradients and AdamW moments)" in out
    assert "parameters (bf16)" in out and "gradients (bf16)" in out
    assert "AdamW state (bf16)" in out
    main([*base, "train.master_weights=bf16", "--json"])
    got = json.loads(capsys.readouterr().out)
    plan = estimate_memory(PRESETS["1b"], MemoryOptions(strategy="none", micro_batch=4, **BF16))
    assert got["mixed_precision"] == "pure" and got["master_weights"] == "bf16"
    assert got["peak"] == plan.peak and got["working"] == 0.0
    main([*base, "parallel.strategy=fsdp", "--gpus", "4", "train.master_weights=bf16"])
    assert "FSDP reduces in fp32" in capsys.readouterr().out
    main(base)  # the default: fp32 masters through autocast
    out = capsys.readouterr().out
    assert "bf16 (autocast)" in out and "parameters (fp32)" in out
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "train.precision=fp16", "train.master_weights=bf16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "train.master_weights = bf16 with train.precision = fp16" in err
    assert "Traceback" not in err
