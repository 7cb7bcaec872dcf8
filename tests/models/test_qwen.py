"""The Qwen family through the spec, without transformers (``tests/pretrained/test_qwen_hf.py``
checks it against transformers): presets built on the meta device and counted, FLOPs and stage
costs, tied embeddings refused with tensor or pipeline parallelism, the KV cache and the
chunked loss, and the planner's memory model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import DEMO
from hpctrain.errors import ConfigError
from hpctrain.models import ModelConfig, get_family
from hpctrain.models.qwen import PRESETS, QwenArgs, QwenModel
from hpctrain.models.qwen.model import kv_cache

QWEN = get_family("qwen")
SMALL = QwenArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, ffn_dim=48,
                 vocab_size=64, max_seq_len=64, qk_norm=True, tie_embeddings=True)


@pytest.mark.parametrize("size", list(PRESETS))
def test_presets_build_on_meta_with_the_counted_parameters(size: str) -> None:
    args = PRESETS[size]
    QWEN.check_args(args)
    model = QWEN.build(args)
    params = list(model.parameters())  # a tied output layer once
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == QWEN.count_params(args, include_embedding=True)
    assert len(params) == QWEN.param_tensors(args)
    assert (model.head.weight is model.embed.weight) == args.tie_embeddings
    assert len(QWEN.fsdp_modules(model)) == args.n_layers


def test_counts_and_flops_of_the_hugging_face_shapes() -> None:
    """transformers' own parameter counts (also checked against its models in
    tests/pretrained/test_qwen_hf.py) and the worked example of flops.py."""
    assert QWEN.count_params(PRESETS["qwen3-0.6b"], include_embedding=True) == 596_049_920
    assert QWEN.count_params(PRESETS["qwen2.5-0.5b"], include_embedding=True) == 494_032_768
    assert QWEN.flops_per_token(PRESETS["qwen3-0.6b"], 4096) == 6_394_871_808
    # The stage costs of the blocks add up to the FLOPs but for the final norm and head.
    for args in (PRESETS["qwen3-0.6b"], dataclasses.replace(PRESETS["tiny-qwen2"],
                                                            tie_embeddings=False)):
        _, block, _ = QWEN.stage_costs(args, 1024, 4096)
        head = args.vocab_size * args.dim  # tied or not, the output matmul runs
        assert QWEN.flops_per_token(args, 1024) - args.n_layers * block == 6 * (args.dim + head)


def test_tying_shares_the_output_weights_not_its_matmul() -> None:
    """A tied head still multiplies every token by a V x dim matrix: FLOPs equal untied's."""
    for name in ("qwen2.5-0.5b", "tiny-qwen2"):
        tied = PRESETS[name]
        untied = dataclasses.replace(tied, tie_embeddings=False)
        assert tied.tie_embeddings
        assert QWEN.flops_per_token(tied, 1024) == QWEN.flops_per_token(untied, 1024)


def test_a_config_selects_the_family_and_its_presets() -> None:
    args = ModelConfig(family="qwen", size="tiny", n_layers=2, tie_embeddings=False).resolve()
    assert args == dataclasses.replace(PRESETS["tiny"], n_layers=2, tie_embeddings=False)
    with pytest.raises(ConfigError, match="n_heads=8 is not divisible by model.n_kv_heads=3"):
        ModelConfig(family="qwen", size="tiny", n_kv_heads=3).resolve()
    with pytest.raises(ConfigError, match="head_dim = 7 is odd"):
        QWEN.check_args(dataclasses.replace(SMALL, head_dim=7))


@pytest.mark.parametrize("axis", ["parallel.tp=2", "parallel.pp=2"])
def test_tied_embeddings_with_tp_or_pp_are_refused_with_the_reason(axis: str) -> None:
    from hpctrain.config import load_config
    from hpctrain.parallel.layout import check_layout

    overrides = ["model.family=qwen", "parallel.strategy=none", axis, "train.grad_accum=2",
                 "data.seq_len=32"]
    with pytest.raises(ConfigError, match=r"tie_embeddings = true with tensor or pipeline(.|\n)*"
                       r"HINT: set model.tie_embeddings=false"):
        check_layout(load_config(DEMO, overrides), 2)
    layout = check_layout(load_config(DEMO, [*overrides, "model.tie_embeddings=false"]), 2)
    assert layout.world_size == 2


def test_the_kv_cache_and_the_chunked_loss_give_the_full_forward() -> None:
    torch.manual_seed(0)
    model = QwenModel(SMALL).eval()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = kv_cache(model, 2, 20)
        parts = [model(tokens[:, :8], cache=cache)]
        parts += [model(tokens[:, i:i + 1], cache=cache) for i in range(8, 20)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:], loss_chunks=3)
    expected = F.cross_entropy(full[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
                               reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)


def test_the_q_k_norms_and_the_biases_change_the_output() -> None:
    """The two flags are computed: a q/k norm weight and a q bias each move the logits."""
    tokens = torch.arange(10)[None]
    for args, name in ((SMALL, "blocks.0.attn.q_norm.weight"),
                       (dataclasses.replace(SMALL, qk_norm=False, qkv_bias=True),
                        "blocks.0.attn.q.bias")):
        torch.manual_seed(0)
        model = QwenModel(args).eval()
        with torch.no_grad():
            before = model(tokens)
            model.get_parameter(name).add_(0.5)
            assert (model(tokens) - before).abs().max() > 1e-4, name


def test_the_planner_sizes_a_qwen_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from hpctrain.cli import main

    main(["plan", "memory", "model.family=qwen", "model.size=qwen3-0.6b",
          "parallel.strategy=fsdp", "--gpus", "2", "data.seq_len=4096"])
    assert "GB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "memory", "model.size=qwen3-0.6b"])  # a llama size by default
    assert "HINT: model.family=qwen has it" in capsys.readouterr().err


def test_the_planner_sizes_queries_by_heads_times_head_dim() -> None:
    """Qwen3's queries and attention output are n_heads x head_dim wide (2048 on a 1024-wide
    stream in qwen3-0.6b): halving the heads shrinks each layer's saved activations by those
    two bf16 tensors' difference (and SDPA's fp32 log-sum-exp per head)."""
    from hpctrain.plan.memory import activation_bytes
    from hpctrain.plan.memory_options import MemoryOptions

    opts = MemoryOptions(strategy="none", micro_batch=1, seq_len=1024)
    wide = PRESETS["qwen3-0.6b"]
    narrow = dataclasses.replace(wide, n_heads=8)  # 8 x 128 = dim
    per_layer = 2 * 2 * (16 - 8) * 128 + 4 * (16 - 8)
    assert activation_bytes(wide, opts) - activation_bytes(narrow, opts) == (
        1024 * wide.n_layers * per_layer)


def test_the_planner_counts_one_adamw_step_per_parameter_tensor() -> None:
    """A Qwen3 block has 11 parameter tensors (its q/k norms), a Qwen2 block 12 (biases)."""
    from hpctrain.plan.memory import state_bytes
    from hpctrain.plan.memory_options import MemoryOptions

    opts = MemoryOptions(strategy="none")
    for size in ("qwen3-0.6b", "qwen2.5-0.5b"):
        args = PRESETS[size]
        params = QWEN.count_params(args, include_embedding=True)
        _, _, optimizer = state_bytes(args, opts)
        assert optimizer == 8 * params + 4 * QWEN.param_tensors(args), size
