"""compare.py --tuned: the peer's command line at the configuration ``hpctrain tune`` picked.

Tune's folder is written here as ``hpctrain tune`` writes it (results.json with the winner,
best.yaml the resolved config); the flags are torchtitan 0.2.2's (its ``job_config.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.config import dump_yaml, load_config
from hpctrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EIGHT_B = REPO / "configs" / "llama-8b-fsdp.yaml"
# The 8b config's values before it left them to auto: the tunings below were written for them.
AS_BEFORE = ["train.global_batch_tokens=null", "train.micro_batch=2", "parallel.strategy=fsdp",
             "parallel.activation_checkpointing=full", "parallel.reshard_after_forward=null",
             "parallel.fsdp_group_blocks=1"]


def _tune_dir(tmp_path: Path, overrides: list[str], gpus: int = 4, winner: int | None = 0,
              config: Path = EIGHT_B) -> Path:
    folder = tmp_path / "tune"
    folder.mkdir(parents=True)
    doc = {"meta": {"gpus": gpus}, "winner": winner,
           "candidates": [{"label": "the winner's label", "overrides": overrides}]}
    (folder / "results.json").write_text(json.dumps(doc))
    pinned = AS_BEFORE if config == EIGHT_B else []
    (folder / "best.yaml").write_text(dump_yaml(load_config(config, [*pinned, *overrides])))
    return folder


def _flags(argv: list[str]) -> dict[str, str]:
    """torchtitan's flags: '--a b' and '--a=b' as {a: b}, a bare '--a' as {a: ''}."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            key, eq, value = argv[i][2:].partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            out[key] = value
        i += 1
    return out


def test_fsdp_zero2_with_accumulation_checkpointing_and_fp8(compare, tmp_path: Path) -> None:
    folder = _tune_dir(tmp_path, [
        "parallel.strategy=fsdp", "parallel.tp=1", "parallel.pp=1",
        "parallel.reshard_after_forward=false", "parallel.activation_checkpointing=selective",
        "train.micro_batch=2", "train.grad_accum=2", "train.precision=fp8",
        "train.fp8_recipe=tensorwise", "parallel.fsdp_prefetch=1",
        "parallel.fsdp_group_blocks=2",
        "parallel.reduce_precision=bf16"])
    tuned = compare.read_tuned(folder)
    assert "ours prefetches 1 FSDP block(s) explicitly" in tuned.note
    assert "ours gathers 2 blocks per FSDP unit; the peer one" in tuned.note
    assert "ours reduces gradients in bf16, the peer in fp32" in tuned.note
    assert tuned.gpus == 4 and tuned.config == (folder / "best.yaml").resolve()
    assert tuned.note.startswith("tune's pick: the winner's label")
    f = _flags(tuned.peer.argv(tmp_path))
    assert f["model.flavor"] == "8B" and f["training.seq_len"] == "2048"
    assert f["parallelism.data_parallel_shard_degree"] == "4"
    assert f["parallelism.data_parallel_replicate_degree"] == "1"
    assert f["parallelism.fsdp_reshard_after_forward"] == "never"  # ZeRO-2
    # Micro-batch 2 on each of 4 ranks, two of them a step: 16 samples a step on both sides.
    assert f["training.local_batch_size"] == "2" and f["training.global_batch_size"] == "16"
    assert f["activation_checkpoint.mode"] == "selective"
    assert f["activation_checkpoint.selective_ac_option"] == "op"  # ours is per-op
    assert f["training.dtype"] == "float32"  # fp32 masters, FSDP's bf16 casts: as ours
    assert f["model.converters"] == "quantize.linear.float8"
    # The output layer stays in bf16 on both sides (ours never converts it).
    assert f["quantize.linear.float8.filter_fqns"] == "output"
    assert "quantize.linear.float8.enable_fsdp_float8_all_gather" in f
    assert "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp" in f


