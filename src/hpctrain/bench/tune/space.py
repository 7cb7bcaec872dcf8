"""The search space of ``hpctrain tune`` and the model's view of it.

A :class:`Setting` is one point (layout, strategy, checkpointing, batch shape, precision); every
setting keeps the config's global batch. :func:`predict` sizes a setting with the memory model
and times it with the step-time model of ``hpctrain plan parallel``, interpolating what those
models do not know (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hpctrain.plan import predict as plan_predict
from hpctrain.plan.parallel import global_batch, pp_degrees, strategies, tp_degrees
from hpctrain.plan.predict import recomputed_share

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
    """(peak bytes per GPU, tokens/s per GPU) of ``cfg`` trained as ``s``: the planner's
    prediction (plan/predict.py), which `auto` ranks by too. ConfigError where it is refused."""
    return plan_predict.predict(plan_predict.with_values(cfg, s.values(cfg)), gpus, peak_tflops)
