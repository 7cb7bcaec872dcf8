"""Checkpoints written by several threads per rank (``checkpoint.write_threads``): one file per
thread, every one in the manifest, and a load as exact as from one file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    make_model,
    make_optimizer,
    manager,
    put_state,
    state_of,
    train_steps,
)

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manifest import describe, read_manifest
from hpctrain.checkpoint.store import write_threads
from hpctrain.errors import ConfigError


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_three_threads_write_three_files_and_load_exactly(pg, no_faults, tmp_path: Path,
                                                          blocking: bool) -> None:
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    m = manager(tmp_path, write_threads=3)
    m.save(2, state_of(model, opt), {"step": 2, "world_size": 1}, blocking=blocking)
    m.wait()
    ckpt = tmp_path / "step-00000002"
    files = read_manifest(ckpt)["files"]
    shards = sorted(n for n in files if n.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    for name in shards:
        assert describe(ckpt / name) == files[name]

    fresh = make_model(5)
    fresh_opt = make_optimizer(fresh)
    train_steps(fresh, fresh_opt, 1, seed=4)
    state = state_of(fresh, fresh_opt)
    m.load(ckpt, state)
    put_state(fresh, fresh_opt, state)
    train_steps(model, opt, 1, seed=9)
    train_steps(fresh, fresh_opt, 1, seed=9)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_auto_takes_half_the_cores_of_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert write_threads(5) == 5
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert write_threads(0) == 8          # 16 cores per rank: capped at 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert write_threads(0) == 2          # 4 cores per rank
    # A launcher bound the rank to 6 cores: those are its own, not shared.
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(6)))
    assert write_threads(0) == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert write_threads(0) == 1


def test_negative_threads_are_refused() -> None:
    with pytest.raises(ConfigError, match="write_threads"):
        CheckpointConfig(write_threads=-1).validate()
