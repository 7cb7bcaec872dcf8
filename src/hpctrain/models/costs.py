"""Cost-model pieces every language-model family shares: what the input embedding and the
output layer with its loss cost per token, in FLOP-equivalents (``ModelFamily.stage_costs``).

Memory traffic is converted to FLOP-equivalents at ``FLOPS_PER_BYTE`` (an H100/H200's dense bf16
peak over its HBM bandwidth), so memory-bound parts weigh what they take in time.
"""

from __future__ import annotations

# Dense bf16 peak over HBM bandwidth of an H100 SXM (989 TFLOP/s / 3.35 TB/s): what one byte of
# memory traffic costs in FLOPs of time on a GPU of that balance.
FLOPS_PER_BYTE = 300.0
# Bytes moved per logit by the loss in fp32: the upcast, max, exp and sum forward; softmax minus
# one-hot and the downcast backward (about six fp32 passes).
LOSS_BYTES_PER_LOGIT = 24.0


def embedding_cost(vocab_size: int, dim: int, microbatch_tokens: int) -> float:
    """Per token: the memory-bound lookup and the dense gradient of a ``[vocab, dim]`` table."""
    # Forward reads one bf16 row per token; backward zeroes and accumulates a dense fp32
    # [vocab, dim] gradient once per micro-batch, shared by its tokens.
    embedding_bytes = 2 * dim + 8 * vocab_size * dim / max(1, microbatch_tokens)
    return embedding_bytes * FLOPS_PER_BYTE


def lm_head_cost(vocab_size: int, dim: int) -> float:
    """Per token: the output matmul (forward and backward) plus the memory-bound loss over
    the ``[tokens, vocab]`` logits."""
    return 6 * vocab_size * dim + LOSS_BYTES_PER_LOGIT * vocab_size * FLOPS_PER_BYTE
