"""The peer at the configuration ``hpctrain tune`` picked: tune's folder as a compare layout.

    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 4 --out runs/tune/8b-4gpu
    python3 benchmarks/peers/compare.py --tuned runs/tune/8b-4gpu --steps 30

Our side trains tune's ``best.yaml`` as written. torchtitan gets the same model, sequence, batch
per optimizer step, layout (tp, pp and its schedule, FSDP or DDP over the rest), ZeRO stage,
activation checkpointing, compile and precision, in its own flags. With TP or PP and no FSDP
dimension the peer's mixed precision is off (it warns and computes in fp32), so it then runs pure
bf16, its fastest setting there, as the fixed layouts of compare.py do; on one GPU and under DDP
it autocasts (its AMP) with fp32 master weights, as ours does. What torchtitan cannot take
is refused with the reason (fp32 or fp16 training, a model size it has no flavor for), and what
it has no counterpart for (the chunked loss, explicit FSDP prefetch, bf16 gradient reduction
beside fp32 master weights) is said in the layout's note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torchtitan_peer import FLAVORS, PEER_SCHEDULES, PeerRun

from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.plan.auto import resolve_auto


@dataclass
class Tuned:
    """What compare needs of a tuning: our config, the GPUs, the peer's run, a note."""

    config: Path
    gpus: int
    peer: PeerRun
    note: str


def read_tuned(folder: Path) -> Tuned:
    """The winner of the tuning in ``folder`` (``results.json`` and ``best.yaml``)."""
    results, best = folder / "results.json", folder / "best.yaml"
    for path in (results, best):
        if not path.is_file():
            raise ConfigError(f"{path} does not exist",
                              hint="pass the --out folder of an `hpctrain tune` call that found "
                              "a winner (it writes results.json and best.yaml)")
    try:
        doc = json.loads(results.read_text())
        winner = doc["winner"]
        label = None if winner is None else doc["candidates"][winner]["label"]
        gpus = int(doc["meta"]["gpus"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"{results} is not a results.json of `hpctrain tune` "
                          f"({type(e).__name__}: {e})",
                          hint="rerun the tuning, or --resume it into the same --out") from e
    if winner is None:
        raise ConfigError(f"{results} has no winner: every candidate failed",
                          hint="its candidates' reasons are in the same file")
    peer, notes = peer_run(best, gpus)
    return Tuned(best.resolve(), gpus, peer, "; ".join([f"tune's pick: {label}", *notes]))


def peer_run(config: Path, gpus: int, overrides: list[str] | None = None
             ) -> tuple[PeerRun, list[str]]:
    """torchtitan's run for ``config`` (with ``overrides``) trained on ``gpus`` GPUs, and notes
    on what differs."""
    cfg = load_config(config, overrides or [])
    resolve_auto(cfg, gpus)  # the values training picks for its `auto` keys on these GPUs
    par, train = cfg.parallel, cfg.train
    if cfg.model.size not in FLAVORS:
        raise ConfigError(f"model.size = {cfg.model.size}: the peer has no flavor for it",
                          hint=f"sizes the peer runs: {', '.join(sorted(FLAVORS))}")
    if train.precision not in ("bf16", "fp8"):
        raise ConfigError(f"train.precision = {train.precision}: the peer is compared in bf16 "
                          "or fp8 only", hint="tune with train.precision=bf16")
    if gpus % (par.tp * par.pp):
        raise ConfigError(f"{gpus} GPUs do not split into tp {par.tp} x pp {par.pp}")
    dp = gpus // (par.tp * par.pp)
    replicate = {"fsdp": par.dp_replicate, "ddp": dp}.get(par.strategy, 1)
    shard = dp // replicate
    notes, extra = [], []
    if par.strategy == "fsdp":
        extra.append("--parallelism.fsdp_reshard_after_forward="
                     + ("always" if par.reshards_after_forward else "never"))
    ac, option = par.activation_checkpointing, None
    if ac == "selective":  # ours is per-op: recompute the pointwise ops, keep the matmuls
        ac, option = "selective", "op"
    elif ac == "every_k":  # torchtitan's layer-level selective: every k-th block
        ac, option = "selective", str(par.ac_every)
    if option is not None:
        extra.append(f"--activation_checkpoint.selective_ac_option={option}")
    if train.master_weights == "bf16":
        dtype = "bfloat16"
    elif shard == 1 and (par.tp > 1 or par.pp > 1):
        dtype = "bfloat16"
        notes.append("peer: pure bf16 (with TP or PP its mixed precision needs an FSDP "
                     "dimension)")
    else:
        # fp32 master weights, bf16 compute through FSDP's policy, or through autocast on
        # one GPU and under DDP (torchtitan's AMP there): as ours.
        dtype = "float32"
    per_rank = train.micro_batch * train.grad_accum  # samples per data-parallel rank and step
    local, pp_micro = train.micro_batch, 1
    if par.pp > 1:
        local = per_rank
        pp_micro = per_rank // (par.pp_microbatches or train.grad_accum)
    elif train.grad_accum > 1:
        extra.append(f"--training.global_batch_size={per_rank * dp}")
    if train.precision == "fp8":
        # Its CLI default converts every Linear, the output layer too; ours keeps the output
        # layer in bf16, as torchtitan's own float8 configs do (filter_fqns = ["output"]).
        extra += ["--model.converters=quantize.linear.float8",
                  "--quantize.linear.float8.filter_fqns=output"]
        if train.fp8_recipe == "tensorwise":
            if shard > 1:
                extra += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                          "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
        else:
            extra.append(f"--quantize.linear.float8.recipe_name={train.fp8_recipe}")
    if par.async_tp:
        extra.append("--parallelism.enable_async_tensor_parallel")
    if par.reduce_precision == "bf16" and dtype == "float32":
        notes.append("ours reduces gradients in bf16, the peer in fp32")
    if par.fsdp_prefetch:
        notes.append(f"ours prefetches {par.fsdp_prefetch} FSDP block(s) explicitly; the peer "
                     "leaves it to FSDP2")
    if par.fsdp_group_blocks > 1:
        notes.append(f"ours gathers {par.fsdp_group_blocks} blocks per FSDP unit; the peer one")
    if train.loss_chunks:
        notes.append(f"ours chunks the loss ({train.loss_chunks}); the peer has no such option")
    return PeerRun(size=cfg.model.size, gpus=gpus, dp_shard=shard, dp_replicate=replicate,
                   tp=par.tp, pp=par.pp, pp_schedule=PEER_SCHEDULES[par.pp_schedule],
                   pp_microbatch_size=pp_micro, local_batch=local, seq_len=cfg.data.seq_len,
                   compile=par.compile, ac=ac, dtype=dtype, extra=extra), notes
