"""The global-order sampler and the prefetching token loader, on synthetic tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpctrain.data.loader import BatchLayout, ContiguousTokens, GlobalOrderSampler, TokenLoader
from hpctrain.errors import ConfigError

# Global batch 12 as (micro_batch, grad_accum, world_size).
LAYOUTS = [(12, 1, 1), (6, 1, 2), (3, 2, 2), (1, 3, 4), (2, 2, 3), (4, 1, 3), (1, 12, 1)]
N = 50  # samples: 4 whole global batches per epoch, remainder 2


def _samplers(micro: int, accum: int, world: int, n: int = N, seed: int = 0):
    return [GlobalOrderSampler(n, BatchLayout(micro, accum, world, r), seed) for r in range(world)]


def _global_steps(micro: int, accum: int, world: int, steps: int, n: int = N, seed: int = 0):
    """Per optimizer step: the indices of all ranks in (micro-step, rank) order."""
    samplers = _samplers(micro, accum, world, n, seed)
    out = []
    for _ in range(steps):
        per_rank = [s.next_step() for s in samplers]  # [rank][micro-step] -> indices
        assert all(len(p) == accum for p in per_rank)
        assert all(len(ix) == micro for p in per_rank for ix in p)
        out.append(np.concatenate([per_rank[r][a] for a in range(accum) for r in range(world)]))
    return out


# -- ContiguousTokens ------------------------------------------------------------------------


def test_contiguous_windows_share_one_boundary_token() -> None:
    ds = ContiguousTokens(np.arange(41), seq_len=8)
    assert len(ds) == 5  # (41 - 1) // 8
    np.testing.assert_array_equal(ds.window(0), np.arange(0, 9))
    np.testing.assert_array_equal(ds.window(4), np.arange(32, 41))
    assert len(ContiguousTokens(np.arange(40), seq_len=8)) == 4  # last window would lack a target
    assert len(ContiguousTokens(np.arange(1), seq_len=8)) == 0


# -- GlobalOrderSampler ----------------------------------------------------------------------


def test_layout_global_batch() -> None:
    for micro, accum, world in LAYOUTS:
        assert BatchLayout(micro, accum, world, 0).global_batch == 12


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_same_global_order_on_any_world_size(layout: tuple[int, int, int]) -> None:
    steps = 10  # crosses two epoch boundaries (4 steps per epoch)
    reference = _global_steps(12, 1, 1, steps)
    got = _global_steps(*layout, steps)
    for ref, step in zip(reference, got, strict=True):
        np.testing.assert_array_equal(step, ref)


def test_epoch_covers_distinct_samples_and_reshuffles() -> None:
    s = GlobalOrderSampler(N, BatchLayout(12, 1, 1, 0), seed=5)
    assert s.steps_per_epoch == 4
    epochs = []
    for _ in range(3):
        epoch = np.concatenate([s.next_step()[0] for _ in range(4)])
        assert len(epoch) == 48
        assert len(set(epoch.tolist())) == 48  # no repeats within an epoch
        assert set(epoch.tolist()) <= set(range(N))
        epochs.append(epoch)
    # The order is the permutation of (seed, epoch), cut at whole global batches.
    for e, epoch in enumerate(epochs):
        np.testing.assert_array_equal(epoch, np.random.default_rng([5, e]).permutation(N)[:48])
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert s.step == 12


def test_epoch_boundary_exactly() -> None:
    s = GlobalOrderSampler(24, BatchLayout(6, 1, 2, 1), seed=0)  # 2 steps per epoch, rank 1
    assert s.steps_per_epoch == 2
    got = [s.next_step()[0] for _ in range(5)]
    for step, ix in enumerate(got):
        epoch, within = divmod(step, 2)
        perm = np.random.default_rng([0, epoch]).permutation(24)
        np.testing.assert_array_equal(ix, perm[within * 12 + 6 : within * 12 + 12])


def test_steps_per_epoch_floor() -> None:
    assert GlobalOrderSampler(35, BatchLayout(3, 2, 2, 0), 0).steps_per_epoch == 2
    assert GlobalOrderSampler(12, BatchLayout(3, 2, 2, 0), 0).steps_per_epoch == 1


def test_every_rank_gets_equal_disjoint_counts() -> None:
    samplers = _samplers(2, 2, 3)
    per_rank = [np.concatenate([ix for _ in range(4) for ix in s.next_step()]) for s in samplers]
    assert [len(p) for p in per_rank] == [16, 16, 16]
    all_ix = np.concatenate(per_rank).tolist()
    assert len(set(all_ix)) == 48


def test_seed_changes_order_same_seed_repeats() -> None:
    a = _global_steps(3, 2, 2, 4, seed=1)
    b = _global_steps(3, 2, 2, 4, seed=1)
    c = _global_steps(3, 2, 2, 4, seed=2)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, z) for x, z in zip(a, c, strict=True))
    # Same sample set per epoch for any seed, just another order.
    assert len(set(np.concatenate(c).tolist())) == 48


@pytest.mark.parametrize("k", [0, 1, 3, 4, 6])
def test_resume_continues_exactly(k: int) -> None:
    lay = BatchLayout(3, 2, 2, 1)
    full = GlobalOrderSampler(N, lay, seed=7)
    expected = [full.next_step() for _ in range(k + 5)][k:]
    first = GlobalOrderSampler(N, lay, seed=7)
    for _ in range(k):
        first.next_step()
    state = first.state_dict()
    assert state == {"step": k, "global_batch": 12, "seed": 7}
    resumed = GlobalOrderSampler(N, lay, seed=7)
    resumed.load_state_dict(state)
    for want in expected:
        for a, b in zip(resumed.next_step(), want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_resume_on_other_world_size_with_same_global_batch() -> None:
    one = GlobalOrderSampler(N, BatchLayout(12, 1, 1, 0), seed=3)
    for _ in range(3):
        one.next_step()
    state = one.state_dict()
    reference = np.concatenate([one.next_step()[0] for _ in range(3)])
    samplers = _samplers(2, 2, 3, seed=3)
    for s in samplers:
        s.load_state_dict(state)
    got = []
    for _ in range(3):
        per_rank = [s.next_step() for s in samplers]
        got.extend(per_rank[r][a] for a in range(2) for r in range(3))
    np.testing.assert_array_equal(np.concatenate(got), reference)


def test_dataset_smaller_than_global_batch() -> None:
    with pytest.raises(ConfigError) as info:
        GlobalOrderSampler(11, BatchLayout(3, 2, 2, 0), seed=0)
    err = info.value
    assert "11 samples" in err.what
    assert "one global batch (12 = micro_batch 3 x grad_accum 2 x 2 ranks)" in err.what
    assert err.hint is not None and "train.micro_batch" in err.hint


# -- TokenLoader -----------------------------------------------------------------------------

SEQ = 8
TOKENS = np.arange(N * SEQ + 1, dtype=np.int64)  # window i starts with token i * SEQ


LAYOUT = BatchLayout(3, 2, 2, 1)


def _loader(prefetch: int, seed: int = 0, dataset=None) -> TokenLoader:
    ds = dataset or ContiguousTokens(TOKENS, SEQ)
    return TokenLoader(ds, GlobalOrderSampler(len(ds), LAYOUT, seed), torch.device("cpu"),
                       prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_next_step_shapes_and_shift(prefetch: int) -> None:
    loader = _loader(prefetch)
    reference = GlobalOrderSampler(N, BatchLayout(3, 2, 2, 1), 0)
    try:
        for _ in range(5):
            step = loader.next_step()
            want = reference.next_step()
            assert len(step) == 2
            for (inputs, targets), ix in zip(step, want, strict=True):
                assert inputs.shape == targets.shape == (3, SEQ)
                assert inputs.dtype == targets.dtype == torch.int64
                rows = torch.as_tensor(np.stack([TOKENS[i * SEQ : i * SEQ + SEQ + 1] for i in ix]))
                torch.testing.assert_close(inputs, rows[:, :-1], rtol=0, atol=0)
                torch.testing.assert_close(targets, rows[:, 1:], rtol=0, atol=0)
                torch.testing.assert_close(targets[:, :-1], inputs[:, 1:], rtol=0, atol=0)
    finally:
        loader.close()


def test_uint8_tokens_become_int64() -> None:
    tokens = (np.arange(N * SEQ + 1) % 256).astype(np.uint8)
    loader = _loader(0, dataset=ContiguousTokens(tokens, SEQ))
    inputs, targets = loader.next_step()[0]
    assert inputs.dtype == torch.int64
    assert int(inputs.max()) < 256


def test_prefetch_gives_identical_batches() -> None:
    a, b = _loader(0), _loader(2)
    try:
        for _ in range(6):
            for (xa, ya), (xb, yb) in zip(a.next_step(), b.next_step(), strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    finally:
        b.close()


def test_state_counts_consumed_not_prefetched_steps() -> None:
    loader = _loader(2)
    try:
        for _ in range(3):
            loader.next_step()
        state = loader.state_dict()
        assert state["step"] == 3
        assert state["global_batch"] == 12
        assert loader.sampler.step >= 3  # the prefetcher may run ahead
        # A new loader resumed from that state hands out what step 4 of the first one would.
        resumed = _loader(2)
        resumed.load_state_dict(state)
        expected = loader.next_step()
        got = resumed.next_step()
        for (xa, ya), (xb, yb) in zip(expected, got, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert resumed.state_dict()["step"] == 4
        resumed.close()
    finally:
        loader.close()


def test_load_state_after_first_fetch_raises() -> None:
    loader = _loader(2)
    try:
        loader.next_step()
        with pytest.raises(RuntimeError, match="before the first batch"):
            loader.load_state_dict({"step": 0})
    finally:
        loader.close()


class _Broken:
    seq_len = SEQ

    def __len__(self) -> int:
        return N

    def window(self, index: int) -> np.ndarray:
        raise OSError(f"cannot read sample {index}")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_dataset_error_surfaces_in_next_step(prefetch: int) -> None:
    loader = _loader(prefetch, dataset=_Broken())
    try:
        with pytest.raises(OSError, match="cannot read sample"):
            loader.next_step()
        assert loader.state_dict()["step"] == 0
        # The worker is gone: a second fetch fails again instead of waiting forever.
        with pytest.raises(OSError, match="cannot read sample"):
            loader.next_step()
    finally:
        loader.close()


@pytest.mark.parametrize(("key", "value"), [("global_batch", 24), ("seed", 1)])
def test_resume_refuses_another_global_batch_or_seed(key: str, value: int) -> None:
    (saver,) = _samplers(12, 1, 1)
    saver.next_step()
    state = {**saver.state_dict(), key: value}
    (fresh,) = _samplers(12, 1, 1)
    with pytest.raises(ConfigError, match=key):
        fresh.load_state_dict(state)
