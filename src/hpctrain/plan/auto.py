"""``auto`` settings: what a config leaves to hpctrain is chosen at start for the run's GPUs.

    train:
      global_batch_tokens: 1048576    # 512 samples of 2048 tokens per step, on any GPU count
      micro_batch: auto
    parallel:
      strategy: auto                  # none (one replica), ddp or fsdp
      reshard_after_forward: auto     # FSDP: true (ZeRO-3) or false (ZeRO-2)
      activation_checkpointing: auto  # none, selective or full
      fsdp_group_blocks: auto

The global batch is the config's (``train.global_batch_tokens``): auto only chooses how it is
split, micro_batch x grad_accum x data-parallel ranks x seq_len, so it changes the speed, never
the mathematics. A batch that cannot be split over the ranks is refused with a hint.

How the values are chosen, in order:

1. `hpctrain tune`'s measurements (``parallel.tune_results``: its ``--out`` folder), where they
   were taken on this GPU kind and count for this model, sequence length, precision and global
   batch: the fastest measured setting the config's fixed values allow.
2. Else the memory model (:mod:`hpctrain.plan.memory`): the settings whose predicted peak plus
   10% fits the GPU (``CPU_MEM_BYTES`` per rank on the CPU), at most ``MAX_MICRO_TOKENS`` tokens
   per micro-batch (``CPU_MICRO_TOKENS`` on the CPU), never one tune saw fail; the least
   recomputation first (none, selective, full), then the fastest by the step-time model of
   `hpctrain plan parallel` (which tune ranks its short list with), then the larger micro-batch,
   ZeRO-2 before ZeRO-3.
3. A model the memory model does not know (a user's task, a family without one): DDP (or none)
   without checkpointing, said in the log; ``micro_batch: auto`` is refused there.

Where nothing fits a GPU, the run is refused before anything is allocated (with the hint of
`plan memory`); on the CPU, whose 16 GB per rank is only a guess, never: it takes no
recomputation and the smallest predicted peak.

The choice is deterministic (the same config, GPU kind and count give the same values), so a
resumed run re-resolves to what it ran with, and on another GPU count keeps the batch in tokens
(the checkpoint's config hash leaves the split out). Every rank chooses alone, from its own GPU,
before the process group is up; once it is, the ranks compare their choices and refuse to train
different splits (``train/job.py``). The run's ``config/config.yaml`` keeps ``auto`` where
the config had it (so that it resumes on any GPU count), ``config/auto.yaml`` the values chosen
for its ranks and why (which `hpctrain runs` and `report` show); ``hpctrain doctor CONFIG``
shows them for its ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpctrain.errors import ConfigError
from hpctrain.models import count_params, family_of_args
from hpctrain.plan import predict as plan_predict
from hpctrain.plan.memory_options import HEADROOM
from hpctrain.plan.parallel import DEFAULT_PEAK_TFLOPS
from hpctrain.plan.predict import with_values

AUTO = "auto"
AUTO_FILE = "auto.yaml"  # in a run's config/: the values auto chose for its ranks, and why
# Larger micro-batches stay faster well past 8 x 2048 tokens (fewer accumulation passes, each
# with its launches, norms and casts): 1b on 2 H200s ran 74.0k tokens/s per GPU at FSDP ZeRO-2
# micro-batch 32 x 1 against 67.6k at DDP 8 x 4 (benchmarks/RESULTS.md, auto vs tune). Beyond
# 32 x 2048 nothing was measured, so the search stops there.
MAX_MICRO_TOKENS = 65536
CPU_MICRO_TOKENS = 2048  # the CPU (tests, demo): small steps
CPU_MEM_BYTES = 16e9  # per rank on the CPU, as tune assumes
AC_ORDER = ("none", "selective", "full")
# FSDP over this many GPUs or more, for models under GROUP_MAX_PARAMS, groups 2 blocks per unit:
# 1b on 4 H200s, where the CPU sets the pace, ran 5.1% faster so; on 2 no change
# (parallel/config.py, benchmarks/RESULTS.md).
GROUP_MIN_GPUS = 4
GROUP_MAX_PARAMS = 3_000_000_000

log = logging.getLogger("hpctrain.auto")


@dataclass(frozen=True)
class Gpu:
    """What the choice is made for: the device's name, its memory and dense peak."""

    name: str
    bytes: float
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    cpu: bool = False


