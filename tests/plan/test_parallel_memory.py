"""`plan memory` with tensor and pipeline parallelism, and `plan parallel`'s ranking."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelArgs, Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.pipeline import split_model
from hpctrain.parallel.stages import balance_stages, module_costs
from hpctrain.plan.memory import activation_bytes, estimate_memory, rank_shares, state_bytes
from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes
from hpctrain.plan.parallel import gpu_peak_tflops, rank_layouts

SMALL = ModelArgs(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                  max_seq_len=16)
H100 = gpu_memory_bytes("h100")


@pytest.mark.parametrize(("pp", "schedule"), [(2, "1f1b"), (3, "1f1b"),
                                               (2, "interleaved_1f1b"), (2, "zbv")])
def test_pipeline_states_exact_against_the_split_model(pp: int, schedule: str) -> None:
    """Each pipeline rank's parameters are counted from the stages the trainer builds."""
    opts = MemoryOptions(strategy="none", pp=pp, pp_schedule=schedule, seq_len=8,
                         micro_batch=2, pp_microbatches=2 * pp)
    shares = rank_shares(SMALL, opts)
    with torch.device("meta"):
        model = Transformer(SMALL)
    layout = ParallelLayout(pp=pp, schedule=schedule, microbatches=opts.microbatches,
                            stages_per_rank=opts.stages_per_rank)
    bounds = balance_stages(SMALL.n_layers, layout.num_stages,
                            module_costs(SMALL, opts.seq_len, opts.micro_batch * opts.seq_len))
    for rank, share in enumerate(shares):
        parts = [part for _, part in split_model(model, layout, rank, bounds)]
        real = [p for part in parts for p in part.parameters()]
        params, _, optimizer = state_bytes(SMALL, opts, share)
        assert params == 4 * sum(p.numel() for p in real)
        assert optimizer == 8 * sum(p.numel() for p in real) + 4 * len(real)


def test_tensor_parallel_splits_matrices_not_norms() -> None:
    model = Transformer(SMALL)
    matrices = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    for tp in (1, 2, 4):
        params, _, _ = state_bytes(SMALL, MemoryOptions(strategy="none", tp=tp))
        assert params == 4 * (matrices / tp + norms)


def test_sequence_parallel_activations_shrink_but_not_by_tp() -> None:
    """Split along the sequence or the heads: 1/tp; the gathered norm outputs stay whole."""
    args = PRESETS["8b"]
    one = MemoryOptions(strategy="none", micro_batch=2, seq_len=4096)
    two = dataclasses.replace(one, tp=2)
    a1, a2 = activation_bytes(args, one), activation_bytes(args, two)
    assert a1 / 2 < a2 < a1 * 0.7


def test_one_f_one_b_holds_p_micro_batches_on_the_first_stage() -> None:
    """1F1B: rank r keeps p - r micro-batches in flight, GPipe all of them."""
    opts = MemoryOptions(strategy="none", pp=4, pp_microbatches=8, micro_batch=1, seq_len=64)
    shares = rank_shares(SMALL.__class__(**{**SMALL.__dict__, "n_layers": 8}), opts)
    assert [round(s.inflight_layers / s.blocks) for s in shares] == [4, 3, 2, 1]
    gpipe = rank_shares(SMALL.__class__(**{**SMALL.__dict__, "n_layers": 8}),
                        dataclasses.replace(opts, pp_schedule="gpipe"))
    assert all(round(s.inflight_layers / s.blocks) == 8 for s in gpipe)


def test_pipeline_plan_reports_its_largest_rank_and_bubble() -> None:
    args = PRESETS["8b"]
    opts = MemoryOptions(strategy="fsdp", gpus=2, pp=2, pp_microbatches=8, micro_batch=1)
    plan = estimate_memory(args, opts)
    assert plan.stage in (0, 1) and plan.bubble == pytest.approx(1 / 9)
    # Inside a pipeline FSDP accumulates unsharded fp32 gradients until the last micro-batch.
    shard_params = plan.params
    assert plan.grads == pytest.approx(shard_params * 2)
    gpipe = estimate_memory(args, dataclasses.replace(opts, pp_schedule="gpipe"))
    assert gpipe.activations > plan.activations


