"""Log injection: text from files and command lines never forges a line or moves a terminal.

Each case plants a value holding a newline followed by a line in our log format, an ANSI
escape, a carriage return, a Unicode line separator and a bidi override, where a user or a
file's author can put one: a pickle global in a checkpoint, a data manifest value, an input
file name, a config key and value, a command-line word. The log file and stderr must hold one
line per record and no raw control character; the value is shown escaped.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pickle
import re
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY, run_cli
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shards import MANIFEST
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import ConfigError
from hpctrain.runtime.logs import EscapingFormatter
from hpctrain.shown import shown

# No "/" in it: it also goes into a file name.
FORGED = "2026-01-01 00:00:00,000 [rank 0 of 1 h] INFO hpctrain.train: FORGED"
# What an attacker appends to a value: a forged log line, then terminal and text-direction tricks.
EVIL = f"\n{FORGED}\r\x1b[2J\x1b]0;title\x07\u2028\u2029\u202e\u2066\x85"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[")


def _assert_clean(text: str) -> None:
    """No raw control character, and the forged text never starts a line of its own."""
    assert not RAW.search(text), repr(RAW.search(text)[0])
    for line in text.splitlines():
        assert not line.startswith(FORGED), line
    assert "\\n2026-01-01" in text, text[-2000:]  # shown, escaped


def _hostile():
    """tests/checkpoint/hostile.py, imported by path (the test folders are not packages)."""
    spec = importlib.util.spec_from_file_location(
        "_ckpt_test_hostile", Path(__file__).resolve().parents[1] / "checkpoint" / "hostile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shown_escapes_and_bounds() -> None:
    assert shown("a\nb\rc\td\x1b[31m\x7f\x85") == "a\\nb\\rc\\td\\x1b[31m\\x7f\\x85"
    assert shown("\u2028\u2029\u202a\u202e\u2066\u2069\u200f\ufeff") == \
        "\\u2028\\u2029\\u202a\\u202e\\u2066\\u2069\\u200f\\ufeff"
    assert shown("naïve 日本 ok") == "naïve 日本 ok"  # printable text is left alone
    long = "x" * 1000 + "\n"
    assert shown(long) == "x" * 200 + "... (1001 characters)"
    assert shown(long, None).endswith("x\\n")
    assert shown(Path("/a\nb")) == "/a\\nb"


def test_error_parts_are_escaped_and_log_records_are_one_line() -> None:
    e = ConfigError(f"bad value {EVIL!r} and {EVIL}", expected=EVIL, hint=EVIL,
                    lines=["tail line one", EVIL])
    rendered = e.render()
    assert len(rendered.splitlines()) == 5  # what, two tail lines, expected, hint
    _assert_clean(rendered)

    record = logging.LogRecord("hpctrain.x", logging.WARNING, __file__, 1,
                               "skipping %s (%d files): " + EVIL, (EVIL, 3), None)
    line = EscapingFormatter("%(asctime)s [x] %(message)s").format(record)
    assert "\n" not in line and "(3 files)" in line
    _assert_clean(line)
    record = logging.LogRecord("hpctrain.x", logging.INFO, __file__, 1, "%(v)s",
                               ({"v": "y" * 5000},), None)
    assert len(EscapingFormatter("%(message)s").format(record)) < 1100  # an argument is cut


def test_refused_pickle_global_in_a_resumed_run(tmp_path: Path) -> None:
    """A checkpoint index whose refused global's name forges a log line: the resume falls back
    and says so on one line, in the log file and on stderr."""
    hostile = _hostile()
    base = ["train", DEMO, *TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4",
            "data.source=stdlib", "checkpoint.every=2", f"run.out_dir={tmp_path}",
            "run.name=r"]
    first = run_cli([*base, "train.steps=4"])
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "r" / "checkpoints" / "step-00000004"
    name = "system" + EVIL
    raw = name.encode()
    assert len(raw) < 256
    payload = (pickle.PROTO + b"\x04" + pickle.SHORT_BINUNICODE + b"\x02os"
               + pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw + pickle.STACK_GLOBAL
               + pickle.STOP)
    hostile.write_resealed(ckpt, ".metadata", payload)

    resumed = run_cli([*base, "train.steps=6"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (tmp_path / "r" / "logs" / "rank-000.log").read_text()
    assert "skipping checkpoint step-00000004" in log
    for text in (log, resumed.stderr):
        _assert_clean(text)
    assert all(RECORD.match(line) for line in log.splitlines()), log


def test_manifest_value_in_data_verify(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "data"
    prepare([tmp_path / "a.txt"], out, PrepareSettings(TokenizerSpec(), shard_tokens=100))
    raw = json.loads((out / MANIFEST).read_text())
    raw["shards"][0]["bin_checksum"] = "0" * 16 + EVIL
    (out / MANIFEST).write_text(json.dumps(raw))
    done = run_cli(["data", "verify", str(out)])
    assert done.returncode != 0 and "hpctrain: error:" in done.stderr, done.stderr[-3000:]
    _assert_clean(done.stderr)


def test_input_file_name_in_data_prepare(tmp_path: Path) -> None:
    bad = tmp_path / f"in{EVIL}.jsonl"
    bad.write_text("{not json\n")
    done = run_cli(["data", "prepare", str(bad), "--out", str(tmp_path / "out")])
    assert done.returncode == 2 and "hpctrain: error:" in done.stderr, done.stderr[-3000:]
    _assert_clean(done.stderr)


@pytest.mark.parametrize("where", ["override key", "override value", "file key", "file value"])
def test_config_keys_and_values(tmp_path: Path, where: str) -> None:
    config = tmp_path / "c.yaml"
    overrides = []
    if where == "override key":
        overrides = [f"train.steps{EVIL}=3"]
    elif where == "override value":
        overrides = [f"train.steps=3{EVIL}"]
    elif where == "file key":
        config.write_text(json.dumps({"train": {f"steps{EVIL}": 3}}))
    else:
        config.write_text(json.dumps({"train": {"precision": f"fp32{EVIL}"}}))
    if not config.exists():
        config.write_text("{}")
    done = run_cli(["config", str(config), *overrides])
    assert done.returncode == 2 and "hpctrain: error:" in done.stderr, done.stderr[-3000:]
    _assert_clean(done.stderr)


@pytest.mark.parametrize("words", [[f"memory{EVIL}"], ["memory", f"--bogus{EVIL}"]])
def test_command_line_word_in_a_usage_error(words: list[str]) -> None:
    # argparse quotes an invalid choice with repr, but echoes unrecognized arguments verbatim.
    done = run_cli(["plan", *words])
    assert done.returncode == 2, done.stderr[-3000:]
    _assert_clean(done.stderr)
