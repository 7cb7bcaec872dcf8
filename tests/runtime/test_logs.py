"""Per-rank logging: file per rank, console only on request, no duplicate handlers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpctrain.runtime.env import detect_env
from hpctrain.runtime.logs import log_device_binding, setup_rank_logging
from hpctrain.runtime.rundir import RunDir


def ours(logger: logging.Logger) -> list[logging.Handler]:
    return [
        h
        for h in logger.handlers
        if isinstance(h, logging.FileHandler | logging.StreamHandler)
        and type(h).__module__ in ("logging", "hpctrain.runtime.logs")
    ]


@pytest.fixture(autouse=True)
def _clean_logger() -> Iterator[None]:
    yield
    logger = logging.getLogger("hpctrain")
    for handler in ours(logger):
        logger.removeHandler(handler)
        handler.close()


def test_rank_file_and_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = RunDir(tmp_path)
    env = replace(detect_env({}), rank=3, world_size=8, hostname="gpu07")
    logger = setup_rank_logging(run, env, console=False)
    logger.getChild("train").info("hello")
    text = run.rank_log(3).read_text()
    assert "[rank 3/8 gpu07] INFO hpctrain.train: hello" in text
    assert capsys.readouterr().err == ""


def test_idempotent_and_console(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = RunDir(tmp_path)
    env = detect_env({})
    setup_rank_logging(run, env, console=True)
    logger = setup_rank_logging(run, env, console=True)
    assert len(ours(logger)) == 2
    log_device_binding(logger, env, torch.device("cpu"))
    err = capsys.readouterr().err
    assert err.count("device binding") == 1
    assert "CUDA_VISIBLE_DEVICES=" in err
    assert run.rank_log(0).read_text().count("device binding") == 1
