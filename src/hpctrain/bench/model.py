"""Training throughput of a model: tokens/s per GPU, MFU, HFU (and energy) of real runs.

    hpctrain bench model --size 1b --micro-batch 4 --compile              # one GPU
    hpctrain bench model --size 8b --strategy fsdp --ac full --nproc 4 --micro-batch 2
    hpctrain bench model --device cpu --steps 12                          # tiny model on the CPU
    hpctrain bench model --config my_task.py --nproc 2 --strategy fsdp    # your own model

The model is the built-in one, or a user's task (``--config my_task.py``, read as ``hpctrain
train`` reads it: DDP on several ranks; hpctrain.task), whose tokens are its samples times its
``tokens_per_sample``; the flags that shape the built-in model (--size, --seq-len) are refused
for a task, as training refuses activation checkpointing for it.

Each measurement is a real ``hpctrain train`` run, started as a user would start it (a child
process, ``--nproc N`` for several ranks), from a config resolved here and written next to the
results. The numbers are read back from the run's ``metrics/rank-*.jsonl``:

- warm-up is skipped: the first logging window (compilation, allocator growth) and every window
  ending in the first ``warmup_frac`` of the steps; event lines (checkpoints, bad steps) carry no
  ``tokens_per_s`` and are skipped too;
- tokens/s per GPU is each rank's median over the kept windows, averaged over ranks;
- MFU is the trainer's (PaLM convention, FLOPs/token = 6N + 12·L·H·Q·T, against the datasheet peak
  of `hpctrain.observe.peaks`; unknown, never guessed, on a CPU or an unlisted GPU);
- HFU counts the recomputed forward of activation checkpointing as well: ×4/3 with ``full``,
  ×(1 + fraction of recomputed blocks / 3) with ``every_k`` (a forward is 1/3 of fwd+bwd FLOPs),
  and with ``selective`` the matmuls it recomputes over the model's FLOPs per token (3 of the 7
  matmuls of every Llama block with ``ac_save_mm: every_other``; none with ``all``);
- energy, when a `PowerSampler` ran alongside, is the GPU energy between the end of warm-up and the
  last logged step (from the metrics' timestamps), divided by the tokens all GPUs trained then
  (the trainer's tokens per step per GPU, from the run's layout record).

The process that starts the run never initialises CUDA: ``auto`` values are chosen for the GPU
that NVML reads (hpctrain.plan.gpu.node_gpu), so no context of its own holds GPU memory while the
run it measures trains.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.bench.common import run_command
from hpctrain.bench.slow_windows import slow_windows
from hpctrain.errors import ConfigError, HpctrainError

if TYPE_CHECKING:
    from hpctrain.models import ModelArgs

COLUMNS = ["size", "strategy", "ranks", "micro_batch", "seq_len", "compile", "ac",
           "tokens_per_s_per_gpu", "mfu_pct", "hfu_pct", "peak_mem_gb", "step_time_s",
           "data_time_pct", "gpu_watts", "joules_per_token", "tokens_per_joule", "final_loss"]


class TrainRunError(HpctrainError):
    """The training run under measurement failed; the message carries its log tail."""

    exit_code = 1


def hfu_factor(ac: str, n_layers: int, ac_every: int = 2, *, args: ModelArgs | None = None,
               seq_len: int = 0, ac_save_mm: str = "every_other") -> float:
    """HFU / MFU for an activation-checkpointing mode: 4/3 for ``full``, 1 for ``none``.

    Recomputing a block re-runs its forward, 1/3 of that block's forward + backward FLOPs, so the
    hardware does 1 + (1/3)·(fraction of blocks recomputed) times the model's FLOPs.
    ``selective`` needs the model's shape (``args``) and ``seq_len``: it recomputes some
    matmuls, whose FLOPs are counted against the model's.
    """
    if ac == "none":
        return 1.0
    if ac == "full":
        return 4.0 / 3.0
    if ac == "every_k":
        if ac_every < 1 or n_layers < 1:
            raise ConfigError(f"ac_every={ac_every}, n_layers={n_layers}", expected=">= 1")
        # The same rule as parallel.parallelize: block i is checkpointed when i % k == 0.
        recomputed = sum(1 for i in range(n_layers) if i % ac_every == 0)
        return 1.0 + recomputed / n_layers / 3.0
    if ac == "selective":
        if args is None or seq_len < 1:
            raise ConfigError("selective activation checkpointing without the model's shape",
                              expected="args and seq_len >= 1")
        from hpctrain.models import flops_per_token  # torch: only when asked
        from hpctrain.parallel.selective_ac import recomputed_flops_per_token

        extra = args.n_layers * recomputed_flops_per_token(args, ac_save_mm)
        return 1.0 + extra / flops_per_token(args, seq_len)
    raise ConfigError(f"unknown activation checkpointing {ac!r}",
                      expected="none, full, every_k or selective")


def device_defaults(on_gpu: bool) -> list[str]:
    """Overrides a bench starts from: the 1b model in bf16 on a GPU, the tiny one in fp32 on CPU."""
    common = ["data.source=stdlib", "checkpoint.interval=none", "checkpoint.save_at_end=false",
              "metrics.progress=false", "run.suffix=none"]
    if on_gpu:
        return [*common, "run.device=cuda", "model.size=1b", "data.seq_len=2048",
                "data.max_bytes=0", "train.micro_batch=4", "train.precision=bf16",
                "parallel.compile=true", "optim.warmup_steps=10"]
    return [*common, "run.device=cpu", "model.size=tiny", "data.seq_len=256",
            "train.micro_batch=8", "train.precision=fp32", "parallel.compile=false",
            "optim.warmup_steps=2"]


def refuse_gpu_size_on_cpu(config: Path | None, overrides: list[str]) -> None:
    """With --device auto and no GPU, refuse a model too large for the CPU (--device cpu forces;
    a task's model is sized by its run, once built)."""
    from hpctrain.models import count_params
    from hpctrain.runtime.config import refuse_large_model_on_cpu

    cfg = run_config(config, overrides, 1)
    if cfg.task:
        return
    model = cfg.model
    refuse_large_model_on_cpu(count_params(model.resolve(), include_embedding=True),
                              model=f"model size {model.size}", force="--device cpu")


def train_argv(config_path: Path, nproc: int, python: str = sys.executable) -> list[str]:
    """The command line that trains `config_path` on `nproc` local ranks (1: no launcher)."""
    argv = [python, "-m", "hpctrain", "train", str(config_path)]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return argv


def rank_metrics(run_dir: Path, ranks: int) -> list[list[dict[str, Any]]]:
    """Per rank, every record of a run's metrics: step windows and events."""
    from hpctrain.observe.metrics import read_metrics

    per_rank = []
    for rank in range(ranks):
        path = Path(run_dir) / "metrics" / f"rank-{rank:03d}.jsonl"
        if not path.exists():
            raise TrainRunError(f"{path} is missing", hint="see the run's logs/ directory")
        per_rank.append(read_metrics(path))
    return per_rank


def _is_window(record: dict[str, Any]) -> bool:
    return isinstance(record.get("tokens_per_s"), int | float)  # event lines have none


def _windows(lines: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [[r for r in rank if _is_window(r)] for rank in lines]


def step_records(run_dir: Path, ranks: int) -> list[list[dict[str, Any]]]:
    """Per rank, the step records of a run's metrics."""
    return _windows(rank_metrics(run_dir, ranks))


def kept_windows(records: list[dict[str, Any]], warmup_frac: float = 0.3
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Split one rank's step records into (kept windows, the last warm-up record).

    The first window is always warm-up, and so is every window ending at or before
    ``warmup_frac`` of the last logged step.
    """
    if len(records) < 2:
        raise ConfigError(f"only {len(records)} logging window(s) in the run",
                          expected="at least 2 (the first one is warm-up)",
                          hint="raise --steps or lower --log-every")
    last = records[-1]["step"]
    cut = 1
    while cut < len(records) - 1 and records[cut]["step"] <= warmup_frac * last:
        cut += 1
    return records[cut:], records[cut - 1]


@dataclass
class ModelResult:
    """What one measured run delivered, per GPU unless said otherwise."""

    ranks: int
    tokens_per_s_per_gpu: float
    mfu: float | None
    hfu: float | None
    peak_mem_gb: float
    step_time_s: float
    data_time_frac: float
    final_loss: float
    measured_steps: tuple[int, int]  # (end of warm-up, last step)
    measured_span_s: tuple[float, float]  # the same, as metrics timestamps
    # The trainer's own (a model replica's tokens shared by its tp x pp GPUs; a task's samples
    # times its tokens_per_sample), from rank 0's layout record; None where it has none.
    tokens_per_step_per_gpu: float | None = None
    tokens_per_sample: int | None = None  # a task's (1: its tokens/s are samples/s); None: built-in
    gpu_watts: float | None = None  # mean over the measured span, summed over the run's GPUs
    joules_per_token: float | None = None
    # Per rank, the median wait of the host for its device at a window's end (None where the
    # metrics predate it): near zero, that rank's GPU waited for its CPU's launches.
    host_wait_s: list[float | None] | None = None
    # Measured windows more than 5% below the median, with their evidence and cause.
    slow_windows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_joule(self) -> float | None:
        """Inverse of joules per token."""
        return 1.0 / self.joules_per_token if self.joules_per_token else None


def summarise(run_dir: Path, ranks: int, *, hfu_mult: float = 1.0,
              warmup_frac: float = 0.3) -> ModelResult:
    """Throughput, MFU/HFU, memory and timing of a finished run from its per-rank metrics."""
    lines = rank_metrics(run_dir, ranks)
    windows = _windows(lines)
    kept, warm_end = [], []
    for recs in windows:
        k, w = kept_windows(recs, warmup_frac)
        kept.append(k)
        warm_end.append(w)
    tok = statistics.mean(statistics.median(r["tokens_per_s"] for r in k) for k in kept)
    mfus = [statistics.median(r["mfu"] for r in k) for k in kept
            if all(isinstance(r.get("mfu"), int | float) for r in k)]
    mfu = statistics.mean(mfus) if len(mfus) == ranks else None
    flat = [r for k in kept for r in k]
    layout = next((r for r in lines[0] if r.get("event") == "layout"), {})
    step_t = statistics.median(r["step_time_s"] for r in flat)
    data_t = statistics.median(r["data_time_s"] for r in flat)
    waits = [statistics.median(r["host_wait_s"] for r in k)
             if all("host_wait_s" in r for r in k) else None for k in kept]
    return ModelResult(
        ranks=ranks,
        tokens_per_s_per_gpu=tok,
        mfu=mfu,
        hfu=None if mfu is None else mfu * hfu_mult,
        peak_mem_gb=max(r["mem_gb"] for r in flat),
        step_time_s=step_t,
        data_time_frac=data_t / step_t if step_t else 0.0,
        final_loss=kept[0][-1]["loss"],
        measured_steps=(warm_end[0]["step"], kept[0][-1]["step"]),
        # Ranks log the same window within a collective's latency; take the widest span.
        measured_span_s=(min(w["ts"] for w in warm_end), max(k[-1]["ts"] for k in kept)),
        tokens_per_step_per_gpu=layout.get("tokens_per_step_per_gpu"),
        tokens_per_sample=layout.get("tokens_per_sample"),
        host_wait_s=waits,
        slow_windows=slow_windows(
            windows, [r for rank in lines for r in rank if not _is_window(r)],
            warm_end[0]["step"], kept[0][-1]["step"]),
    )


def add_energy(result: ModelResult, joules: float, tokens_per_step_per_rank: float) -> None:
    """Fill gpu_watts and joules/token from the GPU energy over the measured span
    (``tokens_per_step_per_rank``: each rank's share of a step's tokens)."""
    first, last = result.measured_steps
    t0, t1 = result.measured_span_s
    tokens = (last - first) * tokens_per_step_per_rank * result.ranks
    if tokens <= 0 or t1 <= t0:
        return
    result.gpu_watts = joules / (t1 - t0)
    result.joules_per_token = joules / tokens


def measure(config_path: Path, run_dir: Path, nproc: int, *, hfu_mult: float,
            timeout: float = 900.0,
            env: dict[str, str] | None = None, cwd: Path | None = None, sampler=None,
            warmup_frac: float = 0.3) -> tuple[ModelResult, float]:
    """Train `config_path` (whose run directory is `run_dir`) and summarise it.

    `sampler` is an optional `hpctrain.observe.power.PowerSampler` (not started yet); it samples
    for the whole run and the energy of the measured span is attributed to its tokens.
    Returns (result, wall seconds of the whole run including start-up).
    """
    if sampler is not None:
        sampler.start()
    try:
        code, tail, wall = run_command(train_argv(config_path, nproc), timeout=timeout,
                                       env=env, cwd=cwd)
    finally:
        if sampler is not None:
            sampler.stop()
    if code != 0:
        raise TrainRunError(f"the training run exited with {code}:", lines=tail.splitlines(),
                            hint=f"logs under {run_dir}/logs")
    result = summarise(run_dir, nproc, hfu_mult=hfu_mult, warmup_frac=warmup_frac)
    if sampler is not None and sampler.samples and result.tokens_per_step_per_gpu:
        add_energy(result, sampler.joules(*result.measured_span_s),
                   result.tokens_per_step_per_gpu)
    return result, wall


def run_model_bench(config: Path | None, overrides: list[str], *, nproc: int, out: Path,
                    steps: int, log_every: int, timeout: float = 900.0,
                    env: dict[str, str] | None = None, sampler_factory=None,
                    warmup_frac: float = 0.3) -> tuple[dict[str, Any], Any]:
    """Resolve a config, train it for `steps` steps on `nproc` ranks, return (row, config).

    The resolved config is written to ``out/config.yaml`` and trained from there (the run lands
    in ``out/train``), so the measured run is exactly the one described in the results.
    `sampler_factory(gpu_indices)` may return a power sampler (or None) for the run's GPUs.
    """
    import shutil

    from hpctrain.config import dump_yaml
    from hpctrain.parallel.layout import check_task_config
    from hpctrain.plan.auto import auto_keys, resolve_auto
    from hpctrain.plan.gpu import node_gpu

    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}", expected="at least 1 rank")
    if steps < 2 * log_every:
        raise ConfigError(f"{steps} steps with a logging window of {log_every}",
                          expected="steps >= 2 x log_every (the first window is warm-up)",
                          hint="e.g. --steps 30 --log-every 5")
    out = Path(out).resolve()
    fixed = [f"train.steps={steps}", f"metrics.log_every={log_every}",
             f"run.out_dir={out}", "run.name=train", "run.suffix=none",
             "checkpoint.interval=none", "checkpoint.save_at_end=false",
             "checkpoint.resume=never", "metrics.progress=false"]
    cfg = run_config(config, [*overrides, *fixed], nproc)
    if cfg.task:
        _refuse_model_shape(cfg.task, overrides)
    # The values its `auto` keys take on these ranks, as training's, for the GPU read without
    # CUDA here (the run's own ranks read it with CUDA, after this process wrote their config).
    resolve_auto(cfg, nproc, node_gpu(cfg) if auto_keys(cfg) else None)
    if cfg.task:  # what training refuses for a task (fp8, activation checkpointing, tp, pp)
        check_task_config(cfg, nproc)
    # One replica may span tp x pp ranks without a strategy; several replicas need one.
    if nproc > cfg.parallel.tp * cfg.parallel.pp and cfg.parallel.strategy == "none":
        raise ConfigError(f"{nproc} ranks with parallel.strategy=none",
                          expected="--strategy ddp or fsdp for several ranks")
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "train", ignore_errors=True)  # a re-used --out starts clean
    config_path = out / "config.yaml"
    config_path.write_text(dump_yaml(cfg))
    args = cfg.model.resolve()
    pc = cfg.parallel
    mult = hfu_factor(pc.activation_checkpointing, args.n_layers, pc.ac_every, args=args,
                      seq_len=cfg.data.seq_len, ac_save_mm=pc.ac_save_mm)
    on_gpu = _uses_cuda(cfg.run.device)
    sampler = sampler_factory(list(range(nproc))) if (sampler_factory and on_gpu) else None
    result, wall = measure(config_path, out / "train", nproc, hfu_mult=mult, timeout=timeout,
                           env=env, sampler=sampler, warmup_frac=warmup_frac)
    row = result_row(result, cfg)
    row["wall_s"] = wall
    return row, cfg


def run_config(config: Path | None, overrides: list[str], nproc: int):
    """The config ``hpctrain train CONFIG --nproc nproc`` would train: a YAML file, or a task
    file (hpctrain.task.load_run_config) named by its absolute path, so that the config
    written beside the results trains it from anywhere."""
    from hpctrain.task import load_run_config

    if config is None:
        from hpctrain.config import load_config

        return load_config(None, overrides)
    return load_run_config(Path(config).absolute(), overrides, nproc)


def _refuse_model_shape(task: str, overrides: list[str]) -> None:
    """Refuse overrides of the built-in model's shape for a task (its model is its own)."""
    shape = [o for o in overrides
             if o.partition("=")[0].startswith("model.") or o.startswith("data.seq_len=")]
    if shape:
        raise ConfigError(f"{' '.join(shape)} with task {task}",
                          expected="a task's own model and samples (the model section and "
                          "data.seq_len shape the built-in model only)",
                          hint="drop --size and --seq-len (or those --set values); size the "
                          "task's model in its own file")


def _uses_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def result_row(result: ModelResult, cfg) -> dict[str, Any]:
    """One results row (see COLUMNS) from a result and the run's resolved JobConfig."""
    pc = cfg.parallel
    ac = pc.activation_checkpointing + {"every_k": f"/{pc.ac_every}",
                                        "selective": f"/{pc.ac_save_mm}"}.get(
                                            pc.activation_checkpointing, "")
    return {
        "size": describe(cfg), "strategy": pc.strategy, "ranks": result.ranks,
        "micro_batch": cfg.train.micro_batch, "seq_len": None if cfg.task else cfg.data.seq_len,
        "compile": pc.compile, "ac": ac,
        "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu,
        "tokens_per_sample": result.tokens_per_sample,
        "mfu_pct": _pct(result.mfu), "hfu_pct": _pct(result.hfu),
        "peak_mem_gb": result.peak_mem_gb, "step_time_s": result.step_time_s,
        "data_time_pct": 100 * result.data_time_frac,
        "gpu_watts": result.gpu_watts, "joules_per_token": result.joules_per_token,
        "tokens_per_joule": result.tokens_per_joule, "final_loss": result.final_loss,
        "measured_steps": list(result.measured_steps),
        "host_wait_ms": None if result.host_wait_s is None else [
            None if w is None else round(1e3 * w, 2) for w in result.host_wait_s],
        "slow_windows": result.slow_windows,
    }


def describe(cfg) -> str:
    """The model measured: the built-in model's size, or ``task SPEC``."""
    return f"task {cfg.task}" if cfg.task else cfg.model.size


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction
