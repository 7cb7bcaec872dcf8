"""CheckpointManager: save (blocking and async), atomic commit, retention, failure, resume choice,
safe loading and resharding — in this process (a 1-rank gloo group) and on 2 spawned gloo ranks.

The 2-rank part runs once per module, in the background while the 1-rank tests run: each rank
executes every scenario of ``_rank_main`` and writes what it saw to ``rank-N.json``; the tests
then assert on both ranks' accounts.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import (
    flip_byte,
    flip_in_tensor,
    fsdp_model,
    init_env,
    make_model,
    make_optimizer,
    manager,
    on_disk_files,
    put_state,
    state_of,
    tmp_dirs,
    train_steps,
    two_spawned_ranks,
)

from hpctrain import faults
from hpctrain.checkpoint.manager import LATEST, CheckpointManager, step_dir_name
from hpctrain.checkpoint.manifest import (
    CheckpointError,
    DamagedCheckpoint,
    describe,
    read_manifest,
)
from hpctrain.checkpoint.safe_io import SafeFileSystemReader
from hpctrain.checkpoint.staging import tensors_of

# Steps at which the 2-rank scenario injects a failing save (sync, async, rank 1 only).
RANK_FAULTS = "save_io_error@step=8;save_io_error@step=9;save_io_error@step=10,rank=1"


# -- the 2-rank scenarios (run in spawned processes) -------------------------------------------

def _scenario(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = {"ok": True, **(fn(*args) or {})}
    except BaseException:
        results[name] = {"ok": False, "error": traceback.format_exc()}


def _commits(out: Path, m: CheckpointManager) -> dict:
    """Steps 1..7, odd ones blocking, even ones async; keep_last=2 + keep_every=3."""
    model = make_model(0)
    opt = make_optimizer(model)
    latest = []
    for step in range(1, 8):
        train_steps(model, opt, 1, seed=step)
        m.save(step, state_of(model, opt), {"step": step, "world_size": 2},
               blocking=step % 2 == 1)
        m.wait()
        latest.append(m.latest_name())
    newest = m.root / step_dir_name(7)
    return {"latest": latest, "committed": [p.name for p in m.committed()],
            "manifest": read_manifest(newest), "files": sorted(on_disk_files(newest)),
            "described": {n: describe(newest / n) for n in on_disk_files(newest)},
            "verified": sorted(m.verify(newest)["files"])}


def _failures(out: Path, m: CheckpointManager) -> dict:
    """Saves at steps 8 (blocking), 9 (async) and 10 (rank 1 only) fail on every rank."""
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    seen = {}
    for step, blocking in ((8, True), (9, False), (10, True)):
        try:
            m.save(step, state_of(model, opt), {"step": step}, blocking=blocking)
            if not blocking:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    m.poll()  # raises once the background write has failed
                    time.sleep(0.02)
            seen[step] = None
        except BaseException as e:  # noqa: BLE001 - the type is what the test checks
            seen[step] = f"{type(e).__module__}.{type(e).__name__}: " + (
                e.render() if isinstance(e, CheckpointError) else str(e))
        dist.barrier()
        seen[f"tmp-after-{step}"] = tmp_dirs(m.root)
        seen[f"latest-after-{step}"] = m.latest_name()
        dist.barrier()  # nobody starts the next save before every rank has looked
    seen["committed"] = [p.name for p in m.committed()]
    seen["verified"] = bool(m.verify(m.root / step_dir_name(7)))
    return seen


def _corrupt(out: Path, m: CheckpointManager) -> dict:
    """Flip a byte inside a tensor of the newest checkpoint (it still loads: only the checksum
    tells); resume must fall back, to exactly the older checkpoint's state."""
    newest = m.root / step_dir_name(7)
    probe = state_of(*_trained(seed=4))
    m.load(newest, probe)
    shard = [flip_in_tensor(newest, probe["model"]["inp.weight"])] if dist.get_rank() == 0 \
        else [None]
    dist.broadcast_object_list(shard, src=0)
    shard = Path(shard[0])
    dist.barrier()
    try:
        m.verify(newest)
        explicit = None
    except CheckpointError as e:
        explicit = e.what
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hpctrain.checkpoint").addHandler(handler)
    state = state_of(*_trained(seed=4))
    try:
        found = m.restore_newest(lambda path, _manifest: m.load(path, state))
    finally:
        logging.getLogger("hpctrain.checkpoint").removeHandler(handler)
    rng = torch.rand(3)  # the RNG stream as the fallback left it
    clean = state_of(*_trained(seed=5))
    m.load(m.root / step_dir_name(6), clean)
    exact = torch.equal(torch.rand(3), rng) and all(torch.equal(a, b) for a, b in zip(
        tensors_of(state), tensors_of(clean), strict=True)) \
        and state["optim"]["param_groups"] == clean["optim"]["param_groups"]
    return {"found": found[0].name if found else None, "logged": records, "exact": exact,
            "explicit": explicit, "shard": str(shard),
            "set_aside": sorted(p.name for p in (m.root / "damaged").iterdir()),
            "latest": m.latest_name()}


