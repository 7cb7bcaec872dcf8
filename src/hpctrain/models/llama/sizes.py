"""Concrete model shapes (`ModelArgs`) and the named presets users pick with `model.size`.

Every preset is an untied Llama-style decoder; `tie_embeddings` is an override, not a preset
property, so the FSDP/TP wrapping of the output layer is the same for every size unless asked.
`qkv_bias` (Qwen2) and `rope_scaling` (Llama 3.1+) exist for imported Hugging Face models
(`hpctrain.models.hf_config`); no preset uses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.errors import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3`` in a Hugging Face config).

    Wavelengths longer than ``original_max_seq_len / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original_max_seq_len / high_freq_factor`` kept, and the ones
    between interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int


@dataclass(frozen=True)
class ModelArgs:
    """The concrete shape of a `Transformer`: everything needed to build it or count its FLOPs."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Length of the precomputed RoPE table; sequences longer than this are refused at forward.
    max_seq_len: int = 8192
    # Biases on the query, key and value projections (Qwen2); none elsewhere.
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


PRESETS: dict[str, ModelArgs] = {
    # CPU demo: ~3.0M params, byte-level vocabulary (the demo tokenizer emits raw bytes).
    "tiny": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=688,
        vocab_size=256,
        max_seq_len=2048,
    ),
    # GPT-2-small width/depth with a Llama vocabulary; ~134M params untied (~110M tied).
    "125m": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        vocab_size=32000,
        max_seq_len=2048,
    ),
    # TinyLlama-1.1B shape: 1,100,048,384 params.
    "1b": ModelArgs(
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        vocab_size=32000,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    # Llama-3-8B shape: 8,030,261,248 params.
    "8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
    ),
}


def check_args(args: ModelArgs) -> None:
    """Raise `ConfigError` unless heads divide the width evenly (even head_dim) and the KV heads
    divide the query heads."""
    if args.dim % args.n_heads != 0:
        raise ConfigError(
            f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}",
            expected="dim to be a multiple of n_heads (head_dim = dim / n_heads)",
            hint="change dim or n_heads so that dim % n_heads == 0",
        )
    if (args.dim // args.n_heads) % 2 != 0:
        raise ConfigError(
            f"head_dim = model.dim / model.n_heads = {args.dim} / {args.n_heads} is odd",
            expected="an even head_dim, since RoPE rotates pairs of channels",
            hint="change dim or n_heads so that dim / n_heads is even",
        )
    if args.n_heads % args.n_kv_heads != 0:
        raise ConfigError(
            f"model.n_heads={args.n_heads} is not divisible by "
            f"model.n_kv_heads={args.n_kv_heads}",
            expected="n_heads to be a multiple of n_kv_heads (grouped-query attention)",
            hint="set n_kv_heads to a divisor of n_heads (n_kv_heads = n_heads disables GQA)",
        )


def args_from_json(raw: object, where: str) -> ModelArgs:
    """`ModelArgs` back from its ``dataclasses.asdict`` form (read as untrusted input)."""
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    if not isinstance(raw, dict) or set(raw) - fields:
        raise ConfigError(f"{where}: model_args = {raw!r} is not a model shape")
    raw = dict(raw)
    scaling = raw.get("rope_scaling")
    try:
        if scaling is not None:
            raw["rope_scaling"] = RopeScaling(**scaling)
        args = ModelArgs(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: model_args = {raw!r} is not a model shape: {e}") from None
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                 "max_seq_len"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: model_args.{name} = {value!r} is not a positive integer")
    return args
