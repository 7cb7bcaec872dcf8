"""Mixing: weights hold over an epoch, the order is the same on 1-4 ranks, resume is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config import load_config
from hpctrain.data.config import DataConfig, MixSource
from hpctrain.data.loader import (
    BatchLayout,
    ContiguousTokens,
    GlobalOrderSampler,
    TokenLoader,
    build_dataset,
)
from hpctrain.data.mixing import BLOCK, MixedTokens
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shard_dataset import ShardTokens
from hpctrain.data.shards import load_manifest
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import ConfigError

SEQ = 4
TAG = 1_000_000  # token = source * TAG + position, so a window names its source and sample


class Grouped(ContiguousTokens):
    """ContiguousTokens cut into "shards" so the source shuffles in windows, like ShardTokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, shards: int):
        super().__init__(tokens, seq_len)
        n = len(self)
        self.shard_sample_counts = np.diff(np.linspace(0, n, shards + 1).astype(np.int64))
        self.window_shards = 2


def _mixture(sizes=(1000, 300, 2500), weights=(0.5, 0.3, 0.2), **kw) -> MixedTokens:
    parts = [Grouped(k * TAG + np.arange(n * SEQ + 1, dtype=np.int64), SEQ, 5)
             for k, n in enumerate(sizes)]
    return MixedTokens(parts, weights, **kw)


def _source_and_sample(ds: MixedTokens, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = ds.windows(idx)
    return w[:, 0] // TAG, (w[:, 0] % TAG) // SEQ


def _steps(ds, world: int, micro: int, accum: int, seed: int, steps: int, start: int = 0):
    """The global order step by step, assembled from every rank's share (via the loader hook)."""
    samplers = []
    for r in range(world):
        s = GlobalOrderSampler(len(ds), BatchLayout(micro, accum, world, r), seed)
        TokenLoader(ds, s, torch.device("cpu"), prefetch=0)  # installs the mixture's order
        s.load_state_dict({"step": start, "global_batch": micro * accum * world, "seed": seed})
        samplers.append(s)
    out = []
    for _ in range(steps):
        per_rank = [s.next_step() for s in samplers]
        out.append(np.concatenate([per_rank[r][a] for a in range(accum) for r in range(world)]))
    return out


def test_proportions_match_weights_over_an_epoch_and_every_block() -> None:
    ds = _mixture()
    n = len(ds)
    assert n == 3800
    order = ds.global_order(7, 0, 0, n)
    src, _ = _source_and_sample(ds, order)
    counts = np.bincount(src, minlength=3)
    assert np.abs(counts - ds.weights * n).max() < 3
    # Over any long stretch the shares hold too (here: a batch of 1024 in the middle).
    big = _mixture(sizes=(40_000, 9_000, 60_000))
    order = big.global_order(1, 2, 30_000, 31_024)
    shares = np.bincount(_source_and_sample(big, order)[0], minlength=3) / 1024
    np.testing.assert_allclose(shares, big.weights, atol=0.05)
    # Block boundaries hold the exact counts: within one per source, the heaviest (source 0)
    # takes the rounding remainders (fewer than the number of sources).
    cum = big.cumulative_counts(np.arange(0, len(big), BLOCK))
    err = np.abs(cum - big.weights[None, :] * np.arange(0, len(big), BLOCK)[:, None])
    assert err[:, 1:].max() < 1 and err[:, 0].max() < 3


def test_each_source_is_read_without_repeats_until_exhausted() -> None:
    ds = _mixture()
    # Source 1 (300 samples, weight 0.3 of 3800) repeats within an epoch: every consecutive run
    # of 300 of its slots is one of its own epochs, a permutation of all its samples.
    src, sample = _source_and_sample(ds, ds.global_order(0, 0, 0, len(ds)))
    s1 = sample[src == 1]
    assert len(s1) >= 900
    for e in range(3):
        assert sorted(s1[e * 300 : (e + 1) * 300].tolist()) == list(range(300))
    # Source 2 (2500 samples, 760 slots per epoch) continues where it stopped next epoch.
    epochs = [_source_and_sample(ds, ds.global_order(0, e, 0, len(ds))) for e in range(3)]
    s2 = np.concatenate([sample[src == 2] for src, sample in epochs])
    assert len(s2) == 3 * 760 and len(set(s2.tolist())) == len(s2)


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a, b = _mixture(), _mixture()
    np.testing.assert_array_equal(a.global_order(5, 1, 100, 900), b.global_order(5, 1, 100, 900))
    # Any sub-range equals the slice of the whole epoch (no hidden state from earlier calls).
    whole = b.global_order(5, 1, 0, len(b))
    np.testing.assert_array_equal(a.global_order(5, 1, 250, 260), whole[250:260])
    assert not np.array_equal(a.global_order(6, 1, 0, 500), whole[:500])
    assert not np.array_equal(a.global_order(5, 2, 0, 500), whole[:500])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_same_global_order_on_1_to_4_ranks(world: int) -> None:
    ds = _mixture()
    ref = _steps(ds, 1, 12, 1, seed=3, steps=400)  # crosses the epoch end (3800 // 12 = 316)
    micro, accum = {1: (12, 1), 2: (3, 2), 3: (2, 2), 4: (1, 3)}[world]
    got = _steps(ds, world, micro, accum, seed=3, steps=400)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("k", "world_after"), [(5, 2), (316, 3), (350, 4)])
