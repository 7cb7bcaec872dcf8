"""The fast save and restore paths (in this process, one rank): staged tensors are written
without DCP's clone, shards are hashed as written, the files stay loadable by stock DCP, and a
restore reads whole tensors straight into their destination, falling back to DCP's path for the
rest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import safe_io, store
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import checksum, read_manifest
from hpctrain.checkpoint.staging import Attached, SharedStaging


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(64, 32, generator=g)
    return {"model": {"w": w.to(torch.bfloat16), "b": torch.rand(32, generator=g),
                      "flag": torch.tensor([True, False])},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": w * 2}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]}}


def _zeroed(state: dict) -> dict:
    out = _state(seed=1)
    for part in ("model",):
        for t in out[part].values():
            t.zero_()
    out["optim"]["state"]["w"]["exp_avg"].zero_()
    out["optim"]["param_groups"][0]["lr"] = 0.0
    return out


def _assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    else:
        assert got == want


@pytest.fixture(scope="module")
def saved(pg, tmp_path_factory: pytest.TempPathFactory):
    """One checkpoint written the way the writer process writes it (staged buffers, no CRC)."""
    root = tmp_path_factory.mktemp("fast")
    state = _state()
    staging = SharedStaging.allocate(state, torch.device("cpu"))
    skeleton = staging.stage(state)
    attached = Attached(os.dup(staging.fd), staging.nbytes, staging.specs)
    staged = attached.rebuild(skeleton)
    hashed_after: list[str] = []
    real_describe = store.describe
    store.describe = lambda p: hashed_after.append(p.name) or real_describe(p)
    torch.serialization.set_crc32_options(False)
    try:
        s = store.CheckpointStore(CheckpointConfig(write_threads=2), root, rank=0, world_size=1)
        s.write(5, staged, {"step": 5}, {"cpu": torch.zeros(4, dtype=torch.uint8)}, group=None,
                planner=attached.planner())
    finally:
        torch.serialization.set_crc32_options(True)
        store.describe = real_describe
    yield root / "step-00000005", state, staged, hashed_after
    attached.close()
    staging.close()


def test_staged_tensors_own_their_storage(saved) -> None:
    """DCP clones a tensor whose storage is larger than itself: staged ones must not be."""
    _, _, staged, _ = saved
    for t in (staged["model"]["w"], staged["optim"]["state"]["w"]["exp_avg"]):
        assert t.untyped_storage().nbytes() == t.nbytes


def test_shards_are_hashed_as_written_and_the_hashes_are_right(saved) -> None:
    path, _, _, hashed_after = saved
    files = read_manifest(path)["files"]
    shards = [name for name in files if name.endswith(".distcp")]
    assert len(shards) == 2  # write_threads=2
    assert not [n for n in hashed_after if n.endswith(".distcp")]  # no second read
    for name, entry in files.items():
        assert entry == {"size": (path / name).stat().st_size, "xxh3": checksum(path / name)}


def test_stock_dcp_loads_the_checkpoint(saved) -> None:
    path, state, _, _ = saved
    target = _zeroed(state)
    dcp.load(target, checkpoint_id=path, no_dist=True)
    _assert_same(target, state)


def test_restore_reads_whole_tensors_directly_and_the_rest_through_dcp(saved, monkeypatch
                                                                       ) -> None:
    path, state, _, _ = saved
    direct: list[str] = []
    real = safe_io.SafeFileSystemReader._direct_span

    def spy(self, f, item, target):
        span = real(self, f, item, target)
        if span is not None:
            direct.append(item.storage_index.fqn)
        return span

    monkeypatch.setattr(safe_io.SafeFileSystemReader, "_direct_span", spy)
    target = _zeroed(state)
    target["model"]["b"] = target["model"]["b"].clone()[::1]
    # A destination that is not contiguous takes DCP's path (loaded, then copied).
    target["optim"]["state"]["w"]["exp_avg"] = torch.zeros(32, 64).t()
    import torch.distributed as dist

    m = CheckpointManager(CheckpointConfig(), path.parent, rank=0, world_size=1,
                          device=torch.device("cpu"), group=dist.group.WORLD)
    m.restore(path, lambda p, _m: m.load(p, target))
    _assert_same(target, state)
    assert sorted(direct) == ["model.b", "model.flag", "model.w", "optim.state.w.step"]
    # The plain values (learning rate, betas) take DCP's own path.


def test_a_saved_layout_unlike_the_destination_is_not_read_directly(saved) -> None:
    """The saved pickle is read onto the meta device: nothing allocated, nothing run."""
    path, _, _, _ = saved
    layout = safe_io._saved_layout
    import io

    buf = io.BytesIO()
    torch.save(torch.rand(3, 4).t(), buf)
    archive = torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
    meta = layout(archive.get_record("data.pkl"))
    assert meta.device.type == "meta" and meta.shape == (4, 3) and not meta.is_contiguous()


def test_verification_reads_the_files_in_parallel_and_names_the_first_bad(tmp_path: Path,
                                                                          monkeypatch) -> None:
    import threading

    from hpctrain.checkpoint import manifest
    from hpctrain.checkpoint.manifest import DamagedCheckpoint, describe, verify_files

    names = ["a", "b", "c"]
    for name in names:
        (tmp_path / name).write_bytes(name.encode() * 1000)
    files = {name: describe(tmp_path / name) for name in names}
    (tmp_path / "b").write_bytes(b"B" * 1000)
    (tmp_path / "c").write_bytes(b"C" * 1000)
    # Every file's hash waits for the others: only reads running at once get past it.
    together = threading.Barrier(len(names), timeout=20)
    real = manifest.checksum

    def meeting(path, stop=None, progress=None):
        together.wait()
        return real(path, stop, progress)

    monkeypatch.setattr(manifest, "checksum", meeting)
    with pytest.raises(DamagedCheckpoint, match=r"/b checksum .* \(corrupted\)"):
        verify_files(tmp_path, files, names)


def _written_through(tmp_path: Path, monkeypatch, block: int, data: list[bytes]):
    """Write ``data`` through a shard stream with ``block``-byte direct blocks; the stream and
    the (bytes, O_DIRECT set?) of every write it made."""
    import fcntl

    monkeypatch.setattr(store._HashingStream, "_DIRECT_BLOCK", block, raising=False)
    writes: list[tuple[int, bool]] = []
    real = getattr(store, "_write_all", None)

    def spy(fd, view):
        writes.append((len(view), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        real(fd, view)

    monkeypatch.setattr(store, "_write_all", spy, raising=False)
    path = tmp_path / "__0_0.distcp"
    fs = store._HashingFileSystem()
    with fs.create_stream(path, "wb") as stream:
        for chunk in data:
            stream.write(chunk)
        stream.flush()  # DCP flushes after every item: not the end of the file
        fd = stream.fileno()
        os.fsync(fd)
        synced = os.fstat(fd).st_size  # what the fsync covered
    return path, fs, writes, synced


def test_shards_are_written_in_direct_blocks_and_the_tail_buffered(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Whole blocks go to the device without the page cache (O_DIRECT, as bench disk writes),
    where the file system allows it: the copy into the cache and its writeback cost more CPU
    than the device's own time (0.3-0.44 vs 1.4-1.6 GB/s on one core here)."""
    from hpctrain.bench.disk import _direct_works
    from hpctrain.runtime.mounts import in_memory

    if in_memory(tmp_path) or not _direct_works(tmp_path / "probe", 8192):
        pytest.skip("no O_DIRECT on this file system (the buffered path is tested below)")
    data = [os.urandom(5000), os.urandom(20000), b"x" * 3]  # 25,003 bytes: 3 blocks + tail
    path, fs, writes, _ = _written_through(tmp_path, monkeypatch, 8192, data)
    assert path.read_bytes() == b"".join(data)
    assert fs.digests[path.name] == {"size": 25003, "xxh3": checksum(path)}
    assert writes == [(8192, True)] * 3 + [(25003 - 3 * 8192, False)]


