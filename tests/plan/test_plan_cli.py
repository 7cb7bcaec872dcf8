"""`plan memory` and `plan parallel` take the training config and KEY=VALUE overrides as `train`
does, size them as `tune` does, and `plan parallel` prints a `train` command that runs."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, REPO, TINY, run_cli
from hpctrain.bench.tune.space import config_setting, predict
from hpctrain.cli import main, parse_args
from hpctrain.config import load_config
from hpctrain.parallel.layout import check_layout
from hpctrain.plan.auto import CPU, resolve_auto
from hpctrain.plan.memory import estimate_memory
from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes
from hpctrain.plan.parallel import rank_layouts

# The 8b config the README trained before its values became auto: fixed values, so that what
# is sized here does not follow the shipped configs.
LLAMA_8B_TEXT = """\
model: {size: 8b}
data: {source: stdlib, seq_len: 2048, max_bytes: 0}
train: {micro_batch: 2, precision: bf16}
parallel: {strategy: fsdp, activation_checkpointing: full, compile: true}
"""


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a YAML config of the 8b model, FSDP, full checkpointing, micro-batch 2."""
    path = tmp_path_factory.mktemp("configs") / "llama-8b.yaml"
    path.write_text(LLAMA_8B_TEXT)
    return str(path)


def _command(out: str) -> str:
    """The `hpctrain train` / `hpctrain sbatch` line `plan parallel` printed."""
    return next(line.strip() for line in out.splitlines()
                if line.strip().startswith(("hpctrain train ", "hpctrain sbatch ")))


def _check_as_train_would(command: str) -> None:
    """Parse ``command`` with hpctrain's own parser, then load and lay out its config as the
    trainer does before it starts (no GPU needed)."""
    args = parse_args(shlex.split(command)[1:])
    ranks = args.nproc if args.command == "train" else args.nodes * args.tasks_per_node
    cfg = load_config(args.config, args.overrides)
    resolve_auto(cfg, ranks, CPU, must_fit=False)  # as each rank does first, on its GPU
    check_layout(cfg, ranks)


def test_the_printed_command_trains_on_two_cpu_ranks(tmp_path: Path, capsys,
                                                     project: Path) -> None:
    """The layout recommended for 2 ranks of 16 GB: its line, as printed, trains."""
    main(["plan", "parallel", DEMO, *TINY, *QUIET, "train.steps=2", f"run.out_dir={tmp_path}",
          "run.name=planned", "--gpus-per-node", "2", "--gpu", "16"])
    command = _command(capsys.readouterr().out)
    assert command.startswith(f"hpctrain train {DEMO} ") and command.endswith(" --nproc 2")
    done = run_cli(shlex.split(command)[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "planned" / "exit_info.json").read_text())["exit_code"] == 0


def test_gpu_layouts_print_commands_that_load_and_lay_out(llama_8b: str, capsys) -> None:
    """8b needs GPUs: the printed lines (one node, two nodes) go through the parser, the
    config loader and the layout checks training runs first."""
    main(["plan", "parallel", llama_8b, "--gpus-per-node", "8", "--gpu", "h100"])
    out = capsys.readouterr().out
    assert "global batch 16 samples" in out  # the config's: micro_batch 2 x 8 ranks
    _check_as_train_would(_command(out))
    main(["plan", "parallel", llama_8b, "train.grad_accum=4", "--gpus-per-node", "4",
          "--nodes", "2", "--gpu", "h100"])
    out = capsys.readouterr().out
    assert "global batch 64 samples" in out  # 2 x 4 accumulated x 8 ranks
    command = _command(out)
    assert command.startswith(f"hpctrain sbatch {llama_8b} parallel.strategy=")
    assert command.count("train.grad_accum=") == 1  # the layout's, not the one planned with
    _check_as_train_would(command)


