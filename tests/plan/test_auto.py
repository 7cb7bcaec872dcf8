"""``auto`` settings (hpctrain.plan.auto): chosen from the memory model, the GPU and tune's
measurements; the global batch in tokens never changes; a run records what it resolved to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.plan.auto import HEADROOM, Gpu, Pick, predict, resolve_auto

REPO = Path(__file__).resolve().parents[2]
LLAMA_1B = REPO / "configs" / "llama-1b.yaml"
AUTO = ["train.micro_batch=auto", "parallel.strategy=auto",
        "parallel.activation_checkpointing=auto", "parallel.reshard_after_forward=auto",
        "parallel.fsdp_group_blocks=auto"]
H100 = Gpu("NVIDIA H100 80GB HBM3", 85e9, 989.0)
H200 = Gpu("NVIDIA H200", 150e9, 989.0)
EIGHT_B = ["model.size=8b", "train.global_batch_tokens=16384"]


def _resolved(overrides: list[str], gpus: int, gpu: Gpu, config: Path = LLAMA_1B):
    cfg = load_config(config, [*AUTO, *overrides])
    return cfg, resolve_auto(cfg, gpus, gpu)


@pytest.mark.parametrize("model, gpu", [([], H100), (EIGHT_B, H200), (EIGHT_B, H100)])
def test_auto_keeps_the_global_batch_fits_and_is_deterministic(model, gpu) -> None:
    """1, 2 and 4 GPUs: micro_batch x grad_accum x ranks x seq_len is the batch in tokens, the
    chosen setting's predicted peak plus 10% fits, and the same inputs choose the same."""
    for gpus in (1, 2, 4):
        try:
            cfg, res = _resolved(model, gpus, gpu)
        except ConfigError as e:  # 8b on one 80 GB card: nothing fits, said so
            assert (gpus, gpu) == (1, H100) and "fits" in e.what and e.hint
            continue
        tc, pc = cfg.train, cfg.parallel
        assert tc.micro_batch * tc.grad_accum * gpus * cfg.data.seq_len == tc.global_batch_tokens
        # One GPU: one replica; 8b cannot be held whole per GPU: FSDP.
        assert pc.strategy == "none" if gpus == 1 else pc.strategy in (
            ("fsdp",) if model else ("ddp", "fsdp"))
        pick = Pick(pc.strategy, 2 if pc.reshard_after_forward is False else 3,
                    pc.activation_checkpointing, tc.micro_batch, tc.grad_accum)
        peak, _ = predict(cfg, pick, gpus, gpu, pc.fsdp_group_blocks)
        assert peak * HEADROOM <= gpu.bytes
        again, res2 = _resolved(model, gpus, gpu)
        assert res2.values == res.values and again == cfg
        if pc.activation_checkpointing != "none":  # recomputation only where none fits
            none = Pick(pc.strategy, 2, "none", 1, tc.micro_batch * tc.grad_accum)
            assert predict(cfg, none, gpus, gpu)[0] * HEADROOM > gpu.bytes


