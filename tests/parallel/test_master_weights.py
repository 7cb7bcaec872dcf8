"""``train.master_weights=bf16``: pure bf16 training (parameters, gradients, AdamW moments).

In process: the path each layout takes, the refusals, and on one rank that the parameters are
the fp32 run's initial weights rounded to bf16 (the RoPE table stays fp32), that nothing
autocasts, and that gradients and the optimizer's moments are bf16.

Two launches side by side (``rank_jobs.py``: gloo, CPU, the tiny 2-layer 64-wide decoder,
deterministic kernels, 4 steps of a global batch of 4 x 32 tokens):

- 2 ranks: TP2 (saving at step 2), PP2 (1F1B, 2 micro-batches), FSDP2 and DDP2, all pure bf16;
  PP2 resumed from the 1-rank pure run's step-2 checkpoint;
- 1 rank: pure bf16 (saving at step 2); fp32 master weights with bf16 compute (saving at step
  2); pure bf16 resumed from TP2's step-2 checkpoint, and from the fp32-master checkpoint;
  fp32 master weights resumed from the pure run's checkpoint.

Tolerances. Layouts sum the same products in other orders, and each bf16 parameter update
rounds to 2^-9 relative. Measured over these 4 steps (PyTorch 2.13, CPU): at most 5.2e-5
relative between layouts, 3.4e-5 for the resumes across layouts, 3.3e-4 against fp32 master
weights (and 2.4e-4 for the run resumed from them). We assert 2e-3 for all, as the mixed-
precision tests do: the loss falls by more than twice that a step here (checked below), so a
resume that loaded the wrong weights or data position still fails.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer
from hpctrain.parallel.config import mixed_precision_path
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import autocast_dtype, parallelize
from rank_jobs import launch
from run_records import assert_close, checkpoint_dir, logged

STEPS = 4
RTOL = 2e-3
LAUNCH_TIMEOUT_S = 600.0
PURE = [*TINY, *QUIET, "train.precision=bf16", "train.master_weights=bf16"]

B = 1_000_000_000


@pytest.mark.parametrize(("strategy", "tp", "pp", "path"), [
    ("none", 1, 1, "pure"), ("none", 2, 1, "pure"), ("none", 1, 2, "pure"),
    ("ddp", 1, 1, "pure"), ("fsdp", 2, 2, "fsdp"),
])
def test_path_with_bf16_master_weights(strategy: str, tp: int, pp: int, path: str) -> None:
    """No casts without FSDP, whatever the size (auto would take FSDP's casts for 8b TP2);
    FSDP's own policy where FSDP shards."""
    assert mixed_precision_path("auto", strategy, tp, pp, "bf16", 8 * B, "bf16") == path
    assert mixed_precision_path("auto", strategy, tp, pp, "bf16", 8 * B) != "pure"
    cfg = load_config(DEMO, [*PURE, f"parallel.strategy={strategy}", f"parallel.tp={tp}",
                             f"parallel.pp={pp}"])
    assert cfg.parallel.mixed_precision_path("bf16", 8 * B, "bf16") == path
    assert autocast_dtype(cfg.parallel, "bf16", 8 * B, "bf16") is None


REFUSED = {
    "fp16": (["train.precision=fp16"], "train.precision = fp16"),
    "fp32": (["train.precision=fp32"], "train.precision = fp32"),
    "fp8": (["train.precision=fp8"], "train.precision = fp8"),
    "autocast asked for": (["parallel.strategy=none", "parallel.mixed_precision=autocast"],
                           "mixed_precision = autocast"),
    "FSDP's casts asked for": (["parallel.strategy=none", "parallel.tp=2",
                                "parallel.mixed_precision=fsdp"], "mixed_precision = fsdp"),
    "bf16 reduction without FSDP": (["parallel.strategy=none", "parallel.pp=2",
                                     "parallel.reduce_precision=bf16"], "reduce_precision"),
    "unknown value": (["train.master_weights=fp16"], "master_weights"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_combination_is_refused_when_the_config_loads(case: str) -> None:
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message) as info:
        load_config(DEMO, [*PURE, *overrides])
    assert info.value.hint or info.value.expected


def test_bf16_reduction_with_fsdp_is_accepted() -> None:
    cfg = load_config(DEMO, [*PURE, "parallel.strategy=fsdp", "parallel.reduce_precision=bf16"])
    assert cfg.train.master_weights == "bf16"


def _model(overrides: list[str], master: str) -> tuple[torch.nn.Module, torch.dtype | None]:
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*TINY, "parallel.strategy=none", *overrides])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    out = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "bf16",
                      seed=3, master_weights=master)
    return out.model, out.autocast


