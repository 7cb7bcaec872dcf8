"""The checkpoint writer process: commits, bit-exact loads, a failing write, kill -9 mid-save,
and DTensor shards written exactly as an in-process save writes them.

One writer serves this module's 1-rank tests in order (starting one costs an interpreter), with
the faults of its scenarios set before it starts: save_io_error at step 3, a 60 s write at
step 5. The 2-rank part (FSDP2 on 2 spawned gloo ranks, each with its writer: a fallback to
the thread writer on both ranks when one has no memory for the buffers, a commit, a write
failing on rank 1 only, rank 1's writer killed mid-save) runs in the background while the
1-rank tests run.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import (
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
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import CheckpointError, describe, read_manifest, step_dir_name
from hpctrain.checkpoint.safe_io import SafeFileSystemReader
from hpctrain.checkpoint.writer import WriterDied

WRITER_FAULTS = "save_io_error@step=3;slow_save@step=5,seconds=60"
RANK_FAULTS = "save_io_error@step=3,rank=1;slow_save@step=4,seconds=2"


# -- 2 ranks, FSDP2 (spawned) ------------------------------------------------------------------

def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    init_env(rank, world_size, port)
    os.environ["HPCTRAIN_FAULTS"] = RANK_FAULTS
    faults._specs.cache_clear()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out_dir = Path(out)
    seen: dict[str, Any] = {}
    try:
        model, opt = fsdp_model()
        meta = {"world_size": 2, "strategy": "fsdp"}
        inline = manager(out_dir / "inline")
        inline.save(2, state_of(model, opt), {"step": 2, **meta}, blocking=True)
        # Rank 1 has no host memory to spare: every rank falls back to the thread writer.
        fallback = manager(out_dir / "fallback")
        fallback.start_writer()
        m = manager(out_dir / "process")
        m.start_writer()  # its interpreter starts beside the other's
        memory = psutil.virtual_memory
        if rank == 1:
            psutil.virtual_memory = lambda: SimpleNamespace(available=0)
        fallback.prepare(state_of(model, opt))
        psutil.virtual_memory = memory
        seen["fallback_mode"] = fallback.mode
        fallback.save(2, state_of(model, opt), {"step": 2, **meta}, blocking=False)
        fallback.close()
        seen["fallback_record"] = fallback.completed[-1]
        m.prepare(state_of(model, opt))
        seen["mode"] = m.mode
        m.save(2, state_of(model, opt), {"step": 2, **meta}, blocking=False)
        m.wait()
        seen["record"] = m.completed[-1]
        try:  # a write that fails on rank 1 only: both ranks learn it
            m.save(3, state_of(model, opt), {"step": 3, **meta}, blocking=False)
            m.wait()
            seen["failed"] = None
        except CheckpointError as e:
            seen["failed"] = e.what
        seen["latest"] = m.latest_name()
        try:  # rank 1's writer killed during the save of step 4: both ranks learn it
            m.save(4, state_of(model, opt), {"step": 4, **meta}, blocking=False)
            if rank == 1:
                os.kill(m._writer.pid, signal.SIGKILL)
            m.wait()
            seen["killed"] = None
        except CheckpointError as e:
            seen["killed"] = f"{type(e).__name__}: {e.what}"
        seen["latest_after_kill"] = m.latest_name()
        m.close()
    except BaseException:
        seen["error"] = traceback.format_exc()
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(seen, default=str))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start the 2 ranks now; ``result()`` joins them and returns (out dir, [rank0, rank1])."""
    out = tmp_path_factory.mktemp("writer_two_ranks")
    with two_spawned_ranks(_rank_main, out, "writer scenarios") as joined:

        def result() -> tuple[Path, list[dict]]:
            out, ranks = joined()
            for r, seen in enumerate(ranks):
                assert "error" not in seen, f"rank {r}:\n{seen['error']}"
            return out, ranks

        yield result


# -- 1 rank, in this process --------------------------------------------------------------------

@pytest.fixture(scope="module")
def writer(pg, two_ranks, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckpointManager]:
    """A manager whose writer process was started with this module's faults."""
    before = os.environ.get("HPCTRAIN_FAULTS")
    os.environ["HPCTRAIN_FAULTS"] = WRITER_FAULTS  # the writer reads them; this process not
    try:
        m = manager(tmp_path_factory.mktemp("writer"))
        m.start_writer()
    finally:
        if before is None:
            os.environ.pop("HPCTRAIN_FAULTS")
        else:
            os.environ["HPCTRAIN_FAULTS"] = before
    faults._specs.cache_clear()
    yield m
    m.close()


