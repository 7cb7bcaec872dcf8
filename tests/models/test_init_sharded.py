"""`Transformer.init_weights` on FSDP2-sharded (DTensor) parameters: 2 real gloo ranks on CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from conftest import free_port
from hpctrain.models import ModelArgs, Transformer

ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50, max_seq_len=64
)


def _worker(rank: int, world_size: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with torch.device("meta"):
            model = Transformer(ARGS)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        weight = model.layers[0].attention.wq.weight
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        results[rank] = {
            "is_dtensor": type(weight).__name__ == "DTensor",
            "finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
            "emb_std": full["tok_embeddings.weight"].std().item(),
            "rope": model.rope.clone(),
        }
    finally:
        dist.destroy_process_group()


def test_init_weights_on_fsdp2_shards() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    expected_rope = Transformer(ARGS).rope
    for rank in range(2):
        assert results[rank]["is_dtensor"]
        assert results[rank]["finite"]
        assert abs(results[rank]["emb_std"] - 0.02) < 0.002
        torch.testing.assert_close(results[rank]["rope"], expected_rope, rtol=0, atol=0)