def test_one_rank_holds_bf16_weights_gradients_and_moments(pg: None) -> None:
    """The initial weights are the fp32 masters' rounded; forward and backward run in bf16
    without autocast; AdamW's moments are bf16 and its step moves the weights."""
    from hpctrain.train.config import OptimConfig
    from hpctrain.train.optim import build_optimizer

    pure, autocast = _model(["train.precision=bf16", "train.master_weights=bf16"], "bf16")
    masters, _ = _model(["train.precision=bf16"], "fp32")
    assert autocast is None
    masters_by_name = dict(masters.named_parameters())
    for name, p in pure.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, masters_by_name[name].to(torch.bfloat16)), name
    assert pure.rope.dtype == torch.float32
    tokens = torch.randint(0, pure.args.vocab_size, (2, 16))
    logits = pure(tokens)
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    params = list(pure.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in params)
    before = [p.detach().clone() for p in params]
    opt = build_optimizer(pure, OptimConfig(lr=1e-2), 1e-2)
    opt.step()
    moments = [s["exp_avg"] for s in opt.state.values()] + [
        s["exp_avg_sq"] for s in opt.state.values()]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert sum(not torch.equal(a, b) for a, b in zip(before, params, strict=True)) == len(params)


def test_gradient_norm_is_computed_in_fp32(pg: None) -> None:
    """bf16 gradients, an fp32 norm: exact to fp32 rounding, not bf16's three digits."""
    from hpctrain.parallel.grad_norm import global_grad_norm

    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    p.grad = torch.full((1000,), 1.0 + 2 ** -7, dtype=torch.bfloat16)
    norm = global_grad_norm([p], None)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(math.sqrt(1000) * (1 + 2 ** -7), rel=1e-6)


# -- real ranks ---------------------------------------------------------------------------------

COMMON = [*PURE, f"train.steps={STEPS}", "optim.schedule=constant", "parallel.strategy=none",
          "train.micro_batch=4", "checkpoint.async_save=false", "checkpoint.save_at_end=false",
          "checkpoint.interval=none"]
