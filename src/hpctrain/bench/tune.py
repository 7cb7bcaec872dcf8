"""``hpctrain tune CONFIG --gpus N``: measure configurations the memory model allows, keep the best.

    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 2 --dry-run    # the short list, nothing run
    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 2              # measure it (minutes)
    hpctrain train runs/tune/llama-8b-fsdp/best.yaml --nproc 2      # train the winner

What is varied, on one node of ``--gpus`` GPUs: the layout (data parallel only; tensor parallel
``tp`` dividing the GPUs, the heads, KV heads, FFN width, vocabulary and sequence; pipeline
parallel ``pp``, a power of two up to the layer count), the data-parallel strategy (DDP, FSDP
ZeRO-3 ``reshard_after_forward=true`` or ZeRO-2 ``=false``; ``none`` when one replica spans all
GPUs), activation checkpointing (none, every k-th block, selective, full), the micro-batch
(powers of two), and fp8 (``train.precision=fp8``) where the config accepts it and the GPU has
fp8 tensor cores (CUDA capability 8.9 or newer; never on a CPU). Compilation, sequence length,
optimizer, data and the chunked loss are the config's (``train.loss_chunks`` is set to 0 for
tp/pp layouts, which refuse it and split the logits themselves).

**The global batch is never changed.** It is the config's ``micro_batch x grad_accum x dp`` on
``--gpus`` GPUs, and every candidate reaches it by adjusting ``train.grad_accum`` (for a
pipeline: its micro-batches). A tuner that changed the batch would change the optimisation
problem (the loss curve, the learning-rate schedule's meaning) to buy speed: that is not tuning.

How the short list is chosen: every combination is sized with `hpctrain.plan.memory` and
dropped unless its peak plus 10% fits the GPU (``torch.cuda.get_device_properties``, or
``--gpu-mem-gb``; 16 GB per rank on a CPU). The rest are ranked by the step-time model of
``hpctrain plan parallel`` (predicted tokens/s per GPU). That model has no ZeRO-2 term (ranked
just ahead of its ZeRO-3 twin: one all-gather fewer per micro-batch) and knows only ``none``
and ``full`` checkpointing: ``every_k`` and ``selective`` step times are interpolated between
the two by the share of the forward they recompute; ``every_k``'s memory too (the memory model
has no ``every_k``; the peak so interpolated errs high, but leaves out up to half a block's
activations).
Nor does it know fp8's speed: fp8 twins of the best predicted layouts are added (their memory
estimated as bf16). ``--max-candidates`` are kept: the config as given first (the baseline), the
best of each layout/strategy, then the next best. The list is printed before anything runs.

Measuring: each candidate is a real ``hpctrain train`` run via `hpctrain.bench.model` (``--steps``
steps; warm-up windows skipped, tokens/s per GPU and MFU as ``bench model`` reads them), one
after the other. A candidate that fails (out of memory, a refused layout, a timeout) is recorded
with a one-line reason and the next one runs. Ctrl-C stops the one running, writes what was
measured, and exits 130. The winner is the highest tokens/s per GPU (all candidates train the
same global batch on the same GPUs, so that is the fastest time to a given loss per step).
``--resume`` continues an interrupted call into the same ``--out``: the candidates it finished
are kept, the rest run (a call can so be split to fit a time limit).

Files in ``--out`` (default ``runs/tune/<config stem>``), written atomically:

- ``results.json``: ``meta`` (device and its name, memory used for the model, GPUs, torch
  version, date, the command, config, global batch, steps, notes, ``interrupted``), and
  ``candidates``: per candidate its label, overrides, settings, predicted peak GB and tokens/s
  per GPU, ``status`` (ok, failed, interrupted, not_run), the reason of a failure, the measured
  numbers and ``mem_ratio`` (measured peak / predicted; on a CPU the measured peak is the
  process's RSS, not comparable), and ``winner`` (its index, or null);
- ``best.overrides``: one ``key=value`` per line (the command's own overrides, then the winner's);
- ``best.yaml``: the resolved config with the winner applied (``hpctrain train best.yaml``);
- ``cNN/``: candidate NN's ``bench model`` folder (``config.yaml`` and the run in ``train/``).

Exit codes: 0 with a winner (also after ``--dry-run``), 1 when every candidate failed (their
reasons are printed), 2 for bad input (unknown config, ``--gpus`` < 1 or more than visible on a
GPU machine, no candidate that fits), 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import ConfigError, HpctrainError

MAX_CANDIDATES = 6
CPU_MEM_GB = 16.0  # per rank, for the memory model when the ranks run on the CPU
HEADROOM = 1.10  # as hpctrain.plan.memory: the peak plus 10% must fit
MAX_MICRO_BATCH = 64
AC_EVERY = 2  # every_k's k unless the config sets one
FP8_TWINS = 2  # fp8 variants of this many of the best predicted layouts
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and newer: fp8 tensor cores


class TuneFailed(HpctrainError):
    """Every candidate failed to run; the message lists each one's reason."""

    exit_code = 1


