"""The short list of ``hpctrain tune``: what fits, ranked, and the config as given first.

Settings from :mod:`hpctrain.bench.tune.space` that the trainer accepts and whose predicted peak
plus 10% fits the memory are ranked by predicted tokens/s per GPU; the best of each layout and
strategy is kept first, the best fp8 settings (sized as fp8) are added where the GPU and the
config allow fp8, and twins of the best tensor- or pipeline-parallel settings without FSDP that
compute bf16 the other way (``parallel.mixed_precision``: FSDP's casts or autocast, whichever
``auto`` did not take): the step-time model cannot tell them apart, and on GPUs they differed
by 3-30%.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.bench.tune.space import (
    Setting,
    config_setting,
    enumerate_settings,
    global_batch,
    predict,
)
from hpctrain.errors import ConfigError
from hpctrain.plan.auto import CPU, Gpu, named_gpu, resolve_auto
from hpctrain.plan.memory_options import HEADROOM

MAX_CANDIDATES = 6
FP8_TWINS = 2  # fp8 variants of this many of the best predicted layouts
CASTS_TWINS = 2  # other-mixed-precision variants of this many TP/PP settings without FSDP
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and newer: fp8 tensor cores


@dataclass
class Candidate:
    """A setting on the short list: what the model predicts, then what was measured."""

    setting: Setting
    dp: int
    # "config" (the config as given), "model" (chosen by the memory model) or "task" (a task's
    # setting, listed without a model: hpctrain.bench.tune.task_candidates)
    source: str
    predicted_peak: float  # bytes per GPU
    predicted_tokens_per_s: float  # per GPU, the planner's step-time model
    overrides: list[str] = field(default_factory=list)
    status: str = "pending"  # ok, failed, interrupted, not_run
    reason: str | None = None
    measured: dict[str, Any] | None = None
    run_dir: str | None = None

    @property
    def label(self) -> str:
        """Readable name of the setting ('as configured' for the baseline)."""
        text = self.setting.label(self.dp)
        return f"{text} (as configured)" if self.source == "config" else text

    @property
    def mem_ratio(self) -> float | None:
        """Measured peak / predicted peak."""
        if not self.measured or not self.predicted_peak:
            return None
        return self.measured["peak_mem_gb"] * 1e9 / self.predicted_peak

    def to_json(self, index: int) -> dict[str, Any]:
        """One entry of results.json."""
        return {"index": index, "label": self.label, "source": self.source,
                "overrides": self.overrides, "dp": self.dp,
                "settings": dataclasses.asdict(self.setting),
                "predicted_peak_gb": self.predicted_peak / 1e9,
                "predicted_tokens_per_s_per_gpu": self.predicted_tokens_per_s,
                "status": self.status, "reason": self.reason, "measured": self.measured,
                "mem_ratio": self.mem_ratio, "run_dir": self.run_dir}


@dataclass
class TunePlan:
    """The short list, and what it was built from."""

    candidates: list[Candidate]
    device: str  # cuda or cpu
    device_name: str
    gpu_bytes: float
    global_batch: int  # samples per optimizer step, every candidate
    fp8: bool
    notes: list[str]
    considered: int  # settings that fit, before the short list
    task: str | None = None  # a task of the user's own: nothing predicted (task_candidates)


def fp8_allowed(config: Path, overrides: list[str], device: str, *,
                capability: tuple[int, int] | None = None,
                named_gpu: str | None = None) -> tuple[bool, str]:
    """(whether fp8 candidates are tried, why not) for this config on a device of CUDA
    ``capability``, or on the GPU type ``named_gpu`` (``--gpu``: fp8 where its datasheet lists
    an fp8 rate)."""
    from hpctrain.config import load_config
    from hpctrain.observe.peaks import peak_tflops

    if device != "cuda":
        return False, "fp8 not tried: no GPU"
    if named_gpu is not None:
        if peak_tflops(named_gpu, "fp8") is None:
            return False, f"fp8 not tried: no fp8 tensor cores known for {named_gpu}"
    elif capability is None:
        return False, "fp8 not tried: the GPU's CUDA capability is unknown"
    if named_gpu is None and tuple(capability) < FP8_CAPABILITY:
        return False, (f"fp8 not tried: CUDA capability {capability[0]}.{capability[1]} "
                       "(fp8 tensor cores need 8.9 or newer)")
    cfg = load_config(config, overrides)
    if cfg.train.precision != "bf16":
        return False, f"fp8 not tried: the config trains in {cfg.train.precision}, not bf16"
    try:
        load_config(config, [*overrides, "train.precision=fp8"])
    except ConfigError as e:
        return False, f"fp8 not tried: train.precision=fp8 is refused ({e.what})"
    return True, ""


def build_candidates(config: Path | None, overrides: list[str], gpus: int, *, device: str,
                     gpu_bytes: float, peak_tflops: float, fp8: bool,
                     max_candidates: int = MAX_CANDIDATES) -> tuple[list[Candidate], list[str],
                                                                    int]:
    """(short list, notes, settings that fit) for ``gpus`` ranks of ``gpu_bytes`` each."""
    from hpctrain.parallel.layout import check_layout
    from hpctrain.parallel.pipeline import schedule_supported

    if max_candidates < 1:
        raise ConfigError(f"--max-candidates {max_candidates}", expected="at least 1")
    gpu = Gpu("tune", gpu_bytes, peak_tflops, cpu=device != "cuda")
    cfg = _resolved(config, overrides, gpus, gpu)
    notes: list[str] = []

    def refusal(s: Setting) -> str | None:
        """Why the trainer would refuse the setting on ``gpus`` ranks (None: it accepts it)."""
        if s.pp > 1 and not schedule_supported(cfg.parallel.pp_schedule, device):
            return f"pipeline schedule {cfg.parallel.pp_schedule} is not supported on {device}"
        try:
            check_layout(_resolved(config, [*overrides, *s.overrides(cfg)], gpus, gpu), gpus)
        except ConfigError as e:
            return e.what
        return None

    def sized(s: Setting) -> tuple[float, float] | str:
        """(peak, tokens/s) if it is predicted to fit, else why not."""
        try:
            mem, tps = predict(cfg, s, gpus, peak_tflops)
        except ConfigError as e:
            return f"the memory model cannot size it ({e.what})"
        if mem * HEADROOM > gpu_bytes:
            return (f"predicted peak {mem / 1e9:.1f} GB + 10% headroom exceeds the "
                    f"{gpu_bytes / 1e9:.1f} GB per GPU")
        return mem, tps

    baseline = None
    own = config_setting(cfg)
    why = refusal(own) or sized(own)
    if isinstance(why, tuple):
        baseline = Candidate(own, gpus // (own.tp * own.pp), "config", *why)
    else:
        notes.append(f"the config as given is not a candidate on {gpus} rank(s): {why}")

    def fitting(precision: str) -> list[Candidate]:
        """The settings in ``precision`` predicted to fit, fastest predicted first; at equal
        speed the larger micro-batch (fewer, larger kernels), ZeRO-2 before ZeRO-3, then the
        smaller peak."""
        found = []
        for s in enumerate_settings(cfg, gpus, precisions=(precision,)):
            if baseline is not None and s == baseline.setting:
                continue
            fit = sized(s)
            if isinstance(fit, tuple):
                found.append(Candidate(s, gpus // (s.tp * s.pp), "model", *fit))
        found.sort(key=lambda c: (-c.predicted_tokens_per_s, -c.setting.micro_batch,
                                  c.setting.zero, c.predicted_peak))
        return found

    ranked = fitting(cfg.train.precision)
    considered = len(ranked) + (baseline is not None)
    slots = max_candidates - (baseline is not None)
    n_fp8 = min(FP8_TWINS, max_candidates // 3) if fp8 else 0
    picked = _pick(ranked, slots - n_fp8, refusal)
    # fp8 settings are sized as fp8 (smaller than bf16: plan/memory.py), so one that fits only
    # in fp8 (8b without AC on 80 GB cards) is tried too. The step-time model ranks them as
    # their bf16 twins: the best of them usually is the fp8 twin of the best bf16 pick.
    twins = _pick(fitting("fp8"), n_fp8, refusal) if n_fp8 else []
    fp8_settings = {t.setting for t in twins}
    with_fp8 = [c for c in picked
                if dataclasses.replace(c.setting, precision="fp8") in fp8_settings]
    # Casts twins take the places of the last picks (second-best variants of a layout first).
    with_twin = []
    for c in picked:
        twin = _casts_twin(c.setting, cfg)
        fit = sized(twin) if twin and refusal(twin) is None else None
        if isinstance(fit, tuple) and len(with_twin) < min(CASTS_TWINS, max_candidates // 3):
            with_twin.append(c)
            twins.append(Candidate(twin, c.dp, "model", *fit))
    keep = [*with_fp8, *with_twin]
    while len(picked) + len(twins) > slots:
        spare = [c for c in picked if c not in keep]
        if spare:
            picked.remove(spare[-1])
        else:
            twins.pop()
    shortlist = ([baseline] if baseline else []) + picked + twins
    # The baseline, then fastest predicted first (an fp8 twin after the bf16 settings that
    # share its prediction).
    shortlist.sort(key=lambda c: (c.source != "config", -c.predicted_tokens_per_s,
                                  c.setting.precision == "fp8"))
    for c in shortlist:
        c.overrides = c.setting.overrides(cfg)
    return shortlist, notes, considered


def _resolved(config: Path | None, overrides: list[str], gpus: int, gpu: Gpu):
    """The config with its ``auto`` values chosen for ``gpus`` of ``gpu`` (hpctrain.plan.auto):
    the baseline is what training would pick, and the global batch the config's."""
    from hpctrain.config import load_config

    cfg = load_config(config, overrides)
    resolve_auto(cfg, gpus, gpu, must_fit=False)  # a baseline that does not fit is said so
    return cfg


