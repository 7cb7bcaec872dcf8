"""`plan memory` and `plan parallel` size the mixed-precision path the trainer takes.

With TP or PP and strategy none, ``parallel.mixed_precision=auto`` computes through FSDP's
parameter casts over one rank (``hpctrain.parallel.config``) from 2B parameters per
model-parallel rank: a bf16 residual stream, one resident bf16 copy of every parameter the rank
holds (embedding included), no autocast weight copies. Smaller models, and
``mixed_precision=autocast``, keep the autocast model. Both are pinned at their predictions and
checked against peaks measured on 2 H200s (PyTorch 2.11).
"""

from __future__ import annotations

import dataclasses

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS
from hpctrain.plan.memory import activation_bytes, estimate_memory, rank_shares, state_bytes
from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes
from hpctrain.plan.parallel import rank_layouts

# (model, options, autocast prediction GB, measured GB (largest rank), FSDP-cast prediction GB,
# measured GB or None, the path auto takes). 8b holds 4.0B parameters per rank, 1b 0.55B.
TP8 = dict(strategy="none", tp=2, micro_batch=8)
PP8 = dict(strategy="none", pp=2, pp_microbatches=8, micro_batch=1)
TP1 = dict(strategy="none", tp=2, micro_batch=4)
LAYOUTS = {
    "8b tp2 batch 8": ("8b", TP8, 111.33, 111.6, 107.56, 110.0, "fsdp"),
    "8b pp2 1f1b 8x1": ("8b", PP8, 93.41, 93.6, 85.90, 86.5, "fsdp"),
    "1b tp2 micro-batch 4": ("1b", TP1, 15.79, 15.8, 15.11, 15.5, "autocast"),
    "1b pp2 1f1b 8x1": ("1b", PP8, 14.95, 15.1, 13.62, 13.8, "autocast"),
}


def _plan(size: str, opts: dict, mixed_precision: str):
    return estimate_memory(PRESETS[size], MemoryOptions(mixed_precision=mixed_precision, **opts))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_both_paths_predict_the_measured_peaks_and_auto_takes_its_path(name: str) -> None:
    size, opts, autocast_gb, autocast_measured, fsdp_gb, fsdp_measured, path = LAYOUTS[name]
    autocast, fsdp = _plan(size, opts, "autocast"), _plan(size, opts, "fsdp")
    assert autocast.peak / 1e9 == pytest.approx(autocast_gb, abs=0.01)
    assert autocast.peak / 1e9 == pytest.approx(autocast_measured, rel=0.10)
    assert fsdp.peak / 1e9 == pytest.approx(fsdp_gb, abs=0.01)
    assert fsdp.peak / 1e9 == pytest.approx(fsdp_measured, rel=0.10)
    assert MemoryOptions(**opts).mixed_precision_path(PRESETS[size]) == path
    assert _plan(size, opts, "auto").peak == (fsdp if path == "fsdp" else autocast).peak
    # A bf16 residual stream: fewer activation bytes; the states are the same.
    assert fsdp.activations < autocast.activations
    assert (fsdp.params, fsdp.optimizer) == (autocast.params, autocast.optimizer)


def test_residual_stream_is_bf16_and_the_bf16_copy_holds_every_parameter() -> None:
    """Exactly 2 B less per residual element, and the working copy is 2 B per parameter."""
    args = PRESETS["1b"]
    opts = MemoryOptions(**TP1, mixed_precision="fsdp")
    autocast = dataclasses.replace(opts, mixed_precision="autocast")
    tokens = opts.micro_batch * opts.seq_len
    saved = activation_bytes(args, autocast) - activation_bytes(args, opts)
    assert saved == pytest.approx(tokens * args.n_layers * 2 * 2 * args.dim / opts.tp)
    params, _, _ = state_bytes(args, opts)
    plan = estimate_memory(args, opts)
    assert plan.peak_moment == "start of backward"
    assert plan.peak == pytest.approx(params + plan.optimizer + params / 2 + plan.activations)


def test_pipeline_holds_one_bf16_copy_per_stage_embedding_included() -> None:
    """FSDP's casts: one bf16 copy of the stage, whatever the micro-batches in flight.
    Autocast: each in-flight micro-batch keeps its own copies of the blocks' weights (rank 0 of
    PP2 1F1B holds two micro-batches), never of the embedding."""
    args = PRESETS["8b"]
    opts = MemoryOptions(**PP8)
    share = rank_shares(args, opts)[0]
    assert share.embedding and not share.head
    params, _, _ = state_bytes(args, opts, share)
    plan = estimate_memory(args, opts)
    assert plan.stage == 0 and plan.working == pytest.approx(params / 2)
    autocast = estimate_memory(args, dataclasses.replace(opts, mixed_precision="autocast"))
    embedding = args.vocab_size * args.dim
    assert share.inflight_layers == 2 * share.blocks
    assert autocast.working == pytest.approx(2 * 2 * (params / 4 - embedding))


