"""`hpctrain data pack`: WebDataset-readable tar shards; global order, equal counts, resume."""

from __future__ import annotations

import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from hpctrain.data import tar_samples
from hpctrain.data.loader import BatchLayout, GlobalOrderSampler
from hpctrain.data.tar_samples import SampleLoader, TarSamples, pack, verify_tar
from hpctrain.errors import DataError

N_SAMPLES = 23  # not divisible by 2, 3 or 4


def _make_tree(root: Path) -> dict[str, dict[str, bytes]]:
    """23 samples in two subdirectories: x.bin (random size) + x.json (+ x.cls for some)."""
    rng = np.random.default_rng(0)
    want: dict[str, dict[str, bytes]] = {}
    for i in range(N_SAMPLES):
        key = f"{'ab'[i % 2]}/s{i:03d}"
        fields = {"bin": rng.bytes(int(rng.integers(100, 3000))),
                  "json": json.dumps({"i": i}).encode()}
        if i % 3 == 0:
            fields["cls"] = str(i % 5).encode()
        for ext, data in fields.items():
            path = root / f"{key}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        want[key] = fields
    return want


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("pack")
    want = _make_tree(root / "src")
    pack(root / "src", root / "out", shard_bytes=8000)
    return root / "out", want


def test_pack_writes_shards_and_manifest(packed) -> None:
    out, want = packed
    raw = verify_tar(out)
    assert raw["samples"] == N_SAMPLES
    assert len(raw["shards"]) >= 5  # several shards of about 8 kB
    assert sum(s["samples"] for s in raw["shards"]) == N_SAMPLES
    assert all(s["bytes"] < 8000 + 4096 or s["samples"] == 1 for s in raw["shards"])