@dataclass(frozen=True)
class Setting:
    """One point of the search: the layout, strategy, checkpointing, batch shape, precision."""

    strategy: str
    tp: int
    pp: int
    ac: str
    micro_batch: int
    grad_accum: int
    precision: str
    zero: int = 3  # FSDP: 3 reshards after forward, 2 keeps the parameters gathered
    ac_every: int = 0  # every_k only
    pp_microbatches: int = 0  # pipeline only; 0: one per loader micro-batch (grad_accum)
    dp_replicate: int = 1
    loss_chunks: int = 0  # the chunked loss; refused with tp or pp

    def overrides(self, cfg=None) -> list[str]:
        """The config overrides that train this setting on top of ``cfg`` (explicit for every
        key the tuner varies; dp_replicate and loss_chunks only where they differ)."""
        out = [f"parallel.strategy={self.strategy}", f"parallel.tp={self.tp}",
               f"parallel.pp={self.pp}"]
        if self.dp_replicate != (cfg.parallel.dp_replicate if cfg else 1):
            out.append(f"parallel.dp_replicate={self.dp_replicate}")
        if self.pp > 1:
            out.append(f"parallel.pp_microbatches={self.pp_microbatches}")
        if self.strategy == "fsdp":
            out.append(f"parallel.reshard_after_forward={str(self.zero == 3).lower()}")
        out.append(f"parallel.activation_checkpointing={self.ac}")
        if self.ac == "every_k":
            out.append(f"parallel.ac_every={self.ac_every}")
        out += [f"train.micro_batch={self.micro_batch}", f"train.grad_accum={self.grad_accum}",
                f"train.precision={self.precision}"]
        if self.loss_chunks != (cfg.train.loss_chunks if cfg else 0):
            out.append(f"train.loss_chunks={self.loss_chunks}")
        return out

    def label(self, dp: int) -> str:
        """'FSDP ZeRO-3 dp2, mb 2 x 1, AC full, bf16'."""
        strategy = {"none": "one replica", "ddp": "DDP",
                    "fsdp": f"FSDP ZeRO-{self.zero}"}[self.strategy]
        layout = f"dp{dp}" + (f" tp{self.tp}" if self.tp > 1 else "") + (
            f" pp{self.pp}" if self.pp > 1 else "")
        ac = {"none": "no AC", "full": "AC full", "selective": "AC selective"}.get(
            self.ac, f"AC every {self.ac_every}")
        return (f"{strategy} {layout}, mb {self.micro_batch} x {self.grad_accum}, {ac}, "
                f"{self.precision}")


@dataclass
class Candidate:
    """A setting on the short list: what the model predicts, then what was measured."""

    setting: Setting
    dp: int
    source: str  # "config" (the config as given) or "model" (chosen by the memory model)
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


# ---- the search space and the model's view of it -----------------------------------------


def global_batch(cfg, gpus: int) -> tuple[int, int]:
    """(samples per step, data-parallel degree) of the config on ``gpus`` GPUs."""
    pc, tc = cfg.parallel, cfg.train
    model_ranks = pc.tp * pc.pp
    if gpus % model_ranks:
        raise ConfigError(
            f"--gpus {gpus} with the config's parallel.tp {pc.tp} x parallel.pp {pc.pp}",
            expected=f"a multiple of {model_ranks} GPUs: the global batch is the config's "
            "micro_batch x grad_accum x data-parallel degree on --gpus GPUs",
            hint=f"tune on a multiple of {model_ranks} GPUs, or pass parallel.tp=1 "
            "parallel.pp=1 (the tuner tries tp and pp itself)")
    dp = gpus // model_ranks
    return tc.micro_batch * tc.grad_accum * dp, dp


