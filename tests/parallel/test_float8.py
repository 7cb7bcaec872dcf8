"""``train.precision=fp8``: torchao float8 Linears in the blocks, on CPU through emulation.

The conversion, the refusals and the memory plan are checked in process. Training runs go
through the real entry point in two launches side by side (``rank_jobs.py``: gloo, CPU, the tiny
2-layer 64-wide decoder, deterministic kernels):

- 1 rank (FSDP over one rank: bf16 parameters as in a GPU run, float8 weights not gathered):
  bf16 and fp8 for 6 steps, and fp8 resumed from the bf16 run's step-3 checkpoint;
- 2 ranks: FSDP with tensorwise scales and float8 all-gather (the scales precomputed after each
  step), saving at step 3; bf16 resumed from that checkpoint; rowwise FSDP; fp8 under PP2 and
  under DDP (fp32 weights, bf16 autocast).

Loss curves cannot tell a right float8 all-gather from a subtly wrong one (scales from each
shard's own maximum moved this model's loss by no more than the right ones), so a third launch,
2 ranks forked from the preloaded interpreter, checks the gathered float8 weights bit for bit
(``_rank_check``).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import DEMO, QUIET, TINY, fork_spawn, run_cli
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer
from hpctrain.observe.metrics import read_metrics
from hpctrain.observe.peaks import mfu_peak_dtype
from hpctrain.parallel.float8 import (
    Float8Training,
    check_float8_device,
    convert_to_float8,
    fused_gather_cast,
    import_float8,
)
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.plan.memory_options import MemoryOptions, resolve_model
from rank_jobs import free_port, launch
from run_records import assert_close, checkpoint_dir, logged

try:
    import_float8()  # torchao, imported without its log noise about kernels a CPU cannot load
except ConfigError:
    pytest.skip("torchao is not installed (pip install -e '.[dev]')", allow_module_level=True)

STEPS = 6
LAUNCH_TIMEOUT_S = 600.0
COMMON = [*TINY, *QUIET, f"train.steps={STEPS}", "optim.schedule=constant",
          "parallel.strategy=fsdp", "checkpoint.async_save=false",
          "checkpoint.save_at_end=false", "checkpoint.interval=none"]
FP8 = ["train.precision=fp8", "train.fp8_emulate=true"]
BF16 = ["train.precision=bf16"]
SAVE_AT_3 = ["checkpoint.interval=steps", "checkpoint.every=3", "checkpoint.keep_every=3"]
BLOCK_LINEARS = {f"layers.{i}.{name}" for i in range(2) for name in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}

# fp8 against bf16, step by step: e4m3 keeps 3 mantissa bits (each operand rounded by up to
# 2^-4 = 6%), but the rounding errors of a 64- or 128-term dot product mostly cancel and the
# loss averages 128 tokens: measured at most 0.04% on this model in 6 steps. 1% (the issue's
# bound for 200 steps on GPU) is a sanity bound: it catches a broken conversion or a garbled
# checkpoint, not subtle scaling errors (the bitwise rank check is for those).
FP8_VS_BF16 = 1e-2
# 2 ranks against 1 for fp8: each rank scales the activations of its own half of the batch,
# so the roundings differ slightly (measured below 0.03%).
RANKS_RTOL = 5e-3


def _tiny_model() -> Transformer:
    cfg = load_config(DEMO, TINY)
    with torch.device("meta"):
        return Transformer(cfg.model.resolve())


def test_conversion_touches_exactly_the_block_linears() -> None:
    """q/k/v/o and w1/w2/w3 of every block become Float8Linear; the embedding and the output
    layer stay; the parameter names (what checkpoints key on) do not change."""
    model = _tiny_model()
    names = list(model.state_dict())
    converted = convert_to_float8(model, Float8Training("tensorwise", emulate=True),
                                  all_gather=False)
    float8 = import_float8()
    assert set(converted) == BLOCK_LINEARS
    found = {name for name, m in model.named_modules()
             if type(m).__name__ == "Float8Linear"}
    assert found == BLOCK_LINEARS
    assert type(model.output) is torch.nn.Linear
    assert type(model.tok_embeddings) is torch.nn.Embedding
    assert list(model.state_dict()) == names
    assert model.layers[0].attention.wq.config.emulate
    assert float8 is not None


def test_float8_all_gather_and_rowwise_config() -> None:
    """Tensorwise under FSDP wraps the weights for float8 all-gather; rowwise cannot."""
    model = _tiny_model()
    convert_to_float8(model, Float8Training("tensorwise", emulate=True), all_gather=True)
    weight = model.layers[1].feed_forward.w2.weight
    assert type(weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"
    rowwise = _tiny_model()
    convert_to_float8(rowwise, Float8Training("rowwise", emulate=True), all_gather=False)
    config = rowwise.layers[0].attention.wo.config
    assert config.cast_config_weight.scaling_granularity.value == "axiswise"
    assert not config.enable_fsdp_float8_all_gather


def test_fp8_refused_on_cpu_without_emulation() -> None:
    """The device check names the device, what fp8 needs and the way out."""
    with pytest.raises(ConfigError) as e:
        check_float8_device(torch.device("cpu"), emulate=False)
    text = e.value.render()
    assert "train.precision = fp8 on the CPU" in text
    assert "compute capability 8.9" in text and "train.fp8_emulate=true" in text
    check_float8_device(torch.device("cpu"), emulate=True)


def test_fp8_run_on_cpu_exits_2(tmp_path: Path) -> None:
    """The CLI run stops at start-up with the message and exit code 2, before any step."""
    done = run_cli(["train", DEMO, *TINY, *QUIET, "train.precision=fp8", "train.steps=2",
                    f"run.out_dir={tmp_path}", "run.name=fp8cpu"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "train.precision = fp8 on the CPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_torchao_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchao the conversion fails with the install command, not an ImportError."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(ConfigError) as e:
        convert_to_float8(_tiny_model(), Float8Training(emulate=True), all_gather=False)
    assert "pip install torchao" in e.value.render()


def test_recipe_and_layout_refusals() -> None:
    """An unknown recipe names the valid ones; fp8 with tensor parallelism is refused."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [*TINY, "train.fp8_recipe=blockwise"])
    assert "'tensorwise', 'rowwise'" in e.value.render()
    with pytest.raises(ConfigError) as e:
        convert_to_float8(_tiny_model(), Float8Training("blockwise", True), all_gather=False)
    assert "tensorwise, rowwise" in e.value.render()
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [*TINY, *FP8, "parallel.strategy=fsdp", "parallel.tp=2"])
    assert "train.precision = fp8 with parallel.tp = 2" in e.value.render()
    # The planner refuses what training refuses, in the same words.
    with pytest.raises(ConfigError) as e:
        MemoryOptions(precision="fp8", strategy="fsdp", gpus=2, tp=2).validate(
            resolve_model("1b"))
    assert "train.precision = fp8 with parallel.tp = 2" in e.value.render()


