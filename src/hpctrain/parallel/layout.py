"""The degrees of every parallelism axis, and every rule they must obey, checked before training.

``mesh_degrees`` needs only the ``parallel:`` section and the world size (it shapes the device
mesh); ``check_layout`` adds the rules that involve the model and the batch: every size the
model family's tensor-parallel plan splits (for Llama: heads, KV heads, FFN width, vocabulary,
sequence length) divisible by ``tp``; layers enough for
the stages; the data-parallel batch divisible into pipeline micro-batches the schedule accepts.
``check_task_config`` is a user task's counterpart (data parallelism only), here so that launchers
check a task without importing the Trainer. Each refusal says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpctrain.errors import ConfigError
from hpctrain.models.registry import family_of_args
from hpctrain.parallel.config import ZERO_BUBBLE_SCHEDULES, ParallelConfig

if TYPE_CHECKING:
    from hpctrain.config import JobConfig


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of the mesh axes and, with pipeline parallelism, how the pipeline runs."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1  # pipeline micro-batches per optimizer step (pp > 1 only)
    stages_per_rank: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: model replicas (each spanning tp x pp ranks)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Ranks the layout spans."""
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all ranks."""
        return self.pp * self.stages_per_rank

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes of the mesh axes (pp, dp_replicate, dp_shard, tp)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def describe(self) -> str:
        """One line for logs: 'pp 2 x dp 1x2 x tp 2 (1f1b, 4 micro-batches)'."""
        text = f"pp {self.pp} x dp {self.dp_replicate}x{self.dp_shard} x tp {self.tp}"
        if self.pp > 1:
            text += (f" ({self.schedule}, {self.num_stages} stages, {self.microbatches} "
                     "micro-batches)")
        return text


def mesh_degrees(pc: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
    """Sizes of (pp, dp_replicate, dp_shard, tp) for ``world_size`` ranks."""
    model_ranks = pc.tp * pc.pp
    fixed = model_ranks * pc.dp_replicate
    if world_size % fixed:
        raise ConfigError(
            f"{world_size} ranks cannot be split into tp {pc.tp} x pp {pc.pp} x dp_replicate "
            f"{pc.dp_replicate} (= {fixed}) times a data-parallel shard degree",
            expected=f"a world size that is a multiple of {fixed}",
            hint=f"run on a multiple of {fixed} ranks, or lower parallel.tp / parallel.pp / "
            "parallel.dp_replicate",
        )
    dp = world_size // model_ranks
    if pc.strategy == "none":
        if dp > 1:
            raise ConfigError(
                f"parallel.strategy = 'none' with {world_size} ranks and tp x pp = "
                f"{model_ranks}",
                expected="'ddp' or 'fsdp' when more than one rank holds the same model part",
                hint=f"set parallel.strategy=ddp (or fsdp), or run with --nproc {model_ranks}",
            )
        return (pc.pp, 1, 1, pc.tp)
    if pc.strategy == "ddp":
        return (pc.pp, dp, 1, pc.tp)
    return (pc.pp, pc.dp_replicate, dp // pc.dp_replicate, pc.tp)


def _refuse_auto(cfg: JobConfig) -> None:
    """The layout rules compare numbers and names: ``auto`` must have been chosen before."""
    pc = cfg.parallel
    left = [key for key, value in (("train.micro_batch", cfg.train.micro_batch),
                                   ("parallel.strategy", pc.strategy),
                                   ("parallel.reshard_after_forward", pc.reshard_after_forward),
                                   ("parallel.activation_checkpointing",
                                    pc.activation_checkpointing),
                                   ("parallel.fsdp_group_blocks", pc.fsdp_group_blocks))
            if value == "auto"]
    if left:
        raise ConfigError(f"{', '.join(left)} = auto reached the layout check unchosen",
                          expected="the values auto stands for, chosen for the job's GPU count",
                          hint="call hpctrain.plan.auto.resolve_auto(cfg, world_size) first "
                          "(training and hpctrain sbatch/submit/k8s do)")


def check_task_config(cfg: JobConfig, world_size: int) -> ParallelLayout:
    """The layout a task trains in (data parallelism only), or a ConfigError naming the key."""
    pc, tc = cfg.parallel, cfg.train
    _refuse_auto(cfg)
    refused = [(pc.tp > 1, f"parallel.tp = {pc.tp}", "parallel.tp=1"),
               (pc.pp > 1, f"parallel.pp = {pc.pp}", "parallel.pp=1"),
               (tc.precision == "fp8", "train.precision = fp8", "train.precision=bf16"),
               (tc.master_weights != "fp32", f"train.master_weights = {tc.master_weights}",
                "train.master_weights=fp32"),
               (pc.activation_checkpointing != "none",
                f"parallel.activation_checkpointing = {pc.activation_checkpointing}",
                "parallel.activation_checkpointing=none (or checkpoint inside your model "
                "with torch.utils.checkpoint)"),
               (tc.loss_chunks > 0, f"train.loss_chunks = {tc.loss_chunks}",
                "train.loss_chunks=0")]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"{what} with a task of your own",
                              expected="data parallelism (ddp or fsdp) and bf16/fp16/fp32: "
                              "the other transforms need a model-family spec",
                              hint=f"set {fix}")
    check_optimizer_sharding(cfg, pc.tp)
    _, dp_replicate, dp_shard, _ = mesh_degrees(pc, world_size)
    return ParallelLayout(1, dp_replicate, dp_shard, 1)


def check_layout(cfg: JobConfig, world_size: int) -> ParallelLayout:
    """Every rule a layout must obey for this model and batch; the layout, or a ConfigError."""
    pc, tc = cfg.parallel, cfg.train
    _refuse_auto(cfg)
    pp, dp_replicate, dp_shard, tp = mesh_degrees(pc, world_size)
    args = cfg.model.resolve()
    if tp > 1:
        check_tensor_parallel(args, cfg.data.seq_len, tp)
    # fp8 and fp16 against tp and pp: ParallelConfig.check_precision, when the config loads
    # (the planner asks it too).
    if (pp > 1 or tp > 1) and args.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings = true with tensor or pipeline parallelism",
            expected="separate input and output embeddings (they live on different "
            "stages, or are sharded differently)",
            hint="set model.tie_embeddings=false",
        )
    check_loss_chunks(tc.loss_chunks, tp, pp)
    check_optimizer_sharding(cfg, tp)
    family = family_of_args(args)
    if tc.loss_chunks and not family.chunked_loss:
        raise ConfigError(
            f"train.loss_chunks = {tc.loss_chunks} with model.family = {family.name}",
            expected="train.loss_chunks = 0: this family's forward does not compute the loss "
            "itself", hint="set train.loss_chunks=0")
    if pc.strategy == "ddp" and (tp > 1 or pp > 1):
        raise ConfigError(
            f"parallel.strategy = ddp with parallel.tp = {tp}, parallel.pp = {pp}",
            expected="fsdp (or none) with tensor or pipeline parallelism: DDP handles neither "
            "sharded (DTensor) parameters nor gradients accumulated inside a pipeline schedule",
            hint=f"set parallel.strategy=fsdp; parallel.dp_replicate={world_size // (tp * pp)} "
            "then replicates without sharding, like DDP",
        )
    if pp == 1:
        return ParallelLayout(1, dp_replicate, dp_shard, tp)
    stages_per_rank = _stages_per_rank(pc)
    num_stages = pp * stages_per_rank
    if args.n_layers < num_stages:
        raise ConfigError(
            f"model.n_layers = {args.n_layers} is fewer than the {num_stages} pipeline stages "
            f"(pp {pp} x {stages_per_rank} per rank)",
            expected="at least one block per stage",
            hint="lower parallel.pp or parallel.pp_stages_per_rank, or use more layers",
        )
    if pc.compile and pc.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule = {pc.pp_schedule} with parallel.compile = true",
            expected="an eager model: zero-bubble schedules split backward into input and "
            "weight passes, which compiled graphs do not support",
            hint="set parallel.compile=false, or pp_schedule=1f1b / interleaved_1f1b",
        )
    microbatches = _check_microbatches(cfg, pp, stages_per_rank)
    return ParallelLayout(pp, dp_replicate, dp_shard, tp, pc.pp_schedule, microbatches,
                          stages_per_rank)


def check_loss_chunks(loss_chunks: int, tp: int, pp: int) -> None:
    """Refuse the chunked loss with tensor or pipeline parallelism (training and the planner)."""
    if loss_chunks and (tp > 1 or pp > 1):
        raise ConfigError(
            f"train.loss_chunks = {loss_chunks} with parallel.tp = {tp}, parallel.pp = {pp}",
            expected="train.loss_chunks = 0 with tensor or pipeline parallelism: the vocabulary-"
            "parallel loss never gathers the logits (each rank holds 1/tp of them), and a "
            "pipeline's last stage computes the loss from its output outside the model",
            hint="set train.loss_chunks=0 (with pipelines, more micro-batches shrink the logits "
            "of each)",
        )


def check_tensor_parallel(args: Any, seq_len: int, tp: int) -> None:
    """Refuse a ``tp`` that does not divide every size it splits, or a model family without
    a tensor-parallel plan (training and the planner)."""
    family = family_of_args(args)
    if family.tensor_plan is None:
        raise ConfigError(f"parallel.tp = {tp} with model.family = {family.name}",
                          expected=f"parallel.tp = 1: the {family.name} family has no "
                          "tensor-parallel plan", hint="set parallel.tp=1")
    for key, value, why in family.tp_splits(args, seq_len):
        if value % tp:
            divisors = [d for d in range(2, value + 1) if value % d == 0][:4]
            raise ConfigError(
                f"{key} = {value} is not divisible by parallel.tp = {tp}",
                expected=f"{key} a multiple of tp: {why}",
                hint=f"use a tp dividing {value} (e.g. {', '.join(map(str, divisors))}) or "
                f"change {key}" if divisors else f"change {key}",
            )


def _stages_per_rank(pc: ParallelConfig) -> int:
    v = pc.stages_per_rank
    if pc.pp_schedule in ("gpipe", "1f1b") and pc.pp_stages_per_rank > 1:
        raise ConfigError(
            f"parallel.pp_stages_per_rank = {pc.pp_stages_per_rank} with pp_schedule "
            f"{pc.pp_schedule}",
            expected="one stage per rank: gpipe and 1f1b do not interleave stages",
            hint="use pp_schedule=interleaved_1f1b (or interleaved_zb, zbv) for several stages "
            "per rank",
        )
    if pc.pp_schedule == "zbv" and v != 2:
        raise ConfigError(
            f"parallel.pp_stages_per_rank = {v} with pp_schedule zbv",
            expected="exactly 2 stages per rank (the V shape: stage r and 2*pp-1-r)",
            hint="set parallel.pp_stages_per_rank=2 (or 0 for the default)",
        )
    return v


def _check_microbatches(cfg: JobConfig, pp: int, stages_per_rank: int) -> int:
    pc, tc = cfg.parallel, cfg.train
    local = tc.micro_batch * tc.grad_accum
    m = pc.pp_microbatches or tc.grad_accum
    if local % m:
        raise ConfigError(
            f"parallel.pp_microbatches = {m} does not divide the {local} samples each "
            f"data-parallel rank takes per step (train.micro_batch {tc.micro_batch} x "
            f"train.grad_accum {tc.grad_accum})",
            expected="equal pipeline micro-batches",
            hint="pick pp_microbatches dividing micro_batch x grad_accum",
        )
    need = {"1f1b": pp, "zbv": 2 * pp - 1}.get(pc.pp_schedule, 1)
    if m < need:
        raise ConfigError(
            f"parallel.pp_microbatches = {m} with pp_schedule {pc.pp_schedule} and pp {pp}",
            expected=f"at least {need} micro-batches per step for this schedule",
            hint=f"raise train.grad_accum (or parallel.pp_microbatches) to {need} or more",
        )
    if stages_per_rank > 1 or pc.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"parallel.pp_microbatches = {m} with pp_schedule {pc.pp_schedule} and pp {pp}",
                expected=f"a multiple of the {rounds} rounds (micro-batches // pp) the "
                "interleaved schedule runs",
                hint=f"use a multiple of pp ({pp}) micro-batches, or fewer than {pp}",
            )
    return m


def check_optimizer_sharding(cfg: JobConfig, tp: int) -> None:
    """Refuse SGD on sharded (DTensor) parameters: FSDP2's or tensor parallelism's."""
    if cfg.optim.name == "sgd" and (cfg.parallel.strategy == "fsdp" or tp > 1):
        # Fused SGD has no DTensor sharding strategy: the first step would end in a bare
        # NotImplementedError. AdamW runs on the local shards (train.optim.LocalShardAdamW).
        raise ConfigError(
            f"optim.name = sgd with parallel.strategy = {cfg.parallel.strategy}, "
            f"parallel.tp = {tp}",
            expected="SGD with unsharded parameters (strategy ddp or none, tp 1), or AdamW",
            hint="set parallel.strategy=ddp parallel.tp=1, or optim.name=adamw")