CPU = Gpu("cpu", CPU_MEM_BYTES, cpu=True)  # the CPU's stand-in (tests, demo, a login node)


@dataclass(frozen=True)
class Pick:
    """One way to split the global batch and spread the model: the values auto may set."""

    strategy: str
    zero: int  # FSDP: 3 reshards after forward, 2 keeps the parameters gathered
    ac: str
    micro_batch: int
    grad_accum: int
    ac_every: int = 0  # every_k only (from tune's measurements)


@dataclass
class Resolution:
    """The values set (dotted config keys) and why, one line each; ``given``: what the config
    held at those keys before (``auto``, grad_accum as given)."""

    values: dict[str, Any]
    reasons: list[str] = field(default_factory=list)
    given: dict[str, Any] = field(default_factory=dict)

    def as_given(self, cfg):
        """A copy of the resolved ``cfg`` with the chosen keys back as given: what a run's
        config.yaml records, so that a resume chooses again for its own GPU count."""
        out = copy.deepcopy(cfg)
        for key, value in self.given.items():
            section, name = key.split(".")
            setattr(getattr(out, section), name, value)
        return out

    def record(self, world_size: int) -> dict[str, Any]:
        """What a run's config/auto.yaml holds: the values chosen for its ranks, and why."""
        return {"world_size": world_size, "values": self.values, "reasons": self.reasons}

    def summary(self) -> str:
        """'parallel.strategy=fsdp, train.micro_batch=4, ...' (as overrides would say it)."""
        return ", ".join(f"{k}={_yaml(v)}" for k, v in self.values.items())

    def log(self, logger: logging.Logger = log) -> None:
        """Log the chosen values and the reasons."""
        if self.values:
            logger.info("auto: %s", self.summary())
        for line in self.reasons:
            logger.info("auto: %s", line)


def auto_keys(cfg) -> list[str]:
    """The config keys left to ``auto``."""
    pc = cfg.parallel
    return [key for key, value in (("train.micro_batch", cfg.train.micro_batch),
                                   ("parallel.strategy", pc.strategy),
                                   ("parallel.reshard_after_forward", pc.reshard_after_forward),
                                   ("parallel.activation_checkpointing",
                                    pc.activation_checkpointing),
                                   ("parallel.fsdp_group_blocks", pc.fsdp_group_blocks))
            if value == AUTO]


def leaves_to_auto(cfg) -> bool:
    """Whether ``resolve_auto`` has anything to set: an ``auto`` key, or grad_accum to derive
    from a global batch in tokens."""
    return bool(auto_keys(cfg)) or cfg.train.global_batch_tokens is not None


def this_gpu(cfg) -> Gpu:
    """The GPU this process would train on (device 0: a node's GPUs are of one kind), or the
    CPU's stand-in."""
    import torch

    from hpctrain.observe.peaks import peak_tflops

    if cfg.run.device != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
        return Gpu(name, float(torch.cuda.get_device_properties(0).total_memory),
                   peak or DEFAULT_PEAK_TFLOPS)
    return CPU


def named_gpu(name: str, precision: str = "bf16") -> Gpu:
    """A GPU given by name (``h100``, ``h200``...) or memory in GB, as a rank on it sees it
    (torch's device name and total memory, from the planner's table): what `plan --gpu`,
    `tune --gpu` and a login node choose for."""
    from hpctrain.plan.memory_options import gpu_named
    from hpctrain.plan.parallel import gpu_peak_tflops

    device, total = gpu_named(name)
    return Gpu(device, total, gpu_peak_tflops(name, precision) or DEFAULT_PEAK_TFLOPS)


