"""The predicted peak memory and speed of a training config: what `auto` and `hpctrain tune`
rank settings by, so that both rank alike.

The memory model (:mod:`hpctrain.plan.memory`) sizes the config through the planner's one
mapping, ``MemoryOptions.from_config``; the step-time model is `plan parallel`'s
(:func:`hpctrain.plan.parallel.predict_step`). Both know activation checkpointing none and full;
selective and every_k are placed between them by the share of the forward they recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.plan.memory import estimate_memory
from hpctrain.plan.memory_options import MemoryOptions
from hpctrain.plan.parallel import ParallelPlan, predict_step


def with_values(cfg, values: dict[str, Any]):
    """A copy of ``cfg`` with dotted config keys set (unvalidated: ``from_config`` checks the
    layout as training does)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kw)
                                       for name, kw in sections.items()})


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
    raise ConfigError(f"activation checkpointing {ac!r} is not known to the planner",
                      expected="none, every_k, selective or full")


def predict(job, gpus: int, peak_tflops: float) -> tuple[float, float]:
    """(peak bytes per GPU, tokens/s per GPU) of ``job`` (a config whose values are all set)
    on ``gpus`` ranks; ConfigError where the memory model or the layout rules refuse it."""
    args = job.model.resolve()
    pc, tc = job.parallel, job.train
    ac = pc.activation_checkpointing
    share = recomputed_share(job, ac, pc.ac_every)
    peaks, step = {}, {}
    for end in ("none", "full"):  # the step-time model knows these two
        opts = MemoryOptions.from_config(
            with_values(job, {"parallel.activation_checkpointing": end}), gpus)
        mem = estimate_memory(args, opts, suggest=False)
        plan = ParallelPlan(pc.strategy, gpus // (pc.tp * pc.pp), pc.tp, pc.pp,
                            opts.micro_batch, end, mem, [],
                            opts.microbatches if pc.pp > 1 else tc.grad_accum)
        predict_step(plan, args, opts, gpus, peak_tflops)
        peaks[end], step[end] = mem.peak, 1 / plan.tokens_per_s
    if ac == "every_k":  # the memory model has no every_k: between its two ends
        peak = (1 - share) * peaks["none"] + share * peaks["full"]
    else:
        peak = estimate_memory(args, MemoryOptions.from_config(job, gpus), suggest=False).peak
    # Step time grows with the forward FLOPs recomputed.
    return peak, 1 / ((1 - share) * step["none"] + share * step["full"])
