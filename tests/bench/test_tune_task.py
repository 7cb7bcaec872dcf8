"""`hpctrain tune my_task.py`: a task of one's own tuned as a family is (the settings training
accepts for it, measured), and `auto` taking its winner; the order in which its candidates run
and what an out-of-memory one skips, in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rank_jobs
from hpctrain.bench import model
from hpctrain.bench.tune import measure
from hpctrain.bench.tune.task_candidates import plan_task_tuning
from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.plan.auto import CPU, resolve_auto
from hpctrain.task import load_run_config

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp_parquet.py"
ON_CPU = ["run.device=cpu", "train.precision=fp32"]


def test_a_task_file_is_tuned_and_auto_takes_its_winner(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    """``tune my_task.py --device cpu --gpus 2 --max-candidates 2 --steps 3`` (was: refused,
    saying why) trains the config as given and the next setting training accepts for a task on
    2 ranks, ranks them by samples/s per GPU and writes what it writes for a family; a config
    with ``parallel.strategy=auto`` and ``parallel.tune_results=`` then takes the winner."""
    monkeypatch.setenv("MLP_TABLE", str(tmp_path / "table.parquet"))

    def ranks_forked(argv: list[str], *, timeout: float, env=None, cwd=None):
        """``hpctrain train CONFIG --nproc 2``: its two ranks forked from the preloaded
        interpreter, each through training's entry point (tests/rank_jobs.py)."""
        assert argv[1:4] == ["-m", "hpctrain", "train"] and argv[5:] == ["--nproc", "2"]
        config = Path(argv[4])  # bench model's resolved config; its run is config's folder/train
        rank_jobs.launch(2, {"config": str(config), "common": [], "out": str(config.parent),
                             "jobs": [{"name": "train", "overrides": []}]},
                         config.parent / "ranks", timeout)
        return 0, "", 1.0

    monkeypatch.setattr(model, "run_command", ranks_forked)
    out = tmp_path / "tune"
    main(["tune", str(MLP), "train.precision=fp32", "--device", "cpu", "--gpus", "2",
          "--max-candidates", "2", "--steps", "3", "--out", str(out)])
    text = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    labels = [c["label"] for c in doc["candidates"]]
    assert labels == ["DDP dp2, mb 8 x 1, no AC, fp32 (as configured)",
                      "FSDP ZeRO-2 dp2, mb 8 x 1, no AC, fp32"]
    assert [c["status"] for c in doc["candidates"]] == ["ok", "ok"]
    assert all(c["measured"]["tokens_per_sample"] == 1 and c["measured"]["tokens_per_s_per_gpu"]
               == c["measured"]["samples_per_s_per_gpu"] > 0 for c in doc["candidates"])
    assert doc["meta"]["global_batch"] == 16 and doc["winner"] in (0, 1)
    best = doc["candidates"][doc["winner"]]
    assert "samples/s per GPU" in text and f"winner: [{doc['winner'] + 1}]" in text
    assert f"train it: hpctrain train {MLP} $(cat {out / 'best.overrides'}) --nproc 2" in text
    lines = (out / "best.overrides").read_text().split()
    assert lines == ["train.precision=fp32", "run.device=cpu", *best["overrides"]]
    trained = load_config(out / "best.yaml")  # `hpctrain train best.yaml --nproc 2` trains it
    assert trained.task == str(MLP) and trained.parallel.strategy == best["settings"]["strategy"]

    cfg = load_run_config(MLP, [*ON_CPU, "parallel.strategy=auto",
                                "parallel.reshard_after_forward=auto",
                                f"parallel.tune_results={out}"], 2)
    reasons = resolve_auto(cfg, 2, CPU).reasons
    assert cfg.parallel.strategy == best["settings"]["strategy"]
    assert any(r.startswith("tune's measurements") for r in reasons), reasons


