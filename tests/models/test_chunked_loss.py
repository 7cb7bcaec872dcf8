"""The chunked linear + cross entropy (``train.loss_chunks``) equals the plain loss, gradients too.

In-process on CPU with a tiny model: fp32 must agree to 1e-6 relative (only the order of float
sums differs); bf16 (autocast, and bf16 parameters as FSDP computes) must stay close.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hpctrain.data.loader import IGNORE_INDEX
from hpctrain.models import ModelArgs, Transformer
from hpctrain.models.chunked_loss import IGNORE_INDEX as LOSS_IGNORE_INDEX
from hpctrain.models.chunked_loss import chunked_linear_cross_entropy

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97,
                  max_seq_len=64)
RTOL = 1e-6


def _batch(seed: int = 1, b: int = 3, t: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SMALL.vocab_size, (b, t), generator=g)
    targets = torch.randint(0, SMALL.vocab_size, (b, t), generator=g)
    targets[0, :4] = IGNORE_INDEX  # a masked prompt
    targets[2, 7:] = IGNORE_INDEX  # padding
    return tokens, targets


def _plain(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def _loss_and_grads(model: Transformer, loss: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_rel(a: torch.Tensor, b: torch.Tensor, rtol: float, name: str) -> None:
    err = (a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)
    assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def test_ignore_index_is_the_loaders() -> None:
    assert LOSS_IGNORE_INDEX == IGNORE_INDEX


@pytest.mark.parametrize("chunks", [1, 4, 7, 1000])
@pytest.mark.parametrize("tied", [False, True])
def test_fp32_equals_plain_loss_and_grads(chunks: int, tied: bool) -> None:
    """33 tokens in 4 or 7 chunks (uneven last), one chunk, and more chunks than tokens."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(SMALL, tie_embeddings=tied))
    tokens, targets = _batch()
    ref_loss, ref = _loss_and_grads(model, _plain(model, tokens, targets))
    loss, grads = _loss_and_grads(model, model(tokens, targets=targets, loss_chunks=chunks))
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert grads.keys() == ref.keys()
    for name in ref:
        _assert_rel(grads[name], ref[name], RTOL, name)


def test_all_targets_ignored_gives_zero_loss_and_grads() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL)
    tokens, _ = _batch()
    targets = torch.full_like(tokens, IGNORE_INDEX)
    loss, grads = _loss_and_grads(model, model(tokens, targets=targets, loss_chunks=3))
    assert loss == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_function_grads_match_autograd_and_respect_grad_output() -> None:
    """The autograd Function alone, scaled by a non-unit upstream gradient."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (10,), generator=g)
    targets[3] = IGNORE_INDEX
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_linear_cross_entropy(h, w, targets, 3) * 2.5, (hidden, weight))


def test_bf16_autocast_is_close_to_plain() -> None:
    """Under autocast both multiply in bf16 and take the loss in fp32."""
    torch.manual_seed(0)
    model = Transformer(SMALL)
    tokens, targets = _batch(t=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _plain(model, tokens, targets)
    ref_loss, ref = _loss_and_grads(model, plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = model(tokens, targets=targets, loss_chunks=5)
    assert chunked.dtype == torch.float32
    loss, grads = _loss_and_grads(model, chunked)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for name in ref:
        _assert_rel(grads[name], ref[name], 3e-2, name)


def test_bf16_parameters_are_close_to_plain() -> None:
    """bf16 weights and activations (what FSDP's mixed precision computes in)."""
    torch.manual_seed(0)
    model = Transformer(SMALL).to(torch.bfloat16)
    tokens, targets = _batch(t=32)
    ref_loss, ref = _loss_and_grads(model, _plain(model, tokens, targets))
    loss, grads = _loss_and_grads(model, model(tokens, targets=targets, loss_chunks=5))
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for name in ref:
        _assert_rel(grads[name], ref[name], 3e-2, name)


def test_logits_paths_are_unchanged() -> None:
    """Without targets the model still returns logits (sampling, HF parity, validation)."""
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    tokens, _ = _batch()
    with torch.no_grad():
        assert model(tokens).shape == (*tokens.shape, SMALL.vocab_size)


def test_memory_plan_models_the_chunked_loss() -> None:
    """The planner: one chunk's logits (bf16, fp32, bf16 gradient) and the fp32 weight gradient
    instead of the whole logits' two bf16 copies (compiled loss)."""
    from hpctrain.errors import ConfigError
    from hpctrain.models import PRESETS
    from hpctrain.plan.memory import activation_bytes, estimate_memory
    from hpctrain.plan.memory_options import MemoryOptions

    args, tokens = PRESETS["1b"], 4 * 2048
    v, d = args.vocab_size, args.dim
    plain = activation_bytes(args, MemoryOptions(micro_batch=4))
    chunked = activation_bytes(args, MemoryOptions(micro_batch=4, loss_chunks=8))
    assert plain - chunked == pytest.approx(2 * 2 * v * tokens - (8 * v * tokens / 8 + 4 * v * d))
    with pytest.raises(ConfigError, match="train.loss_chunks = 8 with parallel.tp = 2"):
        estimate_memory(args, MemoryOptions(tp=2, loss_chunks=8))
