"""Config section ``parallel:``: the data-parallel strategy, activation checkpointing, compile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError


@dataclass
class ParallelConfig:
    """How the model is spread over ranks and which memory/speed transforms apply to it."""

    strategy: Literal["none", "ddp", "fsdp"] = "none"
    # FSDP only. True frees the gathered parameters after forward (ZeRO-3: least memory, one more
    # all-gather in backward); false keeps them until backward (ZeRO-2 behaviour).
    reshard_after_forward: bool = True
    activation_checkpointing: Literal["none", "full", "every_k"] = "none"
    # With every_k: recompute every k-th block only, trading memory for less recomputation.
    ac_every: int = 2
    compile: bool = False

    def validate(self) -> None:
        """Check the values that a type alone cannot."""
        if self.activation_checkpointing == "every_k" and self.ac_every < 1:
            raise ConfigError(
                f"parallel.ac_every = {self.ac_every} must be >= 1",
                hint="ac_every=1 is the same as activation_checkpointing=full",
            )
