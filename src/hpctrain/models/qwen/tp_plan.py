"""Qwen's tensor-parallel plan (Megatron-style with sequence parallelism), as data for
``hpctrain.parallel.tensor``.

As Llama's: norms and residuals on sequence slices, q/k/v and gate/up split by output columns
(heads, FFN width; a bias is split with its rows), o and down by input rows and reduce-scattered
back onto sequence slices, the embedding and the output layer along the vocabulary. Qwen3's q/k
norms act on each head's channels with one weight shared by all heads: each rank normalises its
own heads with a replicated copy (``SequenceParallel`` over the heads dimension), and the
weight's gradient, a partial sum per rank, is summed over the ranks before the update
(``parallel.tensor.reduce_partial_grads``). A shape without q/k norms holds identities in
their place: the same entries wrap them, without communication.

An output layer tied to the embedding is refused with tensor parallelism
(``parallel.layout.check_layout``): the embedding is split by rows for a masked lookup, the
output layer by the vocabulary for the loss, and one Parameter cannot be both.
"""

from __future__ import annotations

from hpctrain.models.qwen.sizes import QwenArgs
from hpctrain.models.spec import TensorPlan


def tensor_plan() -> TensorPlan:
    """Fresh ParallelStyles for the model's own modules and for one block's."""
    # Imported here: DTensor's parallel styles load only when tensor parallelism is used.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return TensorPlan(
        root={
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "final_norm": SequenceParallel(),
            # Local logits [B, T, vocab / tp] for the vocabulary-parallel loss.
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                    use_local_output=True),
        },
        block={
            "attn_norm": SequenceParallel(),
            # The gathered input stays a DTensor: q, k and v's partial input gradients are
            # summed locally and reduce-scattered once (see Llama's plan).
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                       desired_input_layouts=(Replicate(), None)),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            # [B, T, local heads, head_dim]: the heads (dim 2) are this rank's slice.
            "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        },
    )


def tp_splits(args: QwenArgs, seq_len: int) -> list[tuple[str, int, str]]:
    """The sizes tensor parallelism splits: (config key, value, why) that tp must divide."""
    return [
        ("model.n_heads", args.n_heads, "the attention heads are split over tp ranks"),
        ("model.n_kv_heads", args.n_kv_heads, "the key/value heads are split over tp ranks"),
        ("model.ffn_dim", args.ffn_dim, "the FFN's hidden width is split over tp ranks"),
        ("model.vocab_size", args.vocab_size, "the output layer and the loss are split along "
         "the vocabulary"),
        ("data.seq_len", seq_len, "norms and residuals are split along the sequence "
         "(sequence parallelism)"),
    ]
