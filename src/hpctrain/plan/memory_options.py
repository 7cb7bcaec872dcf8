"""What ``hpctrain plan memory`` sizes and what it answers: a training setup (``MemoryOptions``,
checked as training checks it), the per-GPU bytes by category (``MemoryPlan``), and the model
and GPU named on the command line. The sizing itself is :mod:`hpctrain.plan.memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpctrain.errors import ConfigError
from hpctrain.models import ModelArgs, count_params, get_family
from hpctrain.models.registry import DEFAULT, families
from hpctrain.parallel.config import (
    MIXED_PRECISION,
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    REDUCE_PRECISION,
    ParallelConfig,
    mixed_precision_path,
)
from hpctrain.parallel.float8 import FP8_RECIPES, Float8Training, float8_all_gather
from hpctrain.parallel.layout import check_layout, check_loss_chunks, check_tensor_parallel
from hpctrain.parallel.selective_ac import SAVE_MM

if TYPE_CHECKING:
    from hpctrain.config import JobConfig

HEADROOM = 1.10  # plan, auto and tune: the predicted peak plus 10% must fit the GPU
STRATEGIES = ("none", "ddp", "fsdp")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
MASTER_WEIGHTS = ("fp32", "bf16")
AC_MODES = ("none", "full", "selective")

# Per GPU type (lookup by lower-cased short name): the device name torch reports (which tune
# records and training's auto compares) and the bytes torch's total_memory reports, what
# training sizes against (plan/auto.py this_gpu). H100 and H200 were read off the GPUs
# (81559 MiB = 79.6 GiB; 139.8 GiB, benchmarks/RESULTS.md); the others are the datasheet's GB,
# unmeasured here: a little more than torch will report.
GPUS: dict[str, tuple[str, float]] = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559 * 2**20), "h200": ("NVIDIA H200", 139.8 * 2**30),
    "a100-40": ("NVIDIA A100-SXM4-40GB", 40e9), "a100": ("NVIDIA A100-SXM4-80GB", 80e9),
    "a100-80": ("NVIDIA A100-SXM4-80GB", 80e9), "h100-pcie": ("NVIDIA H100 PCIe", 80e9),
    "h100-nvl": ("NVIDIA H100 NVL", 94e9), "b200": ("NVIDIA B200", 180e9),
    "gh200": ("NVIDIA GH200", 96e9), "l40s": ("NVIDIA L40S", 48e9),
    "mi250x": ("AMD Instinct MI250X", 128e9), "mi300x": ("AMD Instinct MI300X", 192e9),
}


@dataclass(frozen=True)
class MemoryOptions:
    """A training setup to size: strategy over `gpus`, precision, AC, batch shape."""

    strategy: str = "fsdp"
    gpus: int = 1
    zero: int = 3  # FSDP only: 3 reshards after forward, 2 keeps parameters gathered
    tp: int = 1
    pp: int = 1
    precision: str = "bf16"
    ac: str = "none"
    ac_save_mm: str = "every_other"  # selective AC: which matmul outputs are kept
    loss_chunks: int = 0  # >0: the chunked linear + cross entropy (no whole logits)
    micro_batch: int = 1  # samples per (pipeline) micro-batch
    # Micro-batches accumulated per step without a pipeline. FSDP then keeps unsharded fp32
    # gradient accumulators until the last one (no reduce-scatter before).
    grad_accum: int = 1
    seq_len: int = 2048
    compile: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0: pp x stages
    pp_stages_per_rank: int = 0  # 0: 2 for interleaved schedules, else 1
    # parallel.mixed_precision: auto, autocast or fsdp (FSDP's casts also without sharding).
    mixed_precision: str = "auto"
    # parallel.reduce_precision: fp32 or bf16 (FSDP's path: the gradient accumulators' dtype).
    reduce_precision: str = "fp32"
    # train.master_weights: fp32, or bf16 (with precision bf16: pure bf16 training, parameters,
    # gradients and AdamW moments in bf16).
    master_weights: str = "fp32"
    # parallel.fsdp_prefetch: blocks gathered ahead of the one computing (0: FSDP2's one).
    fsdp_prefetch: int = 0
    # parallel.fsdp_group_blocks: consecutive blocks per FSDP unit, gathered together.
    fsdp_group_blocks: int = 1
    # train.fp8_recipe, with precision fp8: tensorwise or rowwise scales (module docstring).
    fp8_recipe: str = "tensorwise"

    @classmethod
    def from_config(cls, cfg: JobConfig, gpus: int) -> MemoryOptions:
        """What the memory model sizes of the job ``cfg`` trained on ``gpus`` ranks.

        The one mapping from the training config onto the memory model: ``plan memory``,
        ``plan parallel`` and ``tune`` all size through it, and the layout is the trainer's own
        (``check_layout``: refused with training's words where training refuses it).
        """
        pc, tc = cfg.parallel, cfg.train
        if cfg.task:
            raise ConfigError(
                f"task = {cfg.task!r}: the memory model sizes the model families' models, not "
                "a task's own model", expected="a config whose model section names the model",
                hint="measure the task's peak instead: hpctrain bench model CONFIG")
        if pc.activation_checkpointing == "every_k":
            raise ConfigError(
                "parallel.activation_checkpointing = every_k: the memory model sizes none, "
                "selective and full only",
                expected="none, selective or full (every_k's peak lies between none's and "
                "full's)", hint="size both ends: parallel.activation_checkpointing=none, "
                "then =full")
        layout = check_layout(cfg, gpus)
        if layout.pp > 1:
            # Each data-parallel rank's batch is cut into the pipeline's micro-batches.
            batch = {"micro_batch": tc.micro_batch * tc.grad_accum // layout.microbatches,
                     "pp_microbatches": layout.microbatches}
        else:
            batch = {"micro_batch": tc.micro_batch, "grad_accum": tc.grad_accum}
        return cls(strategy=pc.strategy,
                   # FSDP shards over dp_shard (HSDP replicates the shards); DDP replicates all.
                   gpus=layout.dp_shard if pc.strategy == "fsdp" else layout.dp,
                   zero=3 if pc.strategy != "fsdp" or pc.reshards_after_forward else 2,
                   tp=layout.tp, pp=layout.pp, precision=tc.precision,
                   ac=pc.activation_checkpointing, ac_save_mm=pc.ac_save_mm,
                   loss_chunks=tc.loss_chunks, seq_len=cfg.data.seq_len, compile=pc.compile,
                   pp_schedule=pc.pp_schedule, pp_stages_per_rank=pc.pp_stages_per_rank,
                   mixed_precision=pc.mixed_precision, reduce_precision=pc.reduce_precision,
                   master_weights=tc.master_weights, fsdp_prefetch=pc.fsdp_prefetch,
                   fsdp_group_blocks=pc.fsdp_group_blocks, fp8_recipe=tc.fp8_recipe, **batch)

    def mixed_precision_path(self, args: ModelArgs) -> str:
        """'fsdp', 'autocast', 'pure' (bf16 master weights without FSDP) or 'none' (fp32): how
        the trainer computes this layout of the model ``args``."""
        return mixed_precision_path(self.mixed_precision, self.strategy, self.tp, self.pp,
                                    self.precision, count_params(args, include_embedding=True),
                                    self.master_weights)

    @property
    def float8_gather(self) -> bool:
        """Whether FSDP all-gathers the blocks' Linear weights in float8 (1 B)."""
        fp8 = Float8Training(self.fp8_recipe) if self.precision == "fp8" else None
        return float8_all_gather(fp8, self.strategy, self.gpus)

    @property
    def float8_saved_inputs(self) -> bool:
        """Whether the blocks' Linears keep their inputs for backward in float8 (1 B)."""
        return self.precision == "fp8" and self.fp8_recipe == "tensorwise" and self.compile

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of what the forward computes: 4 in fp32, else 2 (bf16, fp16, and
        fp8 outside its float8 matmuls)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of the parameters, their gradients and each AdamW moment."""
        return 2 if self.master_weights == "bf16" else 4

    def fsdp_wrapped(self, args: ModelArgs) -> bool:
        """Whether FSDP manages the parameters: sharding them, or only casting them."""
        return self.strategy == "fsdp" or self.mixed_precision_path(args) == "fsdp"

    def accumulator_bytes(self, args: ModelArgs) -> int:
        """Bytes per parameter of an unsharded gradient accumulator (module docstring)."""
        if self.fsdp_wrapped(args):
            return 2 if self.reduce_precision == "bf16" else 4
        return self.master_bytes  # the parameters' own .grad

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each rank."""
        if self.pp_schedule not in MULTI_STAGE_SCHEDULES:
            return 1
        return self.pp_stages_per_rank or 2

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per optimizer step."""
        return self.pp_microbatches or self.pp * self.stages_per_rank

    def validate(self, args: ModelArgs) -> None:
        """Raise ConfigError for unknown choices or impossible degrees."""
        for name, value, allowed in (("strategy", self.strategy, STRATEGIES),
                                     ("precision", self.precision, PRECISIONS),
                                     ("activation checkpointing", self.ac, AC_MODES),
                                     ("selective AC's saved matmuls", self.ac_save_mm,
                                      SAVE_MM),
                                     ("mixed precision", self.mixed_precision,
                                      MIXED_PRECISION),
                                     ("reduce precision", self.reduce_precision,
                                      REDUCE_PRECISION),
                                     ("master weights", self.master_weights,
                                      MASTER_WEIGHTS),
                                     ("fp8 recipe", self.fp8_recipe, FP8_RECIPES)):
            if value not in allowed:
                raise ConfigError(f"{name} {value!r} is not known",
                                  expected=f"one of {', '.join(allowed)}")
        for name, value in (("gpus", self.gpus), ("tp", self.tp), ("pp", self.pp),
                            ("micro-batch", self.micro_batch), ("seq-len", self.seq_len),
                            ("grad-accum", self.grad_accum)):
            if value < 1:
                raise ConfigError(f"{name} = {value}", expected="a positive integer")
        if self.loss_chunks < 0:
            raise ConfigError(f"loss chunks = {self.loss_chunks}", expected="0 (off) or more")
        if self.zero not in (2, 3):
            raise ConfigError(f"zero = {self.zero}", expected="2 or 3")
        # The combinations training refuses, refused with the same words.
        check_loss_chunks(self.loss_chunks, self.tp, self.pp)
        check_tensor_parallel(args, self.seq_len, self.tp)
        pc = ParallelConfig(strategy=self.strategy, mixed_precision=self.mixed_precision,
                            tp=self.tp, pp=self.pp, reduce_precision=self.reduce_precision,
                            fsdp_prefetch=self.fsdp_prefetch,
                            fsdp_group_blocks=self.fsdp_group_blocks)
        pc.validate()
        pc.check_precision(self.precision, count_params(args, include_embedding=True),
                           self.master_weights)
        if self.strategy == "none" and self.gpus > 1:
            raise ConfigError(f"strategy none with {self.gpus} GPUs",
                              expected="ddp or fsdp for more than one data-parallel GPU")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"pipeline schedule {self.pp_schedule!r} is not known",
                              expected=f"one of {', '.join(PP_SCHEDULES)}")
        if args.n_layers < self.pp * self.stages_per_rank:
            raise ConfigError(f"pp = {self.pp} x {self.stages_per_rank} stages per rank for "
                              f"{args.n_layers} layers",
                              expected="at least one layer per pipeline stage")


@dataclass
class MemoryPlan:
    """Bytes per GPU by category, the peak, and whether/how it fits."""

    params: float
    grads: float
    optimizer: float
    working: float
    activations: float
    peak: float
    peak_moment: str
    gpu_bytes: float | None = None
    suggestions: list[str] = field(default_factory=list)
    stage: int | None = None  # pipeline rank whose peak this is (the largest), None without PP
    bubble: float = 0.0  # idle share of a step (pipeline bubble)

    @property
    def fits(self) -> bool | None:
        """True when the peak plus 10% headroom fits the GPU; None without a GPU size."""
        if self.gpu_bytes is None:
            return None
        return self.peak * HEADROOM <= self.gpu_bytes


def resolve_model(size: str | None, family: str = DEFAULT, **overrides: int | None) -> ModelArgs:
    """A preset of ``family`` (Llama's: ``tiny``, ``125m``, ``1b``, ``8b``) with optional shape
    overrides."""
    spec = get_family(family)
    presets, args_class = spec.presets, spec.args_class
    if size is None and not all(overrides.get(k) for k in
                                ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")):
        raise ConfigError("no model given", expected="--model SIZE or the full shape",
                          hint=f"sizes: {', '.join(presets)}; or --dim --layers --heads "
                          "--ffn-dim --vocab")
    if size is not None and size not in presets:
        others = [name for name, f in families().items() if size in f.presets]
        raise ConfigError(f"unknown model size {size!r} of the {family} family",
                          expected=f"one of {', '.join(presets)}",
                          hint=f"--family {others[0]} has it" if others else
                          "or give the shape: --dim --layers --heads --ffn-dim --vocab")
    fields = {k: v for k, v in overrides.items() if v is not None}
    if size is None:
        fields.setdefault("n_kv_heads", fields["n_heads"])
        try:
            return args_class(**fields)
        except TypeError as e:  # a family whose shape has fields the flags do not set
            raise ConfigError(f"the {family} family's shape cannot be given by flags alone: "
                              f"{e}", hint=f"name a size: {', '.join(presets)}") from None
    return dataclasses.replace(presets[size], **fields)


def gpu_memory_bytes(gpu: str) -> float:
    """Memory of a GPU given by name (``h100``, ``h200``...: what torch reports on it) or a
    number of GB (``80``)."""
    return gpu_named(gpu)[1]


def gpu_named(gpu: str) -> tuple[str, float]:
    """(device name as torch reports it, bytes) of a GPU given by name, or (``gpu``, GB x 1e9)
    for a number of GB."""
    try:
        return gpu, float(gpu) * 1e9
    except ValueError:
        pass
    key = gpu.lower().removeprefix("nvidia-").removeprefix("nvidia ")
    if key not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}", expected=f"one of {', '.join(GPUS)} "
                          "or a size in GB", hint="e.g. --gpu h100 or --gpu 80")
    return GPUS[key]
