"""AdamW parameter groups, the warmup + cosine/constant LR factor, the scheduler, lr scaling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hpctrain.train.config import OptimConfig
from hpctrain.train.optim import build_optimizer, build_scheduler, lr_factor


def _factors(total: int, **kw) -> list[float]:
    cfg = OptimConfig(**kw)
    return [lr_factor(s, total_steps=total, cfg=cfg) for s in range(total)]


def test_warmup_is_linear_to_one() -> None:
    f = _factors(20, warmup_steps=4, schedule="cosine")
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # reaches 1 at step warmup - 1
    assert f[4] == 1.0  # cosine starts at its top
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))  # then never rises


def test_cosine_values() -> None:
    cfg = OptimConfig(warmup_steps=2, min_lr_ratio=0.1)
    # progress = (step - warmup) / (total - 1 - warmup): the last trained step is total - 1.
    assert lr_factor(11, total_steps=12, cfg=cfg) == pytest.approx(0.1)
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 9))
    assert lr_factor(5, total_steps=12, cfg=cfg) == pytest.approx(expected)
    # At and past total_steps the factor stays at the floor.
    assert lr_factor(12, total_steps=12, cfg=cfg) == pytest.approx(0.1)
    assert lr_factor(50, total_steps=12, cfg=cfg) == pytest.approx(0.1)


def test_cosine_ends_at_min_ratio_on_last_step() -> None:
    f = _factors(10, warmup_steps=0, min_lr_ratio=0.1)
    assert f[-1] == pytest.approx(0.1)


def test_constant_stays_one_after_warmup() -> None:
    f = _factors(10, warmup_steps=3, schedule="constant")
    assert f == pytest.approx([1 / 3, 2 / 3, 1.0] + [1.0] * 7)
    assert lr_factor(1000, total_steps=10, cfg=OptimConfig(warmup_steps=3,
                                                            schedule="constant")) == 1.0


def test_no_warmup() -> None:
    f = _factors(5, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)
    assert f[0] == 1.0
    assert f[1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert _factors(3, warmup_steps=0, schedule="constant") == [1.0, 1.0, 1.0]


def test_warmup_longer_than_run() -> None:
    assert _factors(3, warmup_steps=10) == pytest.approx([0.1, 0.2, 0.3])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 3)  # weight 2-D, bias 1-D
        self.norm = nn.RMSNorm(3)
        self.frozen = nn.Linear(3, 3, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_weight_decay_only_on_matrices() -> None:
    net = _Net()
    cfg = OptimConfig(weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-6)
    opt = build_optimizer(net, cfg, lr=0.01)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert [id(p) for p in decay["params"]] == [id(net.emb.weight), id(net.lin.weight)]
    assert [id(p) for p in no_decay["params"]] == [id(net.lin.bias), id(net.norm.weight)]
    assert decay["weight_decay"] == 0.05
    assert no_decay["weight_decay"] == 0.0
    for g in opt.param_groups:
        assert g["lr"] == 0.01
        assert g["betas"] == (0.8, 0.9)
        assert g["eps"] == 1e-6
        assert g["fused"]  # fused everywhere: the bad-step guard needs found_inf


def test_no_decay_params_are_not_decayed() -> None:
    net = _Net()
    opt = build_optimizer(net, OptimConfig(weight_decay=0.5), lr=0.1)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt.step()
    after = dict(net.named_parameters())
    # Zero gradient: only decoupled weight decay moves a parameter, by lr * wd * p.
    torch.testing.assert_close(after["lin.weight"], before["lin.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(after["lin.bias"], before["lin.bias"], rtol=0, atol=0)
    torch.testing.assert_close(after["norm.weight"], before["norm.weight"], rtol=0, atol=0)


def _sched(total: int = 10):
    net = nn.Linear(2, 2)
    cfg = OptimConfig(warmup_steps=2, min_lr_ratio=0.1)
    opt = build_optimizer(net, cfg, lr=0.4)
    return net, opt, build_scheduler(opt, cfg, total), cfg


def test_scheduler_drives_lr() -> None:
    _, opt, sched, cfg = _sched()
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == seen[-1]
        opt.step()
        sched.step()
    expected = [0.4 * lr_factor(s, total_steps=10, cfg=cfg) for s in range(6)]
    assert seen == pytest.approx(expected)
    assert seen[:3] == pytest.approx([0.2, 0.4, 0.4])
    assert sched.get_last_lr()[0] == pytest.approx(0.4 * lr_factor(6, total_steps=10, cfg=cfg))


def test_scheduler_resume() -> None:
    _, opt, sched, _ = _sched()
    for _ in range(4):
        opt.step()
        sched.step()
    opt_state, sched_state = opt.state_dict(), sched.state_dict()
    assert sched_state["last_epoch"] == 4
    want = []
    for _ in range(4):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()

    # A resumed run builds both afresh (the new scheduler sets lr for step 0), then loads both.
    _, opt2, sched2, _ = _sched()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    got = []
    for _ in range(4):
        got.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert got == want
    assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize(
    ("scale", "global_batch", "expected"),
    [("linear", 512, 6e-4), ("linear", 64, 7.5e-5), ("linear", 256, 3e-4),
     ("none", 512, 3e-4), ("none", 1, 3e-4)],
)
def test_effective_lr(scale: str, global_batch: int, expected: float) -> None:
    cfg = OptimConfig(lr=3e-4, scale_lr=scale, base_batch=256)
    assert cfg.effective_lr(global_batch) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.strategy=fsdp"], "optim.name = sgd with parallel.strategy = fsdp"),
    (["parallel.strategy=none", "parallel.tp=2", "model.tie_embeddings=false"],
     "optim.name = sgd with parallel.strategy = none, parallel.tp = 2"),
])
def test_sgd_on_sharded_parameters_is_refused(overrides: list[str], message: str) -> None:
    """Fused SGD has no DTensor strategy: refused before training, not a NotImplementedError
    at the first step; for a task too (FSDP2 shards its model the same way)."""
    from conftest import DEMO, TINY
    from hpctrain.config import load_config
    from hpctrain.errors import ConfigError
    from hpctrain.parallel.layout import check_layout, check_task_config

    sgd = ["optim.name=sgd", "optim.weight_decay=1e-4"]
    cfg = load_config(DEMO, [*TINY, *sgd, *overrides])
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, 2)
    if "parallel.tp=2" not in overrides:
        with pytest.raises(ConfigError, match=message):
            check_task_config(cfg, 2)
    check_layout(load_config(DEMO, [*TINY, *sgd, "parallel.strategy=ddp"]), 2)


def test_sgd_with_adamw_default_weight_decay_is_refused() -> None:
    """SGD's decay is coupled L2: AdamW's 0.1 left in place would be ~1000x an SGD recipe's."""
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="AdamW's default") as err:
        OptimConfig(name="sgd").validate()
    assert "optim.weight_decay" in err.value.hint
    OptimConfig(name="sgd", weight_decay=1e-4).validate()
    OptimConfig(name="adamw").validate()
