"""Sequence-parallel norm weights: their gradients are summed over the tensor-parallel ranks.
And the collectives one forward-backward of TP2 issues: sequence parallelism all-gathers and
reduce-scatters activations, never all-reduces them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from conftest import fork_spawn, free_port
from hpctrain.models import ModelArgs, Transformer
from hpctrain.parallel.materialize import materialize
from hpctrain.parallel.tensor import apply_tensor_parallel, reduce_partial_grads, tp_loss_fn

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                 max_seq_len=16)
CPU = torch.device("cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))


def _reference_grads() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize(model, CPU, seed=3)
    x, y = _batch()
    F = torch.nn.functional
    F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").backward()
    return {n: p.grad for n, p in model.named_parameters() if "norm" in n}


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = Transformer(ARGS)
        apply_tensor_parallel(model, mesh["tp"])
        materialize(model, CPU, seed=3)
        x, y = _batch()
        comms = CommDebugMode()
        with comms:
            tp_loss_fn(mesh["tp"], ARGS.vocab_size)(model(x), y).backward()
        norms = {n: p for n, p in model.named_parameters() if "norm" in n}
        partial_before = all(any(pl.is_partial() for pl in p.grad.placements)
                             for p in norms.values())
        reduce_partial_grads(list(model.parameters()))
        out[rank] = {
            "partial_before": partial_before,
            "placements": {n: p.grad.placements for n, p in norms.items()},
            "grads": {n: p.grad.to_local().clone() for n, p in norms.items()},
            "all_dtensor": all(isinstance(p.grad, DTensor) for p in model.parameters()),
            "comms": {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()},
        }
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict:
    """Both ranks' observations of one TP2 forward-backward (one spawn for the module)."""
    with mp.Manager() as manager:
        out = manager.dict()
        fork_spawn(_worker, (free_port(), out), 2)
        return dict(out)


def test_partial_norm_gradients_become_the_whole_models(results: dict) -> None:
    reference = _reference_grads()
    for rank in (0, 1):
        r = results[rank]
        assert r["all_dtensor"]
        # DTensor leaves each rank the gradient of its sequence slice only...
        assert r["partial_before"]
        # ...summed, every rank holds the gradient one process computes.
        assert all(p == (Replicate(),) for p in r["placements"].values())
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-6)


def test_sequence_parallel_reduce_scatters_and_never_all_reduces_activations(
        results: dict) -> None:
    """Per block: forward all-gathers before attention and the FFN and reduce-scatters after
    them; backward mirrors that, one reduce-scatter per module for the summed input gradients
    of its projections. An all-reduce per projection (5 a block, each twice a reduce-scatter's
    bytes) once cost an 8b TP2 step 81 ms on H200 (benchmarks/RESULTS.md). The
    vocabulary-parallel loss all-reduces two per-token scalars in place (``allreduce_``)."""
    blocks = ARGS.n_layers
    for rank in (0, 1):
        comms = results[rank]["comms"]
        assert comms.get("all_reduce", 0) == 0, comms
        # + 1 each for the embedding (reduce-scatter onto sequence slices) and the output
        # layer (all-gather of its input), and their mirrors in backward.
        assert comms == {"all_gather_into_tensor": 4 * blocks + 2,
                         "reduce_scatter_tensor": 4 * blocks + 2, "allreduce_": 2}, comms