def _fsdp(out: Path) -> dict:
    """Save with FSDP2 on 2 ranks; rank 0 also writes the full tensors to compare against."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = fsdp_model()
    m = manager(out / "fsdp")
    m.save(2, state_of(model, opt), {"step": 2, "world_size": 2, "strategy": "fsdp"},
           blocking=True)
    full_model, full_optim = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim}, out / "fsdp-full.pt")
    dist.barrier()
    return {}


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    init_env(rank, world_size, port)
    os.environ["HPCTRAIN_FAULTS"] = RANK_FAULTS
    faults._specs.cache_clear()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out_dir = Path(out)
    results: dict[str, Any] = {}
    m = manager(out_dir / "ckpts", keep_last=2, keep_every=3)
    _scenario(results, "commits", _commits, out_dir, m)
    _scenario(results, "failures", _failures, out_dir, m)
    _scenario(results, "corrupt", _corrupt, out_dir, m)
    _scenario(results, "fsdp", _fsdp, out_dir)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start the 2 ranks now; ``result()`` joins them and returns (out dir, [rank0, rank1])."""
    with two_spawned_ranks(_rank_main, tmp_path_factory.mktemp("two_ranks"),
                           "checkpoint scenarios") as result:
        yield result


def _ok(ranks: list[dict], name: str) -> list[dict]:
    for r, res in enumerate(ranks):
        assert res[name]["ok"], f"rank {r} scenario {name}:\n{res[name].get('error')}"
    return [res[name] for res in ranks]


# -- one process --------------------------------------------------------------------------------

def _trained(seed: int = 0, steps: int = 2):
    model = make_model(seed)
    opt = make_optimizer(model)
    train_steps(model, opt, steps)
    return model, opt


def _assert_manifest_complete(ckpt: Path) -> dict:
    manifest = read_manifest(ckpt)
    assert set(manifest["files"]) == on_disk_files(ckpt)
    assert {".metadata", "rng-rank-00000.pt"} <= set(manifest["files"])
    assert any(n.endswith(".distcp") for n in manifest["files"])
    for name, want in manifest["files"].items():
        assert describe(ckpt / name) == want, name
    return manifest


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_save_commits_with_complete_manifest(pg, no_faults, tmp_path: Path,
                                             blocking: bool) -> None:
    model, opt = _trained()
    m = manager(tmp_path)
    m.save(1, state_of(model, opt), {"step": 1, "world_size": 1}, blocking=True)
    train_steps(model, opt, 1)
    stall = m.save(2, state_of(model, opt), {"step": 2, "world_size": 1, "tag": "x"},
                   blocking=blocking)
    assert stall >= 0
    m.wait()
    assert not m.in_flight
    assert [p.name for p in m.committed()] == ["step-00000001", "step-00000002"]
    assert (tmp_path / LATEST).read_text().strip() == "step-00000002" == m.latest_name()
    manifest = _assert_manifest_complete(tmp_path / "step-00000002")
    assert manifest["step"] == 2 and manifest["tag"] == "x"
    assert manifest["name"] == "step-00000002"
    assert tmp_dirs(tmp_path) == []


