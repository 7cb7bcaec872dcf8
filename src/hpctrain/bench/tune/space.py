"""The search space of ``hpctrain tune`` and the model's view of it.

A :class:`Setting` is one point (layout, strategy, checkpointing, batch shape, precision); every
setting keeps the config's global batch. :func:`predict` sizes a setting with the memory model
and times it with the step-time model of ``hpctrain plan parallel``, interpolating what those
models do not know (see the package docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.plan.parallel import global_batch, pp_degrees, strategies, tp_degrees

MAX_MICRO_BATCH = 64
AC_EVERY = 2  # every_k's k unless the config sets one


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
    mixed_precision: str = "auto"  # parallel.mixed_precision
    async_tp: bool = False  # the config's parallel.async_tp, kept where tp > 1 (refused at 1)

    def values(self, cfg=None) -> dict[str, Any]:
        """The config keys and values that train this setting on top of ``cfg`` (explicit for
        every key the tuner varies; dp_replicate and loss_chunks only where they differ)."""
        out: dict[str, Any] = {"parallel.strategy": self.strategy, "parallel.tp": self.tp,
                               "parallel.pp": self.pp}
        if self.dp_replicate != (cfg.parallel.dp_replicate if cfg else 1):
            out["parallel.dp_replicate"] = self.dp_replicate
        if self.mixed_precision != (cfg.parallel.mixed_precision if cfg else "auto"):
            out["parallel.mixed_precision"] = self.mixed_precision
        if self.async_tp != (cfg.parallel.async_tp if cfg else False):
            out["parallel.async_tp"] = self.async_tp
        if cfg is not None:
            for key, value in self.fsdp_schedule(cfg).items():
                if value != getattr(cfg.parallel, key):
                    out[f"parallel.{key}"] = value
        if self.pp > 1:
            out["parallel.pp_microbatches"] = self.pp_microbatches
        if self.strategy == "fsdp":
            out["parallel.reshard_after_forward"] = self.zero == 3
        out["parallel.activation_checkpointing"] = self.ac
        if self.ac == "every_k":
            out["parallel.ac_every"] = self.ac_every
        out.update({"train.micro_batch": self.micro_batch, "train.grad_accum": self.grad_accum,
                    "train.precision": self.precision})
        if self.loss_chunks != (cfg.train.loss_chunks if cfg else 0):
            out["train.loss_chunks"] = self.loss_chunks
        return out

    def overrides(self, cfg=None) -> list[str]:
        """:meth:`values` as ``key=value`` overrides, as ``hpctrain train`` takes them."""
        return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                for key, value in self.values(cfg).items()]

    def fsdp_schedule(self, cfg) -> dict[str, int]:
        """The config's FSDP scheduling options (``fsdp_prefetch``, ``fsdp_group_blocks``)
        where this setting shards with FSDP; their defaults where it does not (training
        refuses them without FSDP)."""
        fsdp = self.strategy == "fsdp"
        return {"fsdp_prefetch": cfg.parallel.fsdp_prefetch if fsdp else 0,
                "fsdp_group_blocks": cfg.parallel.fsdp_group_blocks if fsdp else 1}

    def label(self, dp: int) -> str:
        """'FSDP ZeRO-3 dp2, mb 2 x 1, AC full, bf16'."""
        strategy = {"none": "one replica", "ddp": "DDP",
                    "fsdp": f"FSDP ZeRO-{self.zero}"}[self.strategy]
        layout = f"dp{dp}" + (f" tp{self.tp}" if self.tp > 1 else "") + (
            f" pp{self.pp}" if self.pp > 1 else "")
        ac = {"none": "no AC", "full": "AC full", "selective": "AC selective"}.get(
            self.ac, f"AC every {self.ac_every}")
        casts = {"auto": "", "fsdp": ", FSDP casts", "autocast": ", autocast"}[
            self.mixed_precision]
        return (f"{strategy} {layout}, mb {self.micro_batch} x {self.grad_accum}, {ac}, "
                f"{self.precision}{casts}")


def config_setting(cfg) -> Setting:
    """The setting the config itself describes."""
    pc, tc = cfg.parallel, cfg.train
    m = pc.pp_microbatches if pc.pp > 1 and pc.pp_microbatches != tc.grad_accum else 0
    return Setting(strategy=pc.strategy, tp=pc.tp, pp=pc.pp,
                   ac=pc.activation_checkpointing, micro_batch=tc.micro_batch,
                   grad_accum=tc.grad_accum, precision=tc.precision,
                   zero=3 if pc.strategy != "fsdp" or pc.reshards_after_forward else 2,
                   ac_every=pc.ac_every if pc.activation_checkpointing == "every_k" else 0,
                   pp_microbatches=m if pc.pp > 1 else 0, dp_replicate=pc.dp_replicate,
                   loss_chunks=tc.loss_chunks, mixed_precision=pc.mixed_precision,
                   async_tp=pc.async_tp)


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
    for tp in tp_degrees(args, gpus, cfg.data.seq_len):
        for pp in pp_degrees(args, gpus // tp):
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
                                              loss_chunks=chunks if tp * pp == 1 else 0,
                                              mixed_precision=cfg.parallel.mixed_precision,
                                              async_tp=cfg.parallel.async_tp and tp > 1)
                        mb *= 2


def _strategies(tp: int, pp: int, dp: int) -> list[tuple[str, int]]:
    """The planner's strategies, FSDP as ZeRO-3 and ZeRO-2. Inside a pipeline only ZeRO-2, the
    trainer's default there: resharding after each micro-batch's forward would gather the stage
    twice a micro-batch, and the memory and step models size a stage kept gathered."""
    out: list[tuple[str, int]] = []
    for strategy in strategies(tp, pp, dp):
        out += ([(strategy, 3)] if strategy != "fsdp"
                else [("fsdp", 3), ("fsdp", 2)] if pp == 1 else [("fsdp", 2)])
    return out


def predict(cfg, s: Setting, gpus: int, peak_tflops: float) -> tuple[float, float]:
    """(peak bytes per GPU, tokens/s per GPU) the memory and step-time models give a setting.

    Raises ConfigError where the memory model refuses the setting.
    """
    from hpctrain.plan.memory import estimate_memory

    # The planner's step-time model, so that `plan parallel` and `tune` rank alike.
    from hpctrain.plan.parallel import ParallelPlan, predict_step

    args = cfg.model.resolve()
    dp = gpus // (s.tp * s.pp)
    share = recomputed_share(cfg, s.ac, s.ac_every)
    peaks, step = {}, {}
    for ac in ("none", "full"):  # the step-time model knows these two
        opts = _memory_options(cfg, s, gpus, ac)
        mem = estimate_memory(args, opts, suggest=False)
        plan = ParallelPlan(s.strategy, dp, s.tp, s.pp, opts.micro_batch, ac, mem, [],
                            opts.microbatches if s.pp > 1 else s.grad_accum)
        predict_step(plan, args, opts, gpus, peak_tflops)
        peaks[ac], step[ac] = mem.peak, 1 / plan.tokens_per_s
    if s.ac == "every_k":  # the memory model has no every_k: between its two ends
        peak = (1 - share) * peaks["none"] + share * peaks["full"]
    else:
        peak = estimate_memory(args, _memory_options(cfg, s, gpus, s.ac), suggest=False).peak
    # Step time grows with the forward FLOPs recomputed.
    return peak, 1 / ((1 - share) * step["none"] + share * step["full"])


def _memory_options(cfg, s: Setting, gpus: int, ac: str):
    """What the memory model sizes of ``cfg`` trained as ``s`` (with checkpointing ``ac``) on
    ``gpus`` ranks: the config with the setting's values, through the planner's one mapping."""
    from hpctrain.plan.memory_options import MemoryOptions

    values = {**s.values(cfg), "parallel.activation_checkpointing": ac}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    # A copy with those values (unvalidated: from_config checks the layout as training does).
    job = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kw)
                                      for name, kw in sections.items()})
    return MemoryOptions.from_config(job, gpus)
