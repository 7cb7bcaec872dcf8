"""Distributed validation counts every held-out sample exactly once, on any number of ranks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
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


def _worker(rank: int, world: int, port: int, micro: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = evaluate(_model(), _dataset(), micro_batch=micro, rank=rank,
                             world_size=world, device=torch.device("cpu"), autocast=None)
    finally:
        dist.destroy_process_group()


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


@pytest.mark.parametrize(("world", "micro"), [(1, 4), (2, 3), (3, 2), (4, 5)])
def test_every_sample_counted_once(world: int, micro: int) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, free_port(), micro, out), nprocs=world, join=True)
        results = dict(out)
    for r in results.values():
        assert r["val_tokens"] == N_SAMPLES * SEQ  # padding never counted
        assert r["val_samples"] == N_SAMPLES
        # The same global number on every rank, equal to one pass over the samples in order.
        assert r["val_loss"] == pytest.approx(_reference_loss(), rel=1e-5)
    assert len({r["val_loss"] for r in results.values()}) == 1


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
