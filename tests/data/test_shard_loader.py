"""The loader over shards: window shuffling, exact epochs on 1-4 ranks, resume, validation split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.data.config import DataConfig
from hpctrain.data.loader import (
    BatchLayout,
    GlobalOrderSampler,
    TokenLoader,
    ValidationSampler,
    build_dataset,
    validation_batches,
)
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shard_dataset import ShardTokens
from hpctrain.data.shards import load_manifest
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import ConfigError

SEQ = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """13 documents of uneven length in 3 files, cut into 7 shards of 97 tokens (last shorter)."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1)
    files = []
    for f in range(3):
        path = root / f"in-{f}.jsonl"
        n_docs = [4, 5, 4][f]
        docs = ["abcdefghij"[d % 10] * int(rng.integers(5, 90)) for d in range(n_docs)]
        path.write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
        files.append(path)
    out = root / "out"
    prepare(files, out, PrepareSettings(TokenizerSpec(), shard_tokens=97))
    return out


def _dataset(prepared: Path, **kw) -> ShardTokens:
    return ShardTokens(load_manifest(prepared), SEQ, **kw)


def test_fixture_counts_not_divisible_by_ranks(prepared: Path) -> None:
    m = load_manifest(prepared)
    assert len(m.shards) == 7 and sum(s["docs"] for s in m.shards) == 13
    ds = _dataset(prepared)
    assert len(ds) == sum(max(0, (s["tokens"] - 1) // SEQ) for s in m.shards)
    assert all(len(ds) % w for w in (2, 3, 4))


def test_windows_are_shard_slices(prepared: Path) -> None:
    m = load_manifest(prepared)
    ds = _dataset(prepared)
    i = 0
    for s in range(len(m.shards)):
        tokens = np.asarray(m.tokens(s))
        for k in range((len(tokens) - 1) // SEQ):
            np.testing.assert_array_equal(ds.window(i), tokens[k * SEQ : k * SEQ + SEQ + 1])
            i += 1
    idx = np.array([5, 0, len(ds) - 1, 5])
    np.testing.assert_array_equal(ds.windows(idx), np.stack([ds.window(j) for j in idx]))
    with pytest.raises(IndexError):
        ds.window(len(ds))


def _epoch_by_rank(n: int, groups: np.ndarray, world: int, micro: int, accum: int, seed: int,
                   steps: int, window: int = 2) -> list[np.ndarray]:
    """The global order, step by step, as assembled from every rank's share."""
    samplers = [GlobalOrderSampler(n, BatchLayout(micro, accum, world, r), seed, groups, window)
                for r in range(world)]
    out = []
    for _ in range(steps):
        per_rank = [s.next_step() for s in samplers]
        out.append(np.concatenate([per_rank[r][a] for a in range(accum) for r in range(world)]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_exactly_once_per_epoch(prepared: Path, world: int) -> None:
    ds = _dataset(prepared)
    n, groups = len(ds), ds.shard_sample_counts
    micro = 2
    gb = micro * world
    steps = n // gb
    for epoch in range(2):
        order = _epoch_by_rank(n, groups, world, micro, 1, seed=3, steps=steps * (epoch + 1))
        got = np.concatenate(order[steps * epoch :])
        assert len(got) == steps * gb == n - n % gb
        assert len(set(got.tolist())) == len(got)  # no sample twice
        assert set(got.tolist()) <= set(range(n))
    # Same global order on any world size with the same global batch (here 12).
    ref = _epoch_by_rank(n, groups, 1, 12, 1, seed=3, steps=3)
    for layout in [(6, 1, 2), (2, 2, 3), (1, 3, 4)]:
        got = _epoch_by_rank(n, groups, layout[2], layout[0], layout[1], seed=3, steps=3)
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_full_epoch_when_divisible_covers_all(world: int, accum: int) -> None:
    """When the global batch divides the sample count, one epoch yields every sample once."""
    # The prepared fixture is deliberately not divisible by 2-4 ranks; these uneven shards hold
    # 72 samples, divisible by every global batch below (3 x world x accum).
    groups = np.array([11, 17, 5, 23, 16])
    n, micro = int(groups.sum()), 3
    assert n % (micro * world * accum) == 0
    got = np.concatenate(_epoch_by_rank(n, groups, world, micro, accum, 0,
                                        n // (micro * world * accum)))
    assert sorted(got.tolist()) == list(range(n))


def test_window_shuffling_keeps_reads_local(prepared: Path) -> None:
    ds = _dataset(prepared)
    s = GlobalOrderSampler(len(ds), BatchLayout(len(ds), 1, 1, 0), 0, ds.shard_sample_counts, 2)
    order = s.next_step()[0]
    shard_of = np.searchsorted(np.cumsum(ds.shard_sample_counts), order, side="right")
    # The epoch visits windows of 2 shards one after another: few shard switches per window.
    seen, blocks = [], []
    for sh in shard_of.tolist():
        if not blocks or sh not in blocks[-1]:
            if blocks and len(blocks[-1]) < 2:
                blocks[-1].add(sh)
            else:
                blocks.append({sh})
        seen.append(sh)
    assert len(blocks) == -(-len(ds.shard_sample_counts) // 2)
    # And it is not the identity order.
    assert not np.array_equal(order, np.arange(len(ds)))


@pytest.mark.parametrize(("k", "world_after"), [(2, 2), (3, 3), (5, 1), (7, 4)])
def test_resume_mid_epoch_same_or_other_world(prepared: Path, k: int, world_after: int) -> None:
    ds = _dataset(prepared)
    n, groups = len(ds), ds.shard_sample_counts
    ref = _epoch_by_rank(n, groups, 2, 6, 1, seed=9, steps=k + 6)
    saver = GlobalOrderSampler(n, BatchLayout(6, 1, 2, 0), 9, groups, 2)
    for _ in range(k):
        saver.next_step()
    state = saver.state_dict()
    assert state["shuffle_window"] == 2
    micro, accum = {1: (12, 1), 2: (6, 1), 3: (2, 2), 4: (3, 1)}[world_after]
    samplers = [GlobalOrderSampler(n, BatchLayout(micro, accum, world_after, r), 9, groups, 2)
                for r in range(world_after)]
    for s in samplers:
        s.load_state_dict(state)
    for want in ref[k:]:
        per_rank = [s.next_step() for s in samplers]
        got = np.concatenate([per_rank[r][a] for a in range(accum) for r in range(world_after)])
        np.testing.assert_array_equal(got, want)
    other = GlobalOrderSampler(n, BatchLayout(6, 1, 2, 0), 9, groups, 3)
    with pytest.raises(ConfigError, match="shuffle_window"):
        other.load_state_dict(state)


def test_token_loader_uses_shard_windows_and_resumes(prepared: Path) -> None:
    cfg = DataConfig(source="shards", path=str(prepared), seq_len=SEQ, shuffle_window=2,
                     prefetch=2)
    cfg.validate()
    assert cfg.vocab_size == 257
    ds = build_dataset(cfg)
    lay = BatchLayout(2, 2, 2, 1)
    loader = TokenLoader(ds, GlobalOrderSampler(len(ds), lay, 4), torch.device("cpu"), 2)
    try:
        assert loader.sampler.window_groups == 2
        ref = GlobalOrderSampler(len(ds), lay, 4, ds.shard_sample_counts, 2)
        for _ in range(3):
            for (x, y), ix in zip(loader.next_step(), ref.next_step(), strict=True):
                rows = torch.from_numpy(np.stack([ds.window(int(i)) for i in ix]).astype(np.int64))
                assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
        state = loader.state_dict()
        resumed = TokenLoader(ds, GlobalOrderSampler(len(ds), lay, 4), torch.device("cpu"), 0)
        resumed.load_state_dict(state)
        for (xa, _), (xb, _) in zip(loader.next_step(), resumed.next_step(), strict=True):
            assert torch.equal(xa, xb)
    finally:
        loader.close()


# -- validation split --------------------------------------------------------------------------


def test_val_split_is_disjoint_tail_of_each_shard(prepared: Path) -> None:
    full = _dataset(prepared)
    train = _dataset(prepared, val_fraction=0.25)
    val = _dataset(prepared, split="val", val_fraction=0.25)
    assert len(train) + len(val) == len(full) and len(val) > 0
    def places(ds: ShardTokens) -> list[tuple[int, int]]:
        shard, start = ds.locate(np.arange(len(ds)))
        return list(zip(shard.tolist(), start.tolist(), strict=True))

    t, v = places(train), places(val)
    assert sorted(t + v) == sorted(places(full)) and not set(t) & set(v)
    # Within each shard the validation windows come after the training ones.
    for sh in {s for s, _ in v}:
        assert max((a for s, a in t if s == sh), default=-1) < min(a for s, a in v if s == sh)


@pytest.mark.parametrize("n", [1, 5, 13, 24])
@pytest.mark.parametrize("micro", [1, 3])
def test_validation_sampler_counts_each_sample_once(n: int, micro: int) -> None:
    for world in (1, 2, 3, 4):
        samplers = [ValidationSampler(n, world, r, micro) for r in range(world)]
        assert len({len(s) for s in samplers}) == 1  # same batch count on every rank
        counted = []
        for s in samplers:
            for idx, mask in s:
                assert len(idx) == len(mask) == micro
                counted += idx[mask].tolist()
        assert sorted(counted) == list(range(n))


def test_validation_batches_and_build_dataset(prepared: Path) -> None:
    cfg = DataConfig(source="shards", path=str(prepared), seq_len=SEQ, val_fraction=0.2)
    val = build_dataset(cfg, split="val")
    seen = 0
    for world in (3,):
        for r in range(world):
            for x, y, mask in validation_batches(val, ValidationSampler(len(val), world, r, 2),
                                                 torch.device("cpu")):
                assert x.shape == y.shape == (2, SEQ) and mask.dtype == torch.bool
                seen += int(mask.sum())
    assert seen == len(val)
    with pytest.raises(ConfigError, match="val_fraction"):
        build_dataset(DataConfig(seq_len=SEQ, max_bytes=5000), split="val")
    stdlib_val = build_dataset(DataConfig(seq_len=SEQ, max_bytes=5000, val_fraction=0.1), "val")
    stdlib_train = build_dataset(DataConfig(seq_len=SEQ, max_bytes=5000, val_fraction=0.1))
    assert len(stdlib_val) + len(stdlib_train) == (5000 - 1) // SEQ


# -- config ------------------------------------------------------------------------------------


def test_config_validation(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.path is not set") as info:
        DataConfig(source="shards").validate()
    assert "hpctrain data prepare" in info.value.hint
    with pytest.raises(ConfigError, match="does not exist"):
        DataConfig(source="shards", path=str(tmp_path / "nope")).validate()
    with pytest.raises(ConfigError, match="source is 'stdlib'"):
        DataConfig(path=str(prepared)).validate()
    with pytest.raises(ConfigError, match="val_fraction"):
        DataConfig(val_fraction=1.0).validate()
    assert DataConfig().vocab_size == 256


def test_job_config_takes_vocab_from_manifest(prepared: Path) -> None:
    """The model's vocabulary follows the manifest unless the config fixes it; a fixed one
    too small for the data is refused, naming both numbers and how to follow the data."""
    from hpctrain.config import dump_yaml, load_config

    base = ["data.source=shards", f"data.path={prepared}"]
    for size in ("tiny", "125m"):  # presets of 256 and 32,000 ids both follow the data's 257
        cfg = load_config(None, [*base, f"model.size={size}"])
        assert cfg.model.vocab_size == cfg.model.resolve().vocab_size == 257
        assert "vocab_size: 257" in dump_yaml(cfg)  # what the run directory records
    cfg = load_config(None, [*base, "model.size=tiny", "model.vocab_size=300"])
    assert cfg.model.resolve().vocab_size == 300  # fixed by the config: kept
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, "model.size=tiny", "model.vocab_size=256"])
    assert "data vocabulary (257 ids) is larger than the model's (256" in info.value.what
    assert "remove model.vocab_size" in info.value.hint
    # Byte-level text has no manifest: the preset keeps its own vocabulary.
    assert load_config(None, ["model.size=tiny"]).model.resolve().vocab_size == 256
