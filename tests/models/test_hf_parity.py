"""Hugging Face import and export against transformers itself, for every supported architecture.

Tiny random models (Llama 3.1 with its RoPE scaling, tied Llama, Mistral with a sliding window,
Qwen2 with q/k/v biases; every parameter random, see ``hf_models.py``) are saved by
transformers; hpctrain imports each and must give transformers' logits (fp32, max abs diff
<= 1e-5); `import hf` -> `export hf` must give back the same tensors bit for bit, which
transformers then loads to the same logits; greedy generation with the KV cache must pick
transformers' tokens.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

from hf_models import ARCHS, SEQ, VOCAB, chat_tokenizer, hf_logits, hf_model  # noqa: E402
from hpctrain.cli import main  # noqa: E402
from hpctrain.models import Transformer  # noqa: E402
from hpctrain.models.generate import generate  # noqa: E402
from hpctrain.models.init_source import InitSource  # noqa: E402
from hpctrain.pretrained.weights import load_model  # noqa: E402

ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved model folder per architecture (with a tokenizer)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, arch in enumerate(ARCHS):
        out[arch] = hf_model(root / arch, arch, seed=i)
        chat_tokenizer(out[arch])
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_imported_model_gives_transformers_logits(folders, tokens, arch: str) -> None:
    expected = hf_logits(folders[arch], tokens)
    model = load_model(InitSource("hf", folders[arch]))
    with torch.no_grad():
        got = model(tokens)
    assert (got - expected).abs().max().item() <= ATOL
    assert expected.abs().max().item() > 1.0  # logits of a random model, not near zero


def test_the_parity_is_sensitive_to_rope_scaling_and_biases(folders, tokens) -> None:
    """The Llama 3.1 scaling and Qwen2's (permuted) biases change the logits by far more than
    the tolerance: the parity above checks them."""
    for arch, change in (("llama3", {"rope_scaling": None}), ("qwen2", {"qkv_bias": False})):
        expected = hf_logits(folders[arch], tokens)
        model = load_model(InitSource("hf", folders[arch]))
        with torch.device("meta"):
            wrong = Transformer(dataclasses.replace(model.args, **change))
        wrong.to_empty(device="cpu")
        wrong.init_buffers()
        wrong.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            assert (wrong(tokens) - expected).abs().max().item() > 1e-2, arch


@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_then_export_round_trips_bit_exactly(folders, tokens, tmp_path: Path,
                                                   arch: str) -> None:
    src = folders[arch]
    main(["import", "hf", str(src), "--out", str(tmp_path / "ckpt")])
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["dtype"] == "fp32" and "tokenizer.json" in manifest["assets"]
    main(["export", "hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "fp32"),
          "--dtype", "fp32", "--max-shard-gb", "0.00003"])
    original, exported = _tensors(src), _tensors(tmp_path / "fp32")
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    assert (tmp_path / "fp32" / "model.safetensors.index.json").is_file()  # several shards
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "fp32" / name).read_bytes() == (src / name).read_bytes()
    assert torch.equal(hf_logits(tmp_path / "fp32", tokens), hf_logits(src, tokens))
    # bf16: the same tensors, cast
    main(["export", "hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "bf16")])
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    for name, t in _tensors(tmp_path / "bf16").items():
        assert torch.equal(t, original[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_greedy_generation_picks_transformers_tokens(folders, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 42, 7, 99, 3]
    hf = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # 20 tokens whatever they are, as below
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 20
    model = load_model(InitSource("hf", folders[arch]))
    assert generate(model, prompt, 20) == expected


def test_the_kv_cache_gives_the_full_forward_logits(folders) -> None:
    from hpctrain.models.llama.model import kv_cache

    model = load_model(InitSource("hf", folders["mistral"]))
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = kv_cache(model, batch=2, max_len=30)
        parts = [model(tokens[:, :12], cache=cache), model(tokens[:, 12:20], cache=cache)]
        parts += [model(tokens[:, i:i + 1], cache=cache) for i in range(20, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_a_model_trained_from_scratch_exports_as_a_llama(tmp_path: Path) -> None:
    """No imported config to start from: export writes a LlamaForCausalLM config of its own
    (here with the Llama 3.1 RoPE scaling), which transformers reads to hpctrain's logits."""
    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint.manifest import describe, write_manifest
    from hpctrain.models import ModelArgs
    from hpctrain.models.init_source import args_to_json
    from hpctrain.models.llama.sizes import RopeScaling
    from hpctrain.pretrained.weights import single_process

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                     vocab_size=VOCAB, max_seq_len=SEQ,
                     rope_scaling=RopeScaling(4.0, 1.0, 4.0, 16))
    torch.manual_seed(0)
    model = Transformer(args).eval()
    ckpt = tmp_path / "ckpt"
    with single_process():
        dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt, no_dist=True)
    write_manifest(ckpt, {p.name: describe(p) for p in ckpt.iterdir()},
                   {"step": 0, "model_args": args_to_json(args)})
    main(["export", "hf", str(ckpt), "--out", str(tmp_path / "out"), "--dtype", "fp32"])
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens)
    assert (hf_logits(tmp_path / "out", tokens) - expected).abs().max().item() <= ATOL
