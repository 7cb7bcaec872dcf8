"""`hpctrain tune`: candidates from the memory model, measured, the fastest written out.

Candidate generation is checked in-process (no run); one end-to-end CLI run on the CPU trains
two real candidates plus one injected failure.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hpctrain.bench.model import TrainRunError
from hpctrain.bench.tune import candidates, measure, space
from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
LLAMA_8B = REPO / "configs" / "llama-8b-fsdp.yaml"
# The 8b config's values before it left them to auto (hpctrain.plan.auto), which these short
# lists were worked out for: FSDP ZeRO-3, full AC, micro-batch 2, no batch in tokens.
AS_BEFORE = ["train.global_batch_tokens=null", "train.micro_batch=2", "parallel.strategy=fsdp",
             "parallel.activation_checkpointing=full", "parallel.reshard_after_forward=null",
             "parallel.fsdp_group_blocks=1"]
# The conftest TINY model: ~50k parameters, 32-token samples, a 200 kB corpus.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "data.seq_len=32", "data.max_bytes=200000"]


def test_bench_model_lets_one_replica_span_several_ranks(monkeypatch, tmp_path: Path) -> None:
    """tp 2 with strategy none on 2 ranks is one replica, not 2 ranks without a strategy."""
    from hpctrain.bench import model

    seen = []

    def fake_measure(path, run_dir, nproc, **kw):
        seen.append(nproc)
        return _result(nproc), 1.0

    monkeypatch.setattr(model, "measure", fake_measure)
    row, _ = model.run_model_bench(DEMO, [*TINY, "parallel.strategy=none", "parallel.tp=2"],
                                   nproc=2, out=tmp_path, steps=4, log_every=2)
    assert seen == [2] and row["ranks"] == 2
    with pytest.raises(ConfigError, match="strategy=none"):  # 2 replicas need a strategy
        model.run_model_bench(DEMO, [*TINY, "parallel.strategy=none"], nproc=2, out=tmp_path,
                              steps=4, log_every=2)


def _result(ranks: int):
    from hpctrain.bench.model import ModelResult

    return ModelResult(ranks=ranks, tokens_per_s_per_gpu=100.0, mfu=None, hfu=None,
                       peak_mem_gb=0.5, step_time_s=0.1, data_time_frac=0.0, final_loss=5.0,
                       measured_steps=(2, 4), measured_span_s=(0.0, 1.0))


# ---- candidates, in-process -----------------------------------------------------------------


def test_settings_respect_divisibility_and_keep_the_global_batch() -> None:
    # Global batch 2 x 1 x 4 = 8 samples; 4 heads and 2 KV heads (tp 4 splits no KV head
    # evenly), 2 layers (pp 1 or 2).
    cfg = load_config(DEMO, [*TINY, "parallel.strategy=ddp", "train.micro_batch=2"])
    settings = list(space.enumerate_settings(cfg, 4, precisions=("fp32",)))
    assert {(s.tp, s.pp) for s in settings} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for s in settings:
        dp = 4 // (s.tp * s.pp)
        assert s.micro_batch * s.grad_accum * dp == 8, s
        assert s.strategy == ("none" if dp == 1 else "fsdp" if s.tp * s.pp > 1 else s.strategy)
    assert {s.ac for s in settings} == {"none", "every_k", "selective", "full"}
    assert {(s.strategy, s.zero) for s in settings if s.tp == s.pp == 1} == \
        {("ddp", 3), ("fsdp", 3), ("fsdp", 2)}
    # 3 ranks: tp 3 divides no head count, pp 3 is no power of two: data parallel only.
    three = list(space.enumerate_settings(cfg, 3, precisions=("fp32",)))
    assert {(s.tp, s.pp) for s in three} == {(1, 1)}
    assert all(s.micro_batch * s.grad_accum * 3 == 6 for s in three)
    with pytest.raises(ConfigError, match="multiple of 2 GPUs"):
        space.global_batch(load_config(DEMO, [*TINY, "parallel.tp=2"]), 3)


def test_tp_and_pp_candidates_drop_the_chunked_loss(tmp_path: Path) -> None:
    """The trainer refuses train.loss_chunks with tp or pp; data-parallel ones keep it."""
    cands, _, _ = candidates.build_candidates(DEMO, [*TINY, "train.loss_chunks=4"], 2,
                                              device="cpu", gpu_bytes=16e9, peak_tflops=989.0,
                                              fp8=False, max_candidates=8)
    split = [c for c in cands if c.setting.tp * c.setting.pp > 1]
    whole = [c for c in cands if c.setting.tp * c.setting.pp == 1]
    assert split and whole
    assert all("train.loss_chunks=0" in c.overrides for c in split)
    assert all(not any(o.startswith("train.loss_chunks") for o in c.overrides) for c in whole)
    for c in cands:  # each one loads and passes the trainer's layout rules
        from hpctrain.parallel.layout import check_layout

        check_layout(load_config(DEMO, [*TINY, "train.loss_chunks=4", *c.overrides]), 2)


def test_async_tp_is_kept_for_tp_candidates_and_dropped_where_tp_is_1() -> None:
    """A config with parallel.async_tp (which needs tp > 1) still gets data-parallel candidates:
    they turn it off, the TP ones keep it, and each loads."""
    base = [*TINY, "parallel.strategy=none", "parallel.tp=2", "parallel.compile=true",
            "parallel.async_tp=true"]
    cands, _, _ = candidates.build_candidates(DEMO, base, 2, device="cpu", gpu_bytes=16e9,
                                              peak_tflops=989.0, fp8=False, max_candidates=8)
    split = [c for c in cands if c.setting.tp > 1]
    whole = [c for c in cands if c.setting.tp == 1]
    assert split and whole
    assert all(c.setting.async_tp and not any("async_tp" in o for o in c.overrides)
               for c in split)
    assert all("parallel.async_tp=false" in c.overrides for c in whole)
    for c in cands:
        load_config(DEMO, [*base, *c.overrides])


def test_fsdp_schedule_is_kept_for_fsdp_candidates_and_dropped_for_the_others() -> None:
    """A config with parallel.fsdp_prefetch and fsdp_group_blocks (which need FSDP) still gets
    DDP candidates: they turn both off, the FSDP ones keep the config's, and each loads."""
    base = [*TINY, "parallel.strategy=fsdp", "parallel.fsdp_prefetch=2",
            "parallel.fsdp_group_blocks=2"]
    cands, _, _ = candidates.build_candidates(DEMO, base, 2, device="cpu", gpu_bytes=16e9,
                                              peak_tflops=989.0, fp8=False, max_candidates=12)
    fsdp = [c for c in cands if c.setting.strategy == "fsdp"]
    other = [c for c in cands if c.setting.strategy != "fsdp"]
    assert fsdp and other
    assert all(not any("fsdp_" in o for o in c.overrides) for c in fsdp)
    assert all("parallel.fsdp_prefetch=0" in c.overrides
               and "parallel.fsdp_group_blocks=1" in c.overrides for c in other)
    for c in cands:
        par = load_config(DEMO, [*base, *c.overrides]).parallel
        sharded = c.setting.strategy == "fsdp"
        assert (par.fsdp_prefetch, par.fsdp_group_blocks) == ((2, 2) if sharded else (0, 1))