def test_auto_on_the_cpu_is_small_and_a_run_records_what_it_chose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on the CPU resolves auto to DDP-free, checkpointing-free small micro-batches and
    logs why; its config.yaml keeps auto, so that it resumes on 2 ranks with the batch in
    tokens, and config/auto.yaml holds the values chosen (what runs and report show)."""
    from hpctrain.train.job import run_training

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(DEMO, [*TINY, *QUIET, *AUTO, "train.global_batch_tokens=256",
                             "train.steps=2", "checkpoint.interval=none",
                             f"run.out_dir={tmp_path}", "run.name=auto"])
    run_training(cfg)
    (rank_log,) = (tmp_path / "auto").rglob("rank-000.log")
    text = rank_log.read_text()
    assert "auto: the memory model" in text and "global batch 256 tokens" in text
    from hpctrain.observe.rundata import load_run
    from hpctrain.parallel.layout import check_layout
    from hpctrain.train.checkpointing import config_hashes

    (written,) = (tmp_path / "auto").rglob("config.yaml")
    saved = yaml.safe_load(written.read_text())
    assert saved["train"]["micro_batch"] == "auto" and saved["parallel"]["strategy"] == "auto"
    # 256 tokens = 8 samples of 32: all in one micro-batch on one rank, nothing recomputed.
    shown = load_run(tmp_path / "auto", metrics=False).config
    assert shown["train"]["micro_batch"] == 8 and shown["train"]["grad_accum"] == 1
    assert shown["parallel"]["strategy"] == "none"
    assert shown["parallel"]["activation_checkpointing"] == "none"
    assert shown["parallel"]["fsdp_group_blocks"] == 1
    # Resumed from its own config.yaml on 2 ranks: the batch in tokens stays, the split
    # changes, the layout is one training accepts, and the checkpoint's config hash matches.
    one, two = load_config(written), load_config(written)
    resolve_auto(one, 1, Gpu("cpu", 16e9, cpu=True))
    resolve_auto(two, 2, Gpu("cpu", 16e9, cpu=True))
    check_layout(two, 2)
    assert (two.train.micro_batch, two.train.grad_accum, two.parallel.strategy) == (4, 1, "ddp")
    assert config_hashes(one) == config_hashes(two)


def test_a_gpu_named_on_a_login_node_is_the_gpu_training_sees() -> None:
    """`--gpu h200` is what a rank on an H200 sees: torch's device name (tune's results match
    it) and total_memory, not the datasheet's GB, so plan and training choose alike."""
    from hpctrain.plan.auto import named_gpu

    # 8b on one H200 fits for both (plan refused it at 141e9 B); on one H100 for neither.
    h100 = Gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20, 989.0)
    h200 = Gpu("NVIDIA H200", 139.8 * 2**30, 989.0)
    for name, seen, gpus in (("h100", h100, 4), ("h200", h200, 1), ("h200", h200, 2)):
        assert named_gpu(name) == seen
        assert _resolved(["model.size=8b"], gpus, named_gpu(name))[1].values == \
            _resolved(["model.size=8b"], gpus, seen)[1].values
    assert named_gpu("80").bytes == 80e9
    with pytest.raises(ConfigError, match="unknown GPU"):
        named_gpu("rtx9")


def test_a_batch_that_cannot_be_split_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="cannot be split over 4") as e:
        _resolved(["train.global_batch_tokens=6144"], 4, H100)  # 3 samples of 2048
    assert "8192" in e.value.hint
    with pytest.raises(ConfigError, match="without train.global_batch_tokens"):
        load_config(LLAMA_1B, ["train.micro_batch=auto", "train.global_batch_tokens=null"])
    # A grad_accum given beside the batch in tokens must be the one it implies.
    with pytest.raises(ConfigError, match="grad_accum 8") as e:
        _resolved(["train.micro_batch=4", "train.grad_accum=3"], 2, H100)
    assert "drop train.grad_accum" in e.value.hint
    with pytest.raises(ConfigError, match="strategy = 'none' with 2 ranks"):  # the mesh's words
        _resolved(["parallel.strategy=none"], 2, H100)
    cfg, _ = _resolved(["train.grad_accum=4"], 1, H100)  # fixes the micro-batch: 64 / 4
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (16, 4)


def test_fixed_values_are_kept_and_a_task_falls_back_with_a_message() -> None:
    cfg, res = _resolved(["parallel.strategy=fsdp", "parallel.activation_checkpointing=full"],
                         4, H100)
    assert (cfg.parallel.strategy, cfg.parallel.activation_checkpointing) == ("fsdp", "full")
    assert "parallel.strategy" not in res.values and cfg.parallel.reshard_after_forward in (
        True, False)
    # HSDP (dp_replicate) takes FSDP only, sized over its shard degree: 8 GPUs, 2 replicas.
    from hpctrain.plan.memory_options import MemoryOptions

    cfg, _ = _resolved(["parallel.dp_replicate=2"], 8, H100)
    assert cfg.parallel.strategy == "fsdp" and MemoryOptions.from_config(cfg, 8).gpus == 4
    # Blocks are grouped by FSDP's shard degree: 4 groups 2 per unit, 2 (4 replicas) not.
    assert cfg.parallel.fsdp_group_blocks == 2
    cfg, _ = _resolved(["parallel.dp_replicate=4"], 8, H100)
    assert cfg.parallel.fsdp_group_blocks == 1
    task = ["task=hpctrain.tasks.images:classifier", "train.global_batch_tokens=null"]
    with pytest.raises(ConfigError, match="with a task"):  # a task's samples have no tokens
        _resolved([*task, "train.micro_batch=auto", "train.global_batch_tokens=4096"], 2,
                  H100, DEMO)
    cfg, res = _resolved([*task, "train.micro_batch=4"], 2, H100, DEMO)
    assert cfg.parallel.strategy == "ddp" and "no memory model for a task" in res.reasons[0]


