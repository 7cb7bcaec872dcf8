"""`materialize`: meta-device parameters become the same initial weights on any layout.

Single process first (determinism, the init rules, wrapper names), then 2 real gloo ranks with
FSDP2 whose gathered weights must equal the single-process ones bit for bit.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from conftest import fork_spawn, free_port
from hpctrain.models import ModelArgs, Transformer
from hpctrain.parallel.materialize import canonical_name, materialize

# vocab 51 and ffn 96 split unevenly or evenly over 2 ranks; the embedding has 51 rows, so
# FSDP's dim-0 shards are 26 and 25 rows (padding path).
ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=51, max_seq_len=32
)
# Wide enough that the std estimates below are within a few percent.
WIDE = ModelArgs(
    dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=16
)
CPU = torch.device("cpu")


def _materialized(args: ModelArgs, seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    assert model.tok_embeddings.weight.is_meta
    materialize(model, CPU, seed=seed)
    return model


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(k): v.detach().clone() for k, v in model.named_parameters()}


def test_canonical_name() -> None:
    assert canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    assert canonical_name("module._orig_mod.norm.weight") == "norm.weight"
    assert canonical_name("output.weight") == "output.weight"


def test_same_seed_is_bitwise_identical_and_seed_matters() -> None:
    a, b = _params(_materialized(ARGS, 3)), _params(_materialized(ARGS, 3))
    c = _params(_materialized(ARGS, 4))
    assert a.keys() == b.keys() == c.keys()
    assert len(a) == 2 + 9 * ARGS.n_layers + 1  # emb, norm, output + 9 per block
    for name in a:
        assert not a[name].is_meta
        assert torch.equal(a[name], b[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a[name], c[name]), name


def test_each_parameter_has_its_own_stream() -> None:
    p = _params(_materialized(ARGS, 3))
    # Same shape, same rule, different name: different values.
    assert not torch.equal(p["layers.0.attention.wq.weight"], p["layers.1.attention.wq.weight"])
    assert not torch.equal(p["layers.0.feed_forward.w1.weight"],
                           p["layers.0.feed_forward.w3.weight"])


def test_init_rules() -> None:
    model = _materialized(WIDE, 0)
    p = _params(model)
    emb = p["tok_embeddings.weight"]
    assert emb.std().item() == pytest.approx(0.02, rel=0.03)
    assert abs(emb.mean().item()) < 1e-3
    # Embedding is a plain normal: some values beyond 3 std (65k samples, P ~ 0.27%).
    assert emb.abs().max().item() > 3 * 0.02
    trunc = 0.986  # std of a normal truncated at +-3 sigma, relative to sigma
    for name, t in p.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name == "tok_embeddings.weight":
            continue
        elif name.endswith(("wo.weight", "w2.weight")):
            std = 0.02 / math.sqrt(2 * WIDE.n_layers)
            assert t.std().item() == pytest.approx(std * trunc, rel=0.05), name
            assert t.abs().max().item() <= 3 * std, name
        else:
            assert t.std().item() == pytest.approx(0.02 * trunc, rel=0.05), name
            assert t.abs().max().item() <= 3 * 0.02, name


def test_rope_buffer_recomputed() -> None:
    model = _materialized(ARGS, 0)
    fresh = Transformer(ARGS)
    assert model.rope.device == CPU
    torch.testing.assert_close(model.rope, fresh.rope, rtol=0, atol=0)


def test_wrapped_blocks_get_the_same_weights() -> None:
    plain = _params(_materialized(ARGS, 5))
    with torch.device("meta"):
        model = Transformer(ARGS)
    for i, block in enumerate(list(model.layers)):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    materialize(model, CPU, seed=5)
    wrapped = _params(model)
    assert any("_checkpoint_wrapped_module" in k for k, _ in model.named_parameters())
    assert wrapped.keys() == plain.keys()
    for name in plain:
        assert torch.equal(wrapped[name], plain[name]), name


def test_tied_embeddings_stay_tied() -> None:
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=40,
                     max_seq_len=8, tie_embeddings=True)
    model = _materialized(args, 1)
    assert model.output.weight is model.tok_embeddings.weight
    assert not model.output.weight.is_meta
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_forward_runs_after_materialize() -> None:
    model = _materialized(ARGS, 0)
    logits = model(torch.arange(12).reshape(2, 6) % ARGS.vocab_size)
    assert logits.shape == (2, 6, ARGS.vocab_size)
    assert torch.isfinite(logits).all()


# -- 2 gloo ranks, FSDP2 ---------------------------------------------------------------------


def _fsdp_worker(rank: int, world_size: int, port: int, seed: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with torch.device("meta"):
            model = Transformer(ARGS)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        materialize(model, CPU, seed=seed)
        emb = model.tok_embeddings.weight
        full = {k: v.detach().full_tensor() for k, v in model.named_parameters()}
        tokens = torch.arange(12).reshape(2, 6) % ARGS.vocab_size
        with torch.no_grad():
            logits = model(tokens)
        result = {
            "is_dtensor": isinstance(emb, DTensor),
            "local_rows": emb.to_local().shape[0],
            "params": full,
            "rope": model.rope.clone(),
            "logits": logits,
        }
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_materialize_matches_single_process(tmp_path) -> None:
    seed = 11
    fork_spawn(_fsdp_worker, (2, free_port(), seed, str(tmp_path)), 2)
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(2)}
    single = _materialized(ARGS, seed)
    expected = _params(single)
    with torch.no_grad():
        expected_logits = single(torch.arange(12).reshape(2, 6) % ARGS.vocab_size)
    assert sorted(r["local_rows"] for r in results.values()) == [25, 26]
    for rank in range(2):
        r = results[rank]
        assert r["is_dtensor"]
        assert r["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(r["params"][name], value), (rank, name)
        torch.testing.assert_close(r["rope"], single.rope, rtol=0, atol=0)
        # The forward all-gathers from FSDP's own storage: it too must hold these weights.
        torch.testing.assert_close(r["logits"], expected_logits, rtol=1e-5, atol=1e-6)
