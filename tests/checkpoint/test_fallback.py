"""Resume never crashes on, nor silently ignores, what a checkpoint folder holds; saves tell the
truth about their commit and about a full disk.

In this process, on a 1-rank gloo group: stray entries, manifests with bad or inconsistent
values, checkpoints that verify but do not load, setting damaged ones aside (never deleting,
never overwriting), retention leaving them alone, ``last_committed`` only after a commit, and
"no space left" for real on a small tmpfs (mounting one needs root; the same message is
checked through fault injection by the end-to-end tests).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_optimizer, manager, state_of, train_steps

from hpctrain import faults
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import CheckpointError, DamagedCheckpoint, step_dir_name


def _saved(root: Path, steps: tuple[int, ...], **cfg) -> tuple[CheckpointManager, dict]:
    model = make_model(0)
    opt = make_optimizer(model)
    m = manager(root, **{"keep_last": 5, **cfg})
    for step in steps:
        train_steps(model, opt, 1, seed=step)
        m.save(step, state_of(model, opt), {"step": step, "world_size": 1}, blocking=True)
    return m, state_of(model, opt)


def _loader(m: CheckpointManager):
    model = make_model(9)
    state = state_of(model, make_optimizer(model))
    return lambda path, _manifest: m.load(path, state)


def _edit_manifest(ckpt: Path, **values) -> None:
    path = ckpt / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hpctrain")]


# -- what is in the folder ------------------------------------------------------------------

def test_stray_entries_are_ignored_with_a_warning_and_kept(pg, no_faults, tmp_path: Path,
                                                           caplog) -> None:
    m, state = _saved(tmp_path, (1, 2), keep_last=1)
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-00000010.bak").mkdir()
    (tmp_path / "step-00000012").write_text("a file, not a checkpoint")
    (tmp_path / "step-7").mkdir()  # not how hpctrain names step 7
    (tmp_path / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        assert [p.name for p in m.committed()] == ["step-00000002"]
        m.committed()  # a second look does not warn again
        found = m.restore_newest(_loader(m))
    assert found is not None and found[0].name == "step-00000002"
    warned = [w for w in _warnings(caplog) if w.startswith("ignoring")]
    for name in ("step-abc", "step-00000010.bak", "step-00000012", "step-7", "notes.txt"):
        assert sum(name + ":" in w or name + " " in w for w in warned) == 1, (name, warned)
    # Retention (keep_last=1) prunes only what the run wrote itself.
    m.save(3, state, {"step": 3, "world_size": 1}, blocking=True)
    m.save(4, state, {"step": 4, "world_size": 1}, blocking=True)
    assert [p.name for p in m.committed()] == ["step-00000004"]
    for name in ("step-abc", "step-00000010.bak", "step-00000012", "step-7", "notes.txt"):
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("values,why", [
    ({"step": "abc"}, "step = 'abc'"),
    ({"step": 1}, "says step 1, its folder step-00000002 says 2"),
    ({"step": True}, "step = True"),
    ({"files": {"__0_0.distcp": {"size": "big", "xxh3": "0"}}},
     "files['__0_0.distcp'].size = 'big'"),
])
def test_manifest_with_bad_values_is_damage(pg, no_faults, tmp_path: Path, caplog,
                                            values: dict, why: str) -> None:
    m, _ = _saved(tmp_path, (1, 2))
    _edit_manifest(tmp_path / "step-00000002", **values)
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        found = m.restore_newest(_loader(m))
    assert found is not None and found[0].name == "step-00000001"
    skipped = [w for w in _warnings(caplog) if w.startswith("skipping")]
    assert len(skipped) == 1 and "step-00000002" in skipped[0] and why in skipped[0], skipped


def test_checkpoint_that_verifies_but_does_not_load_falls_back(pg, no_faults,
                                                                tmp_path: Path, caplog) -> None:
    """Saved with a tensor of another shape: every checksum agrees, DCP's load fails."""
    m, state = _saved(tmp_path, (1,))
    state["model"]["inp.weight"] = torch.zeros(3, 3)
    m.save(2, state, {"step": 2, "world_size": 1}, blocking=True)
    m.verify(tmp_path / "step-00000002")
    other = make_model(1)
    with pytest.raises(DamagedCheckpoint, match="step-00000002"):
        m.load(tmp_path / "step-00000002", state_of(other, make_optimizer(other)))
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        found = m.restore_newest(_loader(m))
    assert found is not None and found[0].name == "step-00000001"
    assert any("step-00000002" in w and "Size mismatch" in w for w in _warnings(caplog)), \
        caplog.text


def test_the_callers_own_refusal_falls_back_too(pg, no_faults, tmp_path: Path) -> None:
    """The trainer's checks of the manifest's values raise DamagedCheckpoint in the loader."""
    m, _ = _saved(tmp_path, (1, 2))
    inner = _loader(m)

    def picky(path: Path, manifest: dict) -> None:
        if manifest["step"] == 2:
            raise DamagedCheckpoint(f"{path}: the data position is behind step 2")
        inner(path, manifest)

    found = m.restore_newest(picky)
    assert found is not None and found[0].name == "step-00000001"
    assert m.last_committed == "step-00000001" and m.latest_name() == "step-00000001"


def test_other_errors_are_not_damage(pg, no_faults, tmp_path: Path) -> None:
    """A config mismatch is the user's to fix: nothing is skipped or moved aside."""
    m, _ = _saved(tmp_path, (1, 2))

    def wrong_model(path: Path, manifest: dict) -> None:
        raise CheckpointError("saved for another model shape")

    with pytest.raises(CheckpointError, match="another model shape"):
        m.restore_newest(wrong_model)
    assert [p.name for p in m.committed()] == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "damaged").exists()


