"""The values configs/llama-1b.yaml and configs/llama-8b-fsdp.yaml held before they left them to
``auto`` (hpctrain.plan.auto), which the benchmarks' variants were written and measured with.

Each variant puts these before its own overrides, so that a rerun measures the shape its name
and benchmarks/RESULTS.md describe (e.g. 8b with full AC at micro-batch 2), not whatever auto
picks on the GPUs at hand; auto itself is measured by benchmarks/auto_vs_tune.py.
"""

from __future__ import annotations

_FIXED = ["train.global_batch_tokens=null", "parallel.reshard_after_forward=null",
          "parallel.fsdp_group_blocks=1"]
AS_MEASURED: dict[str, list[str]] = {
    "configs/llama-1b.yaml": [*_FIXED, "train.micro_batch=4", "parallel.strategy=none",
                              "parallel.activation_checkpointing=none"],
    "configs/llama-8b-fsdp.yaml": [*_FIXED, "train.micro_batch=2", "parallel.strategy=fsdp",
                                   "parallel.activation_checkpointing=full"],
}


def pin(config: str, overrides: list[str]) -> None:
    """Put ``config``'s former values in front of ``overrides`` (in place; none for others)."""
    overrides[:0] = AS_MEASURED.get(config, [])
