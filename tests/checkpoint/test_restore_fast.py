"""A restore reads its checkpoint once, verifying the checksums while it loads: what must hold.

Each rank checks the files it wrote in threads while DCP fills the state (``restore``/``load``),
from ``prefetch`` on in a resume (while the model is built). So a damaged checkpoint may put
some of its tensors into the state before the verdict: it must still be refused naming the
file, the fallback must leave exactly the older checkpoint's state (model, optimizer, schedule,
RNG, data position), and nothing after the tensors (schedule, data position, RNG) may be put
back from the damaged one. In this process on a 1-rank gloo group; the 2-rank case is
``test_manager.py``'s ``corrupt`` scenario. Also: tensors read in pieces by several threads,
and values unpickled once for all alike ones, arrive exactly.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    flip_in_tensor,
    make_model,
    make_optimizer,
    manager,
    put_state,
    state_of,
    train_steps,
)

from hpctrain.checkpoint import safe_io
from hpctrain.checkpoint.manifest import (
    CheckpointError,
    DamagedCheckpoint,
    read_manifest,
    step_dir_name,
    verification_share,
)
from hpctrain.config import JobConfig
from hpctrain.train import checkpointing
from hpctrain.train.checkpointing import TrainState


class _Position:
    """The data position (the token loader's protocol), recording every position it is given."""

    def __init__(self, step: int = 0):
        self.state = {"step": step, "global_batch": 8, "seed": 0}
        self.given: list[int] = []

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.given.append(state["step"])
        self.state = dict(state)


def _train_state(seed: int) -> TrainState:
    model = make_model(seed)
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainState(model, opt, sched, _Position(), None)


def _run(root: Path, steps: tuple[int, ...]) -> TrainState:
    """Train, saving after each of ``steps`` (each save with its own RNG stream)."""
    s = _train_state(0)
    m = manager(root, keep_last=5)
    done = 0
    for step in steps:
        while done < step:
            train_steps(s.model, s.optimizer, 1, seed=done)
            s.scheduler.step()
            done += 1
        s.loader.state["step"] = step
        torch.manual_seed(100 + step)
        m.save(step, checkpointing.tensor_state(s),
               checkpointing.meta_state(s, JobConfig(), step=step, world_size=1), blocking=True)
    return s


def _restorer(m, s: TrainState):
    return lambda path, manifest: checkpointing.restore(s, m, path, manifest, JobConfig(),
                                                        data=True)


def _same(a: TrainState, b: TrainState) -> None:
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key, entry in sa["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.loader.state_dict() == b.loader.state_dict()


def test_load_verifies_every_checksum_and_leaves_the_rng(pg, no_faults, tmp_path: Path) -> None:
    """A flipped byte inside a tensor loads without error: only its checksum can refuse it,
    and ``load`` itself must (the RNG is not put back from a refused checkpoint)."""
    s = _run(tmp_path, (2,))
    ckpt = tmp_path / step_dir_name(2)
    shard = flip_in_tensor(ckpt, s.model.inp.weight)
    state = checkpointing.tensor_state(_train_state(1))
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    with pytest.raises(DamagedCheckpoint) as e:
        manager(tmp_path).load(ckpt, state)
    assert shard.name in e.value.what and "checksum" in e.value.what, e.value.what
    assert torch.equal(torch.get_rng_state(), rng), "RNG put back from a damaged checkpoint"


def test_fallback_leaves_exactly_the_older_checkpoints_state(pg, no_faults,
                                                             tmp_path: Path) -> None:
    """The newest checkpoint loads in full (a tensor's byte flipped) before its verdict; the
    older one then leaves the state exactly as a clean restore of it does."""
    s = _run(tmp_path, (2, 3))
    flip_in_tensor(tmp_path / step_dir_name(3), s.optimizer.state[s.model.out.weight]["exp_avg"])
    m = manager(tmp_path, keep_last=5)
    resumed = _train_state(1)
    found = m.restore_newest(_restorer(m, resumed))
    assert found is not None and found[0].name == step_dir_name(2)
    assert resumed.loader.given == [2], "the damaged checkpoint's data position was put back"
    after_resume = torch.rand(4)

    clean = _train_state(2)
    older = m.root / step_dir_name(2)
    checkpointing.restore(clean, m, older, read_manifest(older), JobConfig(), data=True)
    assert torch.equal(torch.rand(4), after_resume), "RNG differs from the older checkpoint's"
    _same(resumed, clean)


def _saved(tmp_path: Path, step: int, **settings):
    """A model trained ``step`` steps, its optimizer, and a manager that saved both at ``step``
    (``settings``: the manager's)."""
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, step)
    m = manager(tmp_path, **settings)
    m.save(step, state_of(model, opt), {"step": step, "world_size": 1}, blocking=True)
    return model, opt, m


def _load_fresh(m, step: int, model):
    """A fresh model and optimizer loaded from ``m``'s step ``step``; its parameters must equal
    ``model``'s."""
    fresh = make_model(1)
    fresh_opt = make_optimizer(fresh)
    state = state_of(fresh, fresh_opt)
    m.load(m.root / step_dir_name(step), state)
    put_state(fresh, fresh_opt, state)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    return fresh, fresh_opt


def test_a_tensor_read_in_pieces_by_several_threads_arrives_whole(pg, no_faults, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """Tensors larger than one read are split between the reading threads, each piece landing
    at its place (pieces of 64 bytes here: every tensor of the model is several)."""
    model, opt, m = _saved(tmp_path, 2)
    monkeypatch.setattr(safe_io, "_PIECE", 64)
    fresh, fresh_opt = _load_fresh(m, 2, model)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in opt.state[a].items():
            assert torch.equal(value, fresh_opt.state[b][key]), key


def test_each_file_is_read_start_to_end_by_one_of_several_threads(pg, no_faults, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """As many files as threads (a rank loads what it wrote): the files are read at once, each
    by one thread from its start to its end, as ``bench disk`` reads (sequential streams,
    which the checksum threads follow through the page cache), not each file by all threads
    in turn."""
    model, _, m = _saved(tmp_path, 1, write_threads=2)
    monkeypatch.setattr(safe_io, "_PIECE", 64)  # several pieces a tensor, many a file
    both = threading.Barrier(2, timeout=30)  # a thread's first piece waits for the other's
    reads: list[tuple[int, str, int]] = []
    read = safe_io._read_into

    def spy(f, dest, offset, fqn) -> None:
        me = threading.get_ident()
        if me not in {thread for thread, _, _ in reads}:
            reads.append((me, str(f.name), offset))
            both.wait()
        else:
            reads.append((me, str(f.name), offset))
        read(f, dest, offset, fqn)

    monkeypatch.setattr(safe_io, "_read_into", spy)
    _load_fresh(m, 1, model)
    readers: dict[str, set[int]] = {}
    for thread, name, _ in reads:
        readers.setdefault(name, set()).add(thread)
    assert len(readers) == 2 and all(len(t) == 1 for t in readers.values()), readers
    assert len({thread for thread, _, _ in reads}) == 2
    for name in readers:
        offsets = [offset for _, n, offset in reads if n == name]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets), name


def test_the_load_follows_each_files_check_through_the_page_cache(pg, no_faults, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A file a thread: a tensor is read once the file's checksum thread has read past it
    (the check reads the disk, the load the page cache), not beside it. The checks start
    only once the load asked to follow them: a load that did not wait would read first."""
    from hpctrain.checkpoint import manifest

    model, _, m = _saved(tmp_path, 1, write_threads=2)
    asked = threading.Event()
    checks: list[manifest.Verification] = []
    wait_read, checksum = manifest.Verification.wait_read, manifest.checksum

    def following(self, name, end, give_up=None) -> None:
        checks.append(self)
        asked.set()
        wait_read(self, name, end, give_up)

    def late(path: Path, stop=None, progress=None) -> str:
        asked.wait(30)
        return checksum(path, stop, progress)

    early: list[str] = []
    read = safe_io._read_into

    def spy(f, dest, offset, fqn) -> None:
        name = Path(f.name).name
        with checks[0]._moved:
            if checks[0]._read.get(name, offset + dest.numel()) < offset + dest.numel():
                early.append(f"{name}@{offset}")
        read(f, dest, offset, fqn)

    monkeypatch.setattr(manifest.Verification, "wait_read", following)
    monkeypatch.setattr(manifest, "checksum", late)
    monkeypatch.setattr(safe_io, "_read_into", spy)
    _load_fresh(m, 1, model)
    assert checks and early == [], early


def test_alike_values_load_once_and_mutable_ones_are_never_shared(pg, no_faults, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """Values saved with the same bytes (the optimizer's settings per parameter) are read
    once; a list is still its own object in each place, so changing one changes no other."""
    m = manager(tmp_path)
    saved = {"w": torch.arange(4.0),
             "groups": {f"p{i}": {"lr": 0.5, "betas": (0.9, 0.95), "name": "adamw",
                                  "order": [1, 2]} for i in range(3)}}
    m.save(1, saved, {"step": 1, "world_size": 1}, blocking=True)
    state = {"w": torch.zeros(4),
             "groups": {f"p{i}": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "order": []}
                        for i in range(3)}}
    unpickled = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(1) or load(*a, **k))
    m.load(tmp_path / step_dir_name(1), state)
    assert len(unpickled) == 3 + 3 + 1  # lr, betas, name once; each list; the RNG file
    assert state == {**saved, "w": state["w"]} and torch.equal(state["w"], saved["w"])
    orders = [group["order"] for group in state["groups"].values()]
    assert len({id(order) for order in orders}) == 3, "one list shared between values"


def test_each_rank_verifies_the_files_it_wrote_and_every_file_is_verified_once() -> None:
    """With the same world size a rank checks its own shards (what it loads, on its node);
    the index, and files of ranks beyond the world size, are dealt out."""
    names = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp",
             "rng-rank-00000.pt", "rng-rank-00001.pt"]
    assert verification_share(names, 1, 2) == ["__1_0.distcp", "__1_1.distcp",
                                                "rng-rank-00001.pt"]
    assert verification_share(names, 0, 2) == ["__0_0.distcp", "__0_1.distcp",
                                                "rng-rank-00000.pt", ".metadata"]
    for world in (1, 2, 3):
        shares = [verification_share(names, rank, world) for rank in range(world)]
        assert sorted(n for share in shares for n in share) == sorted(names), world


def test_a_prefetched_checkpoint_is_checked_once_and_damage_still_refused(
        pg, no_faults, tmp_path: Path, monkeypatch) -> None:
    """``prefetch`` (while the model is built) starts the checks the restore then waits for:
    each file is hashed once, and a damaged newest one is still passed over."""
    from hpctrain.checkpoint import manifest

    s = _run(tmp_path, (2, 3))
    flip_in_tensor(tmp_path / step_dir_name(3), s.model.inp.weight)
    hashed: list[str] = []
    real = manifest.checksum
    monkeypatch.setattr(manifest, "checksum", lambda path, stop=None, progress=None: (
        hashed.append(f"{path.parent.name}/{path.name}") or real(path, stop, progress)))
    m = manager(tmp_path, keep_last=5)
    m.prefetch()
    resumed = _train_state(1)
    found = m.restore_newest(_restorer(m, resumed))
    assert found is not None and found[0].name == step_dir_name(2)
    newest = [h for h in hashed if h.startswith(step_dir_name(3))]
    assert newest and len(newest) == len(set(newest)), hashed


def test_a_named_damaged_checkpoint_is_an_error_and_nothing_after_the_tensors_is_restored(
        pg, no_faults, tmp_path: Path) -> None:
    """``checkpoint.resume=<path>``: no fallback; the schedule and data position stay."""
    s = _run(tmp_path, (2,))
    shard = flip_in_tensor(tmp_path / step_dir_name(2), s.model.out.weight)
    m = manager(tmp_path)
    m.prefetch(tmp_path / step_dir_name(2))  # what a resume of this path starts
    resumed = _train_state(1)
    with pytest.raises(DamagedCheckpoint) as e:
        m.restore(tmp_path / step_dir_name(2), _restorer(m, resumed))
    assert shard.name in e.value.what and "checksum" in e.value.what, e.value.what
    assert resumed.loader.given == [] and resumed.scheduler.last_epoch == 0
    assert m.last_committed is None


def _ours_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.is_alive()
            and t.name.startswith(("hpctrain-load", "hpctrain-verify"))]


def _load_interrupted(tmp_path: Path, release: threading.Event) -> None:
    """Load step 2 into a fresh state, expecting the Ctrl-C the caller arranged: no thread of
    ours outlives it; ``release`` then lets the caller's held threads go."""
    try:
        with pytest.raises(KeyboardInterrupt):
            manager(tmp_path).load(tmp_path / step_dir_name(2),
                                   checkpointing.tensor_state(_train_state(1)))
        assert _ours_alive() == []
    finally:
        release.set()


def test_ctrl_c_while_the_pieces_load_stops_every_thread(pg, no_faults, tmp_path: Path,
                                                        monkeypatch) -> None:
    """SIGINT after the first piece: ``load`` raises KeyboardInterrupt (not damage), and no
    loading or checking thread is left writing into the state or reading the files."""
    _run(tmp_path, (2,))
    monkeypatch.setattr(safe_io, "_PIECE", 64)
    gate, pieces = threading.Event(), []
    read = safe_io._read_into

    def interrupting(f, dest, offset, fqn) -> None:
        pieces.append(offset)
        if len(pieces) == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            gate.wait(1.0)  # the later pieces take long: a thread left behind is still reading
        read(f, dest, offset, fqn)

    monkeypatch.setattr(safe_io, "_read_into", interrupting)
    _load_interrupted(tmp_path, gate)


def test_ctrl_c_while_waiting_for_the_checksums_stops_them(pg, no_faults, tmp_path: Path,
                                                           monkeypatch) -> None:
    """SIGINT while ``load`` waits for its checks (the state loaded): none goes on hashing."""
    from hpctrain.checkpoint import manifest

    _run(tmp_path, (2,))
    release, loaded = threading.Event(), threading.Event()
    real = manifest.checksum

    def held(path: Path, stop: threading.Event | None = None, progress=None) -> str:
        """The index's check (which the load does not follow, unlike the shards', which run
        unheld: the index's is never queued behind them) interrupts ``load`` once it waits
        for the verdict, and hashes only when stopped."""
        if path.name != ".metadata":
            return real(path, stop, progress)
        assert loaded.wait(30)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        # Bounded: a SIGINT nobody raises (a handler left behind) fails the test, never hangs it.
        give_up = time.monotonic() + 60
        while (not (stop is not None and stop.is_set()) and not release.is_set()
               and time.monotonic() < give_up):
            release.wait(0.01)
        return real(path, stop, progress)

    problem = manifest.Verification.problem
    monkeypatch.setattr(manifest, "checksum", held)
    monkeypatch.setattr(manifest.Verification, "problem",
                        lambda self: (loaded.set(), problem(self))[1])
    _load_interrupted(tmp_path, release)


def test_a_shard_or_step_folder_that_is_a_link_is_never_followed(pg, no_faults,
                                                                 tmp_path: Path) -> None:
    """A checkpoint folder's writer could link a shard (or a whole step-N) to any file the
    reader can read: refused even when the bytes match the manifest."""
    _run(tmp_path, (2,))
    ckpt = tmp_path / step_dir_name(2)
    shard = next(ckpt.glob("*.distcp"))
    outside = tmp_path.parent / f"{tmp_path.name}-outside.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)
    m = manager(tmp_path)
    with pytest.raises(DamagedCheckpoint, match="symbolic link"):
        m.load(ckpt, checkpointing.tensor_state(_train_state(1)))
    (tmp_path / step_dir_name(3)).symlink_to(ckpt)
    assert [p.name for p in m.committed()] == [step_dir_name(2)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_loading_threads_work_on_the_targets_gpu(monkeypatch, tmp_path: Path) -> None:
    """Restoring into cuda:1 tensors, no reading thread runs on (and makes a context on) GPU 0."""
    devices: list[int] = []
    read = safe_io._read_into
    monkeypatch.setattr(safe_io, "_read_into", lambda *a: (devices.append(
        torch.cuda.current_device()), read(*a))[1])
    monkeypatch.setattr(safe_io, "_PIECE", 4096)
    source = torch.arange(1 << 16, dtype=torch.float32)
    (tmp_path / "w").write_bytes(source.numpy().tobytes())
    halves = torch.zeros(1 << 16, device="cuda:1").chunk(2)
    spans = [safe_io._Span(half, tmp_path / "w", i * half.nbytes, "w")
             for i, half in enumerate(halves)]
    staging = safe_io._Staging(2, halves[0].device, 4096)
    failed = threading.Event()
    try:
        with open(tmp_path / "w", "rb") as f:
            safe_io._each([[span] for span in spans], 2, lambda worker, span: safe_io._read_span(
                worker, f, span, staging, failed), done=staging.wait, device=halves[0].device)
    finally:
        staging.close()
    assert torch.equal(torch.cat(halves).cpu(), source)
    assert devices and set(devices) == {1}, devices


@pytest.mark.parametrize(("raised", "kind"), [(ValueError("odd"), DamagedCheckpoint),
                                              (MemoryError(), CheckpointError)])
def test_a_check_that_raises_is_a_verdict_on_every_rank(pg, no_faults, tmp_path: Path,
                                                        monkeypatch, raised, kind) -> None:
    """Whatever a check raises is a verdict, never an exception on one rank while its peers
    wait for it: damage, except no memory (which must not set a good checkpoint aside)."""
    from hpctrain.checkpoint import manifest

    _run(tmp_path, (2,))
    monkeypatch.setattr(manifest, "checksum", lambda *_a, **_k: (_ for _ in ()).throw(
        raised))
    with pytest.raises(CheckpointError) as e:
        manager(tmp_path).load(tmp_path / step_dir_name(2),
                               checkpointing.tensor_state(_train_state(1)))
    assert type(e.value) is kind, e.value.what
    assert ("could not be checked" if kind is DamagedCheckpoint else "out of memory") \
        in e.value.what


def test_a_checkpoint_known_damaged_is_not_loaded(pg, no_faults, tmp_path: Path,
                                                  monkeypatch) -> None:
    """A shard cut short is damage known before any byte is read: the fallback loads only the
    older checkpoint."""
    _run(tmp_path, (2, 3))
    shard = next((tmp_path / step_dir_name(3)).glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    read = safe_io.SafeFileSystemReader.read_data
    loaded: list[str] = []
    monkeypatch.setattr(safe_io.SafeFileSystemReader, "read_data", lambda self, *a: (
        loaded.append(Path(self.path).name), read(self, *a))[1])
    m = manager(tmp_path, keep_last=5)
    m.prefetch()
    found = m.restore_newest(_restorer(m, _train_state(1)))
    assert found is not None and found[0].name == step_dir_name(2)
    assert loaded == [step_dir_name(2)]


def test_a_load_reads_with_the_configured_threads(pg, no_faults, tmp_path: Path,
                                                  monkeypatch) -> None:
    """``checkpoint.write_threads`` sets the threads of a load as of a save."""
    _run(tmp_path, (2,))
    used: list[int] = []
    each = safe_io._each
    monkeypatch.setattr(safe_io, "_each", lambda runs, threads, *a, **k: (
        used.append(threads), each(runs, threads, *a, **k))[1])
    manager(tmp_path, write_threads=3).load(tmp_path / step_dir_name(2),
                                            checkpointing.tensor_state(_train_state(1)))
    assert used and set(used) == {3}, used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_refused_pinning_leaves_no_cuda_error_behind() -> None:
    """Buffers already registered are refused a second registration; the next kernel launch
    must not report that refusal as its own failure."""
    first = safe_io._Staging(1, torch.device("cuda"), 4096)
    try:
        assert first.pinned
        assert not safe_io._cuda_call("cudaHostRegister", torch.cuda.cudart().cudaHostRegister(
            first.flat.data_ptr(), first.flat.nbytes, 0))
        assert torch.ones(4, device="cuda").sum().item() == 4.0
    finally:
        first.close()