def test_a_tasks_candidates_run_smallest_first_and_an_oom_skips_the_larger(
        tmp_path: Path, monkeypatch) -> None:
    """Micro-batches 8 (the config's), 16, 32 and 4 dividing each rank's 32 samples, each as
    DDP and FSDP ZeRO-2/3: after the config as given, the smaller micro-batch first and at one
    micro-batch the sharded settings first; DDP at 8 running out of memory records DDP at 16 and
    32 as failed, unrun, and the rest run. Nothing of the task is imported to list them."""
    plan = plan_task_tuning(MLP, [*ON_CPU, "train.grad_accum=4"], 2, max_candidates=100)
    labels = [c.label.split(",")[0] + " mb " + str(c.setting.micro_batch)
              for c in plan.candidates]
    assert labels == ["DDP dp2 mb 8",
                      "FSDP ZeRO-3 dp2 mb 4", "FSDP ZeRO-2 dp2 mb 4", "DDP dp2 mb 4",
                      "FSDP ZeRO-3 dp2 mb 8", "FSDP ZeRO-2 dp2 mb 8",
                      "FSDP ZeRO-3 dp2 mb 16", "FSDP ZeRO-2 dp2 mb 16", "DDP dp2 mb 16",
                      "FSDP ZeRO-3 dp2 mb 32", "FSDP ZeRO-2 dp2 mb 32", "DDP dp2 mb 32"]
    assert all(c.setting.micro_batch * c.setting.grad_accum == 32 for c in plan.candidates)
    ran = []

    def bench(config, overrides, *, nproc, out, **kw):
        values = dict(o.split("=", 1) for o in overrides)
        ran.append((values["parallel.strategy"], int(values["train.micro_batch"])))
        if ran[-1] == ("ddp", 8):
            raise HpctrainError("the training run exited with 1:",
                                lines=["torch.OutOfMemoryError: CUDA out of memory."])
        return {"tokens_per_s_per_gpu": float(ran[-1][1]), "tokens_per_sample": 1,
                "mfu_pct": None, "peak_mem_gb": 1.0}, None

    monkeypatch.setattr(model, "run_model_bench", bench)
    measure.measure(plan, MLP, ON_CPU, 2, tmp_path, steps=3, log_every=1, timeout=60,
                    echo=lambda line: None)
    assert ("ddp", 16) not in ran and ("ddp", 32) not in ran and len(ran) == 10
    status = {(c.setting.strategy, c.setting.micro_batch): (c.status, c.reason)
              for c in plan.candidates if c.setting.zero == 3}
    assert status[("ddp", 8)] == ("failed", "out of memory: torch.OutOfMemoryError: CUDA out "
                                  "of memory.")
    assert status[("ddp", 16)] == status[("ddp", 32)] == (
        "failed", "not run: micro-batch 8 of this setting ran out of memory")
    assert status[("ddp", 4)][0] == status[("fsdp", 32)][0] == "ok"
    assert plan.candidates[measure.winner(plan.candidates)].setting.micro_batch == 32
    # What training refuses for any task is refused as training says it, not as "no setting".
    with pytest.raises(ConfigError) as refused:
        plan_task_tuning(MLP, [*ON_CPU, "parallel.activation_checkpointing=full"], 2,
                         max_candidates=6)
    assert refused.value.what == ("parallel.activation_checkpointing = full with a task of "
                                  "your own")


def test_on_a_gpu_a_tasks_candidates_are_sized_by_a_measured_step(monkeypatch) -> None:
    """On a GPU each strategy's step is measured once (a `plan memory --json` child), its peak
    extrapolated to every micro-batch; what would not fit (peak + 10%) is left out and said
    so, and a strategy whose measurement failed stays in, unsized, with the reason."""
    from hpctrain.bench.tune import task_candidates

    def memory(states: float, gathered: float) -> dict:
        """`plan memory --json` of a task's measured step (hpctrain.plan.task_memory)."""
        return {"n_params": 1, "params": states / 4, "grads": states / 4,
                "optimizer": states / 2, "gathered": gathered, "working": 2e9,
                "activations": 8 * 2e9, "per_sample": 2e9, "update_working": 1e9,
                "measured_on": "NVIDIA H100 80GB HBM3", "gpu_bytes": None, "peak": 0, "gpus": 2}

    asked = []

    def child(config, overrides, gpus):
        values = dict(o.split("=", 1) for o in overrides)
        asked.append((values["parallel.strategy"], values.get("parallel.reshard_after_forward")))
        return {("ddp", None): memory(16e9, 0.0), ("fsdp", "true"): memory(8e9, 1e9)}.get(
            asked[-1], "plan memory exited with 1: torch.OutOfMemoryError: CUDA out of memory.")

    monkeypatch.setattr(task_candidates, "tuning_device",
                        lambda cfg, gpus, **kw: ("cuda", "NVIDIA H100 80GB HBM3", 80e9, (9, 0)))
    monkeypatch.setattr(task_candidates, "measured_memory", child)
    plan = plan_task_tuning(MLP, [*ON_CPU, "train.grad_accum=4"], 2, max_candidates=100)
    assert sorted(asked) == [("ddp", None), ("fsdp", "false"), ("fsdp", "true")]
    peaks = {(c.setting.strategy, c.setting.zero, c.setting.micro_batch): c.predicted_peak
             for c in plan.candidates}
    # DDP: 16 GB of states + 2 GB working + 2 GB a sample; ZeRO-3: 8 + 1 gathered + 2 + 2 each.
    assert peaks[("ddp", 3, 8)] == 34e9 and peaks[("fsdp", 3, 16)] == 43e9
    assert ("ddp", 3, 32) not in peaks and ("fsdp", 3, 32) not in peaks  # 82 and 75 GB
    assert peaks[("fsdp", 2, 32)] == 0.0 and len(plan.candidates) == 10  # unsized, kept
    assert any(n.startswith("left out, their measured peak + 10% exceeding 80.0 GB per GPU: "
                            "DDP dp2, mb 32 x 1") for n in plan.notes), plan.notes
    assert ("FSDP ZeRO-2 dp2, mb 8 x 4, no AC, fp32 and its other micro-batches not sized: "
            "plan memory exited with 1: torch.OutOfMemoryError: CUDA out of memory."
            in plan.notes)
