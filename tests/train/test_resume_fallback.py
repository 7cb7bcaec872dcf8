"""Resume and rollback never crash on, nor silently ignore, what ``checkpoints/`` holds; the exit
info names only committed checkpoints; a full disk says so. Real runs of the tiny demo.

One uninterrupted run saves steps 2, 4 and 6; each scenario copies it, damages it in one way,
and runs the same command again for 8 steps:

- stray entries and a manifest saying ``"step": "abc"``: warned about, skipped, resumed from 4;
- a manifest whose step disagrees with its folder, one whose data position is behind its step:
  both skipped with why, resumed from 2;
- a checkpoint that verifies (manifest resealed) but does not load: skipped, resumed from 4;
- every checkpoint damaged: exit 2 naming each and why, nothing trained, moved or deleted.

Damaged checkpoints passed over are moved to ``checkpoints/damaged/``, never deleted; retention
never touches them nor the stray entries. A rollback after a NaN streak uses the same fallback.
The first three scenarios are read from their logs and folders and run one after another in
one process (conftest's ``train_together``); the others are read from what the CLI says.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    DEMO,
    QUIET,
    TINY,
    RunResult,
    cli_command,
    cli_env,
    kill_group,
    one_of,
    train_together,
)
from hpctrain.checkpoint.manifest import step_of
from hpctrain.observe.metrics import read_metrics


def _load(name: str):
    """Import ``tests/checkpoint/<name>.py`` by path (the test folders are not packages)."""
    key = f"_ckpt_test_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "checkpoint" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


hostile = _load("hostile")

TIMEOUT_S = 180.0
ONE = ["parallel.strategy=none", "train.micro_batch=4", "data.source=stdlib"]
BASE = [*TINY, *QUIET, *ONE, "checkpoint.every=2", "checkpoint.keep_last=5"]
STRAYS = ("step-abc", "step-00000010.bak", "step-00000012", "notes")


def _args(out: Path, name: str, *overrides: str, steps: int = 8,
          flags: tuple[str, ...] = ()) -> list[str]:
    return ["train", DEMO, *BASE, f"train.steps={steps}", f"run.out_dir={out}",
            f"run.name={name}", *overrides, *flags]


def _popen(args: list[str], faults: str | None = None) -> subprocess.Popen:
    env = cli_env()
    env.pop("HPCTRAIN_FAULTS", None)
    if faults:
        env["HPCTRAIN_FAULTS"] = faults
    return subprocess.Popen(cli_command(args), cwd=Path(__file__).resolve().parents[2], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, args: list[str], run_dir: Path) -> RunResult:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        err += f"\n[test] TIMEOUT after {TIMEOUT_S:.0f} s"
    finally:
        kill_group(proc)
    return RunResult(args, proc.returncode, out, err, run_dir)


def _run(out: Path, name: str, *overrides: str, faults: str | None = None,
         **kw: Any) -> RunResult:
    args = _args(out, name, *overrides, **kw)
    return _finish(_popen(args, faults), args, out / name)


def _log(run: RunResult) -> str:
    return (run.run_dir / "logs" / "rank-000.log").read_text()


def _steps(run: RunResult) -> list[int]:
    records = read_metrics(run.run_dir / "metrics" / "rank-000.jsonl")
    return [r["step"] for r in records if "event" not in r]


def _ckpts(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _edit_manifest(ckpt: Path, change: Callable[[dict], None]) -> None:
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _copy(reference: RunResult, out: Path, name: str) -> Path:
    run_dir = out / name
    shutil.copytree(reference.run_dir, run_dir)
    return _ckpts(run_dir)


def _wrong_shape(ckpt: Path) -> None:
    """A tensor of another shape, resealed: every checksum agrees, loading fails."""
    hostile.replace_item(ckpt, "model.tok_embeddings.weight",
                         hostile.torch_pickle(torch.zeros(3)))


# -- the scenarios --------------------------------------------------------------------------------

def _strays_and_bad_step(root: Path) -> None:
    for name in STRAYS[:2]:
        shutil.copytree(root / "step-00000002", root / name)
    (root / STRAYS[2]).write_text("a file named like a checkpoint")
    (root / STRAYS[3]).write_text("the user's notes")
    _edit_manifest(root / "step-00000006", lambda m: m.update(step="abc"))


def _inconsistent(root: Path) -> None:
    _edit_manifest(root / "step-00000006", lambda m: m.update(step=4))
    _edit_manifest(root / "step-00000004", lambda m: m["loader"].update(step=1))


def _does_not_load(root: Path) -> None:
    _wrong_shape(root / "step-00000006")


def _fall_backs(ref: RunResult, out: Path) -> dict[str, RunResult]:
    """Three damaged copies of the reference, each resumed by the same run for 8 steps; they
    are checked by their logs and folders, so one process runs the three in turn."""
    for name, damage in (("strays", _strays_and_bad_step), ("inconsistent", _inconsistent),
                         ("noload", _does_not_load)):
        damage(_copy(ref, out, name))
    # keep_last=1: retention runs after each save and must leave strays and damaged/ alone.
    return train_together(out, {"strays": ["checkpoint.keep_last=1"], "inconsistent": [],
                                "noload": []}, common=[*BASE, "train.steps=8"])


def _all_damaged(ref: RunResult, out: Path) -> RunResult:
    root = _copy(ref, out, "alldamaged")
    hostile.write_resealed(root / "step-00000002", "rng-rank-00000.pt",
                           hostile.torch_pickle(hostile.ShellPayload(out / "pwned")))
    _edit_manifest(root / "step-00000004", lambda m: m.update(step="abc"))
    _wrong_shape(root / "step-00000006")
    return _run(out, "alldamaged")


def _rollback_past_damage(out: Path) -> RunResult:
    """NaN at steps 7-9 (3 in a row roll back); the newest checkpoint (8, saved during the
    streak) is damaged while the run is held before step 9, so the rollback falls back to 6.
    Later streaks roll back to the new step 8 (saved again), so the run ends."""
    name = "rollback"
    args = _args(out, name, "guard.max_consecutive=3", steps=10)
    damaged = out / f"{name}-damaged"
    proc = _popen(args, f"hang@step=9,seconds=120,until={damaged};nan@step=7-9")
    latest = _ckpts(out / name) / "latest"
    try:
        deadline = time.monotonic() + 120
        while not (latest.is_file() and latest.read_text().strip() == "step-00000008"):
            assert time.monotonic() < deadline and proc.poll() is None, "step 8 never committed"
            time.sleep(0.05)
        _wrong_shape(_ckpts(out / name) / "step-00000008")
    finally:
        damaged.touch()  # the held run goes on at once
        result = _finish(proc, args, out / name)
    return result


def _failed_async_save(out: Path) -> RunResult:
    """The async save of step 6 fails with ENOSPC (injected) after step 3's committed."""
    return _run(out, "enospc", "checkpoint.every=3", "checkpoint.async_save=true", steps=9,
                faults="save_io_error@step=6")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         run_pool: ThreadPoolExecutor) -> dict[str, Future]:
    """Start every run of this module; each test waits only for what it checks."""
    out = tmp_path_factory.mktemp("resume")
    f: dict[str, Future] = {"reference": run_pool.submit(_run, out, "reference", steps=6)}

    def after_reference(fn: Callable[[RunResult, Path], Any]) -> Future:
        chained: Future = Future()

        def start(done: Future) -> None:
            def job() -> None:
                try:
                    chained.set_result(fn(done.result().ok(), out))
                except BaseException as e:  # delivered to the test that waits for it
                    chained.set_exception(e)
            run_pool.submit(job)

        f["reference"].add_done_callback(start)
        return chained

    fall_backs = after_reference(_fall_backs)
    for key in ("strays", "inconsistent", "noload"):
        f[key] = one_of(fall_backs, key)
    f["alldamaged"] = after_reference(_all_damaged)
    f["rollback"] = run_pool.submit(_rollback_past_damage, out)
    f["enospc"] = run_pool.submit(_failed_async_save, out)
    return f