def resolve_auto(cfg, world_size: int, gpu: Gpu | None = None, *, must_fit: bool = True
                 ) -> Resolution | None:
    """Set every ``auto`` value of ``cfg`` (and grad_accum from ``train.global_batch_tokens``)
    for ``world_size`` ranks on ``gpu`` (default: this machine's), in place; None when the
    config leaves nothing to choose. Raises ConfigError where the batch cannot be split, and
    where no setting fits unless ``must_fit`` is false (tune's baseline: then the smallest)."""
    if not leaves_to_auto(cfg):
        return None
    keys = auto_keys(cfg)
    pc, tc = cfg.parallel, cfg.train
    dp = _data_parallel(pc, world_size)
    replica = _replica_batch(cfg, dp)
    gpu = gpu or this_gpu(cfg)
    # The CPU's memory is the host's, which the stand-in's 16 GB only guesses: never refuse.
    must_fit = must_fit and not gpu.cpu
    reasons: list[str] = []
    if not keys:  # only grad_accum to derive
        pick = Pick(pc.strategy, 3, pc.activation_checkpointing, tc.micro_batch,
                    _accumulated(cfg, replica))
    elif cfg.task or not family_of_args(cfg.model.resolve()).plan_memory:
        pick = _fallback(cfg, dp, replica, reasons)
    else:
        pick = (_from_tune(cfg, world_size, gpu, replica, dp, reasons, must_fit)
                or _from_model(cfg, world_size, gpu, replica, dp, reasons, must_fit=must_fit))
    values = _values(cfg, pick, dp, gpu, reasons)
    _check_grad_accum(cfg, pick, dp)
    given = {}
    for key, value in values.items():
        section, name = key.split(".")
        given[key] = getattr(getattr(cfg, section), name)
        setattr(getattr(cfg, section), name, value)
    cfg.validate()  # the rules that depend on the values now chosen
    return Resolution(values, reasons, given)


def _data_parallel(pc, world_size: int) -> int:
    """Data-parallel ranks; a mesh training refuses (strategy none on several replicas, a
    world size tp x pp x dp_replicate does not divide) is refused in training's words."""
    from hpctrain.parallel.layout import mesh_degrees

    mesh_degrees(pc, world_size)
    return world_size // (pc.tp * pc.pp)


def _replica_batch(cfg, dp: int) -> int:
    """Samples each data-parallel replica takes per step."""
    tc, seq = cfg.train, cfg.data.seq_len
    tokens = tc.global_batch_tokens
    if tokens is None:
        return tc.micro_batch * tc.grad_accum
    if cfg.task:
        raise ConfigError("train.global_batch_tokens with a task",
                          expected="a task's batch in samples: train.micro_batch x "
                          "train.grad_accum x ranks (a task's samples have no token count)",
                          hint="drop train.global_batch_tokens and give train.micro_batch")
    if tokens % (seq * dp):
        low = tokens // (seq * dp) * seq * dp
        raise ConfigError(
            f"train.global_batch_tokens = {tokens} cannot be split over {dp} data-parallel "
            f"rank(s) of samples of {seq} tokens",
            expected=f"a multiple of data.seq_len x data-parallel ranks = {seq * dp}",
            hint=(f"use {low} or {low + seq * dp}" if low else f"use {seq * dp}")
            + ", or another GPU count")
    return tokens // (seq * dp)


def _accumulated(cfg, replica: int) -> int:
    """grad_accum for the config's fixed micro-batch: the replica's batch must divide."""
    mb = cfg.train.micro_batch
    if replica % mb:
        raise ConfigError(
            f"train.micro_batch = {mb} does not divide the {replica} samples each data-parallel "
            "rank takes of train.global_batch_tokens",
            expected="a micro-batch dividing each rank's share of the global batch",
            hint="set train.micro_batch=auto, or a divisor of " + str(replica))
    return replica // mb


