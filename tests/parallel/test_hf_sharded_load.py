"""Pretrained weights into sharded models: each of 4 gloo ranks reads only the part it holds.

One spawn of 4 ranks loads a Hugging Face folder (Qwen2-style: q/k/v biases, GQA) into FSDP4
(the shards cut heads in half, so the q/k row permutation must work on part of a head; tied
embeddings) and into TP2 x FSDP2 (untied); every parameter gathered back must equal the
single-process load bit for bit, and each rank must have read less than its share plus the
whole heads its rows touch (never the whole model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from conftest import fork_spawn, free_port
from hpctrain.models import ModelArgs, Transformer
from hpctrain.models.hf_weights import HFWeights, write_safetensors
from hpctrain.models.llama.hf_names import expected_shapes, to_hf_name
from hpctrain.parallel.data import apply_fsdp
from hpctrain.parallel.materialize import canonical_name, load_weights, materialize
from hpctrain.parallel.tensor import apply_tensor_parallel

pytest.importorskip("safetensors")

# head_dim 8; FSDP4 splits wk's 16 rows into 4-row shards: half heads.
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=51,
                 max_seq_len=32, qkv_bias=True, rope_theta=1e6)
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
         "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None}


def _hf_folder(root: Path, args: ModelArgs) -> Path:
    root.mkdir()
    torch.manual_seed(1)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    params = {n: p.detach() for n, p in model.named_parameters()}
    entries = [(to_hf_name(n), torch.float32, s) for n, s in expected_shapes(args).items()]
    back = {to_hf_name(n): n for n in expected_shapes(args)}
    # The source's rows in Hugging Face's order: any permutation of rows would do here.
    write_safetensors(root, entries, lambda hf: params[back[hf]], 3000)
    (root / "config.json").write_text(json.dumps({
        **QWEN2, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.ffn_dim, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings}))
    return root


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            .clone() for n, p in model.named_parameters()}


def _worker(rank: int, port: int, folders: dict[str, str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        cpu = torch.device("cpu")
        results = {}
        for name, tp in (("fsdp4", 1), ("tp2_fsdp2", 2)):
            args = dataclasses.replace(ARGS, tie_embeddings=tp == 1)
            mesh = init_device_mesh("cpu", (1, 4 // tp, tp),
                                    mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
            with torch.device("meta"):
                model = Transformer(args)
            if tp > 1:
                apply_tensor_parallel(model, mesh["tp"])
            apply_fsdp(model, mesh, "fp32", True)
            materialize(model, cpu, seed=0)
            reader = HFWeights(Path(folders[name]), args)
            load_weights(model, reader.read)
            results[name] = {"params": _full(model), "bytes_read": reader.bytes_read,
                             "sharded": all(isinstance(p, DTensor) for p in model.parameters())}
        out[rank] = results
    finally:
        dist.destroy_process_group()


def test_each_rank_reads_its_part_and_the_parts_make_the_model(tmp_path: Path) -> None:
    folders = {"fsdp4": str(_hf_folder(tmp_path / "tied", dataclasses.replace(
                   ARGS, tie_embeddings=True))),
               "tp2_fsdp2": str(_hf_folder(tmp_path / "untied", ARGS))}
    with mp.Manager() as manager:
        out = manager.dict()
        fork_spawn(_worker, (free_port(), folders, out), 4)
        results = dict(out)
    for name, folder in folders.items():
        args = dataclasses.replace(ARGS, tie_embeddings=name == "fsdp4")
        reference = Transformer(args)
        whole = HFWeights(Path(folder), args)
        load_weights(reference, whole.read)
        expected = _full(reference)
        total = whole.bytes_read
        for rank in range(4):
            got = results[rank][name]
            assert got["sharded"], name
            assert sorted(got["params"]) == sorted(expected), name
            for key, value in expected.items():
                assert torch.equal(got["params"][key], value), (name, rank, key)
            # A quarter of every tensor, plus at most the two half heads a cut touches.
            assert got["bytes_read"] < 0.4 * total, (name, rank, got["bytes_read"], total)
        if name == "fsdp4":
            assert sum(results[r][name]["bytes_read"] for r in range(4)) < 1.2 * total
