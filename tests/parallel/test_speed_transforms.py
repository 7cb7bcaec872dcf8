"""The speed transforms change no number: chunked loss, selective AC, attention backend.

Real training runs through the real entry point (``rank_jobs.py``: one launch per world size, the
two side by side; gloo, CPU, fp32, deterministic, the tiny demo model, global batch 4):

- 1 process: the reference (plain loss, no checkpointing), ``train.loss_chunks=4``,
  ``parallel.activation_checkpointing=selective``, and ``model.attention_backend=math`` with
  selective AC keeping all matmuls;
- 2 ranks: FSDP with the chunked loss and gradient accumulation, FSDP with selective AC, DDP
  with the chunked loss.

Every step's loss and gradient norm and the validation loss (computed through the chunked loss
where it is on) must equal the reference's to 1e-5 relative; the config refusals come first.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models.sdpa_backend import attention_backend
from hpctrain.observe.metrics import read_metrics
from hpctrain.parallel.layout import check_layout
from rank_jobs import launch

STEPS = 4
RTOL = 1e-5
COMMON = [*TINY, *QUIET, f"train.steps={STEPS}", "optim.schedule=constant",
          "data.val_fraction=0.005", "checkpoint.async_save=false",
          "checkpoint.save_at_end=false", "checkpoint.interval=none"]
ONE = {
    "reference": ["parallel.strategy=none", "train.micro_batch=4"],
    "chunks4": ["parallel.strategy=none", "train.micro_batch=4", "train.loss_chunks=4"],
    "selective": ["parallel.strategy=none", "train.micro_batch=4",
                  "parallel.activation_checkpointing=selective"],
    "math_selective_all": ["parallel.strategy=none", "train.micro_batch=4",
                           "model.attention_backend=math",
                           "parallel.activation_checkpointing=selective",
                           "parallel.ac_save_mm=all"],
}
TWO = {
    "fsdp_chunks_accum": ["parallel.strategy=fsdp", "train.micro_batch=1", "train.grad_accum=2",
                          "train.loss_chunks=4"],
    "fsdp_selective": ["parallel.strategy=fsdp", "train.micro_batch=2",
                       "parallel.activation_checkpointing=selective"],
    "ddp_chunks": ["parallel.strategy=ddp", "train.micro_batch=2", "train.loss_chunks=3"],
}


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.strategy=fsdp", "parallel.tp=2", "train.loss_chunks=4"], 2,
     "train.loss_chunks = 4 with parallel.tp = 2"),
    (["parallel.strategy=none", "parallel.pp=2", "train.loss_chunks=2"], 2,
     "train.loss_chunks = 2 with parallel.tp = 1, parallel.pp = 2"),
    (["train.loss_chunks=-1"], 1, "train.loss_chunks = -1 must be >= 0"),
])
def test_loss_chunks_refused(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        check_layout(load_config(DEMO, [*TINY, *overrides]), world)


@pytest.mark.parametrize("name", ["flash", "cudnn", "efficient"])
def test_gpu_attention_backends_refused_on_cpu(name: str) -> None:
    with pytest.raises(ConfigError, match=f"attention_backend = {name} on a cpu"):
        attention_backend(name, torch.device("cpu"))
    assert attention_backend("math", torch.device("cpu")) is not None


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both launches, side by side, once for the module; the run directories' parent."""
    root = tmp_path_factory.mktemp("transforms")
    runs = root / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [pool.submit(launch, n, {**spec, "jobs": [{"name": k, "overrides": o}
                                                         for k, o in jobs.items()]},
                            root / f"launch-{n}", 600.0) for n, jobs in ((1, ONE), (2, TWO))]
        for d in done:
            d.result()
    return runs


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    return read_metrics(out / name / "metrics" / "rank-000.jsonl")


def _assert_close(actual: float, expected: float, what: str) -> None:
    assert math.isfinite(actual) and abs(actual - expected) <= RTOL * abs(expected), (
        f"{what}: {actual!r} vs {expected!r}")


@pytest.mark.parametrize("name", [*list(ONE)[1:], *TWO])
def test_transform_matches_reference(out: Path, name: str) -> None:
    ref, run = _records(out, "reference"), _records(out, name)
    steps = [r for r in run if "loss" in r]
    ref_steps = [r for r in ref if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert ref_steps[-1]["loss"] < ref_steps[0]["loss"]  # a moving curve
    for got, want in zip(steps, ref_steps, strict=True):
        _assert_close(got["loss"], want["loss"], f"{name} loss at {got['step']}")
        _assert_close(got["grad_norm"], want["grad_norm"], f"{name} grad norm at {got['step']}")
    (val,) = [r["val_loss"] for r in run if "val_loss" in r]
    (ref_val,) = [r["val_loss"] for r in ref if "val_loss" in r]
    _assert_close(val, ref_val, f"{name} validation loss")


@pytest.mark.parametrize("chunks", [0, 3])
def test_trainer_hands_the_targets_to_the_model_when_chunking(chunks: int) -> None:
    """The loss path the trainer takes (the runs above cannot tell: the numbers are equal)."""
    from hpctrain.train.trainer import Trainer

    seen: list[tuple[bool, int]] = []

    def model(tokens: torch.Tensor, targets: torch.Tensor | None = None,
              loss_chunks: int = 1) -> torch.Tensor:
        seen.append((targets is not None, loss_chunks))
        return tokens.float().sum() if targets is not None else tokens.float()

    trainer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(loss_chunks=chunks)),
                              model=model, loss_fn=lambda logits, targets: logits.sum() * 2)
    x = torch.ones(2, 3)
    loss = Trainer._summed_loss(trainer, x, x)
    assert seen == ([(True, chunks)] if chunks else [(False, 1)])
    assert loss.item() == (6.0 if chunks else 12.0)