def test_retention_keeps_last_k_and_every_mth(pg, no_faults, tmp_path: Path) -> None:
    model, opt = _trained(steps=1)
    m = manager(tmp_path, keep_last=2, keep_every=3)
    for step in range(1, 9):
        m.save(step, state_of(model, opt), {"step": step}, blocking=step % 2 == 0)
        m.wait()
        kept = [step_of_name(p.name) for p in m.committed()]
        assert kept[-1] == step and m.latest_name() == step_dir_name(step)
        expected = sorted({s for s in range(1, step + 1) if s % 3 == 0} | {step - 1, step} - {0})
        assert kept == expected, f"after step {step}"
    assert [p.name for p in m.committed()] == [step_dir_name(s) for s in (3, 6, 7, 8)]


def step_of_name(name: str) -> int:
    return int(name.split("-")[1])


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_failed_save_is_not_committed_and_previous_survives(
        pg, no_faults, tmp_path: Path, blocking: bool) -> None:
    no_faults.setenv("HPCTRAIN_FAULTS", "save_io_error@step=2")
    faults._specs.cache_clear()
    model, opt = _trained()
    m = manager(tmp_path)
    m.save(1, state_of(model, opt), {"step": 1}, blocking=True)
    with pytest.raises(CheckpointError) as e:
        m.save(2, state_of(model, opt), {"step": 2}, blocking=blocking)
        if not blocking:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m.poll()
                time.sleep(0.01)
            pytest.fail("poll() never raised the background save's failure")
    err = e.value
    assert "step 2 was not committed" in err.what and "No space left" in err.what
    assert err.hint and "step-00000001 is intact" in err.hint
    m.wait()  # the error was raised once, not again
    assert tmp_dirs(tmp_path) == []
    assert [p.name for p in m.committed()] == ["step-00000001"]
    assert m.latest_name() == "step-00000001"
    m.verify(tmp_path / "step-00000001")
    # The manager stays usable: the next save commits.
    m.save(3, state_of(model, opt), {"step": 3}, blocking=blocking)
    m.wait()
    assert m.latest_name() == "step-00000003"


def _damage(kind: str, ckpt: Path) -> str:
    """Damage a committed checkpoint; return the name of the file an error must mention."""
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if kind == "flip":
        flip_byte(shard)
    elif kind == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif kind == "lost-file":
        (ckpt / "rng-rank-00000.pt").unlink()
        return "rng-rank-00000.pt"
    elif kind == "no-manifest":
        (ckpt / "manifest.json").unlink()
        return "manifest.json"
    return shard.name


def _load_into_fresh(m: CheckpointManager):
    """A loader for ``restore_newest``: fills a fresh model's state like a resume does."""
    state = state_of(*_trained(seed=6))
    return lambda path, _manifest: m.load(path, state)


@pytest.mark.parametrize("kind", ["flip", "truncate", "lost-file", "no-manifest"])
def test_restore_newest_skips_damaged_newest(pg, no_faults, tmp_path: Path, kind: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained()
    m = manager(tmp_path, keep_last=3)
    for step in (1, 2):
        m.save(step, state_of(model, opt), {"step": step}, blocking=True)
    newest = tmp_path / "step-00000002"
    culprit = _damage(kind, newest)
    with pytest.raises(CheckpointError) as e:
        m.verify(newest)
    assert culprit in e.value.what
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        found = m.restore_newest(_load_into_fresh(m))
    assert found is not None and found[0].name == "step-00000001"
    assert found[1]["step"] == 1
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "step-00000002" in skipped[0] and culprit in skipped[0], skipped
    assert m.last_committed == "step-00000001"
    assert [p.name for p in m.committed()] == ["step-00000001"]
    assert (tmp_path / "damaged" / "step-00000002").is_dir()  # moved aside, not deleted


def test_restore_newest_none_without_checkpoints(pg, no_faults, tmp_path: Path) -> None:
    m = manager(tmp_path / "absent")
    assert m.restore_newest(_load_into_fresh(m)) is None  # no checkpoints at all (root missing)
    assert m.last_committed is None


def test_restore_newest_refuses_when_all_damaged(pg, no_faults, tmp_path: Path) -> None:
    """Every checkpoint damaged: an error naming each and why, and nothing moved or deleted."""
    model, opt = _trained()
    m = manager(tmp_path, keep_last=3)
    for step in (1, 2):
        m.save(step, state_of(model, opt), {"step": step}, blocking=True)
    _damage("flip", tmp_path / "step-00000001")
    _damage("no-manifest", tmp_path / "step-00000002")
    with pytest.raises(DamagedCheckpoint) as e:
        m.restore_newest(_load_into_fresh(m))
    lines = [e.value.what, *e.value.lines]  # one escaped line per damaged checkpoint
    assert "every checkpoint" in lines[0] and str(tmp_path) in lines[0]
    assert "step-00000002" in lines[1] and "manifest.json" in lines[1], lines
    assert "step-00000001" in lines[2] and "checksum" in lines[2], lines
    assert e.value.exit_code == 2 and e.value.hint
    assert [p.name for p in m.committed()] == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "damaged").exists()