def test_odd_shapes_refused_on_hardware() -> None:
    """Float8 GEMMs take multiples of 16: a model that breaks it is refused, not crashed."""
    cfg = load_config(DEMO, [*TINY, "model.dim=72", "model.n_heads=4", "model.n_kv_heads=2"])
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    with pytest.raises(ConfigError) as e:
        convert_to_float8(model, Float8Training(), all_gather=False)
    assert "multiples of 16" in e.value.render()


def test_fused_gather_cast_gives_torchao_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cast before a float8 all-gather, replaced by ``fused_gather_cast``: the same float8
    bytes and scale as torchao's, values past the float8 range saturated as torchao does."""
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as weight

    import hpctrain.parallel.float8 as f8

    # The patch holds for the process (an earlier conversion may have made it): start from
    # torchao's method, and leave the class as it was found.
    theirs = f8._TORCHAO_PRE_ALL_GATHER or weight.fsdp_pre_all_gather
    monkeypatch.setattr(weight, "fsdp_pre_all_gather", theirs)
    monkeypatch.setattr(f8, "_TORCHAO_PRE_ALL_GATHER", None)
    assert fused_gather_cast()
    assert weight.fsdp_pre_all_gather is not theirs and fused_gather_cast()  # once only
    torch.manual_seed(0)
    shard = torch.randn(48, 64)
    dtype = torch.float8_e4m3fn
    for scale in (torch.finfo(dtype).max / shard.abs().max(), torch.tensor(1e4)):
        w = weight(shard, LinearMMConfig(), dtype, precomputed_scale=scale.float())
        (want,), (want_scale,) = theirs(w, None)
        (got,), (got_scale,) = weight.fsdp_pre_all_gather(w, None)
        assert got.dtype == dtype and got.shape == shard.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert got_scale is want_scale
    assert got.float().abs().max() == torch.finfo(dtype).max  # 1e4 saturates


