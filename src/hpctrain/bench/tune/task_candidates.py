"""The short list of ``hpctrain tune`` for a task of the user's own (``my_task.py``).

A task's model is the user's code: hpctrain has no memory or step-time model of it. The
candidates are what training accepts for a task on ``--gpus`` ranks (data parallelism only:
``none`` on one, DDP, FSDP ZeRO-2 and ZeRO-3 on several), each at a few micro-batches around
the config's (its value, x2, x4, /2: those dividing each rank's share of the global batch, which
stays the config's). The config as given comes first; then, for each micro-batch in that order
of preference, every strategy, up to ``--max-candidates``.

On this machine's GPU each strategy is sized by what ``hpctrain plan memory TASK`` measures
(hpctrain.plan.task_memory: one real step at micro-batch 1 and 2, extrapolated per sample), in a
child process (this one, which runs the candidates, holds no CUDA context): one child per
strategy, a few seconds against the minute a candidate's run takes, and those whose peak plus
10% would not fit are left out. Its peak is an eager, one-process measurement, so whatever it
says, the candidates run in order of memory appetite (after the config as given): the smaller
micro-batch first, and at one micro-batch FSDP ZeRO-3 (sharded, regathered per use), ZeRO-2
(kept gathered between forward and backward), then DDP or one replica (everything whole); one
that runs out of memory skips the larger micro-batches of its setting
(hpctrain.bench.tune.measure). On a CPU nothing is measured.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hpctrain.bench.tune.candidates import Candidate, TunePlan, tuning_device
from hpctrain.bench.tune.measure import failure_reason
from hpctrain.bench.tune.space import Setting, config_setting
from hpctrain.errors import ConfigError
from hpctrain.plan.gpu import Gpu
from hpctrain.plan.memory_options import HEADROOM
from hpctrain.plan.parallel import global_batch

MEASURE_TIMEOUT_S = 600.0  # one `plan memory` child: imports, the task's data, 3 steps
MICRO_BATCH_FACTORS = ((1, 1), (2, 1), (4, 1), (1, 2))  # x num / den of the config's, in order
# The data-parallel settings of a task, least memory first (FSDP ZeRO-3, ZeRO-2, DDP).
STRATEGIES = (("fsdp", 3), ("fsdp", 2), ("ddp", 3))


def appetite(s: Setting) -> tuple[int, int]:
    """Sort key: smaller micro-batch first, then the setting that holds less of the model."""
    order = {("fsdp", 3): 0, ("fsdp", 2): 1}
    return s.micro_batch, order.get((s.strategy, s.zero), 2)


def task_candidates(cfg, gpus: int, max_candidates: int, refusal: Callable[[Setting], str | None],
                    peak: Callable[[Setting], float | None] | None = None,
                    gpu_bytes: float = 0.0) -> tuple[list[Candidate], list[str], int]:
    """(short list in running order, notes, settings considered) of task config ``cfg`` (its
    ``auto`` values chosen) on ``gpus`` ranks; ``refusal(setting)`` says why training would
    refuse a setting (None: it accepts it); ``peak(setting)``, where given, its measured peak
    bytes per GPU (None: unknown), and a setting whose peak plus 10% exceeds ``gpu_bytes`` is
    left out."""
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
    notes: list[str] = []
    too_large: list[str] = []

    def listed(s: Setting, source: str) -> Candidate | None:
        """The candidate of ``s``, None where training refuses it or it is measured too large."""
        why = refusal(s)
        if why is not None:
            if source == "config":
                notes.append(f"the config as given is not a candidate on {gpus} rank(s): {why}")
            return None
        need = peak(s) if peak is not None else None
        if need is not None and need * HEADROOM > gpu_bytes:
            too_large.append(s.label(dp))
            return None
        return Candidate(s, dp, source, need or 0.0, 0.0)

    baseline = [c for c in [listed(own, "config")] if c is not None]
    accepted = [c for c in (listed(s, "task") for s in settings if s != own) if c is not None]
    picked = sorted(accepted[:max_candidates - len(baseline)], key=lambda c: appetite(c.setting))
    shortlist = baseline + picked
    for c in shortlist:
        c.overrides = c.setting.overrides(cfg)
    if too_large:
        notes.append(f"left out, their measured peak + 10% exceeding {gpu_bytes / 1e9:.1f} GB "
                     f"per GPU: {'; '.join(too_large)}")
    notes.append(("sized by a measured step (plan memory TASK: micro-batch 1 and 2, eager, on "
                  "one GPU); " if peak is not None else "a task's model has no memory model "
                  "and none is measured on a CPU: nothing is predicted; ")
                 + "the candidates run in order of memory appetite (smaller micro-batch, then "
                 "FSDP ZeRO-3, ZeRO-2, DDP), and one that runs out of memory skips the larger "
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
    sizing: list[str] = []
    measured: dict[tuple[str, int], dict | str] = {}

    def peak(s: Setting) -> float | None:
        """The measured peak of ``s``: one `plan memory` child per strategy, extrapolated to
        each micro-batch (hpctrain.plan.task_memory)."""
        key = (s.strategy, s.zero)
        if key not in measured:
            measured[key] = measured_memory(config, [*overrides, *s.overrides(cfg)], gpus)
            if isinstance(measured[key], str):
                sizing.append(f"{s.label(gpus)} and its other micro-batches not sized: "
                              f"{measured[key]}")
        doc = measured[key]
        return None if isinstance(doc, str) else peak_at(doc, s.micro_batch)

    # Measured on this machine's GPU only (--gpu names another kind, a dry run's).
    on_gpu = device == "cuda" and gpu is None
    candidates, notes, considered = task_candidates(
        cfg, gpus, max_candidates, refusal, peak if on_gpu else None, total)
    notes += sizing
    if not candidates:
        # The config as given is refused, and with it what only varies its strategy and
        # micro-batch: training's own refusal says why, in its words.
        check_task_config(cfg, gpus)
        raise ConfigError(f"no setting of task {cfg.task} that training accepts on {gpus} "
                          "rank(s)", lines=notes)
    batch, _ = global_batch(cfg, gpus)
    return TunePlan(candidates, device, name, total, batch, False, notes, considered,
                    task=cfg.task)


def measured_memory(config: Path, overrides: list[str], gpus: int,
                    timeout: float = MEASURE_TIMEOUT_S) -> dict | str:
    """``hpctrain plan memory CONFIG OVERRIDES --gpus N --json`` of a task in a child process
    (this one, which runs the candidates, holds no CUDA context): its measured step, or why
    there is none."""
    argv = [sys.executable, "-m", "hpctrain", "plan", "memory", str(config), *overrides,
            "--gpus", str(gpus), "--json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            why = failure_reason(RuntimeError(done.stderr + done.stdout))
            return f"plan memory exited with {done.returncode}: {why}"
        return json.loads(done.stdout[done.stdout.index("{"):])
    except subprocess.TimeoutExpired:
        return f"plan memory did not finish in {timeout:.0f} s"
    except (OSError, ValueError) as e:
        return f"plan memory's answer cannot be read ({e})"


def peak_at(memory: dict, micro_batch: int) -> float | None:
    """Peak bytes per GPU at ``micro_batch`` from ``plan memory --json`` of a task (its
    activations grow by the measured bytes per sample); None where nothing was measured."""
    from hpctrain.plan.task_memory import TaskMemory

    report = TaskMemory(**{f.name: memory[f.name] for f in dataclasses.fields(TaskMemory)})
    if report.per_sample is None:
        return None
    return dataclasses.replace(report, activations=report.per_sample * micro_batch).peak