def test_damaged_checkpoints_are_moved_aside_never_over_an_earlier_one(pg, no_faults,
                                                                       tmp_path: Path) -> None:
    m, state = _saved(tmp_path, (1, 2))
    for round_ in range(3):
        _edit_manifest(tmp_path / "step-00000002", step="abc")
        found = m.restore_newest(_loader(m))
        assert found is not None and found[0].name == "step-00000001", round_
        m.save(2, state, {"step": 2, "world_size": 1}, blocking=True)
    aside = sorted(p.name for p in (tmp_path / "damaged").iterdir())
    assert aside == ["step-00000002", "step-00000002.1", "step-00000002.2"]
    for name in aside:  # each one intact as it was found
        assert json.loads((tmp_path / "damaged" / name / "manifest.json").read_text())["step"] \
            == "abc"
    # Retention never looks into damaged/.
    for step in (3, 4, 5, 6, 7, 8):
        m.save(step, state, {"step": step, "world_size": 1}, blocking=True)
    assert sorted(p.name for p in (tmp_path / "damaged").iterdir()) == aside


# -- committed means committed ---------------------------------------------------------------

def test_last_committed_is_set_by_the_commit_not_the_start(pg, no_faults, tmp_path: Path) -> None:
    no_faults.setenv("HPCTRAIN_FAULTS", "save_io_error@step=2")
    faults._specs.cache_clear()
    m, state = _saved(tmp_path, (1,))
    assert m.last_committed == "step-00000001"
    m.save(2, state, {"step": 2, "world_size": 1}, blocking=False)
    assert m.last_committed == "step-00000001"  # the async save has only started
    with pytest.raises(CheckpointError, match="step 2 was not committed"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m.poll()
            time.sleep(0.01)
    assert m.last_committed == "step-00000001"
    m.save(3, state, {"step": 3, "world_size": 1}, blocking=False)
    m.wait()
    assert m.last_committed == "step-00000003"


# -- a full disk, for real -------------------------------------------------------------------

@pytest.fixture()
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only); unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the message is "
                    "checked through fault injection in tests/train/test_resume_fallback.py")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big_state(mib: float) -> dict:
    return {"model": {"w": torch.ones(int(mib * (1 << 20)) // 4)}}


def _fill(fs: Path, leave: int) -> None:
    """Take all but ``leave`` bytes of the file system with a ballast file."""
    free = shutil.disk_usage(fs).free
    with open(fs / "ballast", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _gb_numbers(message: str) -> tuple[float, float]:
    match = re.search(r"needs ~([0-9.e+-]+) GB, ([0-9.e+-]+) GB free", message)
    assert match, message
    return float(match[1]), float(match[2])


MIB_GB = (1 << 20) / 1e9


def test_full_disk_during_a_save_says_so(pg, no_faults, small_fs: Path) -> None:
    """The checkpoint grew past the free space: the write itself fails with ENOSPC, the message
    sizes the need by the previous checkpoint, which stays intact."""
    root = small_fs / "checkpoints"
    m = manager(root)
    m.save(1, _big_state(0.5), {"step": 1, "world_size": 1}, blocking=True)
    _fill(small_fs, leave=768 << 10)  # room for the previous size, not for 1 MiB
    with pytest.raises(CheckpointError) as e:
        m.save(2, _big_state(1.0), {"step": 2, "world_size": 1}, blocking=True)
    msg = e.value.what
    assert "step 2 was not committed" in msg and f"no space left on {root}" in msg, msg
    need, free = _gb_numbers(msg)
    assert 0.5 * MIB_GB < need < 0.6 * MIB_GB, msg  # the previous checkpoint's size
    assert free < 0.8 * MIB_GB, msg
    assert "step-00000001 is intact" in (e.value.hint or "")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
    m.verify(root / "step-00000001")
    assert m.last_committed == "step-00000001"


def test_full_disk_on_the_first_save_sizes_the_state(pg, no_faults, small_fs: Path) -> None:
    """No previous checkpoint: the need is what the state being saved holds."""
    root = small_fs / "checkpoints"
    _fill(small_fs, leave=256 << 10)
    m = manager(root)
    with pytest.raises(CheckpointError) as e:
        m.save(1, _big_state(1.0), {"step": 1, "world_size": 1}, blocking=False)
        m.wait()
    need, _ = _gb_numbers(e.value.what)
    assert 0.99 * MIB_GB < need < 1.01 * MIB_GB, e.value.what


def test_full_disk_is_refused_before_a_save_starts(pg, no_faults, small_fs: Path) -> None:
    """The previous checkpoint's size is known: refused up front, nothing written."""
    root = small_fs / "checkpoints"
    m = manager(root)
    m.save(1, _big_state(1.0), {"step": 1, "world_size": 1}, blocking=True)
    _fill(small_fs, leave=512 << 10)
    with pytest.raises(CheckpointError) as e:
        m.save(2, _big_state(1.0), {"step": 2, "world_size": 1}, blocking=False)
    msg = e.value.what
    assert "step 2 was not started" in msg and f"no space left on {root}" in msg, msg
    need, free = _gb_numbers(msg)
    assert 1.0 * MIB_GB < need < 1.1 * MIB_GB and free < need, msg
    assert "step-00000001 is intact" in (e.value.hint or "")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
    # A fresh manager (a restart) sizes the need from the newest checkpoint on disk.
    fresh = manager(root)
    with pytest.raises(CheckpointError, match="was not started"):
        fresh.save(2, _big_state(1.0), {"step": 2, "world_size": 1}, blocking=True)
    (small_fs / "ballast").unlink()
    fresh.save(2, _big_state(1.0), {"step": 2, "world_size": 1}, blocking=True)
    assert fresh.last_committed == step_dir_name(2)