def test_tmpfs_shards_are_written_buffered(tmp_path: Path, monkeypatch) -> None:
    """On tmpfs the page cache is the storage: a direct write would only add a copy."""
    monkeypatch.setattr(store, "in_memory", lambda _path: True)
    data = [os.urandom(20000)]
    path, _, writes, _ = _written_through(tmp_path, monkeypatch, 8192, data)
    assert path.read_bytes() == data[0]
    assert writes and not any(direct for _, direct in writes)


def test_fsync_covers_every_byte_written(tmp_path: Path, monkeypatch) -> None:
    """DCP fsyncs ``stream.fileno()`` before it closes the stream: every byte written must be
    in the file by then, or the end of a shard is not durable when the checkpoint commits."""
    data = [b"header" * 10, b"tail"]
    path, fs, _, synced = _written_through(tmp_path, monkeypatch, 1 << 20, data)
    assert synced == 64 and path.read_bytes() == b"".join(data)
    assert fs.digests[path.name]["size"] == 64


def test_a_file_system_that_refuses_direct_writes_gets_them_buffered(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """O_DIRECT accepted when set but refused at the first write (EINVAL): the bytes go on
    buffered, none lost or repeated."""
    import errno
    import fcntl

    real = store._write_all

    def refusing(fd, view):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, view)

    monkeypatch.setattr(store, "_write_all", refusing)
    monkeypatch.setattr(store._HashingStream, "_DIRECT_BLOCK", 4096)
    data = os.urandom(10_000)
    path = tmp_path / "__0_0.distcp"
    fs = store._HashingFileSystem()
    with fs.create_stream(path, "wb") as stream:
        stream.write(data[:5000])
        stream.write(data[5000:])
        os.fsync(stream.fileno())
    assert path.read_bytes() == data
    assert fs.digests[path.name] == {"size": 10_000, "xxh3": checksum(path)}


