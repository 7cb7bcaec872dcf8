"""A directory built through `staged_dir` appears whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.runtime.rundir import staged_dir


def test_the_folder_appears_only_once_filled(tmp_path: Path) -> None:
    out = tmp_path / "a" / "model"
    with staged_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not out.exists() and tmp.parent == out.parent
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with pytest.raises(OSError, match="disk full"), staged_dir(out) as tmp:
        (tmp / "part").write_text("half")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
