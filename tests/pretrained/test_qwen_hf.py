"""The Qwen family against transformers itself: tiny random Qwen2 (q/k/v biases, tied) and Qwen3
(q/k norms, head_dim 12 apart from hidden 32 / 4 heads, untied) models saved by
transformers (nothing downloaded). hpctrain's logits equal transformers' in fp32 (1e-4; in
practice 0) and are no further from them in bf16 than transformers' own bf16; ``import hf``
-> ``export hf`` gives back the same tensors bit for bit (a tied model's folder holds no
``lm_head.weight``, as transformers writes it); greedy generation picks transformers' tokens;
the presets have the parameter counts of transformers' models of their shape.
"""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import chat_tokenizer, randomize_  # noqa: E402
from hpctrain.cli import main  # noqa: E402
from hpctrain.errors import ConfigError  # noqa: E402
from hpctrain.models import get_family  # noqa: E402
from hpctrain.models.config import ModelConfig  # noqa: E402
from hpctrain.models.generate import generate  # noqa: E402
from hpctrain.models.init_source import InitSource  # noqa: E402
from hpctrain.models.qwen.hf_config import args_from_hf_config  # noqa: E402
from hpctrain.pretrained.weights import load_model  # noqa: E402

VOCAB, SEQ = 320, 40
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, rope_theta=1e6)
# name -> (config class, model class, extra config)
ARCHS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12))}
ATOL = 1e-4


def _hf_model(arch: str, dtype: torch.dtype = torch.float32, folder: Path | None = None):
    """transformers' model of ``arch``: every parameter random (a wrong name, a missed bias or
    norm changes the logits), or loaded from ``folder``."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    if folder is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    torch.manual_seed(len(arch) + len(extra))
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE, **extra))
    randomize_(model)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_hf")
    out = {}
    for arch in ARCHS:
        _hf_model(arch).save_pretrained(root / arch)
        out[arch] = chat_tokenizer(root / arch)
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(glob.glob(str(folder / "*.safetensors")))
            for k, v in load_file(path).items()}


def _qwen(folder: Path):
    """The folder's model in the Qwen family (a Qwen2 folder would import as a llama)."""
    raw = json.loads((folder / "config.json").read_text())
    return load_model(InitSource("hf", folder), args=args_from_hf_config(raw))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_equal_transformers_in_fp32_and_bf16(folders, tokens, arch: str) -> None:
    expected = _logits(_hf_model(arch, folder=folders[arch]), tokens)
    ours = _qwen(folders[arch])
    assert type(ours).__name__ == "QwenModel"
    assert (_logits(ours, tokens) - expected).abs().max().item() <= ATOL
    assert expected.abs().max().item() > 1.0  # a random model's logits, not near zero
    # bf16: no further from transformers' fp32 logits than transformers' own bf16 model.
    theirs = (_logits(_hf_model(arch, torch.bfloat16, folders[arch]), tokens)
              - expected).abs().mean().item()
    mine = (_logits(ours.to(torch.bfloat16), tokens) - expected).abs().mean().item()
    assert 0 < mine <= theirs * 1.05, (mine, theirs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_then_export_round_trips_bit_exactly(folders, tokens, tmp_path: Path,
                                                   arch: str) -> None:
    src = folders[arch]
    # A Qwen3 folder comes to this family by its architecture; Qwen2 is asked for by name.
    main(["import", "hf", str(src), "--out", str(tmp_path / "ckpt"),
          *(["--family", "qwen"] if arch == "qwen2" else [])])
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["model_family"] == "qwen" and manifest["dtype"] == "fp32"
    # The checkpoint (what model.init_from loads) is the folder's model.
    imported = load_model(InitSource("checkpoint", tmp_path / "ckpt"))
    assert type(imported).__name__ == "QwenModel"
    assert torch.equal(_logits(imported, tokens), _logits(_qwen(src), tokens))
    main(["export", "hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
          "--dtype", "fp32"])
    original, exported = _tensors(src), _tensors(tmp_path / "out")
    assert ("lm_head.weight" in original) == (arch == "qwen3")  # what transformers writes
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json").read_bytes()
    assert torch.equal(_logits(_hf_model(arch, folder=tmp_path / "out"), tokens),
                       _logits(_hf_model(arch, folder=src), tokens))


def test_greedy_generation_picks_transformers_tokens(folders) -> None:
    prompt = [5, 17, 42, 7, 99, 3]
    hf = _hf_model("qwen3", folder=folders["qwen3"])
    hf.generation_config.eos_token_id = None  # 12 tokens whatever they are
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(_qwen(folders["qwen3"]), prompt, 12) == expected


@pytest.mark.parametrize("size", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_presets_count_what_transformers_builds(size: str) -> None:
    """A preset's config (as export writes it) builds in transformers, on the meta device, a
    model of exactly the parameters the family counts."""
    import transformers

    qwen = get_family("qwen")
    args = qwen.presets[size]
    config = qwen.hf.config_from_args(args, None, "bfloat16")
    assert args_from_hf_config(config) == args
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config))
    assert sum(p.numel() for p in model.parameters()) == qwen.count_params(
        args, include_embedding=True)