def test_every_layout_sets_back_what_it_cannot_take(llama_8b: str) -> None:
    """A config whose settings some layouts refuse (the chunked loss with tp/pp, FSDP's
    schedule without FSDP, ZeRO-2, HSDP): every ranked layout's line still loads."""
    over = ["train.loss_chunks=4", "parallel.fsdp_group_blocks=2", "parallel.fsdp_prefetch=1",
            "parallel.reshard_after_forward=false", "parallel.dp_replicate=2",
            "model.size=1b"]
    cfg = load_config(llama_8b, over)
    base = MemoryOptions.from_config(cfg, 2)
    plans = rank_layouts(cfg.model.resolve(), base, gpus_per_node=4, nodes=1,
                         gpu_bytes=gpu_memory_bytes("h100"), global_batch=16)
    assert {p.strategy for p in plans} >= {"ddp", "fsdp"} and any(p.tp > 1 for p in plans)
    for plan in plans:
        _check_as_train_would(plan.command(llama_8b, [*over, "parallel.dp_replicate=1"], 4, 1))


def test_layouts_training_refuses_are_left_out(capsys) -> None:
    """Qwen ties its embeddings, which tp and pp refuse: the memory model would fit them, the
    ranking leaves them out and says why."""
    main(["plan", "parallel", "model.family=qwen", "model.size=qwen3-0.6b", "data.seq_len=2048",
          "--gpu", "16", "--gpus-per-node", "4"])
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith("  1. ")]
    assert listed and "x tp 1 x pp 1" in listed[0] and "x tp 2" not in out
    assert "more fit but training refuses them, e.g.: model.tie_embeddings = true" in out


