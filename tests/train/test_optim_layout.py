"""Checkpoints of hpctrain 0.1.0 (optimizer settings per param group) still resume.

0.1.0 saved the optimizer state dict as PyTorch returns it by default (``param_groups`` as one
list); later versions save it by parameter name (``flatten_optimizer_state_dict``), which a
pipeline stage needs. A run that was checkpointed before the upgrade must continue, not be
reported as damaged.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.manager import step_dir_name
from hpctrain.checkpoint.manifest import read_manifest
from hpctrain.config import JobConfig
from hpctrain.train import checkpointing
from hpctrain.train.checkpointing import TrainState


def _helpers():
    path = Path(__file__).resolve().parents[1] / "checkpoint" / "helpers.py"
    spec = importlib.util.spec_from_file_location("_ckpt_helpers_optim_layout", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


helpers = _helpers()


class _Position:
    def __init__(self, step: int = 0):
        self.state = {"step": step, "global_batch": 8, "seed": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def _state(seed: int, steps: int) -> TrainState:
    model = helpers.make_model(seed)
    opt = helpers.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for i in range(steps):
        helpers.train_steps(model, opt, 1, seed=i)
        sched.step()
    return TrainState(model, opt, sched, _Position(steps), None)


def _save(tmp_path: Path, s: TrainState, step: int, layout: str | None) -> Path:
    ckpt = helpers.manager(tmp_path / "ckpt")
    meta = checkpointing.meta_state(s, JobConfig(), step=step, world_size=1)
    if layout is None:  # what 0.1.0 wrote: no marker, settings per param group
        meta.pop("optim_layout", None)
    ckpt.save(step, checkpointing.tensor_state(s, layout=layout), meta, blocking=True)
    return tmp_path / "ckpt" / step_dir_name(step)


@pytest.mark.parametrize("layout", [None, checkpointing.OPTIM_LAYOUT])
def test_both_optimizer_layouts_resume_exactly(pg, tmp_path: Path, layout: str | None) -> None:
    saved = _state(seed=0, steps=3)
    path = _save(tmp_path, saved, 3, layout)
    manifest = read_manifest(path)
    assert manifest.get("optim_layout") == layout
    fresh = _state(seed=5, steps=0)
    step = checkpointing.restore(fresh, helpers.manager(tmp_path / "ckpt"), path, manifest,
                                 JobConfig(), data=True)
    assert step == 3
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = saved.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert [g["weight_decay"] for g in got["param_groups"]] == [0.1, 0.0]
    for key, values in want["state"].items():
        for name, value in values.items():
            assert torch.equal(value, got["state"][key][name]), (key, name)
    assert fresh.loader.state_dict()["step"] == 3


def test_new_checkpoints_say_which_layout_they_hold(pg, tmp_path: Path) -> None:
    path = _save(tmp_path, _state(seed=0, steps=1), 1, checkpointing.OPTIM_LAYOUT)
    assert read_manifest(path)["optim_layout"] == "by_param"


def test_an_unknown_layout_is_damage(pg, tmp_path: Path) -> None:
    from hpctrain.checkpoint.manifest import DamagedCheckpoint

    s = _state(seed=0, steps=1)
    path = _save(tmp_path, s, 1, checkpointing.OPTIM_LAYOUT)
    manifest = {**read_manifest(path), "optim_layout": "by_magic"}
    with pytest.raises(DamagedCheckpoint, match="optim_layout"):
        checkpointing.restore(_state(seed=5, steps=0), helpers.manager(tmp_path / "ckpt"), path,
                              manifest, JobConfig(), data=True)
