"""Parameter counts, training FLOPs per token and modelled costs of a `QwenModel`, from its
shape alone (PaLM's convention, as Llama's ``flops.py`` explains)::

    flops_per_token = 6 * N + 12 * L * H * Q * T

N is every parameter a token's matmuls use but the input embedding table (a lookup): a tied
output layer is that table, yet its V x dim matmul runs all the same, so it counts in N. Q is the
head width (Qwen3's is not dim / H). Worked example, preset ``qwen3-0.6b`` (dim 1024, 28 layers,
16 heads of 128, 8 KV heads, FFN 3072, tied):

    per layer: q, o 2 * 1024 * 2048 = 4,194,304;  k, v 2 * 1024 * 1024 = 2,097,152
               SwiGLU 3 * 1024 * 3072 = 9,437,184; q/k norms 2 * 128; block norms 2 * 1024
               -> 15,730,944
    N = 28 * 15,730,944 + 1024 + 151,936 * 1024 (tied output matmul) = 596,049,920
        (transformers' own parameter count too: tied, the head's weights are the table's)
    at T = 4096: 6N = 3,576,299,520;  12 * L * H * Q * T = 12 * 28 * 16 * 128 * 4096 =
                 2,818,572,288;  flops_per_token = 6,394,871,808
"""

from __future__ import annotations

from hpctrain.models.costs import embedding_cost, lm_head_cost
from hpctrain.models.qwen.sizes import QwenArgs


def _block_params(args: QwenArgs) -> int:
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * q_dim + 2 * args.dim * kv_dim
    if args.qkv_bias:
        attention += q_dim + 2 * kv_dim
    if args.qk_norm:
        attention += 2 * args.head_dim
    return attention + 3 * args.dim * args.ffn_dim + 2 * args.dim


def count_params(args: QwenArgs, *, include_embedding: bool) -> int:
    """Unique parameters of `QwenModel(args)` (tied weights once); without the input embedding
    table if asked (a tied output layer is that table, so then neither is counted)."""
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_embeddings else embedding
    total = args.n_layers * _block_params(args) + args.dim + output  # + final norm
    return total + embedding if include_embedding else total


def flops_per_token(args: QwenArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at ``seq_len``, PaLM convention."""
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    # count_params leaves a tied output layer out (it is the embedding table), but its matmul
    # runs for every token as an untied one's does.
    tied_head = args.vocab_size * args.dim if args.tie_embeddings else 0
    return float(6 * (count_params(args, include_embedding=False) + tied_head) + attention)


def stage_costs(args: QwenArgs, seq_len: int, microbatch_tokens: int
                ) -> tuple[float, float, float]:
    """Modelled training cost per token (FLOP-equivalents) of (embedding, one block, head):
    a block its training FLOPs, the ends as ``models/costs.py`` models them."""
    block = 6 * _block_params(args) + 12 * args.n_heads * args.head_dim * seq_len
    return (embedding_cost(args.vocab_size, args.dim, microbatch_tokens), float(block),
            lm_head_cost(args.vocab_size, args.dim))


def recomputed_flops(args: QwenArgs, save_mm: str) -> float:
    """Matmul FLOPs per token one block recomputes under selective AC: of q, k, v, o, gate, up,
    down (the order the block runs them) every other one is kept, so k, o and up are redone
    with ``every_other``; none with ``all``."""
    if save_mm == "all":
        return 0.0
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return 2.0 * args.dim * (kv_dim + q_dim + args.ffn_dim)


def param_tensors(args: QwenArgs) -> int:
    """Parameter tensors of `QwenModel(args)` (a tied output layer shares the embedding's)."""
    per_block = 9 + (3 if args.qkv_bias else 0) + (2 if args.qk_norm else 0)
    return per_block * args.n_layers + 2 + (0 if args.tie_embeddings else 1)
