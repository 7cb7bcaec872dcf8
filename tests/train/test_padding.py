"""data.remainder=pad: the epoch's last, partly filled batch counts exactly its real samples."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import train_together
from hpctrain.data.loader import (
    IGNORE_INDEX,
    BatchLayout,
    ContiguousTokens,
    GlobalOrderSampler,
    TokenLoader,
)
from hpctrain.observe.metrics import read_metrics

N, SEQ = 10, 32  # 10 samples, global batch 4: steps of 4, 4 and 2 real samples per epoch


@pytest.mark.parametrize(("micro", "accum", "world"), [(4, 1, 1), (2, 1, 2), (1, 2, 2),
                                                       (1, 1, 4)])
def test_pad_covers_every_sample_once_with_equal_counts(micro: int, accum: int,
                                                        world: int) -> None:
    samplers = [GlobalOrderSampler(N, BatchLayout(micro, accum, world, r), seed=3,
                                   remainder="pad") for r in range(world)]
    assert samplers[0].steps_per_epoch == 3
    seen: list[int] = []
    for _ in range(3):
        parts = [s.next_step_masked() for s in samplers]
        assert len({valid for _, _, valid in parts}) == 1  # every rank knows the same count
        for indices, masks, _ in parts:
            assert [len(ix) for ix in indices] == [micro] * accum  # equal counts: no hang
            seen += [int(i) for ix, m in zip(indices, masks, strict=True) for i in ix[m]]
    assert sorted(seen) == list(range(N))


def test_padding_rows_have_ignored_targets() -> None:
    tokens = np.arange(N * SEQ + 1, dtype=np.int64) % 50
    sampler = GlobalOrderSampler(N, BatchLayout(4, 1, 1, 0), seed=0, remainder="pad")
    loader = TokenLoader(ContiguousTokens(tokens, SEQ), sampler, torch.device("cpu"), prefetch=0)
    for _ in range(2):
        (_, targets), = loader.next_step()
        assert loader.last_valid_samples == 4 and (targets != IGNORE_INDEX).all()
    (inputs, targets), = loader.next_step()
    assert loader.last_valid_samples == 2
    assert (targets[:2] != IGNORE_INDEX).all() and (targets[2:] == IGNORE_INDEX).all()
    assert (inputs >= 0).all()  # padding inputs are real tokens, only their targets are masked


# The runs below, apart from their layout.
COMMON = ["run.device=cpu", "data.source=stdlib", f"data.seq_len={SEQ}",
          f"data.max_bytes={N * SEQ + 1}", "data.remainder=pad", "model.dim=64",
          "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
          "train.precision=fp32", "train.deterministic=true", "train.steps=3",
          "metrics.log_every=1", "metrics.progress=false", "checkpoint.interval=none",
          "checkpoint.save_at_end=false", "run.suffix=none"]


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory,
           run_pool: ThreadPoolExecutor) -> dict[str, list[float]]:
    """Run name -> loss per step: the 1-process runs in one launch, the 2-rank run beside it."""
    out = tmp_path_factory.mktemp("padding")
    one = run_pool.submit(train_together, out, {
        "one": ["parallel.strategy=none", "train.micro_batch=4"],
        # A negligible learning rate: every step sees the initial model.
        "frozen": ["parallel.strategy=none", "train.micro_batch=4", "optim.lr=1e-12",
                   "optim.warmup_steps=0"],
    }, common=COMMON)
    two = run_pool.submit(train_together, out, {
        "two": ["parallel.strategy=ddp", "train.micro_batch=2"],
    }, nproc=2, common=COMMON)
    runs = {**one.result(), **two.result()}
    return {name: [r["loss"] for r in read_metrics(run.run_dir / "metrics" / "rank-000.jsonl")
                   if "loss" in r] for name, run in runs.items()}


def test_padded_step_is_exact_on_any_layout(losses: dict[str, list[float]]) -> None:
    """In step 3 only 2 of 4 slots are real: with 2 ranks x 2, rank 1 holds only padding.
    A mean of per-rank means would halve that step's loss; the exact weighting does not."""
    one, two = losses["one"], losses["two"]
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=1e-6)


def test_padded_step_is_a_mean_over_real_tokens_only(losses: dict[str, list[float]]) -> None:
    """With a negligible learning rate every step sees the initial model, whose loss is about
    ln(vocab) on any text: the half-empty step must not read half of that."""
    frozen = losses["frozen"]
    assert frozen[2] == pytest.approx(frozen[0], rel=0.05)
