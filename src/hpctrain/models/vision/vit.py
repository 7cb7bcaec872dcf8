"""Vision Transformer (Dosovitskiy et al. 2020) in plain PyTorch, with torchvision's names.

``torchvision.models.vit_b_16().state_dict()`` loads into ``VisionTransformer(**VIT_SIZES
["vit_b_16"])`` key for key. Attention runs through ``scaled_dot_product_attention`` (flash or
memory-efficient kernels on the GPU) rather than ``nn.MultiheadAttention``, whose parameter
names (``in_proj_weight``, ``out_proj``) it keeps.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

# patch, layers, heads, hidden, mlp width: torchvision's b_16/l_16, and a tiny one for CPU tests.
VIT_SIZES: dict[str, dict[str, int]] = {
    "vit_b_16": {"patch_size": 16, "num_layers": 12, "num_heads": 12, "hidden_dim": 768,
                 "mlp_dim": 3072},
    "vit_l_16": {"patch_size": 16, "num_layers": 24, "num_heads": 16, "hidden_dim": 1024,
                 "mlp_dim": 4096},
    "vit_tiny": {"patch_size": 4, "num_layers": 2, "num_heads": 2, "hidden_dim": 32,
                 "mlp_dim": 64},
}


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameters (packed q/k/v)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"hidden_dim {dim} is not a multiple of num_heads {heads}")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        # Index 0 and 3 carry weights, as in torchvision's MLPBlock (Linear, GELU, Dropout,
        # Linear, Dropout); dropout is 0 in its recipes and left out here.
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Identity(),
                                 nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """Position embedding, the blocks, the final LayerNorm."""

    def __init__(self, seq_len: int, num_layers: int, heads: int, dim: int, mlp_dim: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_len, dim))
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(dim, heads, mlp_dim)) for i in range(num_layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(x + self.pos_embedding))


class VisionTransformer(nn.Module):
    """Patchify (a strided conv), prepend the class token, encode, classify the class token."""

    def __init__(self, image_size: int = 224, patch_size: int = 16, num_layers: int = 12,
                 num_heads: int = 12, hidden_dim: int = 768, mlp_dim: int = 3072,
                 num_classes: int = 1000) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch_size}")
        self.image_size, self.patch_size = image_size, patch_size
        self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_len = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(seq_len, num_layers, num_heads, hidden_dim, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))
        self.reset_parameters()

    def blocks(self) -> list[nn.Module]:
        """The encoder blocks in order (the units FSDP shards)."""
        return list(self.encoder.layers)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torchvision's initialisation (a zero head: the first logits are all 0)."""
        fan_in = self.conv_proj.in_channels * self.patch_size ** 2
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.class_token)
        nn.init.normal_(self.encoder.pos_embedding, std=0.02)
        for block in self.blocks():
            nn.init.xavier_uniform_(block.self_attention.in_proj_weight)
            nn.init.zeros_(block.self_attention.in_proj_bias)
            nn.init.zeros_(block.self_attention.out_proj.bias)
            for lin in (block.mlp[0], block.mlp[3]):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.normal_(lin.bias, std=1e-6)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (batch, patches, hidden)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])