@pytest.mark.parametrize("opts", [
    dict(strategy="fsdp", gpus=4, micro_batch=4),
    dict(strategy="fsdp", gpus=2, tp=2, micro_batch=4),
    dict(strategy="none", micro_batch=4),
    dict(strategy="ddp", gpus=4, micro_batch=4),
    dict(strategy="none", tp=2, micro_batch=4, precision="fp32"),
])
def test_layouts_without_a_choice_are_sized_as_before(opts: dict) -> None:
    """FSDP's own policy, one GPU and DDP (autocast), fp32: auto changes nothing."""
    auto = _plan("1b", opts, "auto")
    pinned = "fsdp" if opts["strategy"] == "fsdp" else "autocast"
    assert auto == _plan("1b", opts, pinned)


@pytest.mark.parametrize(("opts", "message"), [
    (dict(strategy="ddp", gpus=2, mixed_precision="fsdp"), "strategy 'ddp'"),
    (dict(strategy="fsdp", gpus=2, mixed_precision="autocast"), "strategy 'fsdp'"),
    (dict(strategy="none", pp=2, precision="fp8", mixed_precision="fsdp"), "fp8"),
    (dict(strategy="none", mixed_precision="amp"), "mixed precision 'amp'"),
])
def test_combinations_training_refuses_are_refused(opts: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory(PRESETS["1b"], MemoryOptions(**opts))


def test_suggesting_fsdp_leaves_an_autocast_choice_behind() -> None:
    """DDP with mixed_precision=autocast that does not fit still hears 'shard with FSDP'."""
    plan = estimate_memory(PRESETS["8b"], MemoryOptions(strategy="ddp", gpus=4, micro_batch=2,
                                                        mixed_precision="autocast"),
                           gpu_memory_bytes("h100"))
    assert plan.fits is False
    assert any("FSDP" in s for s in plan.suggestions), plan.suggestions


def test_plan_parallel_sizes_tp_and_pp_with_fsdp_casts() -> None:
    """8b on 2 H200s: the TP2 and PP2 layouts (no data parallelism) are sized on auto's path."""
    plans = rank_layouts(PRESETS["8b"], gpus_per_node=2, nodes=1,
                         gpu_bytes=gpu_memory_bytes("h200"))
    model_parallel = [p for p in plans if p.strategy == "none"]
    assert {(p.tp, p.pp) for p in model_parallel} >= {(2, 1), (1, 2)}
    for p in model_parallel:
        opts = dict(strategy="none", tp=p.tp, pp=p.pp, micro_batch=p.micro_batch, ac=p.ac,
                    **({"pp_microbatches": p.microbatches} if p.pp > 1
                       else {"grad_accum": p.microbatches}))
        assert p.memory.peak == _plan("8b", opts, "fsdp").peak
        assert p.memory.peak < _plan("8b", opts, "autocast").peak


def test_cli_plan_memory_names_the_path(capsys) -> None:
    base = ["plan", "memory", "parallel.strategy=none", "parallel.tp=2", "train.micro_batch=4",
            "data.seq_len=2048"]
    main([*base, "model.size=8b"])
    assert "bf16 (FSDP casts)" in capsys.readouterr().out
    main([*base, "model.size=8b", "parallel.mixed_precision=autocast"])
    assert "bf16 (autocast)" in capsys.readouterr().out
    main([*base, "model.size=8b", "--json"])
    assert '"mixed_precision": "fsdp"' in capsys.readouterr().out
    main([*base, "model.size=1b", "--json"])  # 0.55B parameters per rank: autocast
    assert '"mixed_precision": "autocast"' in capsys.readouterr().out
    main([*base, "model.size=1b", "parallel.mixed_precision=fsdp"])
    assert "bf16 (FSDP casts)" in capsys.readouterr().out


def test_autocast_keeps_weight_copies_per_forward_in_flight() -> None:
    """What the pipeline's autocast working buffers model: each forward under autocast saves its
    own bf16 copies of the block matrices and the output layer for its backward, so a stage with
    two micro-batches in flight holds two sets; the embedding is not cast."""
    import torch

    from hpctrain.models import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                  vocab_size=64, max_seq_len=16))
    weights = [p for n, p in model.named_parameters()
               if p.dim() == 2 and "tok_embeddings" not in n]
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        for micro_batch in range(2):  # two forwards in flight, as in a pipeline's warm-up
            tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(
                micro_batch))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(tokens).float().sum()
    # Linear saves its weight's transpose (a view of the copy): compare both ways round.
    bf16 = {t.data_ptr(): t for t in saved if t.dtype == torch.bfloat16 and t.dim() == 2}

    def copies_of(w: torch.Tensor) -> int:
        w = w.bfloat16()
        return sum(1 for t in bf16.values() for u in (t, t.t())
                   if u.shape == w.shape and torch.equal(u, w))

    assert len(weights) > 10
    assert [copies_of(w) for w in weights] == [2] * len(weights)
    assert copies_of(model.tok_embeddings.weight) == 0
