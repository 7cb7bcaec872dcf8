"""A decoder-only transformer written by the user, in one file: next-token prediction.

    hpctrain train examples/tiny_transformer.py --nproc 2 train.steps=200 train.precision=fp32

The corpus is generated: token sequences from a fixed random Markov chain over 64 symbols, so
the loss has somewhere to go. A sample is 64 tokens: tokens/s counts tokens
(``tokens_per_sample``), and FSDP shards each block on its own (``shard_units``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.task import Task

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 64, 64, 4, 2


class Block(nn.Module):
    """Pre-norm attention and MLP, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, DIM)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    """Embedding, blocks, norm, output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def corpus(n: int = 2048) -> torch.Tensor:
    """``n`` sequences of SEQ + 1 tokens from a fixed Markov chain."""
    g = torch.Generator().manual_seed(0)
    transitions = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=g), dim=1)
    tokens = torch.empty(n, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (n,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=g)[:, 0]
    return tokens


def step(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross entropy, and the accuracy of the most likely token."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss, {"accuracy": accuracy}


def task() -> Task:
    """The model, 2048 generated sequences (256 held out), the step above."""
    data = corpus()
    return Task(model=TinyLM, data=data[:-256], eval_data=data[-256:], step=step,
                tokens_per_sample=SEQ, shard_units=lambda m: list(m.blocks))
