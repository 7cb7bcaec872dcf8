"""Tiny Hugging Face models and a tokenizer, made from configs (nothing is downloaded).

``hf_model(folder, arch)`` writes a randomly initialised model of one supported architecture
with every parameter (norm weights and biases included) drawn at random, so a wrong mapping,
permutation or RoPE variant changes the logits. ``chat_tokenizer(folder)`` writes a small
byte-level BPE ``tokenizer.json`` with special tokens and a ``tokenizer_config.json`` holding a
chat template, as a model folder on the Hub has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
              rms_norm_eps=1e-6)
# name -> (transformers config class, model class, extra config, max_shard_size for saving)
ARCHS = {
    # Llama 3.1: the llama3 RoPE scaling (its original context shorter than the test sequence,
    # so every kind of frequency is there), untied, sharded safetensors with an index.
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_theta=500000.0, rope_scaling={
                   "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
               "20KB"),
    # Llama 3.2 1B style: tied embeddings, one safetensors file.
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True), None),
    # Mistral v0.1: a sliding window (48) the sequences stay within.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=48), "40KB"),
    # Qwen2: biases on q, k and v; tied (the small Qwen2 models are).
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), None),
}
SEQ = 48

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS = ("the cat sat on the mat. what is two plus two? four. name a colour: red, green, blue. "
          "hello world, how are you today? fine thanks. ") * 20


def randomize_(model: torch.nn.Module) -> None:
    """Weights far from transformers' init (norm gains around 1, biases and matrices spread),
    so a parity check sees every parameter act."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2 if name.endswith("bias") else 0.08)


def hf_model(folder: Path, arch: str, seed: int = 0, *, vocab: int = VOCAB,
             randomize: bool = True, **overrides) -> Path:
    """Save a tiny random ``arch`` model (see ARCHS) into ``folder``; returns the folder."""
    import transformers

    config_cls, model_cls, extra, shard = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, "vocab_size": vocab, **extra,
                                                  **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    if randomize:
        randomize_(model)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def chat_tokenizer(folder: Path, *, template: bool = True) -> Path:
    """Write tokenizer.json (byte-level BPE, VOCAB ids) + tokenizer_config.json into
    ``folder``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the model saved in ``folder``, computed by transformers in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
