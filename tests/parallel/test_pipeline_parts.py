"""Pipeline pieces without ranks: stage balancing, stage placement, the bubble, the split model,
and the vocabulary-parallel loss against PyTorch's cross entropy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models import PRESETS, ModelArgs, Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.pipeline import StageUnion, split_model
from hpctrain.parallel.stages import (
    balance_stages,
    bubble_estimate,
    inflight_chunks,
    module_costs,
    stage_indices,
)
from hpctrain.parallel.tensor import vocab_parallel_cross_entropy

SMALL = ModelArgs(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                  max_seq_len=16)


def _stage_costs(bounds: tuple[int, ...], costs: tuple[float, float, float]) -> list[float]:
    embedding, block, head = costs
    n = len(bounds) - 1
    return [(bounds[s + 1] - bounds[s]) * block + (embedding if s == 0 else 0)
            + (head if s == n - 1 else 0) for s in range(n)]


def test_equal_blocks_split_evenly_without_heavy_ends() -> None:
    assert balance_stages(8, 4, (0.0, 1.0, 0.0)) == (0, 2, 4, 6, 8)


def test_heavy_output_layer_gets_fewer_blocks() -> None:
    # The head costs three blocks: the last stage takes one block, the others share the rest.
    bounds = balance_stages(10, 3, (0.0, 1.0, 3.0))
    assert bounds in ((0, 4, 8, 10), (0, 5, 9, 10))
    assert max(_stage_costs(bounds, (0.0, 1.0, 3.0))) == 5.0


@pytest.mark.parametrize("size", ["1b", "8b"])
def test_presets_balance_better_than_equal_layer_counts(size: str) -> None:
    """Accounting for the embedding and the output layer lowers the slowest stage."""
    args = PRESETS[size]
    costs = module_costs(args, seq_len=2048, microbatch_tokens=2048)
    embedding, block, head = costs
    assert head > block  # the output layer and the loss outweigh a block at these vocabularies
    stages = 4
    even = tuple(round(i * args.n_layers / stages) for i in range(stages + 1))
    balanced = balance_stages(args.n_layers, stages, costs)
    assert balanced[-1] - balanced[-2] < even[-1] - even[-2]  # the last stage holds fewer
    assert max(_stage_costs(balanced, costs)) < max(_stage_costs(even, costs))


def test_every_stage_gets_a_block() -> None:
    bounds = balance_stages(4, 4, (0.0, 1.0, 100.0))
    assert bounds == (0, 1, 2, 3, 4)


def test_stage_placement_loop_and_v() -> None:
    loop = [stage_indices(r, 4, 2, "interleaved_1f1b") for r in range(4)]
    assert loop == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v = [stage_indices(r, 4, 2, "zbv") for r in range(4)]
    assert v == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_bubble_estimates() -> None:
    assert bubble_estimate("1f1b", 4, 8, 1) == 3 / 11
    assert bubble_estimate("gpipe", 4, 4, 1) == 3 / 7
    assert bubble_estimate("interleaved_1f1b", 4, 8, 2) == 3 / 19
    # Zero bubble: the weight-gradient passes fill two thirds of the idle slots.
    assert bubble_estimate("interleaved_zb", 4, 8, 2) == 3 / 51
    assert bubble_estimate("zbv", 4, 8, 2) == 3 / 51


def test_inflight_micro_batches_per_schedule() -> None:
    """At its peak the first 1F1B stage holds p micro-batches, the last one; GPipe all."""
    assert [inflight_chunks("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight_chunks("gpipe", 4, 8, 1, 3) == 8
    assert inflight_chunks("1f1b", 4, 2, 1, 0) == 2  # never more than there are
    # Interleaved, 2 stages per rank: PyTorch's warm-up (v-1)*m_round + 2(p-1-r), plus one.
    assert [inflight_chunks("interleaved_1f1b", 4, 8, 2, r) for r in range(4)] == [11, 9, 7, 5]
    assert inflight_chunks("zbv", 4, 8, 2, 0) == 8


def test_split_model_keeps_canonical_names() -> None:
    """Stages hold disjoint parts under the whole model's parameter names; together all."""
    with torch.device("meta"):
        model = Transformer(SMALL)
    names = {n for n, _ in model.named_parameters()}
    layout = ParallelLayout(pp=2, schedule="interleaved_1f1b", microbatches=2,
                            stages_per_rank=2)
    bounds = [0, 2, 3, 5, 6]
    seen: list[str] = []
    for rank in range(2):
        parts = split_model(model, layout, rank, bounds)
        assert [s for s, _ in parts] == stage_indices(rank, 2, 2, "interleaved_1f1b")
        union = StageUnion([p for _, p in parts], SMALL.n_layers)
        rank_names = [n for n, _ in union.named_parameters()]
        assert sorted(rank_names) == sorted(n for _, p in parts for n, _ in p.named_parameters())
        seen += rank_names
    assert sorted(seen) == sorted(names)  # each parameter on exactly one rank
    first, = [p for s, p in split_model(model, layout, 0, bounds) if s == 0]
    assert first.output is None and first.tok_embeddings is not None
    assert [i for i, b in enumerate(first.layers) if b is not None] == [0, 1]


def test_split_stages_chain_to_the_whole_model() -> None:
    """Running the stages one after another gives the unsplit model's logits."""
    torch.manual_seed(0)
    model = Transformer(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    layout = ParallelLayout(pp=3, schedule="1f1b", microbatches=3)
    bounds = [0, 1, 4, 6]
    h = tokens
    for rank in range(3):
        ((_, part),) = split_model(model, layout, rank, bounds)
        h = part(h)
    with torch.no_grad():
        torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


@pytest.fixture
def single_rank_group():
    """A one-rank gloo group (the vocabulary-parallel loss calls collectives)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


def test_vocab_parallel_loss_matches_cross_entropy(single_rank_group) -> None:
    """Loss and gradient equal F.cross_entropy's (sum, ignored targets skipped)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    targets[1, 2] = targets[2, 0] = -100
    ours = vocab_parallel_cross_entropy(logits, targets, single_rank_group, 0)
    (grad,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                          ignore_index=-100)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