def _poll_until_raised(m: CheckpointManager, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m.poll()  # raises once the writer has reported the failure
        time.sleep(0.02)
    pytest.fail("poll() never raised the failed background save")


def test_writer_commits_and_a_resume_is_bit_exact(writer: CheckpointManager) -> None:
    m = writer
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    m.prepare(state_of(model, opt))
    assert m.mode == "process" and m.prepared
    m.save(1, state_of(model, opt), {"step": 1, "world_size": 1}, blocking=False)
    assert m.in_flight and m.last_committed is None  # only once its commit is known
    train_steps(model, opt, 1, seed=2)
    # The buffers are reused: the next save waits for the write in flight, and says so.
    m.save(2, state_of(model, opt), {"step": 2, "world_size": 1}, blocking=False)
    after_save = torch.rand(4)  # the RNG stream right after the save
    m.wait()
    assert m.last_committed == m.latest_name() == step_dir_name(2)
    first, second = m.completed
    for record in (first, second):
        assert record["writer"] == "process" and record["bytes"] > 0
        assert record["write_s"] > 0 and record["stall_s"] >= 0 and "wait_s" in record
    assert second["wait_s"] >= 0 and second["stall_s"] >= second["wait_s"]
    ckpt = m.root / step_dir_name(2)
    manifest = read_manifest(ckpt)
    assert set(manifest["files"]) == on_disk_files(ckpt)
    for name, want in manifest["files"].items():
        assert describe(ckpt / name) == want, name
    assert tmp_dirs(m.root) == []
    fresh = make_model(seed=9)
    fresh_opt = make_optimizer(fresh, lr=0.5)
    state = state_of(fresh, fresh_opt)
    m.load(ckpt, state)
    put_state(fresh, fresh_opt, state)
    assert torch.equal(torch.rand(4), after_save), "RNG state not restored"
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in opt.state[a].items():
            assert torch.equal(value, fresh_opt.state[b][key]), key


def test_failure_in_the_writer_stops_at_the_next_poll(writer: CheckpointManager) -> None:
    """save_io_error at step 3 inside the writer process: raised by poll, step 2 intact."""
    m = writer
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    m.save(3, state_of(model, opt), {"step": 3}, blocking=False)
    with pytest.raises(CheckpointError) as e:
        _poll_until_raised(m)
    assert "step 3 was not committed" in e.value.what and "No space left" in e.value.what
    assert "step-00000002 is intact" in e.value.hint
    assert m.latest_name() == step_dir_name(2) and tmp_dirs(m.root) == []
    m.save(4, state_of(model, opt), {"step": 4}, blocking=True)  # the writer goes on
    assert m.latest_name() == step_dir_name(4)


def test_kill_9_of_the_writer_mid_save(writer: CheckpointManager) -> None:
    """Killed while writing step 5 (held by slow_save): the next poll raises, nothing of step 5
    is committed, step 4 is intact and verifies. Last in this module: the writer is gone."""
    m = writer
    model = make_model(0)
    opt = make_optimizer(model)
    m.save(5, state_of(model, opt), {"step": 5}, blocking=False)
    deadline = time.monotonic() + 30
    while not (m.root / ".tmp-step-00000005").is_dir():  # the writer has started on it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    m.poll()  # still writing: nothing to report
    os.kill(m._writer.pid, signal.SIGKILL)
    with pytest.raises(WriterDied) as e:
        _poll_until_raised(m)
    assert "SIGKILL" in e.value.what and "step-00000005" in e.value.what, e.value.what
    assert m.latest_name() == step_dir_name(4) and m.last_committed == step_dir_name(4)
    assert [p.name for p in m.committed()][-1] == step_dir_name(4)
    m.verify(m.root / step_dir_name(4))


def test_fsdp_shards_from_the_writer_match_an_inline_save(two_ranks, pg) -> None:
    """The writer writes each rank's plain buffer as its DTensor chunk: the same index as an
    in-process save of the DTensors, and the same values when loaded into one process."""
    out, ranks = two_ranks()
    for r, seen in enumerate(ranks):
        assert seen["fallback_mode"] == "thread", seen  # rank 0 could have used its writer
        assert seen["fallback_record"]["writer"] == "thread", seen
        assert seen["mode"] == "process", seen
        assert seen["record"]["writer"] == "process", seen
        assert seen["failed"] and "step 3 was not committed" in seen["failed"], (r, seen)
        assert seen["latest"] == seen["latest_after_kill"] == step_dir_name(2)
        assert seen["killed"] and "step-00000004" in seen["killed"], (r, seen)
    # Rank 1 names the kill; rank 0's writer lost its peer inside the save's collectives.
    assert "WriterDied" in ranks[1]["killed"] and "SIGKILL" in ranks[1]["killed"], ranks[1]
    assert "WriterDied" in ranks[0]["killed"], ranks[0]
    inline = SafeFileSystemReader(out / "inline" / step_dir_name(2)).read_metadata()
    staged = SafeFileSystemReader(out / "process" / step_dir_name(2)).read_metadata()
    assert inline.state_dict_metadata.keys() == staged.state_dict_metadata.keys()
    for fqn, want in inline.state_dict_metadata.items():
        got = staged.state_dict_metadata[fqn]
        if hasattr(want, "chunks"):
            assert (got.size, got.properties.dtype) == (want.size, want.properties.dtype), fqn
            assert sorted(got.chunks, key=lambda c: tuple(c.offsets)) == \
                sorted(want.chunks, key=lambda c: tuple(c.offsets)), fqn
    loaded = {}
    for name in ("inline", "process"):
        model = make_model(seed=11)
        opt = make_optimizer(model)
        state = state_of(model, opt)
        CheckpointManager(manager(out / name).cfg, out / name, rank=0, world_size=1,
                          device=torch.device("cpu"), group=dist.group.WORLD).load(
            out / name / step_dir_name(2), state)
        put_state(model, opt, state)
        loaded[name] = state_of(model, opt)
    for key, tensor in loaded["inline"]["model"].items():
        assert torch.equal(loaded["process"]["model"][key], tensor), key
    for fqn, entry in loaded["inline"]["optim"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(loaded["process"]["optim"]["state"][fqn][key], tensor), fqn
