"""Config section ``parallel:``: how the model is spread over ranks, and speed/memory transforms.

The ranks form a mesh ``pp x dp_replicate x dp_shard x tp``. ``tp``, ``pp`` and ``dp_replicate``
are given; the data-parallel shard degree is what is left of the world size::

    parallel:
      strategy: fsdp          # how the data-parallel ranks share the model: none, ddp or fsdp
      tp: 2                   # tensor parallel (inside a node): heads, FFN and vocabulary sharded
      pp: 2                   # pipeline stages across ranks
      dp_replicate: 1         # FSDP only: >1 is HSDP, replicas of FSDP groups
      pp_schedule: 1f1b
      pp_microbatches: 0      # 0: one per loader micro-batch (train.grad_accum)
      mixed_precision: auto   # how bf16 is computed: auto, autocast or fsdp (below)
      reduce_precision: fp32  # FSDP paths: gradients reduced and accumulated in fp32 or bf16
      async_tp: false         # TP with compile on GPUs: overlap SP's collectives with matmuls
      fsdp_prefetch: 0        # FSDP: blocks gathered explicitly ahead of use (0: FSDP2's own)
      fsdp_group_blocks: 1    # FSDP: consecutive blocks gathered and reduced as one unit

``mixed_precision`` (bf16/fp16/fp8; nothing to choose in fp32) says how the forward computes in
the lower precision while the optimizer keeps fp32 master weights:

- ``fsdp``: FSDP2's ``MixedPrecisionPolicy`` casts the parameters to the compute dtype (gradients
  reduced in fp32). Without data-parallel sharding (strategy none) each block and the root are
  ``fully_shard``-ed over the ``dp_shard`` axis of size 1, parameters kept gathered from
  forward through backward (``reshard_after_forward`` false): each forward-backward casts once
  (a pipeline stage once per step, not per micro-batch: the schedule keeps them gathered until
  its last backward), and the embedding output, hence the residual stream, is in the compute
  dtype (half the bytes for sequence-parallel all-gathers and for saved activations);
- ``autocast``: ``torch.autocast`` around each forward (each pipeline stage's forward): weights
  re-cast per forward, residual stream in fp32;
- ``auto``: ``fsdp`` with tensor or pipeline parallelism and strategy none (not fp8) for models
  of at least ``FSDP_CASTS_MIN_PARAMS`` parameters per model-parallel rank (the model's over
  tp x pp), else what the strategy implies (FSDP's own policy with strategy fsdp; autocast on one
  GPU, with DDP, with fp8 and for smaller models). ``mixed_precision_path`` decides; the memory
  planner sizes the same path.

With ``train.master_weights=bf16`` (pure bf16 training) the parameters are bf16 themselves: the
path is ``pure`` (nothing cast, no FSDP wrapper) unless FSDP shards, whose policy then only sets
the reduction dtype; ``auto`` is the only setting accepted without sharding.

``reduce_precision`` (the FSDP path only) is the dtype FSDP's policy reduces gradients in, across
data-parallel ranks, and accumulates them in over the micro-batches of a step (a pipeline's, or
``train.grad_accum``'s). ``fp32`` (the default) upcasts each micro-batch's bf16 gradients and adds
them in fp32: on 8b PP2 (2xH200, 8 micro-batches) those adds took 117 ms of a 922 ms step.
``bf16`` adds them in bf16, as pure-bf16 training does (torchtitan's ``--training.dtype
bfloat16``), halves the accumulators and the reduce-scatter bytes, and casts to the fp32 master
gradients once a step; the price is a bf16 rounding per micro-batch (about 2^-9 relative each),
which grows with the number of micro-batches accumulated. The optimizer still steps fp32 masters.

``async_tp`` (tensor parallelism with ``compile``, CUDA) turns on inductor's micro-pipelined TP:
in each compiled block, an all-gather feeding a matmul and a matmul feeding a reduce-scatter become
one fused op that splits the matmul into chunks and moves each chunk over NVLink (PyTorch's
symmetric memory) while the next computes, so sequence parallelism's collectives hide behind the
GEMMs instead of waiting in front of them. On 8b TP2 (2xH200) the exposed share of the step fell
from 11% to 3.4%, but the step only by 2.1% (most likely the chunked matmuls run slower). Off by
default: it needs symmetric memory between the TP ranks (peer-to-peer NVLink within one node),
and its reduce-scatters sum the ranks' partial results in another order than NCCL's.

``fsdp_prefetch`` (strategy fsdp) sets how many blocks ahead each block issues the all-gathers
of, in forward (the next ones) and in backward (the previous ones). 0 leaves it to FSDP2, whose
implicit prefetch issues a block's all-gather when the CPU reaches that block: on a rank whose
CPU falls behind its GPU (the 4-GPU FSDP profile of 1b in benchmarks/RESULTS.md), it comes after
the previous block's kernels and the GPU waits for it. With 1, a block's all-gather is issued
before the previous block's kernels, whatever the CPU's lead. Each further block held gathered
costs its parameters in the compute dtype (the memory planner counts them). Scheduling only:
the losses are the same bit for bit.

``fsdp_group_blocks`` (strategy fsdp) makes each FSDP unit ``k`` consecutive blocks instead of
one: one all-gather and one reduce-scatter per unit, and a k-th of FSDP's per-unit hooks on the
CPU. Where the CPU sets the pace (1b on 4 H200s, whose profiles are launch-bound on our side
and the peer's), a prototype of it with k = 2 made the step 5.1% faster; on 2 H200s, whose CPUs
keep ahead, k = 2 changed nothing (benchmarks/RESULTS.md).
The price: under ZeRO-3 k blocks are gathered at once (the memory planner counts them), and the
first unit's all-gather and the last unit's reduce-scatter, which nothing hides, are k times
larger. ``fsdp_prefetch`` then counts units. The same gradients are reduced, in fewer
collectives: on 2 CPU ranks the losses are the same bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError

MIXED_PRECISION = ("auto", "autocast", "fsdp")
REDUCE_PRECISION = ("fp32", "bf16")
# Measured on 2xH200 against the same peer (benchmarks/RESULTS.md): FSDP's casts made 8b TP2 and
# PP2 (4.0B parameters per rank) 9.6% and 3.0% faster than autocast, and 1b TP2 and PP2 (0.55B)
# 30% and 23% slower. Their hooks cost about the same per block and micro-batch whatever the
# width, while what they save (one cast per step, a bf16 residual stream) grows with it.
FSDP_CASTS_MIN_PARAMS = 2_000_000_000
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
# Schedules that run several stages on each rank (``pp_stages_per_rank`` applies).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")
# Schedules that split backward into input- and weight-gradient passes (zero bubble).
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv")


@dataclass
class ParallelConfig:
    """How the model is spread over ranks and which memory/speed transforms apply to it."""

    # auto (like every ``auto`` below): chosen at start from the memory model, the GPU and
    # `hpctrain tune`'s measurements (hpctrain.plan.auto); the run's config/auto.yaml records
    # the choice.
    strategy: Literal["none", "ddp", "fsdp", "auto"] = "none"
    # FSDP only. True frees the gathered parameters after forward (ZeRO-3: least memory, one more
    # all-gather in backward); false keeps them until backward (ZeRO-2 behaviour). Unset: true,
    # except inside a pipeline (``reshards_after_forward``).
    reshard_after_forward: bool | Literal["auto"] | None = None
    # selective: every block keeps its matmul and attention outputs and recomputes only the
    # pointwise ops (parallel/selective_ac.py); full/every_k keep only block inputs.
    activation_checkpointing: Literal["none", "full", "every_k", "selective", "auto"] = "none"
    # With every_k: recompute every k-th block only, trading memory for less recomputation.
    ac_every: int = 2
    # With selective: keep every other matmul output (the rest recomputed) or all of them.
    ac_save_mm: Literal["every_other", "all"] = "every_other"
    compile: bool = False
    # Tensor-parallel degree: attention heads, FFN width and vocabulary split over tp ranks,
    # norms and residuals split along the sequence (sequence parallelism). Keep it in a node.
    tp: int = 1
    # Pipeline-parallel degree: the layers split into stages over pp ranks.
    pp: int = 1
    # FSDP only: replicas of the FSDP group (HSDP). The shard degree is what is left.
    dp_replicate: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"
    # Micro-batches per optimizer step through the pipeline; each data-parallel rank's batch
    # (train.micro_batch x train.grad_accum samples) is cut into this many. 0: train.grad_accum.
    pp_microbatches: int = 0
    # Stages held by each rank for interleaved schedules; 0: 1 for gpipe/1f1b, else 2.
    pp_stages_per_rank: int = 0
    # How the forward computes in bf16/fp16 (module docstring): auto, autocast or fsdp (FSDP2's
    # parameter casts, also without sharding). auto: fsdp for TP/PP with strategy none.
    mixed_precision: Literal["auto", "autocast", "fsdp"] = "auto"
    # The FSDP path's gradient reduction and micro-batch accumulation dtype (module docstring).
    reduce_precision: Literal["fp32", "bf16"] = "fp32"
    # Micro-pipelined TP in the compiled blocks (module docstring): needs tp > 1, compile, CUDA.
    async_tp: bool = False
    # FSDP: blocks whose all-gathers each block issues ahead of use (module docstring); 0: FSDP2's.
    fsdp_prefetch: int = 0
    # FSDP: consecutive blocks per FSDP unit (module docstring); 1: each block its own unit.
    fsdp_group_blocks: int | Literal["auto"] = 1
    # `hpctrain tune`'s results (its --out folder or results.json) that ``auto`` prefers to the
    # memory model where they were measured on this GPU kind and count for this model and batch.
    tune_results: str | None = None

    def validate(self) -> None:
        """Check the values that a type alone cannot."""
        if self.activation_checkpointing == "every_k" and self.ac_every < 1:
            raise ConfigError(
                f"parallel.ac_every = {self.ac_every} must be >= 1",
                hint="ac_every=1 is the same as activation_checkpointing=full",
            )
        for key in ("tp", "pp", "dp_replicate", "fsdp_group_blocks"):
            if getattr(self, key) != "auto" and getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key} = {getattr(self, key)} must be >= 1",
                                  hint="1 leaves that axis unused")
        for key in ("pp_microbatches", "pp_stages_per_rank", "fsdp_prefetch"):
            if getattr(self, key) < 0:
                raise ConfigError(f"parallel.{key} = {getattr(self, key)} must be >= 0",
                                  hint="0 picks the default")
        if self.dp_replicate > 1 and self.strategy not in ("fsdp", "auto"):
            raise ConfigError(
                f"parallel.dp_replicate = {self.dp_replicate} with strategy "
                f"{self.strategy!r}",
                expected="dp_replicate > 1 only with strategy fsdp (HSDP: replicas of FSDP "
                "groups)",
                hint="with ddp every data-parallel rank is a replica already: drop "
                "parallel.dp_replicate",
            )

        for key, default in (("fsdp_prefetch", 0), ("fsdp_group_blocks", 1)):
            if getattr(self, key) not in (default, "auto") and self.strategy not in ("fsdp",
                                                                                      "auto"):
                raise ConfigError(
                    f"parallel.{key} = {getattr(self, key)} with strategy {self.strategy!r}",
                    expected=f"{key} with strategy fsdp: it schedules FSDP's collectives",
                    hint=f"drop parallel.{key}, or shard with parallel.strategy=fsdp",
                )
        if self.async_tp and (self.tp == 1 or not self.compile):
            raise ConfigError(
                f"parallel.async_tp = true with tp = {self.tp} and compile = "
                f"{str(self.compile).lower()}",
                expected="async_tp with tp > 1 and compile true: inductor fuses the tensor-"
                "parallel collectives into the matmuls of the compiled blocks",
                hint="set parallel.tp=2 (or more) and parallel.compile=true, or drop "
                "parallel.async_tp",
            )
        if self.mixed_precision == "fsdp" and self.strategy == "ddp":
            raise ConfigError(
                "parallel.mixed_precision = fsdp with strategy 'ddp'",
                expected="mixed_precision fsdp with strategy none (TP, PP or one GPU) or fsdp; "
                "DDP computes in bf16 through autocast",
                hint="drop parallel.mixed_precision (auto), or shard with parallel.strategy=fsdp, "
                "whose parameters FSDP casts",
            )
        if self.mixed_precision == "autocast" and self.strategy == "fsdp":
            raise ConfigError(
                "parallel.mixed_precision = autocast with strategy 'fsdp'",
                expected="mixed_precision auto or fsdp with strategy fsdp: FSDP casts the "
                "parameters it gathers through its own policy",
                hint="drop parallel.mixed_precision (auto)",
            )

    def check_precision(self, precision: str, params: int, master: str = "fp32") -> None:
        """Refuse ``mixed_precision`` and ``reduce_precision`` choices that ``train.precision``,
        ``train.master_weights`` (``master``) and a model of ``params`` parameters cannot take,
        and bf16 master weights without bf16 training, and the precisions tensor or pipeline
        parallelism cannot take (the config's load, ``parallelize`` and the planner all ask)."""
        if precision == "fp8" and self.tp > 1:
            # torchao shards float8 Linears with parallel styles of its own (Float8ColwiseParallel
            # and friends), which parallel/tensor.py does not use yet.
            raise ConfigError(
                f"train.precision = fp8 with parallel.tp = {self.tp}",
                expected="fp8 without tensor parallelism (FSDP, HSDP, DDP and pipeline "
                "parallelism work)",
                hint="set parallel.tp=1 (shard with parallel.strategy=fsdp instead), or "
                "train.precision=bf16 to keep tensor parallelism",
            )
        if precision == "fp16" and (self.tp > 1 or self.pp > 1):
            raise ConfigError(
                "train.precision = fp16 with tensor or pipeline parallelism",
                expected="bf16 or fp32 (fp16's loss scaling is not wired through TP/PP)",
                hint="set train.precision=bf16",
            )
        if master == "bf16" and precision != "bf16":
            raise ConfigError(
                f"train.master_weights = bf16 with train.precision = {precision}",
                expected="bf16 master weights with train.precision bf16 (pure bf16 training); "
                "fp16 needs fp32 masters for its loss scaling, fp8's float8 Linears and fp32 "
                "training keep fp32 weights",
                hint="set train.precision=bf16, or drop train.master_weights (fp32)")
        if (master == "bf16" and self.mixed_precision != "auto"
                and self.strategy not in ("fsdp", "auto")):
            raise ConfigError(
                f"parallel.mixed_precision = {self.mixed_precision} with train.master_weights "
                f"= bf16 and strategy {self.strategy!r}",
                expected="mixed_precision auto with bf16 master weights: the parameters are "
                "bf16 already, so neither autocast nor FSDP's casts have anything to cast",
                hint="drop parallel.mixed_precision (auto), or keep fp32 master weights "
                "(drop train.master_weights)")
        if self.reduce_precision == "bf16" and precision not in ("bf16", "fp8"):
            raise ConfigError(
                f"parallel.reduce_precision = bf16 with train.precision = {precision}",
                expected="reduce_precision bf16 with train.precision bf16 or fp8 (whose "
                "gradients are bf16); fp32 training reduces in fp32, fp16 needs fp32 "
                "reductions for its loss scaling",
                hint="drop parallel.reduce_precision (fp32)")
        unsharded_casts = self.mixed_precision == "fsdp" and self.strategy not in ("fsdp",
                                                                                  "auto")
        if unsharded_casts and precision == "fp8":
            raise ConfigError(
                f"parallel.mixed_precision = fsdp with train.precision = fp8 and strategy "
                f"{self.strategy!r}",
                expected="fp8 without sharding computes through autocast (its float8 Linears "
                "are not wired to an unsharded FSDP cast)",
                hint="drop parallel.mixed_precision (auto picks autocast for fp8), or shard with "
                "parallel.strategy=fsdp",
            )
        if unsharded_casts and precision == "fp16":
            raise ConfigError(
                f"parallel.mixed_precision = fsdp with train.precision = fp16 and strategy "
                f"{self.strategy!r}",
                expected="fp16 through autocast and its GradScaler without sharding (the "
                "scaler for FSDP-cast parameters comes with strategy fsdp only)",
                hint="use train.precision=bf16 (no loss scaling needed), or drop "
                "parallel.mixed_precision",
            )
        if self.strategy == "auto":
            return  # the rest depends on the strategy: checked again once auto chose it
        # bf16 reductions need an FSDP policy to reduce through: the autocast path's gradients
        # belong to fp32 parameters (auto takes it for models under FSDP_CASTS_MIN_PARAMS per
        # model-parallel rank, which only the size tells).
        path = self.mixed_precision_path(precision, params, master)
        if self.reduce_precision == "bf16" and path != "fsdp":
            raise ConfigError(
                f"parallel.reduce_precision = bf16 where the model computes through {path} "
                f"(strategy {self.strategy!r}, mixed_precision {self.mixed_precision!r}, "
                f"{params / 1e9:.2f}B parameters over tp {self.tp} x pp {self.pp})",
                expected="reduce_precision bf16 on FSDP's path: strategy fsdp, or "
                "parallel.mixed_precision fsdp (auto takes it with TP/PP from "
                f"{FSDP_CASTS_MIN_PARAMS / 1e9:.0f}B parameters per model-parallel rank)",
                hint="add parallel.mixed_precision=fsdp, or drop parallel.reduce_precision")

    def mixed_precision_path(self, precision: str, params: int, master: str = "fp32") -> str:
        """How this config computes a model of ``params`` parameters in ``precision`` with
        ``master`` weights: 'fsdp', 'autocast', 'pure' (bf16 parameters) or 'none' (fp32)."""
        return mixed_precision_path(self.mixed_precision, self.strategy, self.tp, self.pp,
                                    precision, params, master)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP frees the gathered parameters after each forward: as set, else true
        except inside a pipeline. There every micro-batch's forward and backward would gather the
        stage again (16 all-gathers a step for 8 micro-batches); 8b PP2 x FSDP2 resharding so ran
        6% behind torchtitan, which keeps them gathered with PP. Zero-bubble schedules always
        keep them: their weight-gradient pass runs after the input gradients, and resharded
        parameters give wrong weight gradients there (measured, PyTorch 2.13)."""
        if self.pp > 1 and self.pp_schedule in ZERO_BUBBLE_SCHEDULES:
            return False
        if isinstance(self.reshard_after_forward, bool):  # not None nor an unresolved auto
            return self.reshard_after_forward
        return self.pp == 1

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each rank (1 unless the schedule interleaves)."""
        if self.pp_schedule not in MULTI_STAGE_SCHEDULES:
            return 1
        return self.pp_stages_per_rank or 2


def mixed_precision_path(setting: str, strategy: str, tp: int, pp: int, precision: str,
                         params: int, master: str = "fp32") -> str:
    """'fsdp' (FSDP2 casts the parameters), 'autocast', 'pure' (the parameters are bf16
    themselves: ``train.master_weights=bf16``, nothing to cast) or 'none' (fp32): how a layout
    computes a model of ``params`` parameters in ``precision`` under ``parallel.mixed_precision =
    setting`` (module docstring)."""
    if precision == "fp32":
        return "none"
    if master == "bf16":
        # FSDP's policy still sets the reduction dtype; without FSDP nothing wraps the model.
        return "fsdp" if strategy == "fsdp" else "pure"
    if strategy == "fsdp" or setting == "fsdp":
        return "fsdp"
    if (setting == "auto" and strategy == "none" and (tp > 1 or pp > 1) and precision != "fp8"
            and params // (tp * pp) >= FSDP_CASTS_MIN_PARAMS):
        return "fsdp"
    return "autocast"
