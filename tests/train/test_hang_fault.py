"""The ``hang`` fault (HPCTRAIN_FAULTS) holds a run before a step for its ``seconds``, unless a
preemption signal arrives or the file its ``until`` names appears: a test that has done what it
held the run for releases it at once instead of sitting out a margin sized for a loaded box.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from hpctrain.train.trainer import Trainer


def _held(requested: str | None = None) -> SimpleNamespace:
    """What ``Trainer._hang`` reads of its trainer: the preemption request, if any."""
    return SimpleNamespace(checkpoints=SimpleNamespace(preempt=SimpleNamespace(
        requested=requested)))


def test_until_releases_the_run_when_its_file_appears(tmp_path: Path) -> None:
    release = tmp_path / "released"
    threading.Timer(0.2, release.touch).start()  # the test has acted
    start = time.monotonic()
    Trainer._hang(_held(), 60.0, str(release))
    assert 0.15 < time.monotonic() - start < 10


def test_without_its_file_the_hang_lasts_its_seconds(tmp_path: Path) -> None:
    start = time.monotonic()
    Trainer._hang(_held(), 0.3, str(tmp_path / "never"))
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    Trainer._hang(_held("SIGUSR2"), 60.0)  # a preemption signal ends it at once
    assert time.monotonic() - start < 1
