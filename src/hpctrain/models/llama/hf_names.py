"""Llama's tensor names and layouts against Hugging Face's (``LlamaForCausalLM`` and kin).

Names: ``model.layers.3.self_attn.q_proj.weight`` is hpctrain's ``layers.3.attention.wq.weight``
(`to_hpctrain_name`, `to_hf_name`). Hugging Face rotates the two halves of each head
(``rotate_half``), hpctrain (like Meta's checkpoints) adjacent channel pairs, so the rows of
q and k (weights and Qwen2's biases) are permuted within each head on the way in and back on
the way out; a permutation, so the round trip is exact.
"""

from __future__ import annotations

import re

import torch

from hpctrain.models.llama.sizes import ModelArgs

_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight",
           "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Derived buffers old transformers versions saved; recomputed, never read.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def to_hpctrain_name(hf: str) -> str | None:
    """hpctrain's name for a Hugging Face tensor name, or None if it has none."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m and m[2] in _LAYER:
        return f"layers.{int(m[1])}.{_LAYER[m[2]]}"
    return None


def to_hf_name(ours: str) -> str:
    """The Hugging Face name of an hpctrain parameter name."""
    if ours in _GLOBAL_BACK:
        return _GLOBAL_BACK[ours]
    m = _OURS_LAYER.fullmatch(ours)
    if not m or m[2] not in _LAYER_BACK:
        raise KeyError(f"{ours!r} has no Hugging Face name")
    return f"model.layers.{int(m[1])}.{_LAYER_BACK[m[2]]}"


def is_derived(hf: str) -> bool:
    """Whether a Hugging Face tensor is a derived buffer (recomputed, never read)."""
    return _DERIVED.fullmatch(hf) is not None


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Transformer(args)`` by hpctrain name (a tied output once, as the
    embedding), with its full shape."""
    d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, \
        args.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d),
                                          "norm.weight": (d,)}
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
                       p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
                       p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w3.weight": (f, d),
                       p + "feed_forward.w2.weight": (d, f), p + "attention_norm.weight": (d,),
                       p + "ffn_norm.weight": (d,)})
        if args.qkv_bias:
            shapes.update({p + "attention.wq.bias": (q,), p + "attention.wk.bias": (kv,),
                           p + "attention.wv.bias": (kv,)})
    return shapes


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """Heads whose rows are permuted between the two layouts (q and k), else None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    return None


def from_hf_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` whole heads from Hugging Face's half-split order to adjacent pairs."""
    hd = t.shape[0] // heads
    return t.reshape(heads, 2, hd // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_hf_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` whole heads from adjacent pairs to Hugging Face's half-split order."""
    hd = t.shape[0] // heads
    return t.reshape(heads, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
