"""The memory model's choice for ``auto`` (hpctrain.plan.auto, its docstring's step 2): the
ways to split a replica's batch and spread the model that the config's fixed values allow, each
sized and timed by the planner's prediction (plan/predict.py, as tune ranks its short list),
and the one that fits with the least recomputation and the most speed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.models import count_params, family_of_args
from hpctrain.plan import predict as plan_predict
from hpctrain.plan.gpu import Gpu
from hpctrain.plan.memory_options import HEADROOM
from hpctrain.plan.predict import with_values

AUTO = "auto"
# Larger micro-batches stay faster well past 8 x 2048 tokens (fewer accumulation passes, each
# with its launches, norms and casts): 1b on 2 H200s ran 74.0k tokens/s per GPU at FSDP ZeRO-2
# micro-batch 32 x 1 against 67.6k at DDP 8 x 4 (benchmarks/RESULTS.md, auto vs tune). Beyond
# 32 x 2048 nothing was measured, so the search stops there.
MAX_MICRO_TOKENS = 65536
CPU_MICRO_TOKENS = 2048  # the CPU (tests, demo): small steps
AC_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Pick:
    """One way to split the global batch and spread the model: the values auto may set."""

    strategy: str
    zero: int  # FSDP: 3 reshards after forward, 2 keeps the parameters gathered
    ac: str
    micro_batch: int
    grad_accum: int
    ac_every: int = 0  # every_k only (from tune's measurements)


def accumulated(cfg, replica: int) -> int:
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
    if tc.grad_accum is not None:  # given beside global_batch_tokens: it fixes the micro-batch
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


def zeros(cfg, strategy: str) -> list[int]:
    """The ZeRO stages ``strategy`` may take (3 outside FSDP, where it means nothing)."""
    pc = cfg.parallel
    if strategy != "fsdp":
        return [3]
    if pc.reshard_after_forward == AUTO:
        # Inside a pipeline only ZeRO-2: resharding would gather each stage twice a micro-batch.
        return [2, 3] if pc.pp == 1 else [2]
    probe = dataclasses.replace(pc, strategy="fsdp")
    return [3 if probe.reshards_after_forward else 2]


def accepted(cfg, pick: Pick) -> bool:
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


def from_model(cfg, world_size: int, gpu: Gpu, replica: int, dp: int,
               reasons: list[str], failed: frozenset = frozenset(), *, must_fit: bool = True
               ) -> Pick:
    """The memory model's choice (hpctrain.plan.auto, 2.); where nothing fits, the smallest
    peak unless ``must_fit``."""
    pc = cfg.parallel
    acs = AC_ORDER if pc.activation_checkpointing == AUTO else (pc.activation_checkpointing,)
    mbs = _micro_batches(cfg, replica, gpu)
    fits, tried, smallest = [], 0, None
    refused: ConfigError | None = None  # the layout rules' words, where they refuse every one
    for strategy in _strategies(cfg, dp):
        for zero in zeros(cfg, strategy):
            for ac in acs:
                for mb in mbs:
                    pick = Pick(strategy, zero, ac, mb, replica // mb)
                    if not accepted(cfg, pick) or pick_key(pick) in failed:
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


def fallback(cfg, dp: int, replica: int, reasons: list[str]) -> Pick:
    """No memory model (hpctrain.plan.auto, 3.)."""
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
    return Pick(strategy, zeros(cfg, strategy)[-1] if strategy == "fsdp" else 3, ac,
                tc.micro_batch, accumulated(cfg, replica))


def pick_key(pick: Pick) -> tuple:
    """What tells two picks apart in tune's results (its failures are never tried again)."""
    return (pick.strategy, pick.zero, pick.ac, pick.micro_batch)


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"