def test_fused_gather_cast_keeps_an_unknown_torchao(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A torchao whose pre-all-gather method takes other arguments keeps its own, warned."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as weight

    def other(self, mesh, outer_size, outer_stride, module, mp_policy):
        raise AssertionError("not called")

    monkeypatch.setattr(weight, "fsdp_pre_all_gather", other)
    assert not fused_gather_cast()
    assert weight.fsdp_pre_all_gather is other
    assert "is not the one hpctrain fuses" in caplog.text


def test_mfu_is_against_the_bf16_peak() -> None:
    """fp8 runs state MFU against bf16's peak; other precisions against their own."""
    assert mfu_peak_dtype("fp8") == "bf16"
    assert mfu_peak_dtype("fp32") == "fp32"


# -- training runs -------------------------------------------------------------------------


def _rank_check(rank: int, port: int) -> None:
    """One rank of 2 (gloo): FSDP with float8 all-gather gathers exactly the float8 weight
    that the whole weight casts to with the scale of its global maximum."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.float8_training_tensor import (
        GemmInputRole,
        hp_tensor_and_scale_to_float8,
    )

    from hpctrain.parallel.parallelize import parallelize
    from hpctrain.runtime.dist import MESH_AXES

    torch.set_num_threads(1)  # 2 ranks and 2 training launches beside them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (1, 1, 2, 1), mesh_dim_names=MESH_AXES)
    cfg = load_config(DEMO, [*TINY, "parallel.strategy=fsdp"])
    par = parallelize(_tiny_model(), cfg.parallel, ParallelLayout(1, 1, 2, 1), mesh,
                      torch.device("cpu"), "fp8", seed=0, fp8=Float8Training(emulate=True))
    assert par.float8_scales
    with torch.no_grad():  # weights that differ between the shards, as after training
        for p in par.model.parameters():
            p.to_local().mul_(1.0 + dist.get_rank())
    par.after_update()  # what the trainer calls after each optimizer step
    for block in par.model.layers:
        wholes = {n: m.weight.full_tensor() for n, m in block.named_modules()
                  if type(m).__name__ == "Float8Linear"}
        assert len(wholes) == 7
        block.unshard()
        for name, whole in wholes.items():
            gathered = block.get_submodule(name).weight
            scale = torch.finfo(torch.float8_e4m3fn).max / whole.abs().max().double()
            torch.testing.assert_close(gathered._scale, scale.float())
            expected = hp_tensor_and_scale_to_float8(
                whole, gathered._scale, torch.float8_e4m3fn, gathered._linear_mm_config,
                GemmInputRole.WEIGHT)
            assert torch.equal(gathered._data.view(torch.uint8),
                               expected._data.view(torch.uint8)), name
        block.reshard()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three launches, concurrently, once for the module; the run directories' parent
    (the rank check's outcome is in ``rank-check.txt`` there)."""
    root = tmp_path_factory.mktemp("float8")
    runs = root / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    one = {**spec, "jobs": [
        {"name": "one_bf16", "overrides": [*BF16, "train.micro_batch=4", *SAVE_AT_3]},
        {"name": "one_fp8", "overrides": [*FP8, "train.micro_batch=4"]},
        {"name": "one_fp8_from_bf16", "overrides": [
            *FP8, "train.micro_batch=4",
            f"checkpoint.resume={checkpoint_dir(runs, 'one_bf16', 3)}"]},
    ]}
    two = {**spec, "jobs": [
        {"name": "two_fp8", "overrides": [*FP8, "train.micro_batch=2", *SAVE_AT_3]},
        {"name": "two_bf16_from_fp8", "overrides": [
            *BF16, "train.micro_batch=2",
            f"checkpoint.resume={checkpoint_dir(runs, 'two_fp8', 3)}"]},
        {"name": "two_rowwise", "overrides": [*FP8, "train.fp8_recipe=rowwise",
                                              "train.micro_batch=2"]},
        {"name": "two_pp2", "overrides": [*FP8, "parallel.pp=2", "train.micro_batch=4",
                                          "parallel.pp_microbatches=2"]},
        {"name": "two_ddp", "overrides": [*FP8, "parallel.strategy=ddp", "train.micro_batch=2"]},
    ]}
    with ThreadPoolExecutor(max_workers=3) as pool:
        first = pool.submit(launch, 1, one, root / "launch-1", LAUNCH_TIMEOUT_S)
        second = pool.submit(launch, 2, two, root / "launch-2", LAUNCH_TIMEOUT_S)
        # Forked from the preloaded interpreter, as rank_jobs' ranks are.
        check = pool.submit(fork_spawn, _rank_check, (free_port(),), 2, LAUNCH_TIMEOUT_S)
        first.result()
        second.result()
        try:
            check.result()
            outcome = "ok"
        except AssertionError as e:
            outcome = str(e)
    (runs / "rank-check.txt").write_text(outcome)
    return runs


def test_fp8_learns_and_tracks_bf16(out: Path) -> None:
    """One rank: the fp8 loss falls and stays within the sanity bound of bf16's, every step."""
    fp8, bf16 = logged(out, "one_fp8"), logged(out, "one_bf16")
    assert sorted(fp8) == list(range(1, STEPS + 1))
    assert fp8[STEPS] < fp8[1] - 0.3, fp8
    for step in fp8:
        assert_close(fp8[step], bf16[step], FP8_VS_BF16, f"fp8 vs bf16 at step {step}")
    assert fp8 != bf16  # the float8 Linears did compute something else


def test_fsdp_float8_all_gather_matches_one_rank(out: Path) -> None:
    """2 ranks gathering float8 weights (scales precomputed after each step) follow the
    1-rank fp8 curve; the log says the weights went over the wire in float8."""
    two, one = logged(out, "two_fp8"), logged(out, "one_fp8")
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in two:
        assert_close(two[step], one[step], RANKS_RTOL, f"2-rank fp8 at step {step}")
    log = (out / "two_fp8" / "logs" / "rank-000.log").read_text()
    assert ("fp8 (tensorwise, emulated): 14 block Linears compute in float8; FSDP gathers "
            "their weights in float8") in log
    # MFU (unknown on a CPU) would be stated against the bf16 peak.
    records = read_metrics(out / "two_fp8" / "metrics" / "rank-000.jsonl")
    (layout,) = [r for r in records if r.get("event") == "layout"]
    assert layout["mfu_peak_dtype"] == "bf16"


def test_gathered_float8_weights_are_exact(out: Path) -> None:
    """2 ranks, FSDP with float8 all-gather, shards of different magnitudes: after the
    scales are precomputed, every gathered float8 weight is bit for bit the whole weight cast
    with the scale of its global maximum (``_rank_check``)."""
    assert (out / "rank-check.txt").read_text() == "ok"


def test_rowwise_pipeline_and_ddp_train(out: Path) -> None:
    """Rowwise scales (weights gathered in bf16), fp8 per pipeline stage and fp8 under DDP
    all train like the 1-rank fp8 run."""
    one = logged(out, "one_fp8")
    for name in ("two_rowwise", "two_pp2", "two_ddp"):
        run = logged(out, name)
        assert sorted(run) == list(range(1, STEPS + 1)), name
        for step in run:
            assert_close(run[step], one[step], FP8_VS_BF16, f"{name} at step {step}")


@pytest.mark.parametrize(("saved", "resumed"), [("two_fp8", "two_bf16_from_fp8"),
                                                ("one_bf16", "one_fp8_from_bf16")])
def test_checkpoints_cross_precisions(out: Path, saved: str, resumed: str) -> None:
    """A checkpoint saved under fp8 (float8-gathered weights included) resumes under bf16 and
    the other way round: same parameter names, and the loss goes on from where it was."""
    before, after = logged(out, saved), logged(out, resumed)
    assert sorted(after) == [4, 5, 6]
    for step in after:
        assert_close(after[step], before[step], FP8_VS_BF16, f"{resumed} at step {step}")
    records = read_metrics(out / resumed / "metrics" / "rank-000.jsonl")
    (load,) = [r for r in records if r.get("event") == "checkpoint_load"]
    assert load["step"] == 3

