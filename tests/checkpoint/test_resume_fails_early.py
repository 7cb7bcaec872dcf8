"""A resume that fails before it restores (the model's build refused) stops the checks its
prefetch started: no rank hashes the whole checkpoint on its way out (minutes on Lustre).

One tiny run in this process saves a checkpoint; the second, with ``resume=auto``, fails in the
trainer's build while every checksum is held until it is told to stop.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY
from hpctrain.checkpoint import manifest
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.train import trainer
from hpctrain.train.job import run_training


def _verifying() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith("hpctrain-verify") and t.is_alive()]


def test_a_failure_before_the_restore_leaves_no_verification_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_faults) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4", "train.steps=1",
            "data.val_fraction=0", f"run.out_dir={tmp_path}", "run.name=early"]
    run_training(load_config(DEMO, args))
    assert list((tmp_path / "early" / "checkpoints").glob("step-*"))

    release, started = threading.Event(), threading.Event()
    real = manifest.checksum

    def held(path: Path, stop: threading.Event | None = None, progress=None) -> str:
        """A checksum that takes until it is stopped (or the test ends)."""
        started.set()
        while not (stop is not None and stop.is_set()) and not release.is_set():
            release.wait(0.01)
        return real(path, stop, progress)

    def refused(*_args, **_kwargs):
        assert started.wait(30), "the prefetch never started"
        raise ConfigError("this layout is refused (the test's)")

    monkeypatch.setattr(manifest, "checksum", held)
    monkeypatch.setattr(trainer, "check_layout", refused)
    try:
        with pytest.raises(ConfigError, match="the test's"):
            run_training(load_config(DEMO, [*args, "train.steps=2", "checkpoint.resume=auto"]))
        assert _verifying() == [], "the prefetch's checks outlived the failed run"
    finally:
        release.set()