def test_webdataset_reads_the_same_keys_and_bytes(packed) -> None:
    wds = pytest.importorskip("webdataset")
    out, want = packed
    urls = [str(out / s["tar"]) for s in verify_tar(out)["shards"]]
    got = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        got[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert got == want


def test_pack_is_byte_identical_when_repeated(packed, tmp_path: Path) -> None:
    out, _ = packed
    again = tmp_path / "again"
    pack(Path(verify_tar(out)["source"]), again, shard_bytes=8000)
    for f in sorted(out.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name


def test_tar_samples_random_access_and_decode(packed) -> None:
    out, want = packed
    ds = TarSamples(out, decode=lambda s: json.loads(s["json"])["i"])
    assert len(ds) == N_SAMPLES
    keys = sorted(want)
    for i in (0, 7, N_SAMPLES - 1, 3):
        raw = ds.sample(i)
        assert raw.pop("__key__").decode() == keys[i]
        assert raw == want[keys[i]]
        assert ds[i] == int(keys[i][-3:])
    with pytest.raises(IndexError):
        ds.sample(N_SAMPLES)
    ds.close()


def test_tar_samples_pickle_without_their_open_files(packed) -> None:
    """A DataLoader worker started by spawn (or Lightning) gets the dataset pickled: it opens
    the shards itself rather than reusing descriptor numbers that mean nothing there (or
    another file), and a forked child does not share the parent's."""
    out, want = packed
    ds = TarSamples(out)
    first = ds.sample(N_SAMPLES - 1)  # opens the last shard
    blob = pickle.dumps(ds)
    ds.close()  # its descriptor numbers are free again: the next open may reuse them
    decoy = os.open(out / "manifest.json", os.O_RDONLY)
    try:
        copy = pickle.loads(blob)
        assert copy.sample(N_SAMPLES - 1) == first
        assert copy.sample(0).pop("__key__").decode() == sorted(want)[0]
        copy.close()
    finally:
        os.close(decoy)
    ds = TarSamples(out)
    ds.sample(0)
    pid = os.fork()
    if pid == 0:  # the child opens its own files, reads, closes them
        ok = ds.sample(1) == TarSamples(out).sample(1)
        ds.close()
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert ds.sample(1)  # the parent's descriptors survive the child's exit
    ds.close()


def _by_rank(ds, world: int, micro: int, accum: int, seed: int, steps: int, start: int = 0):
    loaders = []
    for r in range(world):
        s = GlobalOrderSampler(len(ds), BatchLayout(micro, accum, world, r), seed)
        loader = SampleLoader(ds, s)
        loader.load_state_dict({"step": start, "global_batch": micro * accum * world,
                                "seed": seed, "shuffle_window": ds.window_shards})
        loaders.append(loader)
    out = []
    for _ in range(steps):
        per_rank = [lo.next_step() for lo in loaders]
        assert len({len(p[a]) for p in per_rank for a in range(accum)}) == 1  # equal counts
        out.append([x for a in range(accum) for r in range(world) for x in per_rank[r][a]])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_and_same_order_on_any_world(packed, world: int) -> None:
    out, _ = packed
    ds = TarSamples(out, decode=lambda s: json.loads(s["json"])["i"], window_shards=2)
    gb = 12  # global batch; 23 samples leave a remainder of 11 each epoch
    steps = N_SAMPLES // gb
    ref = _by_rank(ds, 1, gb, 1, seed=4, steps=3 * steps)
    micro, accum = {1: (12, 1), 2: (3, 2), 3: (2, 2), 4: (3, 1)}[world]
    got = _by_rank(ds, world, micro, accum, seed=4, steps=3 * steps)
    assert got == ref
    for e in range(3):
        epoch = [x for step in got[e * steps : (e + 1) * steps] for x in step]
        assert len(epoch) == len(set(epoch)) == steps * gb  # no repeat; remainder dropped
    assert [x for s in got[:steps] for x in s] != [x for s in got[steps : 2 * steps] for x in s]


@pytest.mark.parametrize(("k", "world_after"), [(1, 2), (2, 4), (3, 3)])
def test_resume_is_exact_on_another_world_size(packed, k: int, world_after: int) -> None:
    out, _ = packed
    dec = lambda s: s["__key__"]  # noqa: E731
    full = _by_rank(TarSamples(out, dec, 2), 2, 3, 2, seed=9, steps=k + 4)
    micro = {2: 6, 3: 4, 4: 3}[world_after]
    resumed = _by_rank(TarSamples(out, dec, 2), world_after, micro, 1, seed=9, steps=4, start=k)
    assert resumed == full[k:]


def test_pack_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no files"):
        pack(tmp_path / "empty", tmp_path / "o")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "README").write_text("x")
    with pytest.raises(DataError, match="no extension"):
        pack(tmp_path / "bad", tmp_path / "o")
    with pytest.raises(DataError, match="not a directory"):
        pack(tmp_path / "missing", tmp_path / "o")


def test_cli_pack_and_verify_detects_corruption(tmp_path: Path) -> None:
    _make_tree(tmp_path / "src")
    r = run_cli(["data", "pack", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                 "--shard-mb", "0.01"])
    assert r.returncode == 0, r.stderr
    assert f"{N_SAMPLES} samples" in r.stdout
    tar = tmp_path / "out" / "shard-000001.tar"
    data = bytearray(tar.read_bytes())
    data[700] ^= 1
    tar.write_bytes(bytes(data))
    r = run_cli(["data", "verify", str(tmp_path / "out")])
    assert r.returncode != 0 and "shard-000001.tar" in r.stderr and "Traceback" not in r.stderr


def test_tar_samples_read_from_several_threads(packed) -> None:
    """Threads reading while shards are closed to make room (one open shard here: every
    switch evicts) each get their own sample's bytes, never a closed or reused descriptor."""
    out, want = packed
    ds = TarSamples(out)
    ds.open_shards = 1
    keys = sorted(want)
    order = list(range(N_SAMPLES)) * 20

    def read(shift: int) -> list[str]:
        bad = []
        for i in order[shift:] + order[:shift]:
            raw = ds.sample(i)
            if raw.pop("__key__").decode() != keys[i] or raw != want[keys[i]]:
                bad.append(keys[i])
        return bad

    with ThreadPoolExecutor(4) as pool:
        assert [b for bad in pool.map(read, (0, 5, 11, 17)) for b in bad] == []
    ds.close()


def test_read_many_reads_each_sample_in_one_call(packed, monkeypatch, tmp_path: Path) -> None:
    # Each read lets go of the GIL and takes it back (what a busy training thread makes
    # expensive): a sample's members, together in its shard, come in one read.
    out, want = packed
    ds = TarSamples(out)
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(at) or real(fd, bufs, at))
    indices = [22, 0, 5, 5, 13]
    got = ds.read_many(indices)
    assert len(reads) == len(indices)
    for i, (s, key, members) in zip(indices, got, strict=True):
        raw = ds.sample(i)
        assert key.encode() == raw["__key__"] and {e: bytes(m) for e, m in members.items()} == {
            e: v for e, v in raw.items() if e != "__key__"}
        assert int(ds._starts[s]) <= i < int(ds._starts[s + 1])
        assert not members["bin"].readonly  # torch.frombuffer takes it without a copy
    with pytest.raises(IndexError, match="sample 23 out of range"):
        ds.read_many([1, N_SAMPLES])
    ds.close()
    # Members further apart than a tar header and padding are read apart.
    monkeypatch.setattr(tar_samples, "_MEMBER_GAP", 0)
    reads.clear()
    three = next(i for i, k in enumerate(sorted(want)) if len(want[k]) == 3)
    (_, key, members), = ds.read_many([three])
    assert len(reads) == len(members) == 3  # bin, cls, json: a header between each two
    assert {e: bytes(m) for e, m in members.items()} == want[key]
    ds.close()
    # A truncated shard reads short, as os.pread does.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    first = verify_tar(copy)["shards"][0]
    idx = json.loads((copy / first["idx"]).read_text())
    ext, offset, size = idx["members"][0][-1]
    os.truncate(copy / first["tar"], offset + size // 2)
    (_, key, members), = TarSamples(copy).read_many([0])
    assert bytes(members[ext]) == want[key][ext][:size // 2]