def _casts_twin(s: Setting, cfg) -> Setting | None:
    """``s`` computing bf16 the other way, for a TP/PP setting without FSDP left to ``auto``
    (None for any other)."""
    from hpctrain.models import count_params
    from hpctrain.parallel.config import mixed_precision_path

    # FSDP's casts without sharding are for bf16 only (fp16 and fp8 are refused).
    if (s.strategy != "none" or s.tp * s.pp == 1 or s.mixed_precision != "auto"
            or s.precision != "bf16"):
        return None
    path = mixed_precision_path("auto", s.strategy, s.tp, s.pp, s.precision,
                                count_params(cfg.model.resolve(), include_embedding=True))
    return dataclasses.replace(s, mixed_precision="autocast" if path == "fsdp" else "fsdp")


def _pick(ranked: list[Candidate], n: int, refusal: Callable[[Setting], str | None]
          ) -> list[Candidate]:
    """``n`` candidates: the best of each layout and strategy first, then the next best."""
    chosen: list[Candidate] = []
    groups: set[tuple] = set()
    for first_pass in (True, False):
        for c in ranked:
            if len(chosen) >= n:
                return chosen
            s = c.setting
            group = (s.strategy, s.zero, s.tp, s.pp)
            if c in chosen or (first_pass and group in groups):
                continue
            if refusal(s) is None:
                chosen.append(c)
                groups.add(group)
    return chosen


