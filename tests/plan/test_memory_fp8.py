"""`plan memory` with fp8: what float8 training shrinks, and only where it does.

The measured peaks it is checked against are in tests/plan/test_parallel_memory.py
(MEASURED_H200, the rows ending in fp8); these check the terms one by one.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS
from hpctrain.plan.memory import estimate_memory, rank_shares
from hpctrain.plan.memory_options import MemoryOptions

ARGS = PRESETS["1b"]
TOKENS = 4 * 2048
# Bytes per token and block kept in float8 instead of bf16: the two norm outputs, the attention
# output and the SwiGLU product (the inputs of the blocks' Linears).
SAVED_INPUTS = 3 * ARGS.dim + ARGS.ffn_dim
# The blocks' Linear weights (q, k, v, o; w1, w2, w3): all of their parameters but the norms'.
KV = ARGS.n_kv_heads * ARGS.head_dim
LINEAR = ARGS.n_layers * (ARGS.dim * (2 * ARGS.dim + 2 * KV) + 3 * ARGS.dim * ARGS.ffn_dim)


def _plan(**kw):
    opts = MemoryOptions(**{"seq_len": 2048, "micro_batch": 4, **kw})
    return estimate_memory(ARGS, opts)


def test_compiled_tensorwise_keeps_the_linear_inputs_in_one_byte() -> None:
    bf16 = _plan(strategy="fsdp", gpus=2, zero=2)
    fp8 = _plan(strategy="fsdp", gpus=2, zero=2, precision="fp8")
    saved = bf16.activations - fp8.activations
    assert saved == pytest.approx(TOKENS * ARGS.n_layers * SAVED_INPUTS)
    # States, gradients and the optimizer are bf16's.
    assert (fp8.params, fp8.grads, fp8.optimizer) == (bf16.params, bf16.grads, bf16.optimizer)


@pytest.mark.parametrize("change", [dict(compile=False), dict(fp8_recipe="rowwise")])
def test_eager_or_rowwise_keeps_bf16_inputs(change: dict) -> None:
    """Eager, torchao keeps the bf16 input; rowwise needs it for the other axis's scales."""
    bf16 = _plan(strategy="fsdp", gpus=2, **change)
    fp8 = _plan(strategy="fsdp", gpus=2, precision="fp8", **change)
    assert fp8.activations == bf16.activations


def test_fsdp_gathers_the_linear_weights_in_float8_with_tensorwise_only() -> None:
    """ZeRO-2 keeps the whole model gathered: one byte less per Linear weight; rowwise and
    an unsharded FSDP (one GPU) gather bf16."""
    bf16 = _plan(strategy="fsdp", gpus=2, zero=2)
    fp8 = _plan(strategy="fsdp", gpus=2, zero=2, precision="fp8")
    assert bf16.working - fp8.working == pytest.approx(LINEAR)
    rowwise = _plan(strategy="fsdp", gpus=2, zero=2, precision="fp8", fp8_recipe="rowwise")
    assert rowwise.working == bf16.working
    one = _plan(strategy="fsdp", gpus=1, zero=2, precision="fp8")
    assert one.working == _plan(strategy="fsdp", gpus=1, zero=2).working


def test_zero3_gathers_two_blocks_in_float8() -> None:
    bf16 = _plan(strategy="fsdp", gpus=2)
    fp8 = _plan(strategy="fsdp", gpus=2, precision="fp8")
    assert bf16.working - fp8.working == pytest.approx(2 * LINEAR / ARGS.n_layers)


def test_autocast_makes_no_bf16_copies_of_the_linear_weights() -> None:
    """On one GPU the float8 Linears cast their fp32 weights themselves; the output layer's
    bf16 copy stays."""
    bf16 = _plan(strategy="none")
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _plan(strategy="none", precision="fp8", fp8_recipe=recipe)
        assert bf16.working - fp8.working == pytest.approx(2 * LINEAR)


def test_an_unknown_recipe_is_refused() -> None:
    with pytest.raises(ConfigError, match="fp8 recipe 'blockwise' is not known"):
        _plan(precision="fp8", fp8_recipe="blockwise")


def test_fp8_under_a_pipeline_gathers_its_stage_in_float8() -> None:
    pp = MemoryOptions(strategy="fsdp", gpus=2, pp=2, micro_batch=1, pp_microbatches=8,
                       grad_accum=8, seq_len=2048)
    fp8 = dataclasses.replace(pp, precision="fp8")
    assert fp8.float8_gather and not pp.float8_gather
    bf16_plan, fp8_plan = estimate_memory(ARGS, pp), estimate_memory(ARGS, fp8)
    assert bf16_plan.stage == fp8_plan.stage
    blocks = rank_shares(ARGS, fp8)[fp8_plan.stage].blocks
    assert bf16_plan.working - fp8_plan.working == pytest.approx(LINEAR / ARGS.n_layers * blocks)


def test_cli_sizes_fp8_and_refuses_an_unknown_recipe(capsys) -> None:
    base = ["plan", "memory", "model.size=1b", "parallel.strategy=fsdp", "--gpus", "2",
            "parallel.reshard_after_forward=false", "train.micro_batch=4", "data.seq_len=2048",
            "parallel.compile=true", "--json"]
    main([*base, "train.precision=fp8"])
    tensorwise = json.loads(capsys.readouterr().out)
    main([*base, "train.precision=fp8", "train.fp8_recipe=rowwise"])
    rowwise = json.loads(capsys.readouterr().out)
    assert tensorwise["peak"] < rowwise["peak"]
    assert tensorwise["peak"] / 1e9 == pytest.approx(17.10, rel=0.10)  # measured, 2 H200s
    with pytest.raises(SystemExit) as exc:
        main([*base, "train.precision=fp8", "train.fp8_recipe=blockwise"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "train.fp8_recipe = 'blockwise' is not a valid choice" in err
    assert "Traceback" not in err