def _skipped(log: str, name: str) -> str:
    lines = [line for line in log.splitlines() if f"skipping checkpoint {name}" in line]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


# -- tests -------------------------------------------------------------------------------------

def test_stray_entries_and_a_bad_step_value(runs: dict[str, Future]) -> None:
    run = runs["strays"].result().ok()
    log = _log(run)
    for name in STRAYS:
        assert sum(f"ignoring {_ckpts(run.run_dir) / name}:" in line
                   for line in log.splitlines()) == 1, (name, log[-3000:])
    assert "step = 'abc'" in _skipped(log, "step-00000006")
    assert "resumed from step-00000004" in log
    assert _steps(run)[-4:] == [5, 6, 7, 8]
    root = _ckpts(run.run_dir)
    assert (root / "damaged" / "step-00000006" / "manifest.json").is_file()
    for name in STRAYS:  # retention (keep_last=1) left them alone
        assert (root / name).exists(), name
    assert [p.name for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None] == \
        ["step-00000008"]


def test_inconsistent_manifests_are_damage(runs: dict[str, Future]) -> None:
    run = runs["inconsistent"].result().ok()
    log = _log(run)
    assert "says step 4, its folder step-00000006 says 6" in _skipped(log, "step-00000006")
    assert "data position (1 batches) is behind step 4" in _skipped(log, "step-00000004")
    assert "resumed from step-00000002" in log
    damaged = sorted(p.name for p in (_ckpts(run.run_dir) / "damaged").iterdir())
    assert damaged == ["step-00000004", "step-00000006"]