def _shortlist(gpu_gb: float, overrides: tuple[str, ...] = (), **kw
               ) -> tuple[list, list[str], int]:
    return candidates.build_candidates(LLAMA_8B, [*AS_BEFORE, *overrides], 2, device="cuda",
                                       gpu_bytes=gpu_gb * 1e9, peak_tflops=989.0,
                                       fp8=kw.pop("fp8", False), **kw)


def test_over_memory_candidates_are_dropped_and_the_list_is_short() -> None:
    """8b on 2 GPUs: at 141 GB FSDP without recomputation fits; at 90 GB it does not."""
    big, _, n_big = _shortlist(141.0, max_candidates=8)
    small, notes, n_small = _shortlist(90.0, max_candidates=8)
    # The config kept gathered and without recomputation (ZeRO-2, ~85 GB) does not fit 90 GB.
    zero2_config = ("parallel.reshard_after_forward=false",
                    "parallel.activation_checkpointing=none")
    tiny, notes_tiny, _ = _shortlist(90.0, zero2_config, max_candidates=3)
    assert n_small < n_big and len(big) == len(small) == 8 and len(tiny) == 3
    for cands, gb in ((big, 141.0), (small, 90.0), (tiny, 90.0)):
        assert all(c.predicted_peak * 1.1 <= gb * 1e9 for c in cands)
    # ZeRO-2 without recomputation at micro-batch 2 (~85 GB) is on the 141 GB list only.
    zero2 = [c for c in big if c.setting.zero == 2 and c.setting.ac == "none"
             and c.setting.micro_batch == 2]
    assert len(zero2) == 1 and zero2[0].predicted_peak * 1.1 > 90e9
    assert zero2[0].setting not in {c.setting for c in small}
    # The config as given (FSDP, full AC, micro-batch 2) is measured first, where it fits.
    assert big[0].source == "config" and big[0].overrides[0] == "parallel.strategy=fsdp"
    assert [c.source for c in big].count("config") == 1
    assert len({c.setting for c in big}) == len(big)
    assert tiny[0].source == "model" and "config as given is not a candidate" in notes_tiny[0]
    # Every candidate trains the config's global batch: 2 x 1 x 2 = 4 samples.
    for c in big + small:
        assert c.setting.micro_batch * c.setting.grad_accum * c.dp == 4
    with pytest.raises(ConfigError, match="--max-candidates"):
        _shortlist(80.0, max_candidates=0)