def config_setting(cfg) -> Setting:
    """The setting the config itself describes."""
    pc, tc = cfg.parallel, cfg.train
    m = pc.pp_microbatches if pc.pp > 1 and pc.pp_microbatches != tc.grad_accum else 0
    return Setting(strategy=pc.strategy, tp=pc.tp, pp=pc.pp,
                   ac=pc.activation_checkpointing, micro_batch=tc.micro_batch,
                   grad_accum=tc.grad_accum, precision=tc.precision,
                   zero=3 if pc.strategy != "fsdp" or pc.reshard_after_forward else 2,
                   ac_every=pc.ac_every if pc.activation_checkpointing == "every_k" else 0,
                   pp_microbatches=m if pc.pp > 1 else 0, dp_replicate=pc.dp_replicate,
                   loss_chunks=tc.loss_chunks)


def recomputed_share(cfg, ac: str, ac_every: int = 0) -> float:
    """Share of the model's forward FLOPs recomputed in backward (0: none, 1: full)."""
    args = cfg.model.resolve()
    if ac == "none":
        return 0.0
    if ac == "full":
        return 1.0
    if ac == "every_k":  # the trainer's rule: block i is checkpointed when i % k == 0
        return sum(1 for i in range(args.n_layers) if i % ac_every == 0) / args.n_layers
    if ac == "selective":
        from hpctrain.models import flops_per_token
        from hpctrain.parallel.selective_ac import recomputed_flops_per_token

        # A forward is 1/3 of the training FLOPs per token.
        extra = args.n_layers * recomputed_flops_per_token(args, cfg.parallel.ac_save_mm)
        return 3 * extra / flops_per_token(args, cfg.data.seq_len)
    raise ConfigError(f"activation checkpointing {ac!r} is not known to the tuner",
                      expected="none, every_k, selective or full")


def ac_modes(cfg) -> tuple[str, ...]:
    """Checkpointing modes to try: none, every_k (where it differs from both ends), selective,
    full."""
    k = cfg.parallel.ac_every if cfg.parallel.activation_checkpointing == "every_k" else AC_EVERY
    every_k = ("every_k",) if 0 < recomputed_share(cfg, "every_k", k) < 1 else ()
    return ("none", *every_k, "selective", "full")