def test_configs_it_cannot_compute_are_refused_by_name() -> None:
    base = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SHAPE,
            "head_dim": 12}
    for change, match in (
            ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
             "rope_parameters"),
            ({"attention_bias": True}, "attention_bias = True"),
            ({"use_mrope": True}, "use_mrope"),
            ({"num_experts": 8}, "num_experts is not supported")):
        with pytest.raises(ConfigError, match=match):
            args_from_hf_config({**base, **change})
    # Layers that slide: sequences up to the window are full attention; longer are refused.
    window = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16,
              "use_sliding_window": True}
    assert args_from_hf_config({**base, **window}).max_seq_len == 16
    assert args_from_hf_config(base) == dataclasses.replace(
        args_from_hf_config({**base, **window}), max_seq_len=64)


def test_model_family_chooses_how_a_folder_is_read(folders, tokens, tmp_path: Path) -> None:
    """``model.family: qwen`` with ``init_from: hf:<Qwen2 folder>`` trains the Qwen family (it
    trained a llama: the family was dropped); weights the named family does not read, or a
    checkpoint of another family, are refused saying which family they are."""
    from hf_models import hf_model
    from hpctrain.config import dump_yaml, load_config
    from hpctrain.models.qwen import QwenArgs
    from hpctrain.pretrained.import_hf import import_hf

    qwen2, qwen3 = (f"hf:{folders[a]}" for a in ("qwen2", "qwen3"))
    cfg = load_config(None, ["model.family=qwen", f"model.init_from={qwen2}",
                             f"model.max_seq_len={SEQ}", f"data.seq_len={SEQ}"])
    args = cfg.model.resolve()
    assert isinstance(args, QwenArgs) and args.qkv_bias
    # The model training builds and loads from these args is transformers' Qwen2.
    ours = load_model(InitSource("hf", folders["qwen2"]), args=args)
    assert type(ours).__name__ == "QwenModel"
    assert (_logits(ours, tokens) - _logits(_hf_model("qwen2", folder=folders["qwen2"]),
                                            tokens)).abs().max().item() <= ATOL
    # Unnamed, a Qwen2 folder is a llama (the same computation) and a Qwen3 one a qwen; the
    # config a run saves names the family it settled on.
    for folder, family in ((qwen2, "llama"), (qwen3, "qwen")):
        cfg = load_config(None, [f"model.init_from={folder}", f"model.max_seq_len={SEQ}",
                                 f"data.seq_len={SEQ}"])
        assert f"family: {family}\n" in dump_yaml(cfg)

    llama = f"hf:{hf_model(tmp_path / 'llama', 'llama_tied')}"
    with pytest.raises(ConfigError, match="model.family = 'qwen', but the folder holds a "
                       "'LlamaForCausalLM' model") as e:
        ModelConfig(family="qwen", init_from=llama).resolve()
    assert "the 'llama' family" in e.value.hint
    with pytest.raises(ConfigError, match="'Qwen3ForCausalLM' model .* which the 'llama' "
                       "family does not read"):
        ModelConfig(family="llama", init_from=qwen3).resolve()
    with pytest.raises(ConfigError, match="--family = 'qwen', but the folder holds a "
                       "'LlamaForCausalLM'"):
        import_hf(Path(llama[3:]), tmp_path / "refused", family="qwen")
    assert not (tmp_path / "refused").exists()
    # A checkpoint carries its family: a Qwen2 folder imported without --family is a llama.
    import_hf(folders["qwen2"], tmp_path / "ckpt", "fp32")
    with pytest.raises(ConfigError, match="model.family = 'qwen', but model.init_from = .* "
                       "holds a 'llama' model"):
        ModelConfig(family="qwen", init_from=str(tmp_path / "ckpt")).resolve()
    assert type(ModelConfig(init_from=str(tmp_path / "ckpt")).resolve()).__name__ == "ModelArgs"