def test_fp8_needs_a_gpu_that_has_it_and_a_config_that_accepts_it(monkeypatch) -> None:
    assert candidates.fp8_allowed(LLAMA_8B, [], "cpu") == (False, "fp8 not tried: no GPU")
    allowed, why = candidates.fp8_allowed(LLAMA_8B, [], "cuda", capability=(8, 0))
    assert not allowed and "8.0" in why
    allowed, why = candidates.fp8_allowed(DEMO, [], "cuda", capability=(9, 0))
    assert not allowed and "fp32" in why  # the demo trains in fp32
    # Whether this tree's config takes fp8 or not, both answers are honoured.
    import hpctrain.config as config_module

    real = config_module.load_config

    def refusing(path, overrides=()):
        if "train.precision=fp8" in overrides:
            raise ConfigError("train.precision = 'fp8' is not a valid choice")
        return real(path, overrides)

    def accepting(path, overrides=()):
        return real(path, [o for o in overrides if o != "train.precision=fp8"])

    monkeypatch.setattr(config_module, "load_config", refusing)
    allowed, why = candidates.fp8_allowed(LLAMA_8B, [], "cuda", capability=(9, 0))
    assert not allowed and "refused" in why
    monkeypatch.setattr(config_module, "load_config", accepting)
    assert candidates.fp8_allowed(LLAMA_8B, [], "cuda", capability=(9, 0)) == (True, "")
    cands, _, _ = _shortlist(141.0, max_candidates=6, fp8=True)
    fp8 = [c for c in cands if c.setting.precision == "fp8"]
    assert len(cands) == 6 and len(fp8) == 2
    assert all("train.precision=fp8" in c.overrides for c in fp8)


def test_fp8_settings_are_sized_as_fp8_and_tried_where_only_fp8_fits() -> None:
    """8b without AC, micro-batch 4, on 4 GPUs of 80 GB: ZeRO-2 in bf16 needs ~81 GB, in fp8
    (float8 all-gather and saved inputs) ~67 GB, so only its fp8 form is on the list (measured
    on H200s: 68.0 GB, the fastest of tune's candidates)."""
    overrides = [*AS_BEFORE, "parallel.activation_checkpointing=none", "train.micro_batch=4"]
    cands, _, _ = candidates.build_candidates(LLAMA_8B, overrides, 4, device="cuda",
                                              gpu_bytes=80e9, peak_tflops=989.0, fp8=True,
                                              max_candidates=4)
    zero2 = [c for c in cands if c.setting.zero == 2 and c.setting.ac == "none"
             and c.setting.micro_batch == 4]
    assert [c.setting.precision for c in zero2] == ["fp8"]
    assert 60e9 < zero2[0].predicted_peak < 80e9 / candidates.HEADROOM
    # Each fp8 candidate carries its own, smaller prediction, not its bf16 twin's.
    for c in cands:
        if c.setting.precision == "fp8":
            bf16 = dataclasses.replace(c.setting, precision="bf16")
            assert c.predicted_peak < space.predict(load_config(LLAMA_8B, overrides), bf16,
                                                    4, 989.0)[0]