SAVE_AT_2 = ["checkpoint.interval=steps", "checkpoint.every=2", "checkpoint.keep_every=2"]
HALF_BATCH = ["train.micro_batch=2"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both launches, once for the module: the run directories' parent."""
    root = tmp_path_factory.mktemp("master_weights")
    runs = root / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    two = {**spec, "jobs": [
        {"name": "tp2", "overrides": ["parallel.tp=2", *SAVE_AT_2]},
        {"name": "pp2", "overrides": ["parallel.pp=2", "parallel.pp_microbatches=2"]},
        {"name": "fsdp2", "overrides": ["parallel.strategy=fsdp", *HALF_BATCH]},
        {"name": "ddp2", "overrides": ["parallel.strategy=ddp", *HALF_BATCH]},
        {"name": "pp2_resumed", "wait_for": checkpoint_dir(runs, "one", 2),
         "overrides": ["parallel.pp=2", "parallel.pp_microbatches=2",
                       f"checkpoint.resume={checkpoint_dir(runs, 'one', 2)}"]},
    ]}
    one = {**spec, "jobs": [
        {"name": "one", "overrides": SAVE_AT_2},
        {"name": "masters", "overrides": ["train.master_weights=fp32", *SAVE_AT_2]},
        {"name": "one_from_masters", "overrides": [
            f"checkpoint.resume={checkpoint_dir(runs, 'masters', 2)}"]},
        {"name": "masters_from_one", "overrides": [
            "train.master_weights=fp32", f"checkpoint.resume={checkpoint_dir(runs, 'one', 2)}"]},
        {"name": "one_resumed", "wait_for": checkpoint_dir(runs, "tp2", 2),
         "overrides": [f"checkpoint.resume={checkpoint_dir(runs, 'tp2', 2)}"]},
    ]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(launch, 2, two, root / "launch-2", LAUNCH_TIMEOUT_S),
                pool.submit(launch, 1, one, root / "launch-1", LAUNCH_TIMEOUT_S)]
        for job in jobs:
            job.result()
    return runs


@pytest.mark.parametrize("layout", ["tp2", "pp2", "fsdp2", "ddp2"])
def test_layouts_train_like_one_rank(out: Path, layout: str) -> None:
    """Every layout's pure bf16 losses are the one-rank run's within bf16 rounding."""
    run, one = logged(out, layout), logged(out, "one")
    assert sorted(run) == sorted(one) == list(range(1, STEPS + 1))
    for step in run:
        assert_close(run[step], one[step], RTOL, f"{layout} vs one rank at step {step}")
    log = (out / layout / "logs" / "rank-000.log").read_text()
    expected = ("FSDP's policy reduces" if layout == "fsdp2"
                else "parameters, gradients and AdamW moments in bf16")
    assert expected in log
    # The tolerance tells adjacent steps apart: a wrong resume cannot hide in it.
    assert all(abs(one[s + 1] - one[s]) > 2 * RTOL * one[s] for s in range(1, STEPS))


def test_pure_bf16_trains_like_fp32_master_weights(out: Path) -> None:
    """Same first loss to bf16 rounding (same initial weights, rounded), then close curves,
    not the same ones."""
    pure, masters = logged(out, "one"), logged(out, "masters")
    assert_close(pure[1], masters[1], RTOL, "first step")
    for step in pure:
        assert_close(pure[step], masters[step], RTOL, f"pure vs fp32 masters at step {step}")
    assert pure[STEPS] != masters[STEPS]


def test_checkpoint_holds_bf16_weights_and_moments(out: Path) -> None:
    """What TP2 saved: bf16 weights and AdamW moments (half the bytes of fp32 masters)."""
    from hpctrain.checkpoint.safe_io import SafeFileSystemReader

    meta = SafeFileSystemReader(checkpoint_dir(out, "tp2", 2)).read_metadata()
    dtypes = {key: m.properties.dtype for key, m in meta.state_dict_metadata.items()
              if hasattr(m, "properties")}
    weights = [k for k in dtypes if k.endswith("attention.wq.weight")]
    assert weights and len(dtypes) > 3 * len(weights)
    assert all(dtypes[k] == torch.bfloat16 for k in dtypes if "exp_avg" in k or k in weights)


def test_resume_across_layouts_and_master_dtypes(out: Path) -> None:
    """TP2 -> one rank and one rank -> PP2 resume within bf16 rounding; an fp32-master
    checkpoint resumes into bf16 master weights (its weights and moments rounded), and a
    pure bf16 one into fp32 master weights (widened)."""
    pairs = (("one_resumed", "tp2"), ("pp2_resumed", "one"), ("one_from_masters", "masters"),
             ("masters_from_one", "one"))
    for resumed, source in pairs:
        run, ref = logged(out, resumed), logged(out, source)
        assert sorted(run) == [3, 4], resumed
        for step in run:
            assert_close(run[step], ref[step], RTOL, f"{resumed} vs {source} at step {step}")
    # Resuming continues the masters' run, not a fresh pure one.
    fresh = logged(out, "one")
    assert logged(out, "one_from_masters")[3] != fresh[3]
