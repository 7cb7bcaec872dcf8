"""`hpctrain bench disk`: a small measurement on tmp_path, its files removed, bad paths refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpctrain.bench.disk import run_disk
from hpctrain.cli import main


def test_bench_disk_writes_json_and_leaves_no_files(tmp_path: Path, capsys) -> None:
    target = tmp_path / "fs"
    target.mkdir()
    main(["bench", "disk", str(target), "--size", "4M", "--threads", "2", "--block", "1M",
          "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "disk.json").read_text())
    write, read = data["rows"]
    assert (write["op"], read["op"]) == ("write", "read")
    for row in (write, read):
        assert row["size"] == 4 << 20 and row["threads"] == 2 and row["block"] == 1 << 20
        assert row["gbps"] == pytest.approx(row["size"] / row["seconds"] / 1e9)
    assert "fsync" in write["method"]
    assert data["meta"]["path"] == str(target)
    assert list(target.iterdir()) == []  # cleaned up
    assert "disk: " in capsys.readouterr().out


def test_bench_disk_cleans_up_when_a_write_fails(tmp_path: Path, monkeypatch) -> None:
    from hpctrain.bench import disk
    from hpctrain.errors import ConfigError

    def full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_write_file", full)
    with pytest.raises(ConfigError, match="No space left"):
        run_disk(tmp_path, 1 << 20, threads=2, block=1 << 20)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_bench_disk_refuses_a_read_only_folder(tmp_path: Path, capsys) -> None:
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "disk", str(locked), "--size", "1M"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is not writable" in err and "Traceback" not in err


@pytest.mark.parametrize(("name", "message"), [("missing", "does not exist"),
                                               ("file", "is not a directory")])
def test_bench_disk_refuses_what_is_not_a_folder(tmp_path: Path, capsys, name: str,
                                                 message: str) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "disk", str(tmp_path / name), "--size", "1M"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_checkpoint_reports_save_and_restore_beside_the_disk(tmp_path: Path) -> None:
    """Inline writer (no process to start): the restore is checked bit-exact inside."""
    from hpctrain.bench.checkpoint import run_checkpoint_bench

    res = run_checkpoint_bench(tmp_path, 20_000, saves=1, writer="inline")
    rows = {r["op"]: r for r in res.rows}
    assert list(rows) == ["disk write", "disk read", "save", "write", "restore", "read files",
                          "restore warm"]
    for op in ("save", "restore", "read files", "restore warm"):
        assert rows[op]["size"] > 20_000 * 10 and rows[op]["gbps"] > 0
    for op in ("save", "restore", "restore warm"):
        assert rows[op]["cpu_s"] >= 0
    for op in ("save", "restore", "read files"):  # against the disk's numbers
        assert rows[op]["pct_of_disk"] > 0
    # The writer's own part (write to commit) is inside the save (staging first, then it).
    assert 0 < rows["write"]["seconds"] <= rows["save"]["seconds"]
    assert rows["write"]["pct_of_disk"] >= rows["save"]["pct_of_disk"]
    assert list(tmp_path.iterdir()) == []  # checkpoints and disk files removed


def test_bench_checkpoint_undoes_its_setup_when_it_fails(tmp_path: Path, monkeypatch) -> None:
    """A manager that cannot be made leaves no process group behind; a restore that differs
    from the save is a CheckpointError with a hint, not a bare AssertionError."""
    import torch.distributed as dist

    from hpctrain.bench.checkpoint import run_checkpoint_bench
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.checkpoint.manifest import CheckpointError

    def broken(*_a, **_k):
        raise OSError("no space left on device")

    with monkeypatch.context() as m:
        m.setattr(CheckpointManager, "__init__", broken)
        with pytest.raises(OSError):
            run_checkpoint_bench(tmp_path, 2_000, saves=1, writer="inline", disk=False)
    assert not dist.is_initialized() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(CheckpointManager, "restore", lambda *_a, **_k: None)  # loads nothing
    with pytest.raises(CheckpointError) as e:
        run_checkpoint_bench(tmp_path, 2_000, saves=1, writer="inline", disk=False)
    assert "restored with other values" in e.value.what and e.value.hint
    assert not dist.is_initialized() and list(tmp_path.iterdir()) == []
