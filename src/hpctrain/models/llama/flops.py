"""Parameter counts, training FLOPs per token and modelled costs of a `Transformer`, from its
shape alone.

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B), as torchtitan does::

    flops_per_token = 6 * N + 12 * L * H * Q * T

    N  parameters a token's matmuls use, excluding the token embedding table (a lookup):
       forward 2N + backward 4N per token
    L  layers, H  query heads, Q  head dim, T  sequence length (the attention score/value matmuls)

`N = count_params(args, include_embedding=False)` subtracts only `tok_embeddings.weight` from the
total of unique parameters, like torchtitan's `num_params - tok_embeddings.numel()`. The output
projection is a real vocab_size x dim matmul per token whether or not it is tied to the embedding
table, so `flops_per_token` adds it back when tied (count_params, counting weights, does not).

Worked example, preset `1b` (TinyLlama shape) at T = 2048::

    per layer: attention 2048*2048*2 + 2048*256*2 = 9,437,184
               SwiGLU    3 * 2048 * 5632         = 34,603,008
               2 norms   2 * 2048                = 4,096       -> 44,044,288
    N = 22 * 44,044,288 + 2048 (final norm) + 32000 * 2048 (untied output) = 1,034,512,384
    6N             = 6,207,074,304
    12*L*H*Q*T     = 12 * 22 * 32 * 64 * 2048 = 1,107,296,256
    flops_per_token = 7,314,370,560 (~7.3 GFLOP per token)
"""

from __future__ import annotations

from hpctrain.models.costs import embedding_cost, lm_head_cost
from hpctrain.models.llama.sizes import ModelArgs


def count_params(args: ModelArgs, *, include_embedding: bool) -> int:
    """Return the number of unique parameters of `Transformer(args)` (tied weights once).

    With `include_embedding=False` the token embedding table (`vocab_size * dim`) is left out;
    when embeddings are tied that table is also the output projection, so neither is counted.
    """
    dim, kv_dim = args.dim, args.n_kv_heads * args.head_dim
    attention = 2 * dim * (args.n_heads * args.head_dim) + 2 * dim * kv_dim  # wq, wo + wk, wv
    if args.qkv_bias:
        attention += args.n_heads * args.head_dim + 2 * kv_dim
    feed_forward = 3 * dim * args.ffn_dim  # w1, w2, w3
    norms = 2 * dim
    layers = args.n_layers * (attention + feed_forward + norms)
    embedding = args.vocab_size * dim
    output = 0 if args.tie_embeddings else args.vocab_size * dim
    total = layers + dim + output  # + final norm
    return total + embedding if include_embedding else total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Return training (forward + backward) FLOPs per token at `seq_len`, PaLM convention."""
    n = count_params(args, include_embedding=False)
    if args.tie_embeddings:  # the tied output matmul runs as an untied one does
        n += args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * n + attention)


def stage_costs(args: ModelArgs, seq_len: int, microbatch_tokens: int
                ) -> tuple[float, float, float]:
    """Modelled training cost per token, in FLOP-equivalents, of (embedding, one block, head):
    a block its training FLOPs, the head (final norm, output layer, loss) its matmul plus the
    memory-bound loss, the embedding its lookup and dense gradient (``models/costs.py``). With
    the 1b shape the head weighs about two blocks, with 8b about three."""
    per_layer = (count_params(args, include_embedding=False) - args.dim
                 - (0 if args.tie_embeddings else args.vocab_size * args.dim)) / args.n_layers
    block = 6 * per_layer + 12 * args.n_heads * args.head_dim * seq_len
    return (embedding_cost(args.vocab_size, args.dim, microbatch_tokens), block,
            lm_head_cost(args.vocab_size, args.dim))


def recomputed_flops(args: ModelArgs, save_mm: str) -> float:
    """Matmul FLOPs per token that one block recomputes in backward under selective AC
    (pointwise work not counted): wk, wo and w3 with ``every_other`` (the block runs wq, wk,
    wv, wo, w1, w3, w2 and every other one is kept), none with ``all``."""
    if save_mm == "all":
        return 0.0
    kv_dim = args.n_kv_heads * args.head_dim
    return 2.0 * args.dim * (kv_dim + args.dim + args.ffn_dim)


def param_tensors(args: ModelArgs) -> int:
    """Parameter tensors of `Transformer(args)` (a tied output layer shares the embedding's)."""
    return 9 * args.n_layers + 2 + (0 if args.tie_embeddings else 1)