def plan_tuning(config: Path | None, overrides: list[str], gpus: int, *,
                gpu_mem_gb: float | None = None, max_candidates: int = MAX_CANDIDATES,
                allow_fp8: bool = True, gpu: str | None = None) -> TunePlan:
    """The short list for ``config`` on ``gpus`` GPUs (or CPU ranks) of this machine, or of
    GPUs of type ``gpu`` (``h100``, ``h200``...: memory and peak from the tables, for a short
    list made where no such GPU is, e.g. a login node). This machine's GPU is read without
    initialising CUDA in this process, which runs the candidates (hpctrain.plan.gpu)."""
    from hpctrain.config import load_config
    from hpctrain.observe.peaks import peak_tflops
    from hpctrain.plan.parallel import DEFAULT_PEAK_TFLOPS

    cfg = load_config(config, overrides)
    device, name, total, capability = tuning_device(cfg, gpus, gpu=gpu, gpu_mem_gb=gpu_mem_gb)
    fp8, why = (fp8_allowed(config, overrides, device, capability=capability, named_gpu=gpu)
                if allow_fp8 else (False, "fp8 not tried: --no-fp8"))
    peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
    batch, _ = global_batch(_resolved(config, overrides, gpus, Gpu(
        name, total, peak or DEFAULT_PEAK_TFLOPS, cpu=device != "cuda")), gpus)
    candidates, notes, considered = build_candidates(
        config, overrides, gpus, device=device, gpu_bytes=total,
        peak_tflops=peak or DEFAULT_PEAK_TFLOPS, fp8=fp8, max_candidates=max_candidates)
    if why:
        notes.append(why)
    if not candidates:
        raise ConfigError(
            f"no configuration of this model fits {gpus} x {total / 1e9:.0f} GB at the "
            f"config's global batch of {batch} samples",
            expected="a layout whose predicted peak plus 10% fits the memory",
            hint="see `hpctrain plan memory`; shorten data.seq_len, lower the global batch, "
            "or use more GPUs" + (" (--gpu-mem-gb sets the size assumed)"
                                  if device == "cpu" else ""))
    return TunePlan(candidates, device, name, total, batch, fp8, notes, considered)


