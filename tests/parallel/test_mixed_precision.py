"""``parallel.mixed_precision``: FSDP2's parameter casts also where nothing is sharded (TP, PP).

In process: the path each setting takes (``mixed_precision_path``), the refusals, and on a
1-rank gloo group that FSDP over one rank computes in bf16 (residual stream included) while the
parameters and gradients the optimizer sees stay fp32.

Two launches side by side (``rank_jobs.py``: gloo, CPU, the tiny 2-layer 64-wide decoder in
bf16, deterministic kernels, 4 steps of 4 x 32 tokens):

- 2 ranks: TP2 and PP2 (1F1B, 2 micro-batches) with ``mixed_precision=autocast`` (TP2 through
  ``auto``, which takes it for this tiny model) and ``fsdp`` (what ``auto`` takes from 2B
  parameters per rank), the TP2 one saving at step 2; one fp32 step of each (a path that
  silently computed in fp32 would match it bit for bit); PP2 resumed from the 1-rank run's
  step-2 checkpoint; PP2 with FSDP's casts and ``parallel.reduce_precision=bf16`` (its two
  micro-batches' gradients summed in bf16);
- 1 rank (the one-GPU default: autocast), saving at step 2; resumed from TP2's step-2
  checkpoint.

Tolerances. The two paths round different tensors to bf16 (FSDP: the parameters and the
residual stream; autocast: each matmul's operands), each rounding a relative 2^-9 at most,
averaged over 64-wide dot products and 128 target tokens: measured at most 1.1e-4 relative on
the losses of these 4 steps (PyTorch 2.13, CPU), resumed runs against uninterrupted ones on
another layout and path included, and on the validation losses. We assert 2e-3, half of bf16's
2^-8: it still tells adjacent steps apart (the loss falls by more than twice that a step here,
checked below), so a resume that loaded the wrong weights or data position fails it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer, count_params
from hpctrain.parallel.config import mixed_precision_path
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import autocast_dtype, parallelize
from rank_jobs import launch
from run_records import assert_close, checkpoint_dir, logged

STEPS = 4
RTOL = 2e-3
LAUNCH_TIMEOUT_S = 600.0
BF16 = [*TINY, *QUIET, "train.precision=bf16"]


# -- choosing the path --------------------------------------------------------------------------

B = 1_000_000_000
# (setting, strategy, tp, pp, precision, parameters) -> path
PATHS = [
    ("auto", "none", 2, 1, "bf16", 8 * B, "fsdp"),
    ("auto", "none", 1, 2, "bf16", 8 * B, "fsdp"),
    ("auto", "none", 2, 2, "bf16", 8 * B, "fsdp"),  # 2B per rank: from there on
    ("auto", "none", 2, 2, "bf16", 8 * B - 4, "autocast"),  # just under 2B per rank
    ("auto", "none", 2, 1, "bf16", B, "autocast"),  # 1b: FSDP's hooks cost more than they save
    ("auto", "none", 1, 2, "bf16", B, "autocast"),
    ("auto", "none", 1, 1, "bf16", 8 * B, "autocast"),  # one GPU: as before
    ("auto", "ddp", 1, 1, "bf16", 8 * B, "autocast"),
    ("auto", "fsdp", 2, 2, "bf16", B, "fsdp"),
    ("auto", "none", 1, 2, "fp8", 8 * B, "autocast"),  # fp8 unchanged
    ("auto", "none", 2, 1, "fp32", 8 * B, "none"),
    ("auto", "fsdp", 1, 1, "fp32", B, "none"),
    ("autocast", "none", 2, 1, "bf16", 8 * B, "autocast"),
    ("autocast", "none", 1, 2, "bf16", 8 * B, "autocast"),
    ("fsdp", "none", 1, 1, "bf16", B, "fsdp"),  # one GPU, asked for
    ("fsdp", "none", 2, 1, "bf16", B, "fsdp"),  # a small model, asked for
    ("fsdp", "none", 1, 2, "fp32", B, "none"),  # fp32: nothing to cast
]


@pytest.mark.parametrize(("setting", "strategy", "tp", "pp", "precision", "params", "path"),
                         PATHS)
def test_path_is_chosen_as_specified(setting: str, strategy: str, tp: int, pp: int,
                                     precision: str, params: int, path: str) -> None:
    assert mixed_precision_path(setting, strategy, tp, pp, precision, params) == path
    if (setting, strategy) in (("autocast", "fsdp"), ("fsdp", "ddp")):
        return
    cfg = load_config(DEMO, [*TINY, f"parallel.strategy={strategy}", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", f"parallel.mixed_precision={setting}",
                             f"train.precision={precision}"])
    assert cfg.parallel.mixed_precision_path(precision, params) == path
    # The trainer, validation and pipeline stages autocast exactly where the path says so.
    expected = torch.bfloat16 if path == "autocast" else None
    assert autocast_dtype(cfg.parallel, precision, params) == expected


REFUSED = {
    "fsdp casts inside DDP replicas": (["parallel.strategy=ddp",
                                        "parallel.mixed_precision=fsdp"], "strategy 'ddp'"),
    "autocast under FSDP's policy": (["parallel.strategy=fsdp",
                                      "parallel.mixed_precision=autocast"], "strategy 'fsdp'"),
    "fp8 without sharding": (["parallel.strategy=none", "parallel.pp=2",
                              "parallel.mixed_precision=fsdp", "train.precision=fp8"], "fp8"),
    "fp16 without sharding": (["parallel.strategy=none", "parallel.mixed_precision=fsdp",
                               "train.precision=fp16"], "fp16"),
    "unknown value": (["parallel.mixed_precision=amp"], "mixed_precision"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_combination_is_refused_when_the_config_loads(case: str) -> None:
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message) as info:
        load_config(DEMO, [*TINY, *overrides])
    assert info.value.hint or info.value.expected


# -- one rank, in process -----------------------------------------------------------------------


def test_fsdp_over_one_rank_computes_in_bf16_with_fp32_master_weights(pg: None) -> None:
    """The residual stream (embedding output) and logits are bf16, no autocast is needed, and
    the parameters and gradients the optimizer sees are fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*BF16, "parallel.strategy=none", "parallel.mixed_precision=fsdp"])
    assert autocast_dtype(cfg.parallel, "bf16", count_params(cfg.model.resolve(),
                                                          include_embedding=True)) is None
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    model = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "bf16",
                        seed=0).model
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
    seen: list[torch.dtype] = []
    model.tok_embeddings.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    tokens = torch.randint(0, cfg.model.resolve().vocab_size, (2, 16))
    logits = model(tokens)
    assert seen == [torch.bfloat16] and logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    params = list(model.parameters())
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


