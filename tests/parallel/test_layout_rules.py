"""Every layout rule refuses a bad combination before training, saying what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY, run_cli
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.parallel.layout import ParallelLayout, check_layout

# TINY with 4 layers: dim 64, 4 heads, 2 KV heads, FFN 128, vocabulary 256, 32-token samples.
BASE = [*TINY, "model.n_layers=4"]
FSDP, NONE = "parallel.strategy=fsdp", "parallel.strategy=none"


def _check(world: int, *overrides: str) -> ParallelLayout:
    return check_layout(load_config(DEMO, [*BASE, *overrides]), world)


REFUSED = {
    "world size not a multiple of tp x pp": (
        6, [FSDP, "parallel.tp=2", "parallel.pp=2"], "6 ranks cannot be split"),
    "dp_replicate not dividing the rest": (
        4, [FSDP, "parallel.dp_replicate=3"], "4 ranks cannot be split"),
    "no data-parallel strategy with spare ranks": (
        4, [NONE, "parallel.tp=2"], "strategy = 'none' with 4 ranks"),
    "heads": (4, [FSDP, "model.dim=96", "model.n_heads=6", "model.n_kv_heads=6",
                  "parallel.tp=4"], "model.n_heads = 6 is not divisible by parallel.tp = 4"),
    "KV heads": (4, [FSDP, "parallel.tp=4"], "model.n_kv_heads = 2 is not divisible"),
    "FFN": (2, [FSDP, "parallel.tp=2", "model.ffn_dim=129"], "model.ffn_dim = 129"),
    "vocabulary": (2, [FSDP, "parallel.tp=2", "model.vocab_size=257"],
                   "model.vocab_size = 257"),
    "sequence (sequence parallelism)": (2, [FSDP, "parallel.tp=2", "data.seq_len=33"],
                                        "data.seq_len = 33"),
    "layers vs stages": (2, [NONE, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                             "parallel.pp_stages_per_rank=3"], "fewer than the 6 pipeline"),
    "batch vs micro-batches": (2, [NONE, "parallel.pp=2", "train.micro_batch=3",
                                   "parallel.pp_microbatches=2"], "does not divide the 3"),
    "1f1b needs a micro-batch per stage": (
        4, [NONE, "parallel.pp=4", "train.micro_batch=2", "parallel.pp_microbatches=2"],
        "at least 4 micro-batches"),
    "zbv needs 2pp-1 micro-batches": (
        2, [NONE, "parallel.pp=2", "parallel.pp_schedule=zbv", "train.micro_batch=2",
            "parallel.pp_microbatches=2"], "at least 3 micro-batches"),
    "interleaved rounds": (
        2, [NONE, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
            "train.micro_batch=5", "parallel.pp_microbatches=5"], "multiple of the 2 rounds"),
    "zbv holds two stages per rank": (
        2, [NONE, "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=1",
            "train.grad_accum=4"], "exactly 2 stages per rank"),
    "gpipe does not interleave": (
        2, [NONE, "parallel.pp=2", "parallel.pp_schedule=gpipe",
            "parallel.pp_stages_per_rank=2"], "do not interleave"),
    "zero bubble with compile": (
        2, [NONE, "parallel.pp=2", "parallel.pp_schedule=interleaved_zb", "parallel.compile=true",
            "train.grad_accum=2"], "compiled graphs"),
    "DDP with TP": (4, ["parallel.strategy=ddp", "parallel.tp=2"], "strategy = ddp"),
    "DDP with PP": (4, ["parallel.strategy=ddp", "parallel.pp=2", "train.grad_accum=2"],
                    "strategy = ddp"),
    "fp16 with TP": (2, [NONE, "parallel.tp=2", "train.precision=fp16"], "fp16"),
    "tied embeddings across stages": (
        2, [NONE, "parallel.pp=2", "model.tie_embeddings=true", "train.grad_accum=2"],
        "tie_embeddings"),
}


@pytest.mark.parametrize("rule", list(REFUSED))
def test_bad_layout_is_refused(rule: str) -> None:
    world, overrides, message = REFUSED[rule]
    with pytest.raises(ConfigError, match=message) as info:
        _check(world, *overrides)
    assert info.value.hint or info.value.expected  # it says what to change


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tp=0"], "parallel.tp = 0 must be >= 1"),
    (["parallel.strategy=ddp", "parallel.dp_replicate=2"], "dp_replicate = 2 with strategy"),
    (["parallel.pp_schedule=looped"], "not a valid choice"),
])
def test_bad_parallel_values_are_refused_when_loading(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, [*BASE, *overrides])


@pytest.mark.parametrize(("world", "overrides", "expected"), [
    (4, [FSDP, "parallel.tp=2"], ParallelLayout(1, 1, 2, 2)),
    (8, [FSDP, "parallel.dp_replicate=2", "parallel.tp=2"], ParallelLayout(1, 2, 2, 2)),
    (4, ["parallel.strategy=ddp"], ParallelLayout(1, 4, 1, 1)),
    (4, [NONE, "parallel.pp=2", "parallel.tp=2", "train.grad_accum=2"],
     ParallelLayout(2, 1, 1, 2, "1f1b", 2, 1)),
    (8, [FSDP, "parallel.pp=2", "parallel.pp_schedule=zbv", "train.micro_batch=4",
         "parallel.pp_microbatches=4"],
     ParallelLayout(2, 1, 4, 1, "zbv", 4, 2)),
    (4, [FSDP, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
         "parallel.pp_microbatches=4", "train.micro_batch=8"],
     ParallelLayout(2, 1, 2, 1, "interleaved_1f1b", 4, 2)),
])
def test_good_layouts(world: int, overrides: list[str], expected: ParallelLayout) -> None:
    """The shard degree is what is left; micro-batches default to train.grad_accum."""
    layout = _check(world, *overrides)
    assert layout == expected
    assert layout.world_size == world


def test_cli_refuses_a_bad_layout_with_exit_2(tmp_path: Path) -> None:
    """Through the real CLI: a clear message, exit 2, no traceback."""
    done = run_cli(["train", DEMO, *BASE, *QUIET, "train.steps=1", "parallel.strategy=none",
                    "parallel.tp=2", f"run.out_dir={tmp_path}"])
    assert done.returncode == 2, done.stderr
    assert "1 ranks cannot be split into tp 2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("overrides", "reshards"), [
    ([], True),
    (["parallel.reshard_after_forward=false"], False),
    (["parallel.pp=2"], False),  # each micro-batch would gather the stage twice
    (["parallel.pp=2", "parallel.reshard_after_forward=true"], True),
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.compile=false",
      "parallel.reshard_after_forward=true"], False),  # zero bubble needs them gathered
])
def test_fsdp_reshards_after_forward_unless_inside_a_pipeline(overrides: list[str],
                                                              reshards: bool) -> None:
    assert load_config(DEMO, [*BASE, FSDP, *overrides]).parallel.reshards_after_forward is (
        reshards)
