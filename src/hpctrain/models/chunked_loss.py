"""Linear + cross entropy over chunks of tokens: the full ``[tokens, vocab]`` logits never exist.

The plain loss materialises the logits in the compute dtype, their fp32 copy and, for backward,
the fp32 softmax: for the `1b` model (vocabulary 32,000) at 4 x 2048 tokens that is 0.5 GB bf16 +
1 GB fp32 + its gradient. Here the output projection and the loss run together, ``chunks``
slices of tokens at a time::

    loss = chunked_linear_cross_entropy(hidden [N, D], weight [V, D], targets [N], chunks=8)

Per chunk the logits are ``h @ W^T`` in the compute dtype (autocast's, else the hidden state's),
and the log-sum-exp and target logit are taken in fp32. Only the per-token log-sum-exp (4 B per
token) is kept for backward, which recomputes each chunk's logits and turns them into the
chunk's ``grad_h`` and its share of ``grad_W`` (accumulated in fp32). One chunk's logits live
at a time: memory falls by about ``chunks`` times for one more output matmul in backward.

The result is the SUMMED token loss; ``ignore_index`` targets (padding, loss masks) add 0 and
get no gradient. Pure math on plain tensors: the caller must hand it the whole weight (inside
the model's forward, where FSDP has gathered it).
"""

from __future__ import annotations

import torch

# The target value that adds nothing: F.cross_entropy's default, and what the data loader writes
# for padding and masked-out tokens (``hpctrain.data.loader.IGNORE_INDEX``).
IGNORE_INDEX = -100


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the plain output layer would multiply in: autocast's, else the input's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One chunk's logits, multiplied in the operands' dtype (as the plain layer does), in
    fp32 (fp64 stays fp64) for the loss."""
    return (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of ``hidden @ weight^T``, one token chunk at a time."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunks: int, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
        # Casts are explicit (autocast off inside): backward must repeat exactly these.
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            acc = torch.promote_types(dtype, torch.float32)
            lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=acc)
            total = torch.zeros((), device=hidden.device, dtype=acc)
            for rows in _chunks(hidden.shape[0], chunks):
                logits = _chunk_logits(h[rows], w)
                t = targets[rows]
                keep = t != ignore_index
                lse[rows] = torch.logsumexp(logits, dim=-1)
                target_logit = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
                total += torch.where(keep, lse[rows] - target_logit, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunks, ctx.ignore_index, ctx.dtype = chunks, ignore_index, dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (torch.zeros(weight.shape, device=weight.device, dtype=lse.dtype)
                  if need_w else None)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            for rows in _chunks(hidden.shape[0], ctx.chunks):
                t = targets[rows]
                keep = (t != ctx.ignore_index)[:, None]
                # d(lse - logit_t)/d logits = softmax - onehot(t), zero on ignored rows.
                grad = torch.exp_(_chunk_logits(h[rows], w) - lse[rows, None])
                grad.scatter_add_(1, t.clamp(min=0)[:, None],
                                  torch.full_like(lse[rows, None], -1.0))
                grad = grad.mul_(torch.where(keep, grad_out, 0.0)).to(ctx.dtype)
                if need_h:
                    grad_h[rows] = (grad @ w).to(hidden.dtype)
                if need_w:
                    grad_w += grad.t() @ h[rows]
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def _chunks(n: int, chunks: int) -> list[slice]:
    """``chunks`` consecutive row slices covering ``n`` rows (the last may be shorter)."""
    size = -(-n // max(1, min(chunks, n)))
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, chunks: int,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed fp32 cross entropy of ``hidden [N, D] @ weight[V, D]^T`` against ``targets [N]``,
    computed over ``chunks`` token chunks; ``ignore_index`` targets add 0."""
    if chunks < 1:
        raise ValueError(f"chunks = {chunks} must be >= 1")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunks, ignore_index,
                                            _compute_dtype(hidden))
