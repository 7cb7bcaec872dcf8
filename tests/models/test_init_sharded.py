"""`Transformer.init_weights` on FSDP2-sharded (DTensor) parameters: 2 real gloo ranks on CPU."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from conftest import spawn_ranks
from hpctrain.models import ModelArgs, Transformer

ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50, max_seq_len=64
)


def _worker(rank: int, port: int, results: Any) -> None:
    """One rank of 2 (forked from the preloaded interpreter): what init_weights made, on the
    queue."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
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
        results.put({
            "rank": rank,
            "is_dtensor": type(weight).__name__ == "DTensor",
            "finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
            "emb_std": full["tok_embeddings.weight"].std().item(),
            # By value: a queued tensor is shared memory, which the rank's exit frees.
            "rope": model.rope.numpy().copy(),
        })
    finally:
        dist.destroy_process_group()


def test_init_weights_on_fsdp2_shards() -> None:
    results = sorted(spawn_ranks(_worker, 2), key=lambda r: r["rank"])
    expected_rope = Transformer(ARGS).rope
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["is_dtensor"]
        assert result["finite"]
        assert abs(result["emb_std"] - 0.02) < 0.002
        torch.testing.assert_close(torch.from_numpy(result["rope"]), expected_rope, rtol=0, atol=0)
