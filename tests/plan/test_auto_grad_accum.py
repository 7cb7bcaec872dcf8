"""``train.grad_accum`` beside ``train.global_batch_tokens`` (hpctrain.plan.auto): left unset it
is derived; given, it must be the one the batch implies (a fixed micro-batch) or it fixes the
micro-batch (``micro_batch: auto``), and every command that resolves auto (train, plan, tune,
sbatch/submit) says so alike, never silently overriding what the user wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import DEMO, TINY
from hpctrain.cli import main
from hpctrain.config import dump_yaml, load_config
from hpctrain.errors import ConfigError
from hpctrain.plan.auto import CPU, resolve_auto

REPO = Path(__file__).resolve().parents[2]
# 8 samples of 32 tokens per step: 2 micro-batches of 4 on one rank.
BATCH = [*TINY, "train.global_batch_tokens=256", "train.micro_batch=4"]


def _resolved(*overrides: str):
    cfg = load_config(DEMO, [*BATCH, *overrides])
    return cfg, resolve_auto(cfg, 1, CPU, must_fit=False)


def test_unset_is_derived_and_recorded_unset() -> None:
    cfg, res = _resolved()
    assert cfg.train.grad_accum == 2 and res.values["train.grad_accum"] == 2
    # The run's config.yaml leaves it unset, so that a resume on more ranks derives it again.
    assert "grad_accum: null" in dump_yaml(res.as_given(cfg))
    assert load_config(DEMO, TINY).train.grad_accum == 1  # no batch in tokens: 1, as before


def test_one_that_agrees_is_kept() -> None:
    cfg, _ = _resolved("train.grad_accum=2")
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (4, 2)


def test_with_micro_batch_auto_it_fixes_the_micro_batch() -> None:
    """grad_accum=1 (also the old default's value) is honoured: one micro-batch of the whole
    replica's batch of 128, not the 2 x 64 auto splits it into on the CPU (2048 tokens at
    most per micro-batch there)."""
    cfg, res = _resolved("train.global_batch_tokens=4096", "train.micro_batch=auto")
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (64, 2)
    cfg, res = _resolved("train.global_batch_tokens=4096", "train.micro_batch=auto",
                         "train.grad_accum=1")
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (128, 1)
    assert res.given["train.grad_accum"] == 1


@pytest.mark.parametrize("command", [
    ["train"], ["plan", "memory"], ["tune", "--dry-run", "--gpus", "1"], ["sbatch"]])
def test_one_that_disagrees_is_refused_alike_by_every_command(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """grad_accum=1 with a batch that needs 2: refused naming both values, with a hint, by
    train, plan, tune and sbatch (submit shares sbatch's checks), in the same words."""
    monkeypatch.chdir(tmp_path)  # sbatch creates its log folder here
    with pytest.raises(SystemExit) as exc:
        main([*command[:2], str(REPO / DEMO), *BATCH, "train.grad_accum=1",
              f"run.out_dir={tmp_path / 'runs'}", *command[2:]])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "train.grad_accum = 1 with train.global_batch_tokens = 256" in err, err
    assert "expected: grad_accum 2" in err and "HINT" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_the_error_is_a_config_error_before_any_choice() -> None:
    with pytest.raises(ConfigError) as e:
        _resolved("train.grad_accum=4")
    assert "train.grad_accum = 4" in e.value.what and "drop train.grad_accum" in e.value.hint