def enumerate_settings(cfg, gpus: int, *, precisions: tuple[str, ...]) -> Iterator[Setting]:
    """Every setting of the search space on ``gpus`` GPUs at the config's global batch."""
    args = cfg.model.resolve()
    batch, _ = global_batch(cfg, gpus)
    k = cfg.parallel.ac_every if cfg.parallel.activation_checkpointing == "every_k" else AC_EVERY
    acs = ac_modes(cfg)
    split = (args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size, cfg.data.seq_len)
    for tp in range(1, gpus + 1):
        if gpus % tp or any(x % tp for x in split):
            continue
        for pp in (p for p in (1, 2, 4, 8, 16, 32, 64) if p <= args.n_layers):
            if (gpus // tp) % pp:
                continue
            dp = gpus // (tp * pp)
            if batch % dp:
                continue
            replica = batch // dp
            # The chunked loss (a memory saving, no change in the numbers) is refused with
            # tp or pp, which shard the logits themselves.
            chunks = cfg.train.loss_chunks
            for strategy, zero in _strategies(tp, pp, dp):
                for ac in acs:
                    mb = 1
                    while mb <= min(replica, MAX_MICRO_BATCH):
                        if replica % mb == 0:
                            for precision in precisions:
                                yield Setting(strategy=strategy, tp=tp, pp=pp, ac=ac,
                                              micro_batch=mb, grad_accum=replica // mb,
                                              precision=precision, zero=zero,
                                              ac_every=k if ac == "every_k" else 0,
                                              loss_chunks=chunks if tp * pp == 1 else 0)
                        mb *= 2


def _strategies(tp: int, pp: int, dp: int) -> list[tuple[str, int]]:
    if dp == 1:
        return [("none", 3)]
    if tp == 1 and pp == 1:
        return [("ddp", 3), ("fsdp", 3), ("fsdp", 2)]
    # The trainer refuses DDP with TP or PP; inside a pipeline the memory and step models do
    # not tell ZeRO-2 from ZeRO-3 (a stage keeps its parameters gathered through backward).
    return [("fsdp", 3), ("fsdp", 2)] if pp == 1 else [("fsdp", 3)]


def predict(cfg, s: Setting, gpus: int, peak_tflops: float) -> tuple[float, float]:
    """(peak bytes per GPU, tokens/s per GPU) the memory and step-time models give a setting.

    Raises ConfigError where the memory model refuses the setting.
    """
    from hpctrain.plan.memory import estimate_memory

    # The planner's step-time model, so that `plan parallel` and `tune` rank alike.
    from hpctrain.plan.parallel import ParallelPlan, _predict

    args = cfg.model.resolve()
    dp = gpus // (s.tp * s.pp)
    share = recomputed_share(cfg, s.ac, s.ac_every)
    peaks, step = {}, {}
    for ac in ("none", "full"):  # the step-time model knows these two
        opts = _memory_options(cfg, s, dp, ac)
        mem = estimate_memory(args, opts, suggest=False)
        plan = ParallelPlan(s.strategy, dp, s.tp, s.pp, opts.micro_batch, ac, mem, [],
                            opts.microbatches if s.pp > 1 else s.grad_accum)
        _predict(plan, args, opts, gpus, peak_tflops)
        peaks[ac], step[ac] = mem.peak, 1 / plan.tokens_per_s
    if s.ac == "every_k":  # the memory model has no every_k: between its two ends
        peak = (1 - share) * peaks["none"] + share * peaks["full"]
    else:
        peak = estimate_memory(args, _memory_options(cfg, s, dp, s.ac), suggest=False).peak
    # Step time grows with the forward FLOPs recomputed.
    return peak, 1 / ((1 - share) * step["none"] + share * step["full"])


def _memory_options(cfg, s: Setting, dp: int, ac: str):
    from hpctrain.plan.memory import MemoryOptions

    pc = cfg.parallel
    kw: dict[str, Any] = {}
    micro_batch = s.micro_batch
    if s.pp > 1:
        m = s.pp_microbatches or s.grad_accum
        micro_batch = s.micro_batch * s.grad_accum // m  # samples per pipeline micro-batch
        kw = {"pp_microbatches": m, "pp_schedule": pc.pp_schedule,
              "pp_stages_per_rank": pc.pp_stages_per_rank}
    else:
        kw = {"grad_accum": s.grad_accum}
    # The memory model knows no fp8: torchao's fp8 training keeps bf16 weights and activations
    # around its fp8 matrix products, so it is sized as bf16.
    precision = "bf16" if s.precision == "fp8" else s.precision
    return MemoryOptions(strategy=s.strategy, gpus=dp, zero=s.zero, tp=s.tp, pp=s.pp,
                         precision=precision, ac=ac, ac_save_mm=pc.ac_save_mm,
                         loss_chunks=s.loss_chunks, micro_batch=micro_batch,
                         seq_len=cfg.data.seq_len, compile=pc.compile, **kw)


# ---- building the short list ----------------------------------------------------------------


def fp8_allowed(config: Path, overrides: list[str], device: str, *, capability=None
                ) -> tuple[bool, str]:
    """(whether fp8 candidates are tried, why not) for this config on this device."""
    from hpctrain.config import load_config

    if device != "cuda":
        return False, "fp8 not tried: no GPU"
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability(0)
    if tuple(capability) < FP8_CAPABILITY:
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
    from hpctrain.config import load_config
    from hpctrain.parallel.layout import check_layout
    from hpctrain.parallel.pipeline import schedule_supported

    if max_candidates < 1:
        raise ConfigError(f"--max-candidates {max_candidates}", expected="at least 1")
    cfg = load_config(config, overrides)
    notes: list[str] = []

    def refusal(s: Setting) -> str | None:
        """Why the trainer would refuse the setting on ``gpus`` ranks (None: it accepts it)."""
        if s.pp > 1 and not schedule_supported(cfg.parallel.pp_schedule, device):
            return f"pipeline schedule {cfg.parallel.pp_schedule} is not supported on {device}"
        try:
            check_layout(load_config(config, [*overrides, *s.overrides(cfg)]), gpus)
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

    ranked = []
    for s in enumerate_settings(cfg, gpus, precisions=(cfg.train.precision,)):
        if baseline is not None and s == baseline.setting:
            continue
        fit = sized(s)
        if isinstance(fit, tuple):
            ranked.append(Candidate(s, gpus // (s.tp * s.pp), "model", *fit))
    considered = len(ranked) + (baseline is not None)
    # Fastest predicted first; at equal speed the larger micro-batch (fewer, larger kernels),
    # ZeRO-2 before ZeRO-3, then the smaller peak.
    ranked.sort(key=lambda c: (-c.predicted_tokens_per_s, -c.setting.micro_batch,
                               c.setting.zero, c.predicted_peak))
    slots = max_candidates - (baseline is not None)
    n_fp8 = min(FP8_TWINS, max_candidates // 3) if fp8 else 0
    picked = _pick(ranked, slots - n_fp8, refusal)
    twins = []
    for c in picked[:n_fp8]:
        twin = dataclasses.replace(c.setting, precision="fp8")
        if refusal(twin) is None:
            twins.append(Candidate(twin, c.dp, "model", c.predicted_peak,
                                   c.predicted_tokens_per_s))
    shortlist = ([baseline] if baseline else []) + picked + twins
    # The baseline, then fastest predicted first (an fp8 twin after the bf16 settings that
    # share its prediction).
    shortlist.sort(key=lambda c: (c.source != "config", -c.predicted_tokens_per_s,
                                  c.setting.precision == "fp8"))
    for c in shortlist:
        c.overrides = c.setting.overrides(cfg)
    return shortlist, notes, considered


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
                allow_fp8: bool = True) -> TunePlan:
    """The short list for ``config`` on ``gpus`` GPUs (or CPU ranks) of this machine."""
    import torch

    from hpctrain.config import load_config
    from hpctrain.observe.peaks import peak_tflops
    from hpctrain.plan.parallel import DEFAULT_PEAK_TFLOPS

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}", expected="at least 1")
    cfg = load_config(config, overrides)
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise ConfigError("run.device = cuda but no GPU is visible",
                              hint="run on a GPU node, or set run.device=cpu")
        if gpus > visible:
            raise ConfigError(f"--gpus {gpus} but {visible} GPU(s) visible",
                              expected=f"at most {visible}",
                              hint="tune runs on one node; CUDA_VISIBLE_DEVICES decides what "
                              "is visible")
        name = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        if cfg.run.device == "auto":
            from hpctrain.models import count_params
            from hpctrain.runtime.config import refuse_large_model_on_cpu

            refuse_large_model_on_cpu(count_params(cfg.model.resolve(), include_embedding=True),
                                      model=f"model size {cfg.model.size}",
                                      force="run.device=cpu")
        name, total = "cpu", CPU_MEM_GB * 1e9
    if gpu_mem_gb is not None:
        if gpu_mem_gb <= 0:
            raise ConfigError(f"--gpu-mem-gb {gpu_mem_gb}", expected="a positive size in GB")
        total = gpu_mem_gb * 1e9
    fp8, why = fp8_allowed(config, overrides, device) if allow_fp8 else (False, "fp8 not "
                                                                              "tried: --no-fp8")
    peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
    batch, _ = global_batch(cfg, gpus)
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


# ---- measuring and reporting ----------------------------------------------------------------


def failure_reason(err: BaseException) -> str:
    """One line saying why a candidate failed, from the error or the run's output tail."""
    text = err.what if isinstance(err, HpctrainError) else str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    oom = [line for line in lines if "out of memory" in line.lower()]
    ours = [line for line in lines if line.startswith("hpctrain: error:")]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    if oom:
        line = oom[0] if oom[0].lower().startswith("out of memory") else f"out of memory: {oom[0]}"
    else:
        line = (ours or errors or lines or ["failed"])[-1]
    return line if len(line) <= 200 else line[:197] + "..."


def measure(plan: TunePlan, config: Path | None, overrides: list[str], gpus: int, out: Path, *,
            steps: int, log_every: int, timeout: float,
            echo: Callable[[str], None] = print) -> bool:
    """Run each candidate in turn and record its result; True if Ctrl-C stopped it."""
    from hpctrain.bench.model import run_model_bench

    n = len(plan.candidates)
    for i, c in enumerate(plan.candidates, 1):
        if c.status in ("ok", "failed"):  # --resume: measured by an earlier call
            echo(f"[{i}/{n}] {c.label}: {c.status} in the earlier call, kept")
            continue
        echo(f"[{i}/{n}] {c.label}: {' '.join(c.overrides)}")
        c.run_dir = str(out / f"c{i:02d}")
        try:
            row, _ = run_model_bench(config, [*overrides, *c.overrides], nproc=gpus,
                                     out=Path(c.run_dir), steps=steps, log_every=log_every,
                                     timeout=timeout)
        except KeyboardInterrupt:
            c.status, c.reason = "interrupted", "Ctrl-C"
            for rest in plan.candidates[i:]:
                rest.status = "not_run"
            echo(f"[{i}/{n}] interrupted: keeping the {i - 1} measured before")
            return True
        except HpctrainError as e:
            c.status, c.reason = "failed", failure_reason(e)
            echo(f"[{i}/{n}] failed: {c.reason}")
            continue
        c.status = "ok"
        c.measured = {key: row.get(key) for key in (
            "tokens_per_s_per_gpu", "mfu_pct", "hfu_pct", "peak_mem_gb", "step_time_s",
            "final_loss", "measured_steps", "wall_s")}
        mfu = "unknown" if row["mfu_pct"] is None else f"{row['mfu_pct']:.1f}%"
        echo(f"[{i}/{n}] {row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {mfu}, "
             f"peak {row['peak_mem_gb']:.2f} GB (predicted {c.predicted_peak / 1e9:.2f})")
    return False


def resume_from(plan: TunePlan, path: Path, same: dict[str, Any]) -> int:
    """Take the finished candidates of an earlier call of the same tuning; return how many."""
    try:
        doc = json.loads(path.read_text())
        earlier = doc["candidates"]
        differs = [k for k, v in same.items() if doc["meta"].get(k) != v]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume: {path} cannot be read ({e})",
                          hint="drop --resume, or pass another --out") from None
    if differs or [c["overrides"] for c in earlier] != [c.overrides for c in plan.candidates]:
        raise ConfigError(
            f"--resume: {path} is from another tuning ("
            + (f"its {', '.join(differs)} differ" if differs else "other candidates") + ")",
            expected="the same config, overrides, GPUs, device and steps as the earlier call",
            hint="drop --resume to start over (it overwrites results.json), or pass another "
            "--out")
    taken = 0
    for c, e in zip(plan.candidates, earlier, strict=True):
        if e["status"] in ("ok", "failed"):
            c.status, c.reason, c.measured, c.run_dir = (e["status"], e["reason"], e["measured"],
                                                        e["run_dir"])
            taken += 1
    return taken


def winner(candidates: list[Candidate]) -> int | None:
    """Index of the fastest measured candidate (tokens/s per GPU), None if none ran."""
    ok = [i for i, c in enumerate(candidates) if c.status == "ok"]
    if not ok:
        return None
    return max(ok, key=lambda i: candidates[i].measured["tokens_per_s_per_gpu"])


def print_shortlist(plan: TunePlan, gpus: int) -> None:
    """The candidates and their predictions, before anything runs."""
    from rich.console import Console
    from rich.table import Table

    on_gpu = plan.device == "cuda"
    unit = "GPU" if on_gpu else "rank"
    table = Table(title=f"{len(plan.candidates)} of {plan.considered} settings that fit "
                  f"{gpus} {unit}(s) of {plan.gpu_bytes / 1e9:.0f} GB ({plan.device_name}), "
                  f"global batch {plan.global_batch}")
    for col in ("#", "candidate", "predicted tokens/s per GPU", "predicted peak GB"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for i, c in enumerate(plan.candidates, 1):
        table.add_row(str(i), c.label, f"{c.predicted_tokens_per_s:,.0f}" if on_gpu else "-",
                      f"{c.predicted_peak / 1e9:.2f}")
    Console(width=160).print(table)
    if not on_gpu:
        print("note: on the CPU the step-time model (made for GPUs) only orders the candidates")
    for note in plan.notes:
        print(f"note: {note}")


def print_results(plan: TunePlan, best: int | None) -> None:
    """Measured against predicted, per candidate."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tune results")
    for col in ("#", "candidate", "tokens/s per GPU", "MFU %", "peak GB", "predicted GB",
                "measured/predicted", "status"):
        table.add_column(col, justify="left" if col in ("candidate", "status") else "right")
    for i, c in enumerate(plan.candidates):
        m = c.measured or {}
        status = c.status + (f": {c.reason}" if c.reason and c.status == "failed" else "")
        table.add_row(str(i + 1) + (" *" if i == best else ""), c.label,
                      _num(m.get("tokens_per_s_per_gpu"), ",.0f"), _num(m.get("mfu_pct"), ".1f"),
                      _num(m.get("peak_mem_gb"), ".2f"), f"{c.predicted_peak / 1e9:.2f}",
                      _num(c.mem_ratio, ".2f"), status)
    Console(width=200).print(table)
    if plan.device == "cpu":
        print("note: on the CPU the measured peak is the process's RSS; the model predicts GPU "
              "memory, so the ratio says little here")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def write_results(plan: TunePlan, out: Path, meta: dict[str, Any], best: int | None,
                  config: Path | None, overrides: list[str]) -> list[Path]:
    """Write results.json and, with a winner, best.overrides and best.yaml; return the paths."""
    from hpctrain.config import dump_yaml, load_config
    from hpctrain.data.shards import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "winner": best,
           "candidates": [c.to_json(i) for i, c in enumerate(plan.candidates)]}
    paths = [out / "results.json"]
    atomic_write(paths[0], [(json.dumps(doc, indent=2) + "\n").encode()])
    if best is None:
        return paths
    c = plan.candidates[best]
    lines = [*overrides, *c.overrides]
    atomic_write(out / "best.overrides", ["".join(f"{x}\n" for x in lines).encode()])
    tok = c.measured["tokens_per_s_per_gpu"]
    header = (f"# hpctrain tune: {c.label}, {tok:,.0f} tokens/s per GPU on {meta['gpus']} x "
              f"{plan.device_name} ({out / 'results.json'})\n")
    text = header + dump_yaml(load_config(config, lines))
    atomic_write(out / "best.yaml", [text.encode()])
    return [*paths, out / "best.overrides", out / "best.yaml"]


# ---- the command ----------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tune`` on the top-level sub-parser set."""
    p = sub.add_parser("tune", help="measure a short list of configurations, keep the fastest",
                       description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="YAML config, e.g. configs/llama-8b-fsdp.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides applied before tuning (kept in best.overrides)")
    p.add_argument("--gpus", type=int, required=True,
                   help="GPUs of this node to tune for (CPU ranks without a GPU)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="memory per GPU the model sizes against (default: the GPU's; "
                   f"{CPU_MEM_GB:g} per rank on a CPU)")
    p.add_argument("--max-candidates", type=int, default=MAX_CANDIDATES,
                   help="how many configurations to measure")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per candidate (default 30 on a GPU, 8 on a CPU)")
    p.add_argument("--log-every", type=int, default=None,
                   help="logging window (default 5 on a GPU, 2 on a CPU)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per candidate")
    p.add_argument("--no-fp8", action="store_true", help="never try train.precision=fp8")
    p.add_argument("--resume", action="store_true",
                   help="keep the candidates an earlier, interrupted call measured into --out "
                   "and run the rest")
    p.add_argument("--dry-run", action="store_true",
                   help="print the short list and its predictions, run nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default runs/tune/<config stem>)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain tune``: plan, measure, report, write."""
    import torch

    plan = plan_tuning(args.config, args.overrides, args.gpus, gpu_mem_gb=args.gpu_mem_gb,
                       max_candidates=args.max_candidates, allow_fp8=not args.no_fp8)
    on_gpu = plan.device == "cuda"
    steps = args.steps or (30 if on_gpu else 8)
    log_every = args.log_every or (5 if on_gpu else 2)
    if log_every < 1 or steps < 2 * log_every:
        raise ConfigError(f"--steps {steps} with --log-every {log_every}",
                          expected="steps >= 2 x log_every >= 2 (the first window is warm-up)",
                          hint="e.g. --steps 30 --log-every 5")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}", expected="seconds, > 0")
    print_shortlist(plan, args.gpus)
    if args.dry_run:
        return
    out = (args.out or Path("runs") / "tune" / args.config.stem).resolve()
    same = {"config": str(args.config.resolve()), "overrides": args.overrides,
            "gpus": args.gpus, "device_name": plan.device_name, "steps": steps,
            "log_every": log_every}
    if args.resume and (out / "results.json").exists():
        taken = resume_from(plan, out / "results.json", same)
        print(f"--resume: {taken} candidate(s) measured by an earlier call are kept")
    print(f"measuring {len(plan.candidates)} candidates, {steps} steps each, into {out}",
          flush=True)
    interrupted = measure(plan, args.config, args.overrides, args.gpus, out, steps=steps,
                          log_every=log_every, timeout=args.timeout,
                          echo=lambda line: print(line, flush=True))
    best = winner(plan.candidates)
    meta = {**same, "device": plan.device, "gpu_mem_gb": plan.gpu_bytes / 1e9,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": _command(args), "global_batch": plan.global_batch, "fp8": plan.fp8,
            "notes": plan.notes, "interrupted": interrupted}
    print_results(plan, best)
    paths = write_results(plan, out, meta, best, args.config, args.overrides)
    if best is not None:
        _announce(plan, best, args.config, out, args.gpus)
    elif not interrupted and (out / "best.overrides").exists():
        print(f"note: {out / 'best.overrides'} and best.yaml are from an earlier tuning, "
              "left as they were")
    print(f"results: {', '.join(str(p) for p in paths)}")
    if interrupted:
        raise KeyboardInterrupt
    if best is None:
        reasons = "\n".join(f"  [{i}] {c.label}: {c.reason}"
                            for i, c in enumerate(plan.candidates, 1))
        raise TuneFailed(f"every candidate failed:\n{reasons}",
                         hint=f"the runs' logs are under {out}/cNN/train/logs")


def _announce(plan: TunePlan, best: int, config: Path, out: Path, gpus: int) -> None:
    c = plan.candidates[best]
    tok = c.measured["tokens_per_s_per_gpu"]
    line = f"winner: [{best + 1}] {c.label}: {tok:,.0f} tokens/s per GPU"
    base = next((b for b in plan.candidates if b.source == "config" and b.status == "ok"), None)
    if base is not None and base is not c:
        gain = tok / base.measured["tokens_per_s_per_gpu"] - 1
        line += f" ({gain:+.1%} over the config as given)"
    print(line)
    nproc = f" --nproc {gpus}" if gpus > 1 else ""
    print(f"train it: hpctrain train {config} $(cat {out / 'best.overrides'}){nproc}")


def _command(args: argparse.Namespace) -> str:
    argv = ["hpctrain", "tune", str(args.config), *args.overrides, "--gpus", str(args.gpus)]
    for flag, value in (("--gpu-mem-gb", args.gpu_mem_gb), ("--steps", args.steps),
                        ("--log-every", args.log_every), ("--out", args.out)):
        if value is not None:
            argv += [flag, str(value)]
    if args.max_candidates != MAX_CANDIDATES:
        argv += ["--max-candidates", str(args.max_candidates)]
    argv += [flag for flag, on in (("--no-fp8", args.no_fp8), ("--resume", args.resume),
                                   ("--dry-run", args.dry_run)) if on]
    return shlex.join(argv)
