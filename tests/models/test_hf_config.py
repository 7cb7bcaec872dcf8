"""Hugging Face configs as model shapes: the Hub's real configs map to the right shape, and
what hpctrain would compute differently is refused by name. No transformers needed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelConfig
from hpctrain.models.llama.hf_config import args_from_hf_config, hf_config_from_args
from hpctrain.models.llama.sizes import RopeScaling
from hpctrain.pretrained.weights import starts_from_pretrained

# As on the Hub (transformers 4 format: rope_theta and rope_scaling at the top level).
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True,
    "vocab_size": 128256}
LLAMA_31_8B = {**LLAMA_3_8B, "max_position_embeddings": 131072, "mlp_bias": False,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192,
                                "rope_type": "llama3"}}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 131072,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_llama_3_8b_is_the_8b_preset() -> None:
    assert args_from_hf_config(LLAMA_3_8B) == PRESETS["8b"]


def test_llama_31_carries_its_rope_scaling_in_either_transformers_format() -> None:
    v4 = args_from_hf_config(LLAMA_31_8B)
    assert v4.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert v4.max_seq_len == 131072
    params = {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}
    v5 = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    assert args_from_hf_config({**v5, "rope_parameters": params}) == v4
    # An old config naming the kind "type" instead of "rope_type".
    old = {**LLAMA_31_8B, "rope_scaling": {**{k: v for k, v in LLAMA_31_8B[
        "rope_scaling"].items() if k != "rope_type"}, "type": "llama3"}}
    assert args_from_hf_config(old) == v4


def test_mistral_window_caps_the_sequence_and_qwen2_has_biases() -> None:
    mistral = args_from_hf_config(MISTRAL_7B_V01)
    assert mistral.max_seq_len == 4096 and not mistral.qkv_bias
    qwen = args_from_hf_config(QWEN2_05B)
    assert qwen.qkv_bias and qwen.tie_embeddings and qwen.max_seq_len == 131072
    assert (qwen.n_heads, qwen.n_kv_heads, qwen.head_dim) == (14, 2, 64)


@pytest.mark.parametrize("change, named", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"model_type": "mistral"}, "LlamaForCausalLM"),  # architecture and type disagree
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"auto_map": {"AutoModel": "x.py"}}, "auto_map"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"head_dim": 64}, "head_dim"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_size": "4096"}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_what_hpctrain_does_not_compute_is_refused_by_name(change: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        args_from_hf_config({**LLAMA_3_8B, **change})
    assert named in e.value.what


def test_an_exported_scratch_config_reads_back_as_the_same_shape() -> None:
    args = dataclasses.replace(PRESETS["1b"], rope_scaling=RopeScaling(8.0, 1.0, 4.0, 1024))
    config = hf_config_from_args(args, None, "bfloat16", {"eos_token_id": 2})
    assert args_from_hf_config(json.loads(json.dumps(config))) == args
    assert config["eos_token_id"] == 2


def _hf_folder(root: Path, config: dict) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_model_config_takes_the_shape_from_init_from(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "mistral", MISTRAL_7B_V01)
    mc = ModelConfig(init_from=f"hf:{folder}")
    assert mc.resolve() == args_from_hf_config(MISTRAL_7B_V01)
    assert ModelConfig(init_from=f"hf:{folder}", max_seq_len=1024).resolve().max_seq_len == 1024
    with pytest.raises(ConfigError, match="sliding attention window"):
        ModelConfig(init_from=f"hf:{folder}", max_seq_len=8192).resolve()
    with pytest.raises(ConfigError, match="model.n_layers is set together with"):
        ModelConfig(init_from=f"hf:{folder}", n_layers=2).resolve()
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig(init_from=f"hf:{tmp_path / 'missing'}").resolve()


def test_a_run_resumes_its_own_weights_instead_of_the_pretrained_ones() -> None:
    assert starts_from_pretrained("auto", has_checkpoints=False)
    assert not starts_from_pretrained("auto", has_checkpoints=True)
    assert starts_from_pretrained("never", has_checkpoints=False)
    assert not starts_from_pretrained("/runs/x/checkpoints/step-00000010", False)
