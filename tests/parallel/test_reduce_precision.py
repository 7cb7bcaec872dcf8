"""``parallel.reduce_precision``: the dtype FSDP's path reduces and accumulates gradients in.

In process, on a 1-rank gloo group: two micro-batches accumulated through FSDP's casts (strategy
none, as TP/PP use them) leave fp32 master gradients that are sums taken in bf16 (every element
a bf16 value) with ``bf16``, and sums taken in fp32 with the default; the refusals where no FSDP
policy reduces; the memory planner's accumulators. Training through a pipeline with it runs on
real ranks in ``test_mixed_precision.py`` (job ``pp2_fsdp_bf16``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer, count_params
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import parallelize
from hpctrain.plan.memory import estimate_memory
from hpctrain.plan.memory_options import MemoryOptions, resolve_model

BF16 = [*TINY, *QUIET, "train.precision=bf16"]
FSDP_CASTS = ["parallel.strategy=none", "parallel.mixed_precision=fsdp"]

REFUSED = {
    "fp32 training": (["parallel.strategy=fsdp", "train.precision=fp32"], "train.precision = fp32"),
    "fp16 training": (["parallel.strategy=fsdp", "train.precision=fp16"], "train.precision = fp16"),
    "DDP (autocast)": (["parallel.strategy=ddp"], "computes through autocast"),
    "autocast asked for": (["parallel.tp=2", "parallel.mixed_precision=autocast"],
                           "computes through autocast"),
    # auto takes autocast for the tiny model under TP: only its size says so.
    "auto below the size threshold": (["parallel.tp=2"], "computes through autocast"),
    "one GPU without FSDP": ([], "computes through autocast"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bf16_reduction_is_refused_where_nothing_reduces_through_fsdp(case: str) -> None:
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message) as info:
        load_config(DEMO, [*BF16, *overrides, "parallel.reduce_precision=bf16"])
    assert info.value.hint and info.value.expected


def test_an_unknown_reduce_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="reduce_precision"):
        load_config(DEMO, [*BF16, "parallel.strategy=fsdp", "parallel.reduce_precision=fp16"])


@pytest.mark.parametrize("overrides", [["parallel.strategy=fsdp"],
                                       ["parallel.strategy=fsdp", "train.precision=fp8"],
                                       [*FSDP_CASTS, "parallel.pp=2"],
                                       [*FSDP_CASTS, "parallel.tp=2"]])
def test_bf16_reduction_is_taken_on_fsdp_paths(overrides: list[str]) -> None:
    cfg = load_config(DEMO, [*BF16, *overrides, "parallel.reduce_precision=bf16"])
    assert cfg.parallel.reduce_precision == "bf16"


def _accumulated_grads(reduce: str) -> dict[str, torch.Tensor]:
    """The fp32 gradients the optimizer sees after two micro-batches accumulated under FSDP's
    casts over one rank (the caller's 1-rank group; the trainer's way: no gradient sync until
    the last)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*BF16, *FSDP_CASTS, f"parallel.reduce_precision={reduce}"])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    model = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "bf16",
                        seed=0).model
    tokens = torch.randint(0, cfg.model.resolve().vocab_size, (2, 2, 16),
                           generator=torch.Generator().manual_seed(1))
    for i, last in enumerate((False, True)):
        model.set_requires_gradient_sync(last)
        model(tokens[i]).float().logsumexp(-1).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_bf16_reduction_accumulates_micro_batches_in_bf16(pg: None) -> None:
    """With bf16 every accumulated gradient element is a bf16 value, kept as an fp32 master
    gradient; with fp32 (the default) the sums are fp32 ones; the two agree to bf16 rounding."""
    fp32, bf16 = _accumulated_grads("fp32"), _accumulated_grads("bf16")
    assert fp32.keys() == bf16.keys() and len(bf16) > 10
    for name, grad in bf16.items():
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, grad.bfloat16().float()), f"{name}: not summed in bf16"
        ref = fp32[name]
        assert torch.linalg.norm(grad - ref) <= 1e-2 * torch.linalg.norm(ref), name
    # The default really sums in fp32: its sums of bf16 gradients leave bf16's grid.
    off_grid = [n for n, g in fp32.items() if not torch.equal(g, g.bfloat16().float())]
    assert len(off_grid) > len(fp32) // 2, off_grid


