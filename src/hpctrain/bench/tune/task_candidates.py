"""The short list of ``hpctrain tune`` for a task of the user's own (``my_task.py``).

A task's model is the user's code: hpctrain has no memory or step-time model of it, so nothing is
predicted. The candidates are what training accepts for a task on ``--gpus`` ranks (data
parallelism only: ``none`` on one, DDP, FSDP ZeRO-2 and ZeRO-3 on several), each at a few
micro-batches around the config's (its value, x2, x4, /2: those dividing each rank's share of
the global batch, which stays the config's). The config as given comes first; then, for each
micro-batch in that order of preference, every strategy, up to ``--max-candidates``.

They run in order of memory appetite (after the config as given): the smaller micro-batch
first, and at one micro-batch FSDP ZeRO-3 (sharded, regathered per use), ZeRO-2 (kept gathered
between forward and backward), then DDP or one replica (everything whole), so that one which
runs out of memory can skip the larger micro-batches of its setting (hpctrain.bench.tune.measure).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hpctrain.bench.tune.candidates import Candidate, TunePlan, tuning_device
from hpctrain.bench.tune.space import Setting, config_setting
from hpctrain.errors import ConfigError
from hpctrain.plan.gpu import Gpu
from hpctrain.plan.parallel import global_batch

MICRO_BATCH_FACTORS = ((1, 1), (2, 1), (4, 1), (1, 2))  # x num / den of the config's, in order
# The data-parallel settings of a task, least memory first (FSDP ZeRO-3, ZeRO-2, DDP).
STRATEGIES = (("fsdp", 3), ("fsdp", 2), ("ddp", 3))


def appetite(s: Setting) -> tuple[int, int]:
    """Sort key: smaller micro-batch first, then the setting that holds less of the model."""
    order = {("fsdp", 3): 0, ("fsdp", 2): 1}
    return s.micro_batch, order.get((s.strategy, s.zero), 2)


def task_candidates(cfg, gpus: int, max_candidates: int,
                    refusal) -> tuple[list[Candidate], list[str], int]:
    """(short list in running order, notes, settings considered) of task config ``cfg`` (its
    ``auto`` values chosen) on ``gpus`` ranks; ``refusal(setting)`` says why training would
    refuse a setting (None: it accepts it)."""
    if max_candidates < 1:
        raise ConfigError(f"--max-candidates {max_candidates}", expected="at least 1")
    batch, dp = global_batch(cfg, gpus)
    replica = batch // dp
    own = config_setting(cfg)
    mbs: list[int] = []
    for num, den in MICRO_BATCH_FACTORS:
        mb, rest = divmod(own.micro_batch * num, den)
        if not rest and mb >= 1 and replica % mb == 0 and mb not in mbs:
            mbs.append(mb)
    strategies = [("none", 3)] if dp == 1 else [*reversed(STRATEGIES)]  # DDP first: the fastest
    settings = [dataclasses.replace(own, strategy=strategy, zero=zero, micro_batch=mb,
                                    grad_accum=replica // mb)
                for mb in mbs for strategy, zero in strategies]
    notes = []
    why = refusal(own)
    baseline = [Candidate(own, dp, "config", 0.0, 0.0)] if why is None else []
    if why is not None:
        notes.append(f"the config as given is not a candidate on {gpus} rank(s): {why}")
    accepted = [s for s in settings if s != own and refusal(s) is None]
    picked = accepted[:max_candidates - len(baseline)]
    picked.sort(key=appetite)
    shortlist = baseline + [Candidate(s, dp, "task", 0.0, 0.0) for s in picked]
    for c in shortlist:
        c.overrides = c.setting.overrides(cfg)
    notes.append("a task's model has no memory or step-time model: nothing is predicted; the "
                 "candidates run in order of memory appetite (smaller micro-batch, then FSDP "
                 "ZeRO-3, ZeRO-2, DDP), and one that runs out of memory skips the larger "
                 "micro-batches of its setting")
    return shortlist, notes, len(accepted) + len(baseline)


def plan_task_tuning(config: Path, overrides: list[str], gpus: int, *,
                     gpu_mem_gb: float | None = None, max_candidates: int,
                     gpu: str | None = None) -> TunePlan:
    """The short list of task file or task config ``config`` on ``gpus`` GPUs (or CPU ranks)
    of this machine, or of type ``gpu`` (a dry run's): read as ``hpctrain train`` reads it."""
    from hpctrain.bench.model import run_config
    from hpctrain.parallel.layout import check_task_config
    from hpctrain.plan.auto import resolve_auto

    cfg = run_config(config, overrides, gpus)
    device, name, total, _ = tuning_device(cfg, gpus, gpu=gpu, gpu_mem_gb=gpu_mem_gb)
    here = Gpu(name, total, cpu=device != "cuda")

    def resolved(extra: list[str]):
        """The config with ``extra`` overrides and its ``auto`` values chosen, as training's."""
        c = run_config(config, [*overrides, *extra], gpus)
        resolve_auto(c, gpus, here)
        return c

    def refusal(s: Setting) -> str | None:
        try:
            check_task_config(resolved(s.overrides(cfg)), gpus)
        except ConfigError as e:
            return e.what
        return None

    cfg = resolved([])
    candidates, notes, considered = task_candidates(cfg, gpus, max_candidates, refusal)
    if not candidates:
        # The config as given is refused, and with it what only varies its strategy and
        # micro-batch: training's own refusal says why, in its words.
        check_task_config(cfg, gpus)
        raise ConfigError(f"no setting of task {cfg.task} that training accepts on {gpus} "
                          "rank(s)", lines=notes)
    batch, _ = global_batch(cfg, gpus)
    return TunePlan(candidates, device, name, total, batch, False, notes, considered,
                    task=cfg.task)