def test_layouts_are_ranked_and_each_fits() -> None:
    plans = rank_layouts(PRESETS["8b"], gpus_per_node=8, nodes=2, gpu_bytes=H100)
    speeds = [p.tokens_per_s for p in plans]
    assert speeds == sorted(speeds, reverse=True) and len(plans) > 3
    assert all(p.memory.fits for p in plans)
    assert all(p.dp * p.tp * p.pp == 16 for p in plans)
    best = plans[0]
    command = best.command("config.yaml", ["model.size=8b"], 8, 2)
    assert command.startswith("hpctrain sbatch config.yaml model.size=8b")
    assert f"parallel.strategy={best.strategy}" in command and "--nodes 2" in command


def test_small_model_on_one_node_gets_data_parallel() -> None:
    plans = rank_layouts(PRESETS["1b"], gpus_per_node=2, nodes=1, gpu_bytes=H100)
    assert (plans[0].tp, plans[0].pp) == (1, 1)
    assert {(p.tp, p.pp) for p in plans} >= {(2, 1), (1, 2)}  # TP2 and PP2 fit, ranked lower


def test_cli_plan_parallel_prints_the_command_and_ranking(capsys) -> None:
    """The README's form of it: --model, deprecated, says the override it stands for."""
    main(["plan", "parallel", "--model", "1b", "--gpus-per-node", "2", "--nodes", "1",
          "--gpu", "h100"])
    out, err = capsys.readouterr()
    assert "hpctrain train CONFIG data.seq_len=2048 parallel.compile=true model.size=1b" in out
    assert "--nproc 2" in out and "layouts fit" in out and "tokens/s per GPU" in out
    assert "--model 1b: deprecated, write model.size=1b" in err
    # The batch planned for, in tokens: a CONFIG that gives one in tokens keeps this split.
    command = next(ln.strip() for ln in out.splitlines() if "hpctrain train CONFIG" in ln)
    words = dict(w.split("=", 1) for w in command.split() if "=" in w)
    assert int(words["train.global_batch_tokens"]) == 2048 * int(words["train.micro_batch"]) \
        * int(words["train.grad_accum"]) * 2


def test_cli_plan_memory_with_pipeline(capsys) -> None:
    main(["plan", "memory", "model.size=8b", "parallel.strategy=none", "parallel.tp=2",
          "parallel.pp=2", "train.micro_batch=1", "train.grad_accum=8", "data.seq_len=2048",
          "parallel.compile=true", "--gpu", "h100"])
    out = capsys.readouterr().out
    assert "largest on pipeline rank" in out and "bubble 11.1%" in out


# Peaks measured (metrics mem_gb = torch.cuda.max_memory_allocated) on 2 H200s, PyTorch 2.11,
# 125m, bf16, 30 steps of 16 x 1024 tokens per step:
#   hpctrain train configs/demo.yaml model.size=125m data.seq_len=1024 train.precision=bf16 \
#       run.device=cuda parallel.strategy=none parallel.tp=2 train.micro_batch=16 --nproc 2
#   (TP2 compiled: + parallel.compile=true; PP2: parallel.pp=2 train.micro_batch=2
#    train.grad_accum=8 instead of tp and micro_batch)
# TP/PP without FSDP were measured computing through autocast (before parallel.mixed_precision).
AUTOCAST = "autocast"
MEASURED_TP_PP = [
    (dict(strategy="none", tp=2, micro_batch=16, compile=False, mixed_precision=AUTOCAST), 8.53),
    (dict(strategy="none", tp=2, micro_batch=16, mixed_precision=AUTOCAST), 7.07),
    (dict(strategy="none", pp=2, pp_microbatches=8, micro_batch=2, compile=False,
          mixed_precision=AUTOCAST), 3.27),
    (dict(strategy="fsdp", gpus=2, micro_batch=8, compile=False), 6.88),
]


