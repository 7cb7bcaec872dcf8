"""Progress display: rank 0 only, plain lines without a terminal."""

from __future__ import annotations

import io
from dataclasses import replace

from hpctrain.observe.progress import TrainProgress, format_stats
from hpctrain.runtime.env import detect_env


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_other_ranks_print_nothing() -> None:
    out = FakeTTY()
    env = replace(detect_env({}), rank=1, world_size=2)
    with TrainProgress(10, env, file=out, plain_every=1) as progress:
        for step in range(1, 11):
            progress.update(step, 3.0, 1000.0, 0.4)
    assert out.getvalue() == ""


def test_disabled_prints_nothing() -> None:
    out = io.StringIO()
    with TrainProgress(10, detect_env({}), enabled=False, file=out, plain_every=1) as progress:
        progress.update(10, 3.0, 1000.0, 0.4)
    assert out.getvalue() == ""


def test_non_tty_prints_plain_lines_every_n() -> None:
    out = io.StringIO()
    with TrainProgress(10, detect_env({}), file=out, plain_every=4) as progress:
        for step in range(1, 11):
            progress.update(step, 3.214, 12_300.0, 0.412)
    lines = out.getvalue().splitlines()
    # every 4th update, plus the final step
    assert [line.split()[2] for line in lines] == ["4/10", "8/10", "10/10"]
    assert "loss 3.21 | 12.3k tok/s | MFU 41.2%" in lines[0]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_tty_uses_rich_bar() -> None:
    out = FakeTTY()
    with TrainProgress(10, detect_env({}), file=out) as progress:
        progress.update(5, 3.0, 1000.0, None)
    assert "5/10" in out.getvalue()
    assert "MFU n/a (unknown device)" in out.getvalue()


def test_format_stats() -> None:
    assert format_stats(3.214, 12_345.0, 0.412) == "loss 3.21 | 12.3k tok/s | MFU 41.2%"
    assert format_stats(None, 2.5e6, None) == "loss n/a | 2.5M tok/s | MFU n/a (unknown device)"
