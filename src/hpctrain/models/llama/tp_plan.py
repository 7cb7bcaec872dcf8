"""Llama's tensor-parallel plan (Megatron-style, with sequence parallelism), as data for
``hpctrain.parallel.tensor``, which applies it.

Each block: the norms run on a slice of the sequence (``SequenceParallel``); before attention and
the FFN the sequence is all-gathered, q/k/v and w1/w3 are split by output columns (heads and FFN
width), wo and w2 by input rows, and their partial sums are reduce-scattered back to sequence
slices. The embedding is split along the vocabulary (a masked lookup, then a reduce-scatter onto
sequence slices) and so is the output layer, whose logits stay sharded for the
vocabulary-parallel loss.
"""

from __future__ import annotations

from hpctrain.models.llama.sizes import ModelArgs
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
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # Local logits [B, T, vocab / tp]: the loss works on the shards.
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                      use_local_output=True),
        },
        block={
            "attention_norm": SequenceParallel(),
            # The RoPE table (second argument) is a plain tensor every rank holds whole. The
            # gathered input stays a DTensor (use_local_output off): the partial gradients that
            # wq, wk and wv (w1 and w3) send back to it are summed locally and reduce-scattered
            # once onto sequence slices. A local tensor here would make each projection
            # all-reduce its own: 5 all-reduces per block in backward instead of 2
            # reduce-scatters (81 ms of an 846 ms 8b TP2 step on H200, all of it exposed).
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        },
    )


def tp_splits(args: ModelArgs, seq_len: int) -> list[tuple[str, int, str]]:
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