@pytest.mark.parametrize(("opts", "measured_gb"), MEASURED_TP_PP)
def test_within_ten_percent_of_measured_tp_and_pp_peaks(opts: dict, measured_gb: float) -> None:
    plan = estimate_memory(PRESETS["125m"], MemoryOptions(seq_len=1024, **opts))
    assert plan.peak / 1e9 == pytest.approx(measured_gb, rel=0.10)


# Peaks measured on H200s at sequence 2048 (benchmarks/RESULTS.md; issues 10, 15), no AC, each
# the largest rank's max_memory_allocated, as (model, options, GB). PP8: 8 micro-batches of 1.
PP8 = dict(strategy="none", micro_batch=1, grad_accum=8, pp_microbatches=8)
MEASURED_H200 = {
    # 1b on 4 GPUs (compare.py layouts 1b-tp4, 1b-pp2tp2, 1b-pp4-SCHEDULE, 1b-fsdp4): compiled,
    # autocast (0.55B parameters or fewer per rank).
    "1b tp4": ("1b", dict(strategy="none", tp=4, micro_batch=8), 13.6),
    "1b pp2 x tp2 1f1b": ("1b", dict(PP8, pp=2, tp=2), 8.0),
    "1b pp4 1f1b": ("1b", dict(PP8, pp=4), 10.9),
    "1b pp4 gpipe": ("1b", dict(PP8, pp=4, pp_schedule="gpipe"), 14.9),
    "1b pp4 interleaved 1f1b": ("1b", dict(PP8, pp=4, pp_schedule="interleaved_1f1b"), 13.2),
    # The zero-bubble schedules run eager (PyTorch 2.11, 2 stages per rank).
    "1b pp4 zbv": ("1b", dict(PP8, pp=4, pp_schedule="zbv", compile=False), 13.1),
    "1b pp4 interleaved zb": ("1b", dict(PP8, pp=4, pp_schedule="interleaved_zb",
                                         compile=False), 13.1),
    "1b fsdp4": ("1b", dict(strategy="fsdp", gpus=4, micro_batch=4), 15.3),
    "1b fsdp4 zero2": ("1b", dict(strategy="fsdp", gpus=4, micro_batch=4, zero=2), 17.5),
    # 8b on 4 GPUs (layouts 8b-tp4, 8b-pp2tp2, 8b-pp4-SCHEDULE): FSDP's casts (auto's path at 8B
    # parameters), compiled except the zero-bubble schedules; measured before any was fitted.
    "8b tp4": ("8b", dict(strategy="none", tp=4, micro_batch=8), 59.4),
    "8b pp2 x tp2 1f1b": ("8b", dict(PP8, pp=2, tp=2), 45.0),
    "8b pp4 1f1b": ("8b", dict(PP8, pp=4), 50.6),
    "8b pp4 gpipe": ("8b", dict(PP8, pp=4, pp_schedule="gpipe"), 58.4),
    "8b pp4 interleaved 1f1b": ("8b", dict(PP8, pp=4, pp_schedule="interleaved_1f1b"), 59.4),
    "8b pp4 zbv": ("8b", dict(PP8, pp=4, pp_schedule="zbv", compile=False), 59.9),
    "8b pp4 interleaved zb": ("8b", dict(PP8, pp=4, pp_schedule="interleaved_zb",
                                         compile=False), 60.3),
    # Pure bf16 (master weights in bf16) on 2 GPUs, and FSDP composed with TP and with PP on 4
    # (``gpus`` is the data-parallel width).
    "8b tp2 pure bf16": ("8b", dict(strategy="none", tp=2, micro_batch=8,
                                    master_weights="bf16"), 77.8),
    "8b pp2 1f1b pure bf16": ("8b", dict(PP8, pp=2, master_weights="bf16"), 44.1),
    "1b one gpu pure bf16": ("1b", dict(strategy="none", micro_batch=4, master_weights="bf16"),
                             18.5),
    "8b fsdp2 x tp2": ("8b", dict(strategy="fsdp", gpus=2, tp=2, micro_batch=8), 77.9),
    "8b pp2 x fsdp2 1f1b": ("8b", dict(PP8, strategy="fsdp", gpus=2, pp=2), 61.1),
    "8b fsdp4": ("8b", dict(strategy="fsdp", gpus=4, micro_batch=4), 67.2),
    # hpctrain tune's candidates (2026-11-27, 2 and 4 H200s, compiled, micro-batch 4), and the
    # 1b fp8 run on one GPU (autocast). fp8 is tensorwise, FSDP's all-gather in float8.
    "1b fsdp2": ("1b", dict(strategy="fsdp", gpus=2, micro_batch=4), 18.61),
    "1b fsdp2 zero2": ("1b", dict(strategy="fsdp", gpus=2, micro_batch=4, zero=2), 20.72),
    "1b ddp2": ("1b", dict(strategy="ddp", gpus=2, micro_batch=4), 35.86),
    "8b fsdp2": ("8b", dict(strategy="fsdp", gpus=2, micro_batch=4), 91.74),
    "8b fsdp2 zero2": ("8b", dict(strategy="fsdp", gpus=2, micro_batch=4, zero=2), 105.26),
    "8b fsdp4 zero2": ("8b", dict(strategy="fsdp", gpus=4, micro_batch=4, zero=2), 81.17),
    "1b fsdp2 zero2 fp8": ("1b", dict(strategy="fsdp", gpus=2, micro_batch=4, zero=2,
                                      precision="fp8"), 17.10),
    "8b fsdp2 zero2 fp8": ("8b", dict(strategy="fsdp", gpus=2, micro_batch=4, zero=2,
                                      precision="fp8"), 92.11),
    "8b fsdp4 zero2 fp8": ("8b", dict(strategy="fsdp", gpus=4, micro_batch=4, zero=2,
                                      precision="fp8"), 68.02),
    "1b one gpu fp8": ("1b", dict(strategy="none", micro_batch=4, precision="fp8"), 22.5),
}