def test_deprecated_flags_are_the_overrides_they_name(llama_8b: str, capsys) -> None:
    """The README's `plan memory` line sizes what its overrides (and the config) size."""
    main(["plan", "memory", "--model", "8b", "--strategy", "fsdp", "--gpus", "4", "--ac",
          "full", "--micro-batch", "2", "--gpu", "h100", "--json"])
    old, err = capsys.readouterr()
    assert ("--model 8b, --strategy fsdp, --ac full, --micro-batch 2: deprecated, write "
            "model.size=8b parallel.strategy=fsdp parallel.activation_checkpointing=full "
            "train.micro_batch=2") in err
    main(["plan", "memory", llama_8b, "--gpus", "4", "--gpu", "h100", "--json"])
    assert json.loads(old) == json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, override", [
    (["memory", "--tp", "2"], "write parallel.tp=2"),
    (["parallel", "--zero", "2"], "write parallel.reshard_after_forward=false"),
    (["memory", "--no-compile"], "write parallel.compile=false"),
    (["interval", "--gpu-mttf-h", "5000"], "write checkpoint.mttf_gpu_hours=5000"),
])
def test_a_removed_flag_names_the_override_that_replaced_it(argv, override, capsys) -> None:
    """A script written for plan's old flags is told what to write, not only "unrecognized"."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["plan", *argv])
    assert exit_.value.code == 2
    assert override in capsys.readouterr().err


def test_plan_and_tune_size_a_config_alike(llama_8b: str, capsys) -> None:
    """One mapping from config to memory model: plan memory's peak is tune's prediction for
    the config as given (a pipeline; HSDP, sharded over dp_shard only)."""
    for over, gpus in ((["parallel.pp=2", "train.grad_accum=4"], 4),
                       (["parallel.dp_replicate=2"], 4)):
        main(["plan", "memory", llama_8b, *over, "--gpus", str(gpus), "--json"])
        peak = json.loads(capsys.readouterr().out)["peak"]
        cfg = load_config(llama_8b, over)
        assert predict(cfg, config_setting(cfg), gpus, 989.0)[0] == pytest.approx(peak)
    hsdp = estimate_memory(cfg.model.resolve(), MemoryOptions.from_config(cfg, 4)).peak
    fsdp2 = load_config(llama_8b, [])
    assert hsdp == estimate_memory(fsdp2.model.resolve(),
                                   MemoryOptions.from_config(fsdp2, 2)).peak


@pytest.mark.parametrize("argv, message", [
    (["memory", "LLAMA_8B", "parallel.tpp=2"],
     "unknown config key 'parallel.tpp'\n  expected: one of: strategy, "),
    (["memory", "model.size=8b", "model.sizes=1b"], "HINT: did you mean 'size'?"),
    (["memory", "LLAMA_8B", "parallel.activation_checkpointing=every_k"],
     "the memory model sizes none, selective and full only"),
    # A task config is sized by measuring its model (plan/task_memory), which must exist.
    (["memory", DEMO, "task=my_task.py"], "task file 'my_task.py' does not exist"),
    (["memory", "LLAMA_8B", "parallel.tp=3", "--gpus", "3"],
     "model.n_heads = 32 is not divisible by parallel.tp = 3"),
    (["memory", "LLAMA_8B", "--gpus", "3", "parallel.pp=2"], "multiple of 2"),
    (["memory", "LLAMA_8B", "8"], "'8' is not a KEY=VALUE override"),
    (["parallel", "LLAMA_8B", "parallel.strategy=ddp", "--gpu", "h100"],
     "'parallel.strategy=ddp' is what plan parallel chooses"),
    (["parallel", "LLAMA_8B", "--gpu", "h100", "--gpus-per-node", "3", "parallel.tp=2"],
     "3 GPUs with the config's parallel.tp 2"),
])
def test_a_key_plan_cannot_use_says_why(argv: list[str], message: str, llama_8b: str,
                                        capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *(llama_8b if word == "LLAMA_8B" else word for word in argv)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_interval_and_goodput_read_the_checkpoint_keys(tmp_path: Path, capsys) -> None:
    """checkpoint.mttf_gpu_hours and checkpoint.max_overhead, from a config file or as
    overrides, as the training schedule reads them (its default MTTF without either)."""
    config = tmp_path / "ckpt.yaml"
    config.write_text("checkpoint: {mttf_gpu_hours: 5000, max_overhead: 0.02}\n")
    main(["plan", "interval", str(config), "--save-min", "1", "--gpus", "64"])
    from_file = capsys.readouterr().out
    main(["plan", "interval", "checkpoint.mttf_gpu_hours=5000", "checkpoint.max_overhead=0.02",
          "--save-min", "1", "--gpus", "64"])
    assert capsys.readouterr().out == from_file and "job MTTF 78.12 h" in from_file
    main(["plan", "goodput", "--gpus", "1000", "--save-s", "20", "--restart-s", "300"])
    assert "job MTTF 50.00 h" in capsys.readouterr().out  # 50,000 GPU-hours per GPU
    with pytest.raises(SystemExit) as exc:
        main(["plan", "interval", "checkpoint.mttf=5", "--gpus", "8", "--save-min", "1"])
    assert exc.value.code == 2
    assert "unknown config key 'checkpoint.mttf'" in capsys.readouterr().err


def test_auto_values_are_chosen_for_the_gpus_planned(capsys) -> None:
    """A config with auto values (the shipped 8b): plan memory sizes what training would pick
    on --gpus of --gpu, and needs --gpu to pick; plan parallel's line keeps a batch in tokens."""
    config = str(REPO / "configs" / "llama-8b-fsdp.yaml")
    main(["plan", "memory", config, "--gpus", "4", "--gpu", "h100"])
    out = capsys.readouterr().out
    assert "auto on 4 x h100: parallel.strategy=fsdp" in out and "fits:" in out
    with pytest.raises(SystemExit):
        main(["plan", "memory", config, "--gpus", "4"])
    assert "expected: --gpu TYPE" in capsys.readouterr().err
    main(["plan", "parallel", config, "--gpus-per-node", "8", "--gpu", "h100",
          "--global-batch", "64"])
    command = _command(capsys.readouterr().out)
    assert "train.global_batch_tokens=131072" in command  # 64 samples of 2048 tokens
    _check_as_train_would(command)
