"""The Llama-style Transformer: causality, GQA against a reference, meta init, initial loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelArgs, Transformer
from hpctrain.models.llama.model import apply_rope, precompute_rope

SMALL = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    vocab_size=50,
    max_seq_len=64,
)


def _model(args: ModelArgs = SMALL, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def test_forward_shape_and_causality() -> None:
    model = _model().eval()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = torch.randint(0, SMALL.vocab_size, (2, 7))
    with torch.no_grad():
        logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 16, SMALL.vocab_size)
    torch.testing.assert_close(logits[:, :9], logits_changed[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[:, 9:], logits_changed[:, 9:])


def test_rope_matches_complex_reference() -> None:
    # Meta's Llama applies RoPE as complex multiplication of adjacent channel pairs.
    x = torch.randn(2, 8, 3, 16, dtype=torch.float64)
    rope = precompute_rope(16, 8, 10000.0)
    freqs = torch.polar(
        torch.ones(8, 8, dtype=torch.float64), torch.atan2(rope[..., 1], rope[..., 0]).double()
    )
    expected = torch.view_as_real(
        torch.view_as_complex(x.reshape(2, 8, 3, 8, 2)) * freqs[None, :, None, :]
    ).flatten(-2)
    torch.testing.assert_close(apply_rope(x, rope), expected, rtol=0, atol=1e-6)


def test_gqa_attention_matches_reference_with_repeated_kv() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL).double()
    attn = model.layers[0].attention
    bsz, seqlen, n_rep = 2, 10, SMALL.n_heads // SMALL.n_kv_heads
    x = torch.randn(bsz, seqlen, SMALL.dim, dtype=torch.float64)
    rope = model.rope[:seqlen]

    q = apply_rope(attn.wq(x).view(bsz, seqlen, SMALL.n_heads, -1), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(bsz, seqlen, SMALL.n_kv_heads, -1), rope).transpose(1, 2)
    v = attn.wv(x).view(bsz, seqlen, SMALL.n_kv_heads, -1).transpose(1, 2)
    # Query head h reads kv head h // n_rep.
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(SMALL.head_dim)
    future = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    expected = attn.wo((probs @ v).transpose(1, 2).reshape(bsz, seqlen, -1))

    with torch.no_grad():
        torch.testing.assert_close(attn(x, rope), expected.detach(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_init_matches_cpu_build(tie: bool) -> None:
    args = ModelArgs(**{**SMALL.__dict__, "tie_embeddings": tie})
    with torch.device("meta"):
        model = Transformer(args)
    assert model.tok_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()

    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert (model.output.weight is model.tok_embeddings.weight) == tie

    reference = Transformer(args)  # built directly on CPU; construction draws from the RNG
    torch.manual_seed(7)
    reference.init_weights()
    torch.testing.assert_close(model.rope, reference.rope, rtol=0, atol=0)
    for (name, p), (_, p_ref) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(p, p_ref), name

    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    model.init_weights()
    for name, p in model.state_dict().items():
        assert torch.equal(p, first[name]), name


def test_residual_projections_scaled_down() -> None:
    model = _model(ModelArgs(**{**SMALL.__dict__, "dim": 256, "ffn_dim": 512}))
    block = model.layers[0]
    expected = 0.02 / math.sqrt(2 * SMALL.n_layers)
    assert block.attention.wo.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_initial_loss_near_log_vocab() -> None:
    args = PRESETS["tiny"]
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 65))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.3


def test_too_long_sequence_is_a_config_error() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
