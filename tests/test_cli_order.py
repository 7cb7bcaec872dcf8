"""Options and KEY=VALUE overrides (or input lists) in any order, in every subcommand.

argparse stops a positional list at the first option, so ``hpctrain train CONFIG --nproc 2
key=value`` used to fail with "unrecognized arguments".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from conftest import DEMO, run_cli
from hpctrain.cli import _parser, parse_args

# Each subcommand that takes a positional list, parsed with options before, between and after.
CASES = {
    ("train",): (
        ["train", "c.yaml", "--nproc", "2", "a=1", "--max-restarts", "3", "b=2", "--fresh"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "nproc": 2, "max_restarts": 3,
         "fresh": True}),
    ("sbatch",): (
        ["sbatch", "--nodes", "2", "c.yaml", "a=1", "--time", "02:00:00", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "nodes": 2, "time": "02:00:00"}),
    ("submit",): (
        ["submit", "c.yaml", "--array", "0-3", "a=1", "--dry-run", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "array": "0-3", "dry_run": True}),
    ("pipeline",): (
        ["pipeline", "--dry-run", "status", "p.yaml"],
        {"words": ["status", "p.yaml"], "dry_run": True}),
    ("doctor",): (
        ["doctor", "c.yaml", "--expect-busbw", "10", "a=1", "--no-gpu-health", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "expect_busbw": 10.0}),
    ("k8s",): (
        ["k8s", "c.yaml", "--image", "i", "a=1", "--runs-pvc", "r", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "image": "i", "runs_pvc": "r"}),
    ("tune",): (
        ["tune", "c.yaml", "--gpus", "2", "a=1", "--dry-run", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"], "gpus": 2, "dry_run": True}),
    ("config",): (
        ["config", "c.yaml", "a=1", "b=2"],
        {"config": Path("c.yaml"), "overrides": ["a=1", "b=2"]}),
    ("data", "prepare"): (
        ["data", "prepare", "x.txt", "--out", "o", "y.txt", "--shard-mb", "8", "z/"],
        {"inputs": ["x.txt", "y.txt", "z/"], "out": Path("o"), "shard_mb": 8.0}),
    ("data", "train-tokenizer"): (
        ["data", "train-tokenizer", "--vocab", "300", "x.txt", "--out", "t.json", "y.txt"],
        {"inputs": ["x.txt", "y.txt"], "vocab": 300, "out": Path("t.json")}),
    ("plan", "memory"): (
        ["plan", "memory", "c.yaml", "--gpus", "4", "a=1", "--gpu", "h100", "b=2"],
        {"job": ["c.yaml", "a=1", "b=2"], "gpus": 4, "gpu": "h100"}),
    ("plan", "parallel"): (
        ["plan", "parallel", "--gpus-per-node", "8", "c.yaml", "a=1", "--nodes", "2", "b=2"],
        {"job": ["c.yaml", "a=1", "b=2"], "gpus_per_node": 8, "nodes": 2}),
    ("plan", "interval"): (
        ["plan", "interval", "c.yaml", "--gpus", "4", "a=1", "--save-min", "2", "b=2"],
        {"job": ["c.yaml", "a=1", "b=2"], "gpus": 4, "save_min": 2.0}),
    ("plan", "goodput"): (
        ["plan", "goodput", "c.yaml", "--gpus", "4", "a=1", "--save-s", "20", "b=2"],
        {"job": ["c.yaml", "a=1", "b=2"], "gpus": 4, "save_s": 20.0}),
    ("report",): (
        ["report", "runs/a", "-o", "r.html", "runs/b"],
        {"runs": [Path("runs/a"), Path("runs/b")], "output": Path("r.html")}),
}


@pytest.mark.parametrize("argv,expected", CASES.values(), ids=[" ".join(k) for k in CASES])
def test_options_and_positionals_in_any_order(argv: list[str], expected: dict) -> None:
    args = parse_args(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value, (key, vars(args))


def test_options_first_or_last_still_work() -> None:
    assert parse_args(["train", "--nproc", "2", "c.yaml", "a=1"]).overrides == ["a=1"]
    assert parse_args(["train", "c.yaml", "a=1", "b=2", "--nproc", "2"]).overrides == \
        ["a=1", "b=2"]
    assert parse_args(["data", "merge", "--keep-parts", "o"]).out == Path("o")


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every subcommand that has no subcommands of its own."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def test_every_subcommand_with_a_positional_list_is_covered_here() -> None:
    """A new subcommand with a positional list must be added to CASES above."""
    with_lists = {path for path, leaf in _leaves(_parser())
                  if any(not a.option_strings and a.nargs in ("*", "+") for a in leaf._actions)}
    assert with_lists == set(CASES)


def test_the_real_command_accepts_an_override_after_an_option(tmp_path: Path) -> None:
    """Through the installed entry point: the override after --resume reaches the config
    (its unknown key is what fails), rather than being an unrecognized argument."""
    done = run_cli(["train", DEMO, "--resume", "never", f"run.out_dir={tmp_path}",
                    "train.stepz=3"], timeout=120)
    assert done.returncode == 2, done.stderr
    assert "unknown config key 'train.stepz'" in done.stderr, done.stderr
    assert "unrecognized arguments" not in done.stderr