def test_tp_and_pp_without_fsdp_are_also_tried_with_the_other_bf16_casts() -> None:
    """8b on 2 GPUs: auto computes TP2 and PP2 through FSDP's casts (4B parameters per rank);
    each is measured beside its autocast twin, which the memory model sizes on its own."""
    cands, _, _ = _shortlist(141.0, max_candidates=8)
    assert len(cands) == 8 and len({c.setting for c in cands}) == 8
    twins = [c for c in cands if c.setting.mixed_precision != "auto"]
    assert {(c.setting.tp, c.setting.pp) for c in twins} == {(2, 1), (1, 2)}
    for twin in twins:
        assert twin.setting.mixed_precision == "autocast" and twin.setting.strategy == "none"
        assert "parallel.mixed_precision=autocast" in twin.overrides
        assert twin.label.endswith(", autocast")
        (auto,) = [c for c in cands if c.setting == dataclasses.replace(
            twin.setting, mixed_precision="auto")]
        assert "parallel.mixed_precision=autocast" not in auto.overrides
        assert twin.predicted_peak > auto.predicted_peak  # fp32 residual stream, weight copies
    # A config that names its path keeps it: no twins, and no candidate overrides it.
    pinned, _, _ = _shortlist(141.0, ("parallel.mixed_precision=autocast",
                                      "parallel.strategy=none", "parallel.tp=2"),
                              max_candidates=8)
    assert all(c.setting.mixed_precision == "autocast" for c in pinned)
    assert not any("parallel.mixed_precision" in o for c in pinned for o in c.overrides)


def test_a_pure_bf16_config_is_sized_and_ranked_in_bf16() -> None:
    """8b on 2 GPUs with train.master_weights=bf16: every candidate keeps it, is sized at the
    bf16 states (a smaller peak than the same setting with fp32 masters), and none is offered
    another path's casts or fp8 (both refused with bf16 master weights)."""
    pure, _, n_pure = _shortlist(90.0, ("train.master_weights=bf16",), max_candidates=8, fp8=True)
    masters, _, n_masters = _shortlist(90.0, max_candidates=8)
    assert n_pure > n_masters  # at 90 GB more settings fit without fp32 states
    assert pure and all(c.setting.mixed_precision == "auto" for c in pure)
    assert all(c.setting.precision == "bf16" for c in pure)
    by_setting = {c.setting: c for c in masters}
    shared = [c for c in pure if c.setting in by_setting]
    assert shared
    for c in shared:
        assert c.predicted_peak < by_setting[c.setting].predicted_peak
        if c.setting.strategy == "fsdp":
            # The same parameters to gather and reduce (gathered bf16, reduced in fp32): the
            # step-time model counts them from the bf16 states' bytes without halving them.
            assert c.predicted_tokens_per_s == pytest.approx(
                by_setting[c.setting].predicted_tokens_per_s)
    # The config's own setting says nothing of master weights: every run inherits bf16.
    cfg = load_config(LLAMA_8B, [*AS_BEFORE, "train.master_weights=bf16", *pure[0].overrides])
    assert cfg.train.master_weights == "bf16"


def test_no_fp8_candidate_on_the_cpu() -> None:
    plan = candidates.plan_tuning(DEMO, TINY, 2, max_candidates=8)
    assert plan.device == "cpu" and not plan.fp8 and "fp8 not tried: no GPU" in plan.notes
    assert len(plan.candidates) == 8
    assert all(c.setting.precision == "fp32" for c in plan.candidates)
    # The best of each layout comes before a second variant of any.
    groups = [(c.setting.strategy, c.setting.zero, c.setting.tp, c.setting.pp)
              for c in plan.candidates]
    assert {(1, 2), (2, 1)} <= {g[2:] for g in groups}


def test_failure_reason_is_one_line() -> None:
    oom = TrainRunError("the training run exited with 1:", lines=[
        "Traceback ...", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB",
        "hpctrain: error: rank 0 failed"])
    assert measure.failure_reason(oom).startswith("out of memory: torch.OutOfMemoryError")
    ours = TrainRunError("the training run exited with 2:", lines=[
        "hpctrain: error: 1 ranks cannot be split", "  expected: a world size",
        "  HINT: run on more"])
    assert measure.failure_reason(ours) == "hpctrain: error: 1 ranks cannot be split"
    timeout = TrainRunError("the training run exited with 124:",
                            lines=["step 3", "killed after 900 s"])
    assert measure.failure_reason(timeout) == "killed after 900 s"
    assert "\n" not in measure.failure_reason(TrainRunError("x" * 500)) and \
        len(measure.failure_reason(TrainRunError("x" * 500))) == 200