def test_tune_measurements_on_this_gpu_are_preferred(tmp_path: Path) -> None:
    """tune's fastest measured setting wins over the memory model's where it was measured on
    this GPU kind and count for this model and batch; a setting it saw fail is never taken;
    results from another GPU count are passed over, saying why."""
    from hpctrain.bench.tune.candidates import Candidate, TunePlan
    from hpctrain.bench.tune.measure import write_results
    from hpctrain.bench.tune.space import Setting

    fixed = ["train.global_batch_tokens=65536"]
    model_cfg, _ = _resolved(fixed, 2, H100)
    assert model_cfg.parallel.activation_checkpointing == "none"

    def cand(ac: str, mb: int, status: str, tps: float | None) -> Candidate:
        s = Setting("fsdp", 1, 1, ac, mb, 16 // mb, "bf16", zero=3)
        c = Candidate(s, 2, "model", 1e9, 1.0, overrides=s.overrides(), status=status)
        c.measured = {"tokens_per_s_per_gpu": tps, "peak_mem_gb": 50.0} if tps else None
        return c

    cands = [cand("none", 16, "failed", None), cand("selective", 4, "ok", 900.0),
             cand("full", 8, "ok", 1000.0)]
    plan = TunePlan(cands, "cuda", H100.name, H100.bytes, 16, False, [], 3)
    meta = {"device_name": H100.name, "gpus": 2, "global_batch": 32, "config": str(LLAMA_1B)}
    write_results(plan, tmp_path, meta, 2, LLAMA_1B, [*AUTO, *fixed])
    cfg, res = _resolved([*fixed, f"parallel.tune_results={tmp_path}"], 2, H100)
    assert (cfg.parallel.activation_checkpointing, cfg.train.micro_batch) == ("full", 8)
    assert cfg.parallel.reshard_after_forward is True and "tune's measurements" in res.reasons[0]
    # With checkpointing fixed to none, no measured setting fits; the model chooses the
    # largest micro-batch it predicts to fit (16, checked below), but
    # never the setting tune saw fail (none at micro-batch 16): 8.
    cfg, res = _resolved([*fixed, f"parallel.tune_results={tmp_path}",
                          "parallel.activation_checkpointing=none",
                          "parallel.strategy=fsdp", "parallel.reshard_after_forward=true"],
                         2, H100)
    assert cfg.train.micro_batch == 8 and "no measured setting" in res.reasons[0]
    cfg, _ = _resolved([*fixed, "parallel.activation_checkpointing=none",
                        "parallel.strategy=fsdp", "parallel.reshard_after_forward=true"], 2, H100)
    assert cfg.train.micro_batch == 16  # what it takes without tune's failure
    cfg, res = _resolved([*fixed, f"parallel.tune_results={tmp_path}"], 4, H100)
    assert "another GPU count (2, this run: 4)" in res.reasons[0]
    # Measured compiled: a speed of another program than an eager run's.
    cfg, res = _resolved([*fixed, f"parallel.tune_results={tmp_path}", "parallel.compile=false"],
                         2, H100)
    assert "another parallel.compile (True, this run: False)" in res.reasons[0]
    # A results file whose candidates are damaged is refused in words, not a KeyError.
    doc = json.loads((tmp_path / "results.json").read_text())
    for c in doc["candidates"]:
        c.pop("measured", None)
    (tmp_path / "results.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="not tune's results"):
        _resolved([*fixed, f"parallel.tune_results={tmp_path}"], 2, H100)


def test_a_resume_on_another_gpu_count_is_the_same_training_config() -> None:
    """With the batch in tokens, the split (micro_batch, grad_accum) is not the mathematics:
    the checkpoint's config hash stays, so a resume on 2 ranks of a 1-rank run does not warn of
    a changed training config."""
    from hpctrain.train.checkpointing import config_hashes

    hashes = []
    for ranks in (1, 2):
        cfg = load_config(DEMO, [*TINY, *AUTO, "train.global_batch_tokens=256"])
        resolve_auto(cfg, ranks, Gpu("cpu", 16e9, cpu=True))
        hashes.append(config_hashes(cfg))
    assert hashes[0] == hashes[1]


def _rank_seeing_another_gpu(rank: int, port: int, out: str) -> None:
    """One rank of a 2-rank run whose rank 1 sees a GPU of another size: both must refuse."""
    import os

    from hpctrain.plan import auto

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    if rank == 1:  # nothing fits 1 MB: the CPU's stand-in then takes micro-batch 1
        auto.this_gpu = lambda cfg: Gpu("cpu", 1e6, cpu=True)
    from hpctrain.train.job import run_training

    cfg = load_config(DEMO, [*TINY, *QUIET, *AUTO, "train.global_batch_tokens=512",
                             "train.steps=2", "checkpoint.interval=none",
                             f"run.out_dir={out}", "run.name=odd"])
    try:
        run_training(cfg)
    except ConfigError as e:
        Path(out, f"rank-{rank}.txt").write_text(e.what)


def test_ranks_that_chose_differently_are_refused(tmp_path: Path) -> None:
    """Each rank resolves auto alone from its own GPU: a rank that chose otherwise (another
    GPU kind or memory) would train another split of the batch, so every rank refuses."""
    from conftest import fork_spawn, free_port

    fork_spawn(_rank_seeing_another_gpu, (free_port(), str(tmp_path)), 2)
    for rank in (0, 1):
        text = (tmp_path / f"rank-{rank}.txt").read_text()
        assert "auto chose differently on rank 1" in text and "train.micro_batch=1" in text


def test_a_resume_with_another_global_batch_names_the_saved_one() -> None:
    """A run saved before global_batch_tokens (4 samples of 2048) resumed with a batch in
    tokens: the hint names the value that resumes it, in tokens (and in samples for a task)."""
    from hpctrain.data.order import BatchLayout, GlobalOrderSampler
    from hpctrain.data.samples import StreamLoader

    saved = {"step": 3, "global_batch": 4, "seed": 0}
    tokens = GlobalOrderSampler(4096, BatchLayout(8, 8, 8, 0), 0, seq_len=2048)
    with pytest.raises(ConfigError, match="global_batch 4, this run has 512") as e:
        tokens.load_state_dict(saved)
    assert "train.global_batch_tokens=8192" in e.value.hint
    samples = GlobalOrderSampler(4096, BatchLayout(8, 1, 1, 0), 0)  # a task's: no tokens
    with pytest.raises(ConfigError) as e:
        samples.load_state_dict(saved)
    assert "4 samples" in e.value.hint and "global_batch_tokens" not in e.value.hint
    stream = StreamLoader(iter([]), BatchLayout(8, 1, 1, 0), 0, None, list)
    with pytest.raises(ConfigError) as e:
        stream.load_state_dict(saved)
    assert "4 samples" in e.value.hint


def test_auto_and_tune_predict_a_setting_alike() -> None:
    """auto and tune rank settings by one prediction (plan/predict.py, through the planner's
    one mapping MemoryOptions.from_config): every_k between none and full, for both."""
    from hpctrain.bench.tune import space

    cfg = load_config(LLAMA_1B, [*AUTO, "parallel.fsdp_group_blocks=1"])
    for ac, k in (("none", 0), ("every_k", 2), ("full", 0)):
        ours = predict(cfg, Pick("fsdp", 2, ac, 4, 8, k), 2, H100)
        theirs = space.predict(cfg, space.Setting("fsdp", 1, 1, ac, 4, 8, "bf16", zero=2,
                                                  ac_every=k), 2, H100.peak_tflops)
        assert ours == pytest.approx(theirs)


def test_doctor_chooses_auto_for_the_jobs_ranks() -> None:
    """doctor run as one process for a job of 4 ranks (--nproc 4) sizes auto for 4, and its
    problem keeps training's 'expected'."""
    from hpctrain.launch.doctor.checks import Inputs, check_auto
    from hpctrain.launch.doctor.facts import Facts

    cfg = load_config(LLAMA_1B, ["run.device=cpu", "train.global_batch_tokens=6144"])
    one = check_auto(Inputs([Facts()], cfg=cfg))
    assert not one.problems and "on 1 rank(s)" in one.ok
    (problem,) = check_auto(Inputs([Facts()], cfg=cfg, job_ranks=4)).problems
    assert "cannot be split over 4" in problem.what and "expected: a multiple" in problem.what