@pytest.mark.parametrize("name", list(MEASURED_H200))
def test_within_ten_percent_of_measured_h200_peaks(name: str) -> None:
    size, opts, measured_gb = MEASURED_H200[name]
    plan = estimate_memory(PRESETS[size], MemoryOptions(seq_len=2048, **opts))
    assert plan.peak / 1e9 == pytest.approx(measured_gb, rel=0.10)


def test_fp8_is_planned_at_the_bf16_peak() -> None:
    """Only the blocks' GEMMs run in float8: the fp8 datasheet peak would predict ~2x."""
    assert gpu_peak_tflops("h100", "fp8") == gpu_peak_tflops("h100", "bf16") > 0


def test_pure_bf16_layouts_are_sized_as_such_and_their_command_says_so(capsys) -> None:
    """8b on 2 x 80 GB: bf16 master weights fit more layouts, with smaller peaks, and the
    printed command trains what was sized; a bad choice is refused as such."""
    masters = rank_layouts(PRESETS["8b"], gpus_per_node=2, nodes=1, gpu_bytes=H100)
    pure = rank_layouts(PRESETS["8b"], MemoryOptions(master_weights="bf16"), gpus_per_node=2,
                        nodes=1, gpu_bytes=H100)
    assert len(pure) >= len(masters)
    assert min(p.memory.peak for p in pure) < min(p.memory.peak for p in masters)
    assert all(p.options.master_weights == "bf16" for p in pure)
    main(["plan", "parallel", "model.size=8b", "train.master_weights=bf16", "data.seq_len=2048",
          "parallel.compile=true", "--gpus-per-node", "2", "--gpu", "h100"])
    assert "hpctrain train CONFIG model.size=8b train.master_weights=bf16" in (
        capsys.readouterr().out)
    with pytest.raises(ConfigError, match="master_weights = bf16 with train.precision = fp32"):
        rank_layouts(PRESETS["1b"], MemoryOptions(precision="fp32", master_weights="bf16"),
                     gpus_per_node=2, nodes=1, gpu_bytes=H100)
