"""benchmarks/peers/lease_*.sh: every command they run parses, before a lease is spent on it.

A typo in a layout name or a flag costs a GPU lease a step, found only when its log comes back;
here each ``step`` line goes through the real parsers (compare.py's and the ``hpctrain`` CLI's)
and every layout's config loads with its overrides.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpctrain.cli import parse_args
from hpctrain.config import load_config

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"
# script: (steps, of which compare.py runs)
SCRIPTS = {"lease_4gpu.sh": (9, 9), "lease_2gpu.sh": (8, 7)}
COMPARE = "python3 benchmarks/peers/compare.py"


def _steps(script: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of each ``step NAME COMMAND...`` line, continuations joined, $C and $R
    expanded, a trailing ``&`` (a step run beside the next) dropped."""
    text = (PEERS / script).read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        words = shlex.split(line.replace("$C", COMPARE).replace("$R", "/tmp/lease"),
                            comments=True)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # an environment assignment before the step (CUDA_VISIBLE_...)
        if words and words[-1] == "&":
            words = words[:-1]
        if words and words[0] == "step":
            steps.append((words[1], words[2:]))
    return steps


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_step_parses_and_its_layouts_load(compare, script: str) -> None:
    steps = _steps(script)
    names = [name for name, _ in steps]
    n_steps, n_compared = SCRIPTS[script]
    assert len(steps) == n_steps and len(set(names)) == len(names), names
    compared = 0
    for name, argv in steps:
        if argv[:2] == COMPARE.split():
            args = compare.parser().parse_args(argv[2:])
            assert args.layouts or args.tuned, name
            for layout in args.layouts:
                chosen = compare.chosen_layout(layout, args)
                load_config(REPO / chosen.config, chosen.overrides)
            compared += 1
        else:
            assert argv[:3] == ["python3", "-m", "hpctrain"], (name, argv)
            args = parse_args(argv[3:])
            load_config(REPO / args.config, args.overrides)
    assert compared == n_compared


def test_the_tuned_comparison_reads_the_tuning_it_follows() -> None:
    steps = dict(_steps("lease_2gpu.sh"))
    tune_out = steps["tune-8b"][steps["tune-8b"].index("--out") + 1]
    tuned = steps["8b-tuned"]
    assert tuned[tuned.index("--tuned") + 1] == tune_out
