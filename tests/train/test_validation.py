"""Distributed validation counts every held-out sample exactly once, on any number of ranks."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import spawn_ranks
from hpctrain.data.loader import ContiguousTokens
from hpctrain.models import ModelArgs, Transformer
from hpctrain.train.validate import evaluate

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                 max_seq_len=64)
SEQ = 16
N_SAMPLES = 23  # not divisible by 2, 3 or 4: padding must be masked out exactly


def _dataset() -> ContiguousTokens:
    rng = np.random.default_rng(0)
    return ContiguousTokens(rng.integers(0, 64, N_SAMPLES * SEQ + 1).astype(np.int64), SEQ)


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


# (ranks, micro-batch): 23 samples leave a different remainder on each.
CASES = [(1, 4), (2, 3), (3, 2), (4, 5)]


def _worker(rank: int, port: int, queue) -> None:
    """One of 4 processes: evaluate every case this rank takes part in, each in a process group
    of its own size (ranks beyond it sit out), so 4 processes serve all cases; put
    {(ranks, rank): result} on the queue."""
    store = dist.TCPStore("127.0.0.1", port, len(CASES), is_master=rank == 0)
    mine = {}
    for world, micro in CASES:
        if rank >= world:
            continue
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{world}x{micro}", store),
                                rank=rank, world_size=world)
        try:
            mine[world, rank] = evaluate(_model(), _dataset(), micro_batch=micro, rank=rank,
                                         world_size=world, device=torch.device("cpu"),
                                         autocast=None)
        finally:
            dist.destroy_process_group()
    queue.put(mine)
    # Rank 0 serves the store: it leaves last.
    store.add("done", 1)
    while rank == 0 and store.add("done", 0) < len(CASES):
        time.sleep(0.01)


@pytest.fixture(scope="module")
def results() -> dict[tuple[int, int], dict]:
    """(ranks, rank) -> that rank's validation result, every case from one start of 4."""
    return {key: result for mine in spawn_ranks(_worker, len(CASES))
            for key, result in mine.items()}


def _reference_loss() -> float:
    ds, model = _dataset(), _model()
    losses = []
    with torch.no_grad():
        for i in range(len(ds)):
            t = torch.from_numpy(ds.window(i).copy())[None]
            logits = model(t[:, :-1])
            losses.append(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), t[:, 1:].flatten(), reduction="sum").item())
    return sum(losses) / (len(ds) * SEQ)


@pytest.mark.parametrize(("world", "micro"), CASES)
def test_every_sample_counted_once(results: dict[tuple[int, int], dict], world: int,
                                   micro: int) -> None:
    ranks = [results[world, rank] for rank in range(world)]
    for r in ranks:
        assert r["val_tokens"] == N_SAMPLES * SEQ  # padding never counted
        assert r["val_samples"] == N_SAMPLES
        # The same global number on every rank, equal to one pass over the samples in order.
        assert r["val_loss"] == pytest.approx(_reference_loss(), rel=1e-5)
    assert len({r["val_loss"] for r in ranks}) == 1


class _Masked(ContiguousTokens):
    """The same tokens with a loss mask: every third position counts (like prompts and replies)."""

    has_loss_mask = True

    def mask_windows(self, indices: np.ndarray) -> np.ndarray:
        pos = (np.asarray(indices)[:, None] * SEQ + np.arange(SEQ + 1)[None, :])
        return pos % 3 == 0


def test_masked_targets_are_not_counted() -> None:
    ds = _Masked(_dataset().tokens, SEQ)
    model = _model()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            t = torch.from_numpy(ds.window(i).copy())[None]
            keep = torch.from_numpy(ds.mask_windows(np.array([i]))[:, 1:])
            losses = torch.nn.functional.cross_entropy(
                model(t[:, :-1]).flatten(0, 1).double(), t[:, 1:].flatten(), reduction="none")
            total += losses[keep.flatten()].sum().item()
            count += int(keep.sum())
    r = evaluate(model, ds, micro_batch=5, rank=0, world_size=1, device=torch.device("cpu"),
                 autocast=None)
    assert r["val_tokens"] == count < N_SAMPLES * SEQ
    assert r["val_loss"] == pytest.approx(total / count, rel=1e-6)


def test_a_bounded_split_takes_the_same_spread_samples_on_any_layout() -> None:
    """train.val_max_samples: 7 of the 23 samples, spread over the split, each counted once,
    the same 7 on every number of ranks and micro-batch size (layouts stay comparable)."""
    from hpctrain.data.loader import ValidationSampler

    for world, micro in CASES:
        taken = []
        for rank in range(world):
            sampler = ValidationSampler(N_SAMPLES, world, rank, micro, max_samples=7)
            assert len(sampler) == math.ceil(math.ceil(7 / world) / micro)
            for indices, mask in sampler:
                taken += indices[mask].tolist()
        assert sorted(taken) == [0, 3, 6, 9, 13, 16, 19]  # floor(j * 23 / 7)