def test_pipeline_and_tensor_parallel_without_fsdp(compare, tmp_path: Path) -> None:
    folder = _tune_dir(tmp_path, [
        "parallel.strategy=none", "parallel.tp=2", "parallel.pp=2",
        "parallel.pp_schedule=interleaved_zb", "parallel.compile=false",
        "parallel.activation_checkpointing=every_k", "parallel.ac_every=3",
        "train.micro_batch=1", "train.grad_accum=8"])
    tuned = compare.read_tuned(folder)
    f = _flags(tuned.peer.argv(tmp_path))
    assert (f["parallelism.tensor_parallel_degree"], f["parallelism.pipeline_parallel_degree"],
            f["parallelism.data_parallel_shard_degree"]) == ("2", "2", "1")
    assert f["parallelism.pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    # 8 samples a step cut into 8 micro-batches of 1, as ours.
    assert f["training.local_batch_size"] == "8"
    assert f["parallelism.pipeline_parallel_microbatch_size"] == "1"
    assert "training.global_batch_size" not in f
    assert f["activation_checkpoint.selective_ac_option"] == "3"  # every third block
    assert "compile.no-enable" in f
    assert f["training.dtype"] == "bfloat16" and "peer: pure bf16" in tuned.note


def test_ddp_replicates_on_the_peer(compare, tmp_path: Path) -> None:
    folder = _tune_dir(tmp_path, ["parallel.strategy=ddp", "train.micro_batch=4",
                                  "parallel.activation_checkpointing=full",
                                  "train.precision=fp8", "train.fp8_recipe=rowwise"], gpus=2)
    f = _flags(compare.read_tuned(folder).peer.argv(tmp_path))
    assert f["parallelism.data_parallel_replicate_degree"] == "2"
    assert f["parallelism.data_parallel_shard_degree"] == "1"
    assert f["activation_checkpoint.mode"] == "full"
    assert "parallelism.fsdp_reshard_after_forward" not in f
    # fp32 master weights: torchtitan autocasts under DDP (its AMP), as ours does.
    assert f["training.dtype"] == "float32"
    # Rowwise scales, and no float8 all-gather without FSDP.
    assert f["quantize.linear.float8.recipe_name"] == "rowwise"
    assert "quantize.linear.float8.enable_fsdp_float8_all_gather" not in f


def test_what_the_peer_cannot_run_is_refused(compare, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as e:
        compare.read_tuned(tmp_path / "nowhere")
    assert "hpctrain tune" in e.value.hint
    with pytest.raises(ConfigError, match="has no winner"):
        compare.read_tuned(_tune_dir(tmp_path / "a", [], winner=None))
    damaged = _tune_dir(tmp_path / "d", [])
    (damaged / "results.json").write_text('{"meta": {"gpus": 4}, "winn')  # cut short
    with pytest.raises(ConfigError, match="is not a results.json of `hpctrain tune`"):
        compare.read_tuned(damaged)
    (damaged / "results.json").write_text('{"winner": 3, "candidates": [], "meta": {}}')
    with pytest.raises(ConfigError, match="IndexError"):
        compare.read_tuned(damaged)
    with pytest.raises(ConfigError, match="compared in bf16 or fp8 only"):
        compare.read_tuned(_tune_dir(tmp_path / "b", ["train.precision=fp32"]))
    with pytest.raises(ConfigError, match="no flavor"):
        compare.read_tuned(_tune_dir(tmp_path / "c", [], config=REPO / "configs" / "demo.yaml"))


def test_the_command_line_takes_a_tune_folder(compare, tmp_path: Path) -> None:
    args = compare.parser().parse_args(["--tuned", str(tmp_path), "--steps", "30"])
    assert args.tuned == tmp_path and args.layouts == []
    args = compare.parser().parse_args(["--layouts", "8b-fsdp4", "--tuned", str(tmp_path)])
    assert args.layouts == ["8b-fsdp4"]