class _Payload:
    """Unpickling this runs a shell command (what a hostile .metadata could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_safe_reader_refuses_pickled_code(pg, no_faults, tmp_path: Path) -> None:
    model, opt = _trained()
    m = manager(tmp_path / "ckpts")
    m.save(1, state_of(model, opt), {"step": 1}, blocking=True)
    ckpt = tmp_path / "ckpts" / "step-00000001"
    SafeFileSystemReader(ckpt).read_metadata()  # the genuine index is accepted
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    (ckpt / ".metadata").write_bytes(evil)

    with pytest.raises(CheckpointError, match="not allowed") as e:
        SafeFileSystemReader(ckpt).read_metadata()
    assert ".metadata" in e.value.what
    assert not marker.exists(), "the checkpoint index ran code"
    # The payload is live: a plain unpickler would have run it.
    pickle.loads(evil)
    assert marker.exists()


def test_load_of_hostile_index_raises_checkpoint_error(pg, no_faults, tmp_path: Path) -> None:
    """Through ``load`` (what resume calls) the refusal is a CheckpointError naming the file."""
    model, opt = _trained()
    m = manager(tmp_path / "ckpts")
    m.save(1, state_of(model, opt), {"step": 1}, blocking=True)
    ckpt = tmp_path / "ckpts" / "step-00000001"
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    try:
        m.load(ckpt, state_of(*_trained(seed=1)))
    except CheckpointError as e:
        assert ".metadata" in e.what
    except BaseException as e:  # noqa: BLE001
        pytest.fail(f"load raised {type(e).__module__}.{type(e).__name__}, not "
                    f"CheckpointError: {str(e)[:600]}")
    else:
        pytest.fail("load accepted a hostile checkpoint index")
    assert not marker.exists(), "the checkpoint index ran code"


def test_safe_reader_refuses_non_metadata_object(pg, tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        SafeFileSystemReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04")  # truncated pickle
    with pytest.raises(CheckpointError, match="unreadable"):
        SafeFileSystemReader(tmp_path).read_metadata()


def test_load_restores_params_optimizer_groups_and_rng_bitwise(pg, no_faults,
                                                               tmp_path: Path) -> None:
    model, opt = _trained(seed=0, steps=3)
    m = manager(tmp_path)
    m.save(3, state_of(model, opt), {"step": 3, "world_size": 1}, blocking=True)
    after_save = torch.rand(5)  # the RNG stream right after the save

    fresh = make_model(seed=7)
    fresh_opt = make_optimizer(fresh, lr=0.5)
    for group in fresh_opt.param_groups:
        group["betas"], group["weight_decay"] = (0.5, 0.5), 0.3
    assert not torch.equal(fresh.inp.weight, model.inp.weight)
    state = state_of(fresh, fresh_opt)
    m.load(tmp_path / "step-00000003", state)
    put_state(fresh, fresh_opt, state)

    assert torch.equal(torch.rand(5), after_save), "CPU RNG state not restored"
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    # Hyper-parameters are pickled values: they came back through SafeLoadPlanner.
    for saved, loaded in zip(opt.param_groups, fresh_opt.param_groups, strict=True):
        for key in ("lr", "betas", "weight_decay", "eps"):
            assert loaded[key] == saved[key], key
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        sa, sb = opt.state[a], fresh_opt.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    # Nothing is missing: one more identical step keeps them identical.
    train_steps(model, opt, 1, seed=9)
    train_steps(fresh, fresh_opt, 1, seed=9)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_on_other_world_size_reseeds_rng(pg, no_faults, tmp_path: Path) -> None:
    """RNG streams are per rank: on another world size they are derived, not copied."""
    model, opt = _trained()
    m = manager(tmp_path)
    m.save(4, state_of(model, opt), {"step": 4, "world_size": 2}, blocking=True)
    m.load(tmp_path / "step-00000004", state_of(*_trained(seed=3)))
    got = torch.rand(3)
    torch.manual_seed(4 * 1_000_003 + 0)
    assert torch.equal(got, torch.rand(3))


# -- two ranks ----------------------------------------------------------------------------------

def test_two_ranks_commit_sync_and_async(two_ranks) -> None:
    _, ranks = two_ranks()
    res = _ok(ranks, "commits")
    assert res[0]["latest"] == [step_dir_name(s) for s in range(1, 8)]
    assert res[0]["committed"] == res[1]["committed"] == \
        [step_dir_name(s) for s in (3, 6, 7)]
    manifest = res[0]["manifest"]
    names = set(manifest["files"])
    # Each rank hashed its own files; rank 0 also the index: the union is every file on disk.
    assert names == set(res[0]["files"])
    assert {".metadata", "rng-rank-00000.pt", "rng-rank-00001.pt"} <= names
    assert manifest["files"] == res[0]["described"]
    assert res[0]["verified"] == res[1]["verified"] == sorted(names)


def test_two_ranks_failed_save_raises_everywhere(two_ranks) -> None:
    """Blocking, async and a one-rank I/O error: all ranks raise, nothing is half-committed."""
    _, ranks = two_ranks()
    res = _ok(ranks, "failures")
    for r, seen in enumerate(res):
        for step in ("8", "9", "10"):
            msg = seen[step]
            assert msg is not None, f"rank {r}: the failed save at step {step} did not raise"
            assert msg.startswith("hpctrain.checkpoint.manifest.CheckpointError"), \
                f"rank {r}, step {step}: not a CheckpointError: {msg[:2000]}"
            assert f"step {step} was not committed" in msg, msg
            assert "step-00000007 is intact" in msg, msg
            assert seen[f"tmp-after-{step}"] == [], seen
            assert seen[f"latest-after-{step}"] == "step-00000007"
        assert seen["committed"] == [step_dir_name(s) for s in (3, 6, 7)]
        assert seen["verified"]


def test_two_ranks_resume_skips_corrupted_newest(two_ranks) -> None:
    _, ranks = two_ranks()
    res = _ok(ranks, "corrupt")
    shard = Path(res[0]["shard"]).name
    for r, seen in enumerate(res):
        assert seen["found"] == "step-00000006", f"rank {r}: {seen}"
        assert seen["exact"], f"rank {r}: the state is not exactly step-00000006's"
        assert seen["explicit"] and shard in seen["explicit"] and "checksum" in seen["explicit"]
    logged = [m for m in res[0]["logged"] if "skipping" in m]
    assert logged and "step-00000007" in logged[0] and shard in logged[0], res[0]["logged"]
    # Moved aside once (by rank 0), never deleted; ``latest`` names what was resumed.
    assert res[0]["set_aside"] == res[1]["set_aside"] == ["step-00000007"]
    assert res[0]["latest"] == "step-00000006"


def test_fsdp_two_ranks_loads_into_one_process(two_ranks, pg, no_faults) -> None:
    """DCP reshards: FSDP shards of 2 ranks fill a plain model and optimizer in 1 process."""
    out, ranks = two_ranks()
    _ok(ranks, "fsdp")
    ckpt = out / "fsdp" / "step-00000002"
    assert len(list(ckpt.glob("__*_0.distcp"))) == 2  # each rank wrote its own shard
    full = torch.load(out / "fsdp-full.pt", weights_only=True)

    model = make_model(seed=11)
    opt = make_optimizer(model, lr=0.7)
    state = state_of(model, opt)
    m = CheckpointManager(manager(out / "fsdp").cfg, out / "fsdp", rank=0, world_size=1,
                          device=torch.device("cpu"), group=dist.group.WORLD)
    m.load(ckpt, state)
    put_state(model, opt, state)
    loaded = state_of(model, opt)
    assert set(loaded["model"]) == set(full["model"])
    for name, tensor in full["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    for fqn, entry in full["optim"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(loaded["optim"]["state"][fqn][key], tensor), (fqn, key)
    for saved, got in zip(full["optim"]["param_groups"], loaded["optim"]["param_groups"],
                          strict=True):
        assert got["lr"] == saved["lr"] and got["params"] == saved["params"]