def tuning_device(cfg, gpus: int, *, gpu: str | None = None, gpu_mem_gb: float | None = None
                  ) -> tuple[str, str, float, tuple[int, int] | None]:
    """(device, its name, memory per GPU or rank, CUDA capability) that ``cfg`` is tuned for
    on ``gpus`` GPUs of this machine, or of type ``gpu``; read without initialising CUDA here
    (hpctrain.plan.gpu)."""
    import torch

    from hpctrain.observe.peaks import peak_tflops
    from hpctrain.plan.gpu import node_gpu

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}", expected="at least 1")
    device = cfg.run.device
    capability = None  # CUDA's, of this machine's GPU (fp8 tensor cores)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() or gpu else "cpu"
    if gpu is not None:
        if device != "cuda":
            raise ConfigError(f"--gpu {gpu} with run.device = {device}",
                              expected="run.device auto or cuda", hint="drop --gpu to tune "
                              "for CPU ranks")
        # As a rank on that GPU sees it: torch's name (training's auto matches tune's results
        # by it) and total memory.
        named = named_gpu(gpu)
        name, total = named.name, named.bytes
        if peak_tflops(gpu) is None:
            raise ConfigError(f"--gpu {gpu}: no peak TFLOP/s known for it",
                              expected="a GPU type the step-time model knows, e.g. h100, "
                              "h200, a100, b200, l40s, mi300x",
                              hint="without --gpu, tune on a node that has the GPU")
    elif device == "cuda":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise ConfigError("run.device = cuda but no GPU is visible",
                              hint="run on a GPU node, or set run.device=cpu")
        if gpus > visible:
            raise ConfigError(f"--gpus {gpus} but {visible} GPU(s) visible",
                              expected=f"at most {visible}",
                              hint="tune runs on one node; CUDA_VISIBLE_DEVICES decides what "
                              "is visible")
        here = node_gpu(cfg)  # NVML, or a child process: no CUDA context in this one
        name, total, capability = here.name, here.bytes, here.capability
    else:
        if cfg.run.device == "auto" and not cfg.task:  # a task's model is sized by its run
            from hpctrain.models import count_params
            from hpctrain.runtime.config import refuse_large_model_on_cpu

            refuse_large_model_on_cpu(count_params(cfg.model.resolve(), include_embedding=True),
                                      model=f"model size {cfg.model.size}",
                                      force="run.device=cpu")
        name, total = "cpu", CPU.bytes
    if gpu_mem_gb is not None:
        if gpu_mem_gb <= 0:
            raise ConfigError(f"--gpu-mem-gb {gpu_mem_gb}", expected="a positive size in GB")
        total = gpu_mem_gb * 1e9
    return device, name, total, capability
