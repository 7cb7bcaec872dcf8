"""Pieces of the live observer that need no process group: forward timing, profile config."""

from __future__ import annotations

import pytest
import torch

from hpctrain import faults
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.observe.live import ForwardTimer


def test_forward_timer_counts_training_forwards_only(monkeypatch) -> None:
    monkeypatch.setenv("HPCTRAIN_FAULTS", "slow@step=1,rank=0,seconds=0.05")
    faults._specs.cache_clear()
    try:
        model = torch.nn.Linear(4, 4)
        timer = ForwardTimer(model, torch.device("cpu"), rank=0)
        timer.step = 1
        with torch.no_grad():  # validation: train mode, no grad
            model(torch.ones(2, 4))
        assert timer.take() == 0.0
        model(torch.ones(2, 4)).sum().backward()
        assert timer.take() >= 0.05  # the injected sleep is inside the timed forward
        assert timer.take() == 0.0  # taken once
        timer.step = 2  # the fault is for step 1 only
        model.eval()
        model(torch.ones(2, 4))
        assert timer.take() == 0.0
    finally:
        faults._specs.cache_clear()


def test_forward_timer_hooks_stay_out_of_a_compiled_module() -> None:
    """``module.compile()`` (the task trainer's) compiles the module's hooks with it: traced,
    the timer guarded on its own clock readings and list length, recompiled at every step, and
    on CUDA its events were never recorded (an H200 run failed "Both events must be recorded")."""
    import torch._dynamo

    model = torch.nn.Linear(4, 4)
    timer = ForwardTimer(model, torch.device("cpu"), rank=0)
    model.compile(backend="eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
    assert timer.take() > 0.0
    torch._dynamo.reset()


@pytest.mark.parametrize("override, message", [
    ("profile.steps=[5]", "is not [first, last]"),
    ("profile.steps=[6,5]", "is not [first, last]"),
    ("profile.steps=[0,2]", "is not [first, last]"),
    ("profile.signal=SIGNOPE", "not a catchable signal"),
    ("profile.signal=SIGKILL", "not a catchable signal"),
    ("profile.signal_steps=0", "must be >= 1"),
    ("metrics.straggler_threshold=0", "must be positive"),
    ("metrics.straggler_windows=-1", "must be >= 0"),
    ("watchdog.flight_recorder=-5", "must be >= 0"),
])
def test_bad_observe_config_is_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_good_observe_config_loads() -> None:
    cfg = load_config(None, ["profile.steps=[20,22]", "profile.signal=", "track.mlflow=true",
                             "track.mlflow_uri=http://mlflow:5000"])
    assert cfg.profile.steps == [20, 22] and cfg.profile.signal == ""