def _micro_batches(cfg, replica: int, gpu: Gpu) -> list[int]:
    """The micro-batches to try: the config's, the one a given grad_accum implies, or powers
    of two dividing the replica's batch up to the token cap (1 at least)."""
    tc = cfg.train
    if tc.micro_batch != AUTO:
        return [tc.micro_batch]
    if tc.grad_accum != 1:  # given beside global_batch_tokens: it fixes the micro-batch
        if replica % tc.grad_accum:
            raise ConfigError(
                f"train.grad_accum = {tc.grad_accum} with {replica} samples per data-parallel "
                "rank (from train.global_batch_tokens)",
                expected="a grad_accum dividing each rank's share of the global batch",
                hint="drop train.grad_accum: auto derives it")
        return [replica // tc.grad_accum]
    cap = CPU_MICRO_TOKENS if gpu.cpu else MAX_MICRO_TOKENS
    out, mb = [], 1
    while mb <= replica:
        if replica % mb == 0 and (mb == 1 or mb * cfg.data.seq_len <= cap):
            out.append(mb)
        mb *= 2
    return out


def _strategies(cfg, dp: int) -> list[str]:
    pc = cfg.parallel
    if pc.strategy != AUTO:
        return [pc.strategy]
    if dp == 1:
        return ["none"]
    if pc.tp * pc.pp > 1:
        return ["fsdp"]  # the trainer refuses DDP with TP or PP
    return ["ddp", "fsdp"]


def _zeros(cfg, strategy: str) -> list[int]:
    pc = cfg.parallel
    if strategy != "fsdp":
        return [3]
    if pc.reshard_after_forward == AUTO:
        # Inside a pipeline only ZeRO-2: resharding would gather each stage twice a micro-batch.
        return [2, 3] if pc.pp == 1 else [2]
    probe = dataclasses.replace(pc, strategy="fsdp")
    return [3 if probe.reshards_after_forward else 2]


def _accepted(cfg, pick: Pick) -> bool:
    """Whether the parallel section's own rules accept ``pick`` (fixed values beside it)."""
    pc = dataclasses.replace(cfg.parallel, strategy=pick.strategy,
                             activation_checkpointing=pick.ac, reshard_after_forward=None,
                             fsdp_group_blocks=1 if cfg.parallel.fsdp_group_blocks == AUTO
                             else cfg.parallel.fsdp_group_blocks)
    try:
        pc.validate()
        pc.check_precision(cfg.train.precision,
                           count_params(cfg.model.resolve(), include_embedding=True),
                           cfg.train.master_weights)
    except ConfigError:
        return False
    return True


def predict(cfg, pick: Pick, world_size: int, gpu: Gpu, group_blocks: int = 1
            ) -> tuple[float, float]:
    """(predicted peak bytes per GPU, predicted tokens/s per GPU) of ``cfg`` trained as
    ``pick`` (``group_blocks`` where fsdp_group_blocks is auto): the planner's prediction, as
    tune's; ConfigError where it, or the layout rules, refuse it."""
    return plan_predict.predict(with_values(cfg, _pick_values(cfg, pick, group_blocks)),
                                world_size, gpu.peak_tflops)


def _pick_values(cfg, pick: Pick, group_blocks: int = 1) -> dict[str, Any]:
    """Every value ``pick`` sets, the auto ones included: what the planner sizes."""
    pc = cfg.parallel
    fsdp = pick.strategy == "fsdp"
    values: dict[str, Any] = {
        "parallel.strategy": pick.strategy,
        "parallel.reshard_after_forward": pick.zero == 3 if fsdp else None,
        "parallel.activation_checkpointing": pick.ac,
        "parallel.fsdp_group_blocks": (1 if not fsdp else group_blocks
                                       if pc.fsdp_group_blocks == AUTO else pc.fsdp_group_blocks),
        "train.micro_batch": pick.micro_batch, "train.grad_accum": pick.grad_accum}
    if pick.ac == "every_k" and pick.ac_every:
        values["parallel.ac_every"] = pick.ac_every
    return values


def _from_model(cfg, world_size: int, gpu: Gpu, replica: int, dp: int,
                reasons: list[str], failed: frozenset = frozenset(), *, must_fit: bool = True
                ) -> Pick:
    """The memory model's choice (module docstring, 2.); where nothing fits, the smallest
    peak unless ``must_fit``."""
    pc = cfg.parallel
    acs = AC_ORDER if pc.activation_checkpointing == AUTO else (pc.activation_checkpointing,)
    mbs = _micro_batches(cfg, replica, gpu)
    fits, tried, smallest = [], 0, None
    refused: ConfigError | None = None  # the layout rules' words, where they refuse every one
    for strategy in _strategies(cfg, dp):
        for zero in _zeros(cfg, strategy):
            for ac in acs:
                for mb in mbs:
                    pick = Pick(strategy, zero, ac, mb, replica // mb)
                    if not _accepted(cfg, pick) or _key(pick) in failed:
                        continue
                    tried += 1
                    try:
                        peak, tps = predict(cfg, pick, world_size, gpu)
                    except ConfigError as e:
                        refused = refused or e
                        continue
                    if peak * HEADROOM <= gpu.bytes:
                        fits.append((pick, peak, tps))
                    # The CPU's stand-in: no recomputation before a smaller peak.
                    rank = (AC_ORDER.index(ac) if gpu.cpu and ac in AC_ORDER else 0, peak)
                    if smallest is None or rank < smallest[2]:
                        smallest = (pick, peak, rank)
    if smallest is None and refused is not None:
        raise refused
    if not fits and smallest is not None and not must_fit:
        least = "the least recomputation, then " if gpu.cpu else ""
        reasons.append(f"nothing fits {_gib(gpu.bytes)}: {least}the smallest predicted peak, "
                       f"{_gib(smallest[1])}")
        return smallest[0]
    if not fits:
        raise ConfigError(
            f"auto: none of the {tried} settings tried fits {world_size} x "
            f"{_gib(gpu.bytes)} ({gpu.name}) at {replica} samples of {cfg.data.seq_len} tokens "
            "per data-parallel rank",
            expected="a setting whose predicted peak plus 10% fits the memory",
            hint=f"use more GPUs (`hpctrain plan memory CONFIG --gpus {2 * world_size} --gpu "
            "TYPE` sizes them), a shorter data.seq_len, tensor/pipeline parallelism "
            "(parallel.tp, parallel.pp), or a smaller train.global_batch_tokens (FSDP holds "
            "unsharded gradients while it accumulates)")
    fits.sort(key=lambda f: (AC_ORDER.index(f[0].ac) if f[0].ac in AC_ORDER else 0, -f[2],
                             -f[0].micro_batch, f[0].zero))
    pick, peak, tps = fits[0]
    where = "the CPU's stand-in" if gpu.cpu else gpu.name
    reasons.append(f"the memory model: {len(fits)} of {tried} settings fit {_gib(gpu.bytes)} "
                   f"({where}) with 10% headroom; the chosen one peaks at {_gib(peak)}"
                   + ("" if gpu.cpu else f", predicted {tps:,.0f} tokens/s per GPU"))
    _explain(cfg, pick, fits, gpu, reasons)
    return pick


def _explain(cfg, pick: Pick, fits: list, gpu: Gpu, reasons: list[str]) -> None:
    pc, tc = cfg.parallel, cfg.train
    if tc.micro_batch == AUTO:
        same = (pick.strategy, pick.zero, pick.ac)
        bigger = [f for f in fits if f[0].micro_batch > pick.micro_batch
                  and (f[0].strategy, f[0].zero, f[0].ac) == same]
        cap = CPU_MICRO_TOKENS if gpu.cpu else MAX_MICRO_TOKENS
        why = (f"the largest that fits {_gib(gpu.bytes)} with 10% headroom" if not bigger
               else "larger ones fit but are predicted slower (a pipeline's bubble)")
        reasons.append(f"micro_batch {pick.micro_batch}: {why} (with strategy {pick.strategy}, "
                       f"AC {pick.ac}; at most {cap} tokens per micro-batch)")
    if pc.activation_checkpointing == AUTO:
        why = {"none": "no recomputation needed: it fits without",
               "selective": "nothing fits without checkpointing; selective does",
               "full": "nothing fits without or with selective checkpointing"}[pick.ac]
        reasons.append(f"activation_checkpointing {pick.ac}: {why}")
    if pc.strategy == AUTO:
        others = {}
        for p, _, tps in fits:
            others.setdefault(p.strategy, tps)
        rest = ", ".join(f"{s} {t:,.0f}" for s, t in others.items() if s != pick.strategy)
        reasons.append(f"strategy {pick.strategy}" + ("" if gpu.cpu or not rest else
                                                       f": the fastest predicted (best of "
                                                       f"the others: {rest} tokens/s per GPU)"))


def _fallback(cfg, dp: int, replica: int, reasons: list[str]) -> Pick:
    """No memory model (module docstring, 3.)."""
    pc, tc = cfg.parallel, cfg.train
    what = ("a task's model (hpctrain.task)" if cfg.task
            else f"the {family_of_args(cfg.model.resolve()).name!r} family")
    if tc.micro_batch == AUTO:
        raise ConfigError(f"train.micro_batch = auto for {what}, which the memory model cannot "
                          "size", expected="a number for train.micro_batch",
                          hint="give train.micro_batch (hpctrain tune measures what fits)")
    strategy = pc.strategy
    if strategy == AUTO:
        strategy = "none" if dp == 1 else "ddp" if pc.tp * pc.pp == 1 else "fsdp"
    ac = "none" if pc.activation_checkpointing == AUTO else pc.activation_checkpointing
    reasons.append(f"no memory model for {what}: auto falls back to strategy {strategy}, "
                   f"activation_checkpointing {ac}, FSDP's defaults")
    return Pick(strategy, _zeros(cfg, strategy)[-1] if strategy == "fsdp" else 3, ac,
                tc.micro_batch, _accumulated(cfg, replica))


def _key(pick: Pick) -> tuple:
    return (pick.strategy, pick.zero, pick.ac, pick.micro_batch)


def _from_tune(cfg, world_size: int, gpu: Gpu, replica: int, dp: int,
               reasons: list[str], must_fit: bool = True) -> Pick | None:
    """The fastest measured setting of tune's results that this run may take (module
    docstring, 1.); None (said in ``reasons``) where there are none."""
    path = cfg.parallel.tune_results
    if path is None:
        return None
    doc, why = _tune_doc(cfg, Path(path), world_size, gpu, replica * dp)
    if doc is None:
        reasons.append(f"tune results {path} not used: {why}")
        return None
    allowed, failed = [], set()
    for c in doc["candidates"]:
        s = c.get("settings") or {}
        pick = Pick(s.get("strategy"), s.get("zero", 3), s.get("ac"), s.get("micro_batch", 0),
                    s.get("grad_accum", 0), s.get("ac_every", 0))
        if c.get("status") == "failed":
            failed.add(_key(pick))
        if c.get("status") == "ok" and _fits_config(cfg, s, pick, replica):
            allowed.append((c["measured"]["tokens_per_s_per_gpu"], -len(allowed), pick))
    if not allowed:
        reasons.append(f"tune results {path}: no measured setting fits the config's fixed "
                       "values; the memory model chooses")
        return _from_model(cfg, world_size, gpu, replica, dp, reasons, frozenset(failed),
                           must_fit=must_fit)
    tps, _, pick = max(allowed)
    reasons.append(f"tune's measurements ({path}, {world_size} x {gpu.name}): the fastest of "
                   f"{len(allowed)} measured settings this config allows, {tps:,.0f} tokens/s "
                   "per GPU")
    return pick


def _tune_doc(cfg, path: Path, world_size: int, gpu: Gpu, samples: int
              ) -> tuple[dict | None, str]:
    """(tune's results.json, "") where it was measured for this run, else (None, why not)."""
    results = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(results.read_text())
        meta = doc["meta"]
        best = yaml.safe_load((results.parent / "best.yaml").read_text())
    except FileNotFoundError as e:
        return None, f"{e.filename} does not exist (no tuning finished there)"
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise ConfigError(f"parallel.tune_results = {path}: cannot be read ({e})",
                          expected="the --out folder of `hpctrain tune` (results.json, "
                          "best.yaml)", hint="rerun tune, or drop parallel.tune_results") from None
    model = dataclasses.asdict(cfg.model)
    best = best if isinstance(best, dict) else {}
    checks = [("GPU", meta.get("device_name"), gpu.name),
              ("GPU count", meta.get("gpus"), world_size),
              ("global batch (samples)", meta.get("global_batch"), samples),
              ("model", best.get("model"), model)]
    # The values tune keeps as its config gives them (it varies the others per candidate):
    # measured with others, its speeds are another program's.
    fsdp = (best.get("parallel") or {}).get("strategy") == "fsdp"
    for key in _TUNE_KEEPS:
        section, name = key.split(".")
        ours = getattr(getattr(cfg, section), name)
        # FSDP's scheduling options are set to their defaults where tune's winner is not FSDP.
        if ours != AUTO and (fsdp or name not in ("fsdp_prefetch", "fsdp_group_blocks")):
            checks.append((key, (best.get(section) or {}).get(name), ours))
    for what, theirs, ours in checks:
        if theirs != ours:
            return None, f"measured for another {what} ({_short(theirs)}, this run: " \
                         f"{_short(ours)})"
    return doc, ""


_TUNE_KEEPS = ("data.seq_len", "parallel.compile", "train.master_weights", "parallel.ac_save_mm",
               "train.fp8_recipe", "parallel.fsdp_prefetch", "parallel.fsdp_group_blocks",
               "parallel.reduce_precision")


def _fits_config(cfg, s: dict, pick: Pick, replica: int) -> bool:
    """Whether a measured setting keeps the config's fixed values and global batch."""
    pc, tc = cfg.parallel, cfg.train
    same = {"tp": pc.tp, "pp": pc.pp, "dp_replicate": pc.dp_replicate,
            "precision": tc.precision, "mixed_precision": pc.mixed_precision,
            "loss_chunks": tc.loss_chunks}
    if any(s.get(k) != v for k, v in same.items()):
        return False
    if pc.pp > 1 and s.get("pp_microbatches", 0) not in (0, pc.pp_microbatches):
        return False
    if pick.micro_batch * pick.grad_accum != replica:
        return False
    fixed = (pc.strategy, pc.activation_checkpointing, tc.micro_batch)
    for given, value in zip(fixed, (pick.strategy, pick.ac, pick.micro_batch), strict=True):
        if given != AUTO and given != value:
            return False
    if pick.ac == "every_k" and pc.activation_checkpointing == AUTO and pick.ac_every < 1:
        return False
    if (pc.reshard_after_forward != AUTO and pick.strategy == "fsdp"
            and pick.zero != _zeros(cfg, "fsdp")[0]):
        return False
    return _accepted(cfg, pick)  # the parallel section's own rules, as for the model's picks


def _values(cfg, pick: Pick, dp: int, gpu: Gpu, reasons: list[str]) -> dict[str, Any]:
    """The config values ``pick`` sets: the auto keys, and grad_accum beside a global batch in
    tokens."""
    pc, tc = cfg.parallel, cfg.train
    values: dict[str, Any] = {}
    if pc.strategy == AUTO:
        values["parallel.strategy"] = pick.strategy
    if pc.reshard_after_forward == AUTO:
        # Outside FSDP it means nothing: unset, as the trainer's default.
        values["parallel.reshard_after_forward"] = (pick.zero == 3 if pick.strategy == "fsdp"
                                                    else None)
        if pick.strategy == "fsdp":
            reasons.append(f"reshard_after_forward {str(pick.zero == 3).lower()} (ZeRO-"
                           f"{pick.zero}): " + ("the parameters stay gathered from forward to "
                                                "backward, one all-gather fewer" if pick.zero == 2
                                                else "ZeRO-2 does not fit or predicts slower"))
    if pc.activation_checkpointing == AUTO:
        values["parallel.activation_checkpointing"] = pick.ac
        if pick.ac == "every_k":
            values["parallel.ac_every"] = pick.ac_every
    if pc.fsdp_group_blocks == AUTO:
        values["parallel.fsdp_group_blocks"] = _group_blocks(cfg, pick, dp, gpu, reasons)
    if tc.micro_batch == AUTO:
        values["train.micro_batch"] = pick.micro_batch
    if tc.global_batch_tokens is not None:
        values["train.grad_accum"] = pick.grad_accum
        reasons.append(f"global batch {tc.global_batch_tokens} tokens = micro_batch "
                       f"{pick.micro_batch} x grad_accum {pick.grad_accum} x {dp} data-parallel "
                       f"rank(s) x {cfg.data.seq_len} tokens")
    return values


def _group_blocks(cfg, pick: Pick, dp: int, gpu: Gpu, reasons: list[str]) -> int:
    """2 where FSDP's per-unit hooks set the pace (many GPUs, a small model) and it fits; 1
    otherwise (and outside FSDP, which refuses any other)."""
    shard = dp // cfg.parallel.dp_replicate  # HSDP: the hooks run per shard group
    if pick.strategy != "fsdp" or gpu.cpu or shard < GROUP_MIN_GPUS or cfg.task:
        return 1
    if count_params(cfg.model.resolve(), include_embedding=True) >= GROUP_MAX_PARAMS:
        return 1
    try:
        peak, _ = predict(cfg, pick, dp * cfg.parallel.tp * cfg.parallel.pp, gpu, 2)
    except ConfigError:
        return 1
    if peak * HEADROOM > gpu.bytes:
        return 1
    reasons.append(f"fsdp_group_blocks 2: FSDP sharded over {shard} GPUs, a model under "
                   f"{GROUP_MAX_PARAMS / 1e9:.0f}B parameters is paced by its per-unit hooks "
                   "(1b on 4 H200s: 5.1% faster with 2)")
    return 2


def _check_grad_accum(cfg, pick: Pick, dp: int) -> None:
    """A grad_accum given beside global_batch_tokens must be the one the batch implies."""
    tc = cfg.train
    if tc.global_batch_tokens is None or tc.grad_accum in (1, pick.grad_accum):
        return
    raise ConfigError(
        f"train.grad_accum = {tc.grad_accum} with train.global_batch_tokens = "
        f"{tc.global_batch_tokens}",
        expected=f"grad_accum {pick.grad_accum} (global_batch_tokens / (micro_batch "
        f"{pick.micro_batch} x {dp} data-parallel rank(s) x {cfg.data.seq_len} tokens))",
        hint="drop train.grad_accum: it follows from the global batch")


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