# ---- the command ----------------------------------------------------------------------------


def _tiny_argv(out: Path, *extra: str) -> list[str]:
    return ["tune", str(DEMO), *TINY, "--gpus", "1", "--max-candidates", "2", "--out", str(out),
            *extra]


def test_tune_cpu_end_to_end(monkeypatch, tmp_path: Path, capsys) -> None:
    """Two real candidates and one that fails in its run: the winner is written and trains."""
    real = candidates.build_candidates

    def with_a_failure(*args, **kw):
        cands, notes, n = real(*args, **kw)
        bad = space.Setting("none", 3, 1, "none", 8, 1, "fp32")  # tp 3: the trainer refuses it
        cands.insert(1, candidates.Candidate(bad, 1, "model", 1e6, 1.0, bad.overrides()))
        return cands, notes, n

    monkeypatch.setattr(candidates, "build_candidates", with_a_failure)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "tune"
    main(_tiny_argv(out))
    text = capsys.readouterr().out
    assert "[1/3]" in text and "[2/3] failed: hpctrain: error:" in text and "winner: [" in text
    doc = json.loads((out / "results.json").read_text())
    status = [c["status"] for c in doc["candidates"]]
    assert status == ["ok", "failed", "ok"]
    assert doc["candidates"][1]["reason"].startswith("hpctrain: error: 1 ranks cannot be split")
    assert doc["winner"] in (0, 2)
    best = doc["candidates"][doc["winner"]]
    assert best["measured"]["tokens_per_s_per_gpu"] == max(
        c["measured"]["tokens_per_s_per_gpu"] for c in doc["candidates"] if c["measured"])
    assert best["mem_ratio"] > 0 and best["predicted_peak_gb"] > 0
    meta = doc["meta"]
    assert meta["device"] == "cpu" and meta["global_batch"] == 8 and not meta["interrupted"]
    assert meta["command"].startswith("hpctrain tune ") and meta["torch"] and meta["date"]
    # best.overrides: the command's overrides, then the winner's; best.yaml is the same config.
    lines = (out / "best.overrides").read_text().splitlines()
    assert lines == [*TINY, *best["overrides"]]
    from hpctrain.config import to_dict

    assert to_dict(load_config(out / "best.yaml")) == to_dict(load_config(DEMO, lines))
    main(["config", str(out / "best.yaml")])  # loads and validates as a training config
    assert "micro_batch: 8" in capsys.readouterr().out
    assert (out / "c01" / "train" / "metrics" / "rank-000.jsonl").exists()


def _fake_row(tok: float) -> dict:
    return {"tokens_per_s_per_gpu": tok, "mfu_pct": None, "hfu_pct": None, "peak_mem_gb": 0.3,
            "step_time_s": 0.1, "final_loss": 5.0, "measured_steps": [2, 8], "wall_s": 1.0}


def test_ctrl_c_keeps_what_was_measured_and_resume_continues(monkeypatch, tmp_path: Path,
                                                             capsys) -> None:
    from hpctrain.bench import model

    calls = []

    def fake(config, overrides, **kw):
        calls.append(overrides)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _fake_row(123.0), None

    monkeypatch.setattr(model, "run_model_bench", fake)
    out = tmp_path / "tune"
    with pytest.raises(SystemExit) as exc:
        main(_tiny_argv(out, "--max-candidates", "3"))
    assert exc.value.code == 130
    doc = json.loads((out / "results.json").read_text())
    assert [c["status"] for c in doc["candidates"]] == ["ok", "interrupted", "not_run"]
    assert doc["meta"]["interrupted"] and doc["winner"] == 0
    assert (out / "best.overrides").exists() and (out / "best.yaml").exists()
    # --resume keeps the first and runs the other two; another tuning into it is refused.
    with pytest.raises(SystemExit) as exc:
        main(_tiny_argv(out, "--max-candidates", "3", "--resume", "--steps", "6"))
    assert exc.value.code == 2 and "steps differ" in capsys.readouterr().err
    main(_tiny_argv(out, "--max-candidates", "3", "--resume"))
    assert len(calls) == 4 and calls[2] == calls[1] and calls[3] not in calls[:3]
    doc = json.loads((out / "results.json").read_text())
    assert [c["status"] for c in doc["candidates"]] == ["ok", "ok", "ok"]
    assert not doc["meta"]["interrupted"] and "--resume" in doc["meta"]["command"]