def test_resume_is_exact_on_another_world_size(k: int, world_after: int) -> None:
    ds = _mixture()
    full = _steps(ds, 2, 3, 2, seed=11, steps=k + 20)
    micro = {2: 6, 3: 4, 4: 3}[world_after]
    resumed = _steps(_mixture(), world_after, micro, 1, seed=11, steps=20, start=k)
    for a, b in zip(full[k:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mixture_errors() -> None:
    part = ContiguousTokens(np.arange(41), SEQ)
    with pytest.raises(ConfigError, match="> 0"):
        MixedTokens([part, part], [1.0, 0.0])
    with pytest.raises(ConfigError, match="no samples"):
        MixedTokens([part, ContiguousTokens(np.arange(2), SEQ)], [1.0, 1.0])
    with pytest.raises(IndexError):
        MixedTokens([part], [1.0]).global_order(0, 0, 0, 11)


@pytest.fixture(scope="module")
def two_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, letter, docs in (("a", "a", 30), ("b", "b", 9)):
        src = root / f"{name}.txt"
        src.write_text(letter * 40 * docs)
        prepare([src], root / name, PrepareSettings(TokenizerSpec(), shard_tokens=150))
        out.append(root / name)
    return out


def test_config_and_build_dataset_end_to_end(two_dirs: list[Path]) -> None:
    a, b = two_dirs
    cfg = load_config(None, ["data.source=mix", f"data.mix=[{{path: {a}, weight: 3}}, "
                             f"{{path: {b}}}]", "data.seq_len=8", "data.val_fraction=0.2",
                             "model.vocab_size=257"])
    assert cfg.data.mix == [MixSource(str(a), 3.0), MixSource(str(b), 1.0)]
    assert cfg.data.vocab_size == 257
    train = build_dataset(cfg.data)
    val = build_dataset(cfg.data, "val")
    parts = [ShardTokens(load_manifest(p), 8, split=s, val_fraction=0.2)
             for p in (a, b) for s in ("train", "val")]
    assert len(train) == len(parts[0]) + len(parts[2])
    assert len(val) == len(parts[1]) + len(parts[3])  # validation: each held-out sample once
    loader = TokenLoader(train, GlobalOrderSampler(len(train), BatchLayout(8, 1, 1, 0), 0),
                         torch.device("cpu"), prefetch=1)
    first = [loader.next_step()[0][0] for _ in range(10)]
    loader.close()
    letters = torch.cat(first)[:, 0]
    share_a = (letters == ord("a")).float().mean().item()
    assert 0.6 < share_a < 0.9  # weight 3:1


@pytest.mark.parametrize(("override", "match"), [
    (["data.mix=[{path: /nonexistent, weight: 1}]"], "no manifest.json"),
    (["data.mix=[]"], "data.mix is empty"),
    (["data.mix=[{path: A, weight: -1}]"], "must be > 0"),
    (["data.mix=[{path: A, wieght: 1}]"], r"unknown config key .data\.mix\[0\]\.wieght."),
])
def test_config_errors(two_dirs: list[Path], override: list[str], match: str) -> None:
    items = ["data.source=mix"] + [o.replace("A", str(two_dirs[0])) for o in override]
    with pytest.raises(ConfigError, match=match):
        load_config(None, items)
    with pytest.raises(ConfigError, match="data.source=mix"):
        DataConfig(mix=[MixSource(str(two_dirs[0]))]).validate()