def test_checkpoint_that_does_not_load_falls_back(runs: dict[str, Future]) -> None:
    run = runs["noload"].result().ok()
    log = _log(run)
    assert "tok_embeddings" in _skipped(log, "step-00000006")
    assert "resumed from step-00000004" in log
    assert _steps(run)[-4:] == [5, 6, 7, 8]


def test_every_checkpoint_damaged_refuses_to_start(runs: dict[str, Future]) -> None:
    run = runs["alldamaged"].result()
    assert run.returncode == 2, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    err = run.stderr
    assert "every checkpoint in" in err, run.describe()
    named = {line.split(":")[0].strip(): line for line in err.splitlines()
             if line.strip().startswith("step-0")}
    assert "tok_embeddings" in named["step-00000006"], named
    assert "step = 'abc'" in named["step-00000004"], named
    assert "rng-rank-00000.pt" in named["step-00000002"] and "posix.system" in \
        named["step-00000002"], named
    assert _steps(run) == list(range(1, 7))  # the copied metrics only: nothing trained
    root = _ckpts(run.run_dir)
    assert sorted(p.name for p in root.glob("step-*")) == \
        ["step-00000002", "step-00000004", "step-00000006"]
    assert not (root / "damaged").exists()
    assert not (run.run_dir.parent / "pwned").exists()
    assert run.exit_info()["exit_code"] == 2


def test_rollback_falls_back_past_a_damaged_checkpoint(runs: dict[str, Future]) -> None:
    run = runs["rollback"].result().ok()
    records = read_metrics(run.run_dir / "metrics" / "rank-000.jsonl")
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert rollbacks and rollbacks[0]["from_step"] == 9, rollbacks
    assert rollbacks[0]["checkpoint"] == "step-00000006", rollbacks
    assert "tok_embeddings" in _skipped(_log(run), "step-00000008")
    assert (_ckpts(run.run_dir) / "damaged" / "step-00000008").is_dir()
    assert run.exit_info()["extra"]["steps"] == 10


def test_failed_async_save_is_not_the_last_checkpoint(runs: dict[str, Future]) -> None:
    run = runs["enospc"].result()
    assert run.returncode not in (0, None), run.describe()
    info = run.exit_info()
    assert info["last_checkpoint"] == "step-00000003", info
    assert (_ckpts(run.run_dir) / "latest").read_text().strip() == "step-00000003"
    root = _ckpts(run.run_dir)
    assert f"no space left on {root}: this checkpoint needs ~" in run.stderr, run.describe()
    assert " GB free" in run.stderr and "step-00000003 is intact" in run.stderr
    assert "Traceback" not in run.stderr, run.describe()