# -- real ranks ---------------------------------------------------------------------------------

# Validation at step 2 and at the end: FSDP's forward without backward leaves the parameters
# gathered, and training must go on from there.
COMMON = [*BF16, f"train.steps={STEPS}", "optim.schedule=constant", "parallel.strategy=none",
          "train.micro_batch=4", "data.val_fraction=0.005", "train.val_every=2",
          "checkpoint.async_save=false", "checkpoint.save_at_end=false",
          "checkpoint.interval=none"]
SAVE_AT_2 = ["checkpoint.interval=steps", "checkpoint.every=2", "checkpoint.keep_every=2"]
TP2, PP2 = ["parallel.tp=2"], ["parallel.pp=2", "parallel.pp_microbatches=2"]
AUTOCAST = ["parallel.mixed_precision=autocast"]
FSDP_CASTS = ["parallel.mixed_precision=fsdp"]
FP32_STEP = ["train.precision=fp32", "train.steps=1"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both launches, once for the module: the run directories' parent."""
    root = tmp_path_factory.mktemp("mixed_precision")
    runs = root / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    two = {**spec, "jobs": [
        {"name": "tp2_fsdp", "overrides": [*TP2, *FSDP_CASTS, *SAVE_AT_2]},
        # auto: the tiny model is far below 2B parameters per rank, so autocast.
        {"name": "tp2_autocast", "overrides": TP2},
        {"name": "pp2_fsdp", "overrides": [*PP2, *FSDP_CASTS]},
        {"name": "pp2_autocast", "overrides": [*PP2, *AUTOCAST]},
        {"name": "pp2_fsdp_bf16", "overrides": [*PP2, *FSDP_CASTS,
                                                "parallel.reduce_precision=bf16"]},
        {"name": "tp2_fp32", "overrides": [*TP2, *FP32_STEP]},
        {"name": "pp2_fp32", "overrides": [*PP2, *FP32_STEP]},
        {"name": "pp2_resumed", "wait_for": checkpoint_dir(runs, "one", 2),
         "overrides": [*PP2, *FSDP_CASTS, f"checkpoint.resume={checkpoint_dir(runs, 'one', 2)}"]},
    ]}
    one = {**spec, "jobs": [
        {"name": "one", "overrides": SAVE_AT_2},
        {"name": "one_resumed", "wait_for": checkpoint_dir(runs, "tp2_fsdp", 2),
         "overrides": [f"checkpoint.resume={checkpoint_dir(runs, 'tp2_fsdp', 2)}"]},
    ]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(launch, 2, two, root / "launch-2", LAUNCH_TIMEOUT_S),
                pool.submit(launch, 1, one, root / "launch-1", LAUNCH_TIMEOUT_S)]
        for job in jobs:
            job.result()
    return runs


def _path_logged(out: Path, name: str) -> str:
    lines = [line for line in (out / name / "logs" / "rank-000.log").read_text().splitlines()
             if "mixed precision:" in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_fsdp_casts_train_like_autocast(out: Path, layout: str) -> None:
    """Same training and validation losses as autocast within bf16 rounding, through another
    path (logged)."""
    fsdp, autocast = logged(out, f"{layout}_fsdp"), logged(out, f"{layout}_autocast")
    assert sorted(fsdp) == sorted(autocast) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert_close(fsdp[step], autocast[step], RTOL, f"{layout} fsdp vs autocast at step {step}")
    val, val_autocast = (logged(out, f"{layout}_{path}", "val_loss")
                         for path in ("fsdp", "autocast"))
    assert sorted(val) == sorted(val_autocast) == [2, STEPS]
    for step in val:
        assert_close(val[step], val_autocast[step], RTOL, f"{layout} validation at step {step}")
    assert fsdp != autocast  # the casts really differ
    fp32 = logged(out, f"{layout}_fp32")[1]
    assert fsdp[1] != fp32 and autocast[1] != fp32  # and both compute in bf16
    assert "FSDP2 casts the parameters to bf16 (FSDP over a 1-rank" in _path_logged(
        out, f"{layout}_fsdp")
    assert "autocast to bf16" in _path_logged(out, f"{layout}_autocast")
    assert "(parallel.mixed_precision=auto)" in _path_logged(out, "tp2_autocast")
    # The tolerance tells adjacent steps apart: a wrong resume cannot hide in it.
    assert all(abs(fsdp[s + 1] - fsdp[s]) > 2 * RTOL * fsdp[s] for s in range(1, STEPS))


def test_bf16_reduction_trains_like_fp32_reduction(out: Path) -> None:
    """PP2 accumulating its micro-batches' gradients in bf16: the same losses within bf16
    rounding as in fp32 (the first step's exactly: no update yet), not the very same ones."""
    bf16, fp32 = logged(out, "pp2_fsdp_bf16"), logged(out, "pp2_fsdp")
    assert sorted(bf16) == sorted(fp32) == list(range(1, STEPS + 1))
    assert bf16[1] == fp32[1]
    for step in bf16:
        assert_close(bf16[step], fp32[step], RTOL, f"pp2 bf16 vs fp32 reduction at step {step}")
    assert bf16[STEPS] != fp32[STEPS]
    assert "reduced and accumulated in bf16" in _path_logged(out, "pp2_fsdp_bf16")
    assert "reduced and accumulated in fp32" in _path_logged(out, "pp2_fsdp")


def test_checkpoint_holds_fp32_master_weights_and_optimizer_state(out: Path) -> None:
    """What TP2 with FSDP's casts saved (the optimizer's view) is fp32 throughout."""
    from hpctrain.checkpoint.safe_io import SafeFileSystemReader

    meta = SafeFileSystemReader(checkpoint_dir(out, "tp2_fsdp", 2)).read_metadata()
    dtypes: dict[str, Any] = {key: m.properties.dtype for key, m in
                              meta.state_dict_metadata.items() if hasattr(m, "properties")}
    weights = [k for k in dtypes if k.endswith("attention.wq.weight")]
    assert weights and len(dtypes) > 3 * len(weights)  # weights and AdamW moments
    floats = {k: d for k, d in dtypes.items() if d.is_floating_point}
    assert floats and all(d == torch.float32 for d in floats.values()), floats


def test_resume_across_layouts_and_paths(out: Path) -> None:
    """TP2 (FSDP casts) -> one rank (autocast), and one rank -> PP2 (FSDP casts): the resumed
    steps' losses are the uninterrupted run's within bf16 rounding."""
    for resumed, source in (("one_resumed", "tp2_fsdp"), ("pp2_resumed", "one")):
        run, ref = logged(out, resumed), logged(out, source)
        assert sorted(run) == [3, 4], resumed
        for step in run:
            assert_close(run[step], ref[step], RTOL, f"{resumed} vs {source} at step {step}")