def test_planner_sizes_bf16_accumulators() -> None:
    """8b PP2 through FSDP's casts (auto's path from 2B parameters per rank): the unsharded
    accumulators take 2 B per parameter instead of 4; the rest of the plan is unchanged."""
    args = resolve_model("8b")
    opts = MemoryOptions(strategy="none", gpus=1, pp=2, micro_batch=1, pp_microbatches=8)
    fp32 = estimate_memory(args, opts)
    bf16 = estimate_memory(args, dataclasses.replace(opts, reduce_precision="bf16"))
    assert bf16.grads == fp32.grads / 2
    assert bf16.peak == pytest.approx(fp32.peak - fp32.grads / 2)
    assert (bf16.params, bf16.optimizer, bf16.working, bf16.activations) == (
        fp32.params, fp32.optimizer, fp32.working, fp32.activations)
    # FSDP over 2 GPUs with 4 micro-batches accumulated: 2 B less per parameter of the
    # unsharded accumulators (every parameter), and of the root's gradients awaiting their
    # reduce-scatter at the end of backward (embedding, output layer, final norm).
    opts = MemoryOptions(strategy="fsdp", gpus=2, micro_batch=2, grad_accum=4)
    fp32 = estimate_memory(args, opts)
    bf16 = estimate_memory(args, dataclasses.replace(opts, reduce_precision="bf16"))
    assert not args.tie_embeddings
    root = 2 * args.vocab_size * args.dim + args.dim
    saved = 2 * (count_params(args, include_embedding=True) + root)
    assert bf16.working == pytest.approx(fp32.working - saved)
    assert fp32.peak - saved <= bf16.peak < fp32.peak  # the peak's moment may change


def test_planner_refuses_bf16_accumulators_on_the_autocast_path() -> None:
    opts = MemoryOptions(strategy="none", gpus=1, tp=2, reduce_precision="bf16")
    with pytest.raises(ConfigError, match="computes through autocast"):
        estimate_memory(resolve_model("1b"), opts)


def test_planner_matches_the_measured_peak() -> None:
    """8b PP2 (1F1B, 8 micro-batches of 1 x 2048, compiled, no AC) with bf16 accumulators:
    predicted 77.4 GB; measured 78.0 on 2 H200s (benchmarks/RESULTS.md), against 86.5 in fp32."""
    opts = MemoryOptions(strategy="none", gpus=1, pp=2, micro_batch=1, pp_microbatches=8,
                         reduce_precision="bf16")
    peak = estimate_memory(resolve_model("8b"), opts).peak / 1e9
    assert round(peak, 1) == 77.4
    assert abs(peak - 78.0) / 78.0 < 0.10


def test_plan_memory_command_takes_the_option(capsys: pytest.CaptureFixture) -> None:
    from hpctrain.cli import main

    base = ["plan", "memory", "parallel.strategy=none", "parallel.pp=2", "train.micro_batch=1",
            "train.grad_accum=8", "data.seq_len=2048", "parallel.compile=true"]
    main([*base, "model.size=8b", "parallel.reduce_precision=bf16"])
    out = capsys.readouterr().out
    assert "gradients (bf16)" in out and "77.4" in out
    main([*base, "model.size=8b"])
    assert "gradients (fp32)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # 1b: autocast, nothing reduces in bf16
        main([*base, "model.size=1b", "parallel.reduce_precision=bf16"])
    assert exit_info.value.code != 0
    assert "computes through autocast" in capsys.readouterr().err
