"""Every ``hpctrain`` option says what it does and its default; --version and the top-level help
are for users.

The walk covers every (sub)parser the real command builds, so an option added later without help
text, or with a default its help does not show, fails here.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

import hpctrain
from hpctrain.cli import COMMANDS, _parser, has_default


def _walk(parser: argparse.ArgumentParser, path: str = "hpctrain"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")


PARSERS = list(_walk(_parser()))


def test_the_walk_reaches_nested_commands() -> None:
    names = {path for path, _ in PARSERS}
    assert {"hpctrain train", "hpctrain sbatch", "hpctrain submit", "hpctrain doctor",
            "hpctrain bench gemm", "hpctrain plan memory", "hpctrain data prepare",
            "hpctrain export hf", "hpctrain k8s", "hpctrain tune"} <= names


@pytest.mark.parametrize("path,parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_every_option_has_help_and_shows_its_default(path: str, parser) -> None:
    formatter = parser._get_formatter()
    missing, no_default = [], []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:  # hidden on purpose (test hooks)
            continue
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            missing.append(name)
            continue
        if has_default(action):
            shown = formatter._expand_help(action)
            if "default" not in shown.lower():
                no_default.append(f"{name} (default {action.default!r}): {shown!r}")
    assert not missing, f"{path}: options without help text: {missing}"
    assert not no_default, f"{path}: help does not show the default: {no_default}"


@pytest.mark.parametrize("path,parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_descriptions_are_whole_user_sentences(path: str, parser) -> None:
    text = parser.description or ""
    if not text:
        return
    # Docstrings cut at their first line ended mid-sentence ("... one line per").
    assert text.rstrip()[-1] in ".)!?:", f"{path}: description ends mid-sentence: {text!r}"
    # reStructuredText markup and notes for developers are not help.
    assert "``" not in text, f"{path}: developer markup in the description: {text!r}"


# One new interpreter runs ``python -m hpctrain ARGV`` for each ARGV in turn, as ``python -m``
# does (runpy), and reports what each printed and the modules imported by then.
_PROBE = """
import contextlib, io, json, runpy, sys
report = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["hpctrain", *argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
    report.append({"stdout": out.getvalue(), "modules": sorted(sys.modules)})
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``--version``, ``--help`` and ``runs`` of an empty folder, in that order, in one new
    interpreter: each one's stdout and every module imported up to its end."""
    commands = {"version": ["--version"], "help": ["--help"],
                "runs": ["runs", str(tmp_path_factory.mktemp("no-runs"))]}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(commands.values()))],
                          capture_output=True, text=True, check=True, timeout=120)
    return dict(zip(commands, json.loads(done.stdout.splitlines()[-1]), strict=True))


def test_version_prints_the_package_version_without_importing_torch(fresh) -> None:
    assert fresh["version"]["stdout"].strip() == f"hpctrain {hpctrain.__version__}"
    assert "hpctrain.cli" in fresh["version"]["modules"]
    assert "torch" not in fresh["version"]["modules"]


def test_top_level_help_imports_no_command_module(fresh) -> None:
    """`hpctrain --help` answers in a fraction of a second: no torch, no command's module."""
    assert re.search(r"sbatch\s+write a Slurm batch script", fresh["help"]["stdout"])
    modules = set(fresh["help"]["modules"])
    assert "torch" not in modules
    assert not {"hpctrain.launch.sbatch", "hpctrain.observe.cli", "hpctrain.data.cli"} & modules


def test_runs_reads_records_without_importing_torch(fresh) -> None:
    modules = fresh["runs"]["modules"]
    assert "hpctrain.observe.runs" in modules and "torch" not in modules


def test_each_command_is_listed_with_its_own_help_line() -> None:
    """The listing `hpctrain --help` prints without importing the commands (cli.COMMANDS) is
    what each command's module registers, in the same order."""
    (commands,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    registered = {choice.dest: choice.help for choice in commands._choices_actions}
    assert list(registered) == list(COMMANDS)
    assert registered == COMMANDS


def test_top_level_help_is_for_users() -> None:
    text = _parser().format_help()
    assert "no logic lives here" not in text and "delegate" not in text
    assert "--version" in text
    assert re.search(r"train\s+train a model", text)
    assert "hpctrain train configs/demo.yaml" in text  # a first command to type
