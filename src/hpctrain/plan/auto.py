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
3. A model the memory model does not know (a user's task, a family without one): tune's
   measurements as in 1. (``hpctrain tune my_task.py``) where they apply, else DDP (or none)
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

Here: the split of the batch and the values set in the config (and recorded); the choice
itself in :mod:`hpctrain.plan.auto_tuned` (1.) and :mod:`hpctrain.plan.auto_search` (2., 3.);
the GPU it is made for in :mod:`hpctrain.plan.gpu`.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import yaml

from hpctrain.errors import ConfigError
from hpctrain.models import count_params, family_of_args
from hpctrain.plan.auto_search import (
    AUTO,
    Pick,
    accumulated,
    fallback,
    from_model,
    predict,
)
from hpctrain.plan.auto_tuned import from_tune
from hpctrain.plan.gpu import CPU, Gpu, named_gpu, this_gpu
from hpctrain.plan.memory_options import HEADROOM

# What callers import from here, the one entry point: the GPU stand-ins, the prediction.
__all__ = ["AUTO", "AUTO_FILE", "CPU", "HEADROOM", "Gpu", "Pick", "Resolution", "auto_keys",
           "leaves_to_auto", "named_gpu", "predict", "resolve_auto", "this_gpu"]

AUTO_FILE = "auto.yaml"  # in a run's config/: the values auto chose for its ranks, and why
# FSDP over this many GPUs or more, for models under GROUP_MAX_PARAMS, groups 2 blocks per unit:
# 1b on 4 H200s, where the CPU sets the pace, ran 5.1% faster so; on 2 no change
# (parallel/config.py, benchmarks/RESULTS.md).
GROUP_MIN_GPUS = 4
GROUP_MAX_PARAMS = 3_000_000_000

log = logging.getLogger("hpctrain.auto")


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
        """What a run's config/auto.yaml holds: the values chosen for its ranks, why, and what
        the config held at those keys (its config.yaml's values there; a record without
        ``given`` predates an unset grad_accum, hpctrain.config.load_config)."""
        return {"world_size": world_size, "values": self.values, "reasons": self.reasons,
                "given": self.given}

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
    _check_grad_accum(cfg, replica, dp)  # what the user wrote is kept, or refused: never replaced
    reasons: list[str] = []
    if not keys:  # only grad_accum to derive: no GPU to ask (a launcher re-resolving asks none)
        pick = Pick(pc.strategy, 3, pc.activation_checkpointing, tc.micro_batch,
                    accumulated(cfg, replica))
    elif cfg.task or not family_of_args(cfg.model.resolve()).plan_memory:
        # No memory model: tune's measurements where they apply (a task tuned by `hpctrain
        # tune my_task.py`), else the fallback.
        tuned = None
        if cfg.parallel.tune_results is not None and cfg.train.micro_batch != AUTO:
            tuned = from_tune(cfg, world_size, gpu or this_gpu(cfg), replica, dp, reasons,
                              must_fit, model=False)
        pick = tuned or fallback(cfg, dp, replica, reasons)
    else:
        gpu = gpu or this_gpu(cfg)
        # The CPU's memory is the host's, which the stand-in's 16 GB only guesses: never refuse.
        must_fit = must_fit and not gpu.cpu
        pick = (from_tune(cfg, world_size, gpu, replica, dp, reasons, must_fit)
                or from_model(cfg, world_size, gpu, replica, dp, reasons, must_fit=must_fit))
    values = _values(cfg, pick, dp, gpu, reasons)
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


def _values(cfg, pick: Pick, dp: int, gpu: Gpu | None, reasons: list[str]
            ) -> dict[str, Any]:
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


def _group_blocks(cfg, pick: Pick, dp: int, gpu: Gpu | None, reasons: list[str]) -> int:
    """2 where FSDP's per-unit hooks set the pace (many GPUs, a small model) and it fits; 1
    otherwise (and outside FSDP, which refuses any other)."""
    shard = dp // cfg.parallel.dp_replicate  # HSDP: the hooks run per shard group
    # No GPU asked: no memory model (the fallback) to size the larger units with.
    if (gpu is None or pick.strategy != "fsdp" or gpu.cpu or shard < GROUP_MIN_GPUS
            or cfg.task):
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


def _check_grad_accum(cfg, replica: int, dp: int) -> None:
    """A grad_accum given beside global_batch_tokens and a fixed micro-batch must be the one
    the batch implies (beside ``micro_batch: auto`` it fixes the micro-batch instead)."""
    tc = cfg.train
    if tc.global_batch_tokens is None or tc.grad_accum is None or tc.micro_batch == AUTO:
        return
    derived = accumulated(cfg, replica)
    if tc.grad_accum == derived:
        return
    raise ConfigError(
        f"train.grad_accum = {tc.grad_accum} with train.global_batch_tokens = "
        f"{tc.global_batch_tokens}",
        expected=f"grad_accum {derived} (global_batch_tokens / (micro_batch {tc.micro_batch} x "
        f"{dp} data-parallel rank(s) x {cfg.data.seq_len} tokens))",
        hint=f"drop train.grad_accum (it follows from the global batch), or set "
        f"train.grad_accum={derived}")


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