def test_retention_deletes_the_old_checkpoint_after_the_commit(pg, tmp_path: Path,
                                                               monkeypatch) -> None:
    """A save returns once committed: the older checkpoint is out of the way at once (renamed)
    and its blocks are freed by a thread (0.3-0.4 s per GB here, inside every save before)."""
    import shutil
    import threading

    release = threading.Event()
    real = shutil.rmtree

    def slow(path, *args, **kwargs):
        if "step-00000001" in Path(path).name and Path(path).exists():
            release.wait(30)
        real(path, *args, **kwargs)

    monkeypatch.setattr(store.shutil, "rmtree", slow)
    s = store.CheckpointStore(CheckpointConfig(keep_last=1), tmp_path, rank=0, world_size=1)
    for step in (1, 2):
        saving = threading.Thread(target=s.write, args=(step, _state(), {"step": step},
                                                        {"cpu": torch.zeros(1)}),
                                  kwargs={"group": None})
        saving.start()
        saving.join(5)
        committed = not saving.is_alive()
        if not committed:
            release.set()  # let the old code finish, then fail
        saving.join()
        assert committed, f"save {step} waited for the older checkpoint's deletion"
    assert [p.name for p in s.committed()] == ["step-00000002"]
    assert (tmp_path / ".retired-step-00000001").is_dir()  # retired, not yet deleted
    release.set()
    s.wait_removed()
    assert not (tmp_path / ".retired-step-00000001").exists()


def test_direct_io_off_writes_every_shard_buffered(pg, tmp_path: Path, monkeypatch) -> None:
    """checkpoint.direct_io=false: the way out where a file system takes O_DIRECT badly."""
    import fcntl

    direct: list[bool] = []
    real = store._write_all

    def spy(fd, view):
        direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        real(fd, view)

    monkeypatch.setattr(store, "_write_all", spy)
    monkeypatch.setattr(store._HashingStream, "_DIRECT_BLOCK", 4096)
    s = store.CheckpointStore(CheckpointConfig(direct_io=False), tmp_path, rank=0, world_size=1)
    s.write(1, _state(), {"step": 1}, {"cpu": torch.zeros(1)}, group=None)
    assert direct and not any(direct)
