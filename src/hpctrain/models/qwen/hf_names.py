"""Qwen's tensor names against Hugging Face's (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``).

``model.layers.3.self_attn.q_proj.weight`` is ``blocks.3.attn.q.weight``. Both sides rotate the
two halves of each head, so every tensor is stored alike: no rows are reordered, and import and
export copy the values as they are.
"""

from __future__ import annotations

import re

import torch

from hpctrain.models.qwen.sizes import QwenArgs

_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
           "lm_head.weight": "head.weight"}
_BLOCK = {
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
# Derived buffers older transformers versions saved; recomputed, never read.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def to_ours(hf: str) -> str | None:
    """Our name for a Hugging Face tensor name, or None if it has none."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _HF_BLOCK.fullmatch(hf)
    if m and m[2] in _BLOCK:
        return f"blocks.{int(m[1])}.{_BLOCK[m[2]]}"
    return None


def to_hf(ours: str) -> str:
    """The Hugging Face name of one of our parameter names."""
    if ours in _GLOBAL_BACK:
        return _GLOBAL_BACK[ours]
    m = _OUR_BLOCK.fullmatch(ours)
    if not m or m[2] not in _BLOCK_BACK:
        raise KeyError(f"{ours!r} has no Hugging Face name")
    return f"model.layers.{int(m[1])}.{_BLOCK_BACK[m[2]]}"


def is_derived(hf: str) -> bool:
    """Whether a Hugging Face tensor is a derived buffer (recomputed, never read)."""
    return _DERIVED.fullmatch(hf) is not None


def shapes(args: QwenArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``QwenModel(args)`` by our name (a tied output layer once, as the
    embedding), with its full shape."""
    d, f, hd = args.dim, args.ffn_dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"embed.weight": (args.vocab_size, d),
                                       "final_norm.weight": (d,)}
    if not args.tie_embeddings:
        out["head.weight"] = (args.vocab_size, d)
    for i in range(args.n_layers):
        p = f"blocks.{i}."
        out.update({p + "attn.q.weight": (q, d), p + "attn.k.weight": (kv, d),
                    p + "attn.v.weight": (kv, d), p + "attn.o.weight": (d, q),
                    p + "mlp.gate.weight": (f, d), p + "mlp.up.weight": (f, d),
                    p + "mlp.down.weight": (d, f), p + "attn_norm.weight": (d,),
                    p + "mlp_norm.weight": (d,)})
        if args.qkv_bias:
            out.update({p + "attn.q.bias": (q,), p + "attn.k.bias": (kv,),
                        p + "attn.v.bias": (kv,)})
        if args.qk_norm:
            out.update({p + "attn.q_norm.weight": (hd,), p + "attn.k_norm.weight": (hd,)})
    return out


def permuted_heads(name: str, args: QwenArgs) -> int | None:
    """None: no tensor's rows are reordered between the two layouts."""
    return None


def same_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t`` as it is (the layouts agree; never called while `permuted_heads` says None)."""
    return t
