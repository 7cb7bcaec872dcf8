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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
# Schedules that run several stages on each rank (``pp_stages_per_rank`` applies).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")
# Schedules that split backward into input- and weight-gradient passes (zero bubble).
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv")


@dataclass
class ParallelConfig:
    """How the model is spread over ranks and which memory/speed transforms apply to it."""

    strategy: Literal["none", "ddp", "fsdp"] = "none"
    # FSDP only. True frees the gathered parameters after forward (ZeRO-3: least memory, one more
    # all-gather in backward); false keeps them until backward (ZeRO-2 behaviour). Zero-bubble
    # pipeline schedules always keep them (their weight-gradient pass needs them).
    reshard_after_forward: bool = True
    # selective: every block keeps its matmul and attention outputs and recomputes only the
    # pointwise ops (parallel/selective_ac.py); full/every_k keep only block inputs.
    activation_checkpointing: Literal["none", "full", "every_k", "selective"] = "none"
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

    def validate(self) -> None:
        """Check the values that a type alone cannot."""
        if self.activation_checkpointing == "every_k" and self.ac_every < 1:
            raise ConfigError(
                f"parallel.ac_every = {self.ac_every} must be >= 1",
                hint="ac_every=1 is the same as activation_checkpointing=full",
            )
        for key in ("tp", "pp", "dp_replicate"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key} = {getattr(self, key)} must be >= 1",
                                  hint="1 leaves that axis unused")
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, key) < 0:
                raise ConfigError(f"parallel.{key} = {getattr(self, key)} must be >= 0",
                                  hint="0 picks the default")
        if self.dp_replicate > 1 and self.strategy != "fsdp":
            raise ConfigError(
                f"parallel.dp_replicate = {self.dp_replicate} with strategy "
                f"{self.strategy!r}",
                expected="dp_replicate > 1 only with strategy fsdp (HSDP: replicas of FSDP "
                "groups)",
                hint="with ddp every data-parallel rank is a replica already: drop "
                "parallel.dp_replicate",
            )

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each rank (1 unless the schedule interleaves)."""
        if self.pp_schedule not in MULTI_STAGE_SCHEDULES:
            return 1
        return self.pp_stages_per_rank or 2
