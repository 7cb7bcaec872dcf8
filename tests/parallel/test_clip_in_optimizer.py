"""Clipping folded into the fused AdamW (``clip_divisor`` as its ``grad_scale``) updates the
weights and moments as clipping the gradients first does: to fp32 rounding where the norm is
clipped (a few bf16 roundings with bf16 gradients), bit for bit where it is not."""

from __future__ import annotations

import pytest
import torch

from hpctrain.parallel.grad_norm import clip_divisor, clip_grads_, global_grad_norm


def _params(dtype: torch.dtype, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in ((64, 32), (32,), (128, 64)):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def _step(params: list[torch.nn.Parameter], max_norm: float, fused_clip: bool) -> list:
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    norm = global_grad_norm(params, None)
    if fused_clip:
        opt.grad_scale = clip_divisor(norm, max_norm)
    else:
        clip_grads_(params, max_norm, norm)
    opt.step()
    state = [opt.state[p] for p in params]
    return [t.detach().clone() for p, s in zip(params, state, strict=True)
            for t in (p, s["exp_avg"], s["exp_avg_sq"])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [10.0, 1e-3])  # a norm far above the bound, then below it
def test_fused_clip_matches_clipping_first(dtype: torch.dtype, scale: float) -> None:
    max_norm = 1.0
    first, fused = (_step(_params(dtype, scale), max_norm, f) for f in (False, True))
    clipped = global_grad_norm(_params(dtype, scale), None).item() > max_norm
    assert clipped == (scale > 1)
    for a, b in zip(first, fused, strict=True):
        if clipped:
            # In bf16, clipping first rounds the clipped gradients to bf16 and the kernel does
            # not: a gradient 2^-9 apart, its square 2^-8, each result rounded again.
            tol = 1e-6 if dtype == torch.float32 else 2 ** -6
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item())
        else:
            assert torch.equal(a, b)


def test_divisor_is_one_below_the_bound_and_norm_over_bound_above() -> None:
    assert clip_divisor(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_divisor(torch.tensor(4.0), 2.0).item() == pytest.approx(2.0, rel=1e-6)
    assert clip_divisor(torch.tensor(4.0, dtype=torch.bfloat16), 2.0).dtype == torch.float32