def test_every_candidate_failing_exits_1(monkeypatch, tmp_path: Path, capsys) -> None:
    from hpctrain.bench import model

    def fake(config, overrides, **kw):
        raise TrainRunError("the training run exited with 1:", lines=["CUDA out of memory"])

    monkeypatch.setattr(model, "run_model_bench", fake)
    with pytest.raises(SystemExit) as exc:
        main(_tiny_argv(tmp_path / "tune"))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "every candidate failed" in err and "[2]" in err and "out of memory" in err
    doc = json.loads((tmp_path / "tune" / "results.json").read_text())
    assert doc["winner"] is None and not (tmp_path / "tune" / "best.yaml").exists()


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus: 0 is out of range"),
    (["--gpus", "64", "run.device=cuda"], "GPU"),
    (["--gpus", "3", "parallel.tp=2"], "multiple of 2 GPUs"),
    (["--gpus", "1", "--steps", "4", "--log-every", "3"], "steps >= 2 x log_every"),
    (["--gpus", "1", "--gpu-mem-gb", "0.0001"], "no configuration of this model fits"),
    (["--gpus", "1", "--max-candidates", "0"], "--max-candidates"),
    (["--gpus", "1", "model.size=huge"], "model"),
])
def test_bad_input_exits_2(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(DEMO), *TINY, "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


def test_unknown_config_or_a_gpu_model_without_a_gpu_exits_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(tmp_path / "nope.yaml"), "--gpus", "1"])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():  # 8b with run.device auto lands on the CPU: refused
        with pytest.raises(SystemExit) as exc:
            main(["tune", str(LLAMA_8B), "--gpus", "2", "--out", str(tmp_path)])
        assert exc.value.code == 2 and "or set run.device=cpu" in capsys.readouterr().err


def test_a_dry_run_without_a_gpu_hints_at_gpu_type(tmp_path: Path, capsys,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run on a login node wants the short list for the job's GPUs: --gpu TYPE, not the
    CPU (which the refusal of a measuring run rightly suggests)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a login node
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(LLAMA_8B), "--gpus", "4", "--dry-run", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    hint = err.split("HINT:", 1)[1]
    assert "add --gpu TYPE" in hint and "Traceback" not in err, err


def test_dry_run_prints_the_list_and_runs_nothing(tmp_path: Path, capsys) -> None:
    main(_tiny_argv(tmp_path / "tune", "--dry-run"))
    text = capsys.readouterr().out
    assert "(as configured)" in text and "predicted peak GB" in text
    assert not (tmp_path / "tune").exists()


def test_dry_run_for_a_named_gpu_type_needs_no_gpu(tmp_path: Path, capsys) -> None:
    """On a login node (no GPU), ``--gpu h200 --dry-run`` lists 8b's candidates for H200s: GPU
    memory and peak from the tables, fp8 twins since the H200 has fp8 tensor cores."""
    main(["tune", str(LLAMA_8B), "--gpus", "4", "--gpu", "h200", "--dry-run",
          "--out", str(tmp_path / "tune")])
    text = capsys.readouterr().out
    assert "fit 4 GPU(s) of 150 GB (NVIDIA H200)" in text and "(as configured)" in text
    assert "fp8" in text and "tokens/s per GPU" in text
    assert not (tmp_path / "tune").exists()
    # An A100 has no fp8 tensor cores: no fp8 candidate, and the note says why.
    main(["tune", str(LLAMA_8B), "--gpus", "4", "--gpu", "a100-80", "--dry-run"])
    text = capsys.readouterr().out
    assert "no fp8 tensor cores known for a100-80" in text


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h200"], "--gpu h200 without --dry-run"),
    (["--gpu", "rtx9", "--dry-run"], "unknown GPU 'rtx9'"),
    (["--gpu", "h200", "--dry-run", "run.device=cpu"], "--gpu h200 with run.device = cpu"),
])
def test_a_named_gpu_is_refused_where_it_cannot_apply(argv: list[str], message: str,
                                                     tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(LLAMA_8B), "--gpus", "2", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "HINT" in err and "Traceback" not in err
