"""The shape of a Qwen model (`QwenArgs`), its named presets and its shape rules.

One shape covers both generations, by two flags: Qwen2/Qwen2.5 put biases on the q/k/v
projections (``qkv_bias``), Qwen3 normalises each query and key head (RMSNorm over the head's
channels, before RoPE: ``qk_norm``) and has none. Unlike Llama's, the head width is a field of
its own (Qwen3-0.6B: 16 heads of 128 channels over a 1024-wide residual stream). The small
models of both tie the output layer to the input embedding (``tie_embeddings``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.errors import ConfigError


@dataclass(frozen=True)
class QwenArgs:
    """The concrete shape of a `QwenModel`: everything needed to build it or count its FLOPs."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    # Length of the RoPE table; longer sequences are refused at forward.
    max_seq_len: int = 4096
    qkv_bias: bool = False  # Qwen2/Qwen2.5
    qk_norm: bool = False  # Qwen3


_QWEN25 = dict(vocab_size=151936, tie_embeddings=True, qkv_bias=True, max_seq_len=32768)
_QWEN3 = dict(vocab_size=151936, tie_embeddings=True, qk_norm=True, head_dim=128,
              max_seq_len=40960)

PRESETS: dict[str, QwenArgs] = {
    # CPU demo: a Qwen3-style (q/k norms, head_dim apart from dim / n_heads) tied decoder on
    # the demo's byte-level vocabulary, ~3.4M parameters.
    "tiny": QwenArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=48, ffn_dim=688,
                     vocab_size=256, tie_embeddings=True, qk_norm=True, max_seq_len=2048),
    # Its Qwen2.5-style twin (q/k/v biases, head_dim = dim / n_heads), ~2.9M parameters.
    "tiny-qwen2": QwenArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                           ffn_dim=688, vocab_size=256, tie_embeddings=True, qkv_bias=True,
                           max_seq_len=2048),
    # The Hugging Face models' shapes (config.json of Qwen/Qwen2.5-0.5B etc.).
    "qwen2.5-0.5b": QwenArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                             ffn_dim=4864, **_QWEN25),
    "qwen2.5-1.5b": QwenArgs(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                             ffn_dim=8960, **_QWEN25),
    "qwen3-0.6b": QwenArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                           **_QWEN3),
    "qwen3-1.7b": QwenArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144,
                           **_QWEN3),
}


def check_args(args: QwenArgs) -> None:
    """Raise `ConfigError` unless the head width is even and the KV heads divide the query
    heads."""
    if args.head_dim % 2:
        raise ConfigError(
            f"model.head_dim = {args.head_dim} is odd",
            expected="an even head_dim, since RoPE rotates pairs of channels",
            hint="pick a preset with an even head_dim")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={args.n_heads} is not divisible by "
            f"model.n_kv_heads={args.n_kv_heads}",
            expected="n_heads to be a multiple of n_kv_heads (grouped-query attention)",
            hint="set n_kv_heads to a divisor of n_heads (n_kv_heads = n_heads disables GQA)")


def args_from_json(raw: object, where: str) -> QwenArgs:
    """`QwenArgs` back from its ``dataclasses.asdict`` form (read as untrusted input)."""
    fields = {f.name: f for f in dataclasses.fields(QwenArgs)}
    if not isinstance(raw, dict) or set(raw) - set(fields):
        raise ConfigError(f"{where}: model_args = {raw!r} is not a Qwen model shape")
    try:
        args = QwenArgs(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: model_args = {raw!r} is not a Qwen model shape: {e}"
                          ) from None
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                 "vocab_size", "max_seq_len"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: model_args.{name} = {value!r} is not a positive integer")
    for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
        if not isinstance(getattr(args, name), bool):
            raise ConfigError(f"{where}: model_args.{name} = {getattr(args, name)!r} is not "
                              "true or false")
    for name in ("rope_theta", "norm_eps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(f"{where}: model_args.{name} = {value!r} is not a positive number")
    return args
