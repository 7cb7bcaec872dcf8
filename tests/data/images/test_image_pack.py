"""`hpctrain data pack-images`: manifests, splits, skipped files, links, determinism, resume."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from image_trees import CLASSES, PER_CLASS, image_tree_fixture, tiny_jpeg  # noqa: F401

from hpctrain.cli import main
from hpctrain.data.images import ImageShards
from hpctrain.data.images.pack import PackSettings, pack_images, verify_images
from hpctrain.data.staging import clear_cache
from hpctrain.errors import ConfigError, DataError

SMALL = PackSettings(shard_bytes=6000, val_fraction=0.25)  # ~3 tiny JPEGs per shard


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def packed(image_tree, tmp_path_factory) -> Path:
    src, _ = image_tree
    out = tmp_path_factory.mktemp("packed") / "out"
    pack_images(src, out, SMALL)
    return out


def test_manifest_counts_classes_and_skipped(packed, image_tree) -> None:
    _, images = image_tree
    raw = verify_images(packed)
    assert raw["classes"] == list(CLASSES)
    assert [s["path"] for s in raw["skipped"]] == ["dog/notes.jpg"]
    assert "not an image" in raw["skipped"][0]["why"]
    n_val = round(PER_CLASS * 0.25)
    assert raw["splits"]["val"]["class_counts"] == [n_val] * len(CLASSES)
    assert raw["splits"]["train"]["class_counts"] == [PER_CLASS - n_val] * len(CLASSES)
    for split in ("train", "val"):
        m = json.loads((packed / split / "manifest.json").read_text())
        assert m["classes"] == list(CLASSES) and m["split"] == split
        assert len(m["shards"]) == raw["splits"][split]["shards"] >= 2
        for s in m["shards"]:
            assert sum(s["class_counts"]) == s["samples"]
            assert s["checksum"].startswith("sha256:") and s["bytes"] > 0
    # Shuffled into shards: the first train shard does not hold a single class.
    first = json.loads((packed / "train" / "manifest.json").read_text())["shards"][0]
    assert max(first["class_counts"]) < first["samples"] or first["samples"] == 1


def test_shards_give_the_original_bytes_and_labels(packed, image_tree) -> None:
    _, images = image_tree
    seen = {}
    for split in ("train", "val"):
        ds = ImageShards(packed, split)
        for i in range(len(ds)):
            data, label = ds[i]
            sample = ds[i]
            cls = sample.key.split("/")[0]
            assert label == CLASSES.index(cls)
            seen[f"{sample.key}.jpg"] = data.numpy().tobytes()
        ds.close()
    # DataLoader workers (spawn) get the dataset pickled: it must not carry this process's
    # open file descriptors, which mean nothing (or another file) over there.
    ds = ImageShards(packed, "val")
    want = ds[0][0]
    copy = pickle.loads(pickle.dumps(ds))
    ds.close()  # the descriptors the copy would have carried are closed now
    assert torch.equal(copy[0][0], want)
    copy.close()
    # DataLoader workers pickle samples: the shard and key come along.
    back = pickle.loads(pickle.dumps(sample))
    assert torch.equal(back[0], sample[0]) and back[1] == sample[1] and len(back) == 2
    assert (back.shard, back.key, back.shard_samples) == (sample.shard, sample.key,
                                                          sample.shard_samples)
    assert seen == images  # every image once, byte for byte, across the two splits


def test_repack_is_byte_identical_and_resume_keeps_finished_shards(packed, image_tree,
                                                                   tmp_path) -> None:
    src, _ = image_tree
    out = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt):
        pack_images(src, out, SMALL, stop_after_shards=2, readers=1)  # the rest: 8 readers
    assert (out / "pack.partial.json").is_file() and not (out / "manifest.json").exists()
    first = (out / "train" / "shard-000000.tar").stat()
    pack_images(src, out, SMALL)  # the same command again: resumes
    again = (out / "train" / "shard-000000.tar").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not redone
    assert not (out / "pack.partial.json").exists()
    assert _tree_bytes(out) == _tree_bytes(packed)


def test_resume_redoes_a_damaged_shard(image_tree, tmp_path) -> None:
    src, _ = image_tree
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        pack_images(src, out, SMALL, stop_after_shards=2)
    shard = out / "train" / "shard-000001.tar"
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])  # torn by a crash
    pack_images(src, out, SMALL)
    assert shard.read_bytes() == good
    verify_images(out)


def test_link_out_of_the_tree_is_skipped(image_tree, tmp_path, caplog) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "a.jpg").write_bytes(tiny_jpeg(1))
    (tmp_path / "secret.jpg").write_bytes(tiny_jpeg(2))
    os.symlink(tmp_path / "secret.jpg", src / "cat" / "b.jpg")
    with caplog.at_level(logging.WARNING, logger="hpctrain.data"):
        pack_images(src, tmp_path / "out")
    assert "outside the inputs" in caplog.text and "b.jpg" in caplog.text
    ds = ImageShards(tmp_path / "out")
    assert len(ds) == 1 and ds[0].key == "cat/a"


def test_table_of_paths_and_labels(tmp_path) -> None:
    data = tmp_path / "data"
    (data / "imgs").mkdir(parents=True)
    rows = ["path,label,split"]
    for i in range(6):
        (data / "imgs" / f"x{i}.v2.jpg").write_bytes(tiny_jpeg(i))
        rows.append(f"imgs/x{i}.v2.jpg,{[10, 2][i % 2]},{'val' if i == 5 else 'train'}")
    (tmp_path / "outside.jpg").write_bytes(tiny_jpeg(9))
    os.symlink(tmp_path / "outside.jpg", data / "imgs" / "link.jpg")
    rows += ["imgs/link.jpg,2,", "imgs/missing.jpg,2,"]
    table = data / "labels.csv"
    table.write_text("\n".join(rows) + "\n")
    raw = json.loads(pack_images(table, tmp_path / "out").read_text())
    assert raw["classes"] == ["2", "10"]  # integer labels sort as numbers
    assert sorted(s["path"] for s in raw["skipped"]) == ["imgs/link.jpg", "imgs/missing.jpg"]
    assert raw["splits"]["train"]["samples"] == 5 and raw["splits"]["val"]["samples"] == 1
    ds = ImageShards(tmp_path / "out", "train")
    assert sorted((s.key, s[1]) for s in (ds[i] for i in range(len(ds)))) == [
        ("imgs/x0_v2", 1), ("imgs/x1_v2", 0), ("imgs/x2_v2", 1), ("imgs/x3_v2", 0),
        ("imgs/x4_v2", 1)]

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"path": [f"imgs/x{i}.v2.jpg" for i in range(4)],
                                "label": [3, 1, 3, 20]}), data / "labels.parquet")
    raw = json.loads(pack_images(data / "labels.parquet", tmp_path / "outpq").read_text())
    assert raw["classes"] == ["1", "3", "20"] and raw["splits"]["train"]["samples"] == 4

    (data / "bad.csv").write_text("path,label\nimgs/../../outside.jpg,1\n")
    with pytest.raises(DataError, match="leaves the table's folder"):
        pack_images(data / "bad.csv", tmp_path / "out2")
    with pytest.raises(ConfigError, match="val-fraction"):
        pack_images(table, tmp_path / "out3", PackSettings(val_fraction=0.5))


def test_cli_pack_and_verify(image_tree, tmp_path, capfd) -> None:
    src, _ = image_tree
    out = tmp_path / "out"
    main(["data", "pack-images", str(src), "--out", str(out), "--shard-mb", "0.01",
          "--val-fraction", "0.25", "--no-progress"])
    assert "3 classes, train 18 images" in capfd.readouterr().out
    main(["data", "verify", str(out)])
    assert "checksums OK" in capfd.readouterr().out
    shard = out / "val" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\1")
    with pytest.raises(SystemExit) as e:
        main(["data", "verify", str(out)])
    assert e.value.code != 0
    assert "checksum mismatch" in capfd.readouterr().err


def test_staged_split_reads_the_same_samples(packed, tmp_path) -> None:
    local = tmp_path / "local"
    clear_cache()
    try:
        staged = ImageShards(packed, "val", stage_to=str(local), local_rank=0)
        shared = ImageShards(packed, "val")
        assert staged.root.is_relative_to(local) and staged.root.name.startswith("val-")
        assert len(staged) == len(shared) > 0
        assert all(torch.equal(staged[i][0], shared[i][0]) and staged[i][1] == shared[i][1]
                   for i in range(len(shared)))
    finally:
        clear_cache()


def test_webdataset_reads_the_image_shards(packed, image_tree) -> None:
    wds = pytest.importorskip("webdataset")
    _, images = image_tree
    m = json.loads((packed / "val" / "manifest.json").read_text())
    got = list(wds.WebDataset([str(packed / "val" / s["tar"]) for s in m["shards"]],
                              shardshuffle=False))
    assert len(got) == m["samples"]
    for sample in got:
        assert sample["jpg"] == images[f"{sample['__key__']}.jpg"]
        assert int(sample["cls"]) == CLASSES.index(sample["__key__"].split("/")[0])


def test_a_split_folder_read_as_the_other_split_is_refused(packed) -> None:
    assert len(ImageShards(packed / "val", "val")) == len(ImageShards(packed, "val"))
    with pytest.raises(DataError, match="is the 'val' split"):
        ImageShards(packed / "val")  # split="train" by default


def test_a_split_folder_of_another_dataset_is_refused_and_untouched(image_tree, tmp_path) -> None:
    src, _ = image_tree
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    theirs = {"shard-000000.tar": b"their shard", "manifest.json": b"{}", "notes.txt": b"x"}
    for name, data in theirs.items():
        (out / "train" / name).write_bytes(data)
    with pytest.raises(DataError, match="did not write"):
        pack_images(src, out, SMALL)
    assert _tree_bytes(out / "train") == theirs


def test_an_input_edited_in_place_is_another_job(tmp_path) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    for i in range(4):
        (src / "cat" / f"{i}.jpg").write_bytes(tiny_jpeg(i))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        pack_images(src, out, PackSettings(shard_bytes=1), stop_after_shards=1, readers=1)
    edited = src / "cat" / "0.jpg"
    stat = edited.stat()
    edited.write_bytes(tiny_jpeg(7)[:stat.st_size].ljust(stat.st_size, b"\0"))  # same size
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="interrupted pack of other inputs"):
        pack_images(src, out, PackSettings(shard_bytes=1))


def test_a_table_row_swapped_to_a_link_out_after_its_check_is_not_read(tmp_path,
                                                                       monkeypatch) -> None:
    from hpctrain.data.images import listing
    data = tmp_path / "data"
    data.mkdir()
    (data / "inside.jpg").write_bytes(tiny_jpeg(1))
    (tmp_path / "secret.jpg").write_bytes(tiny_jpeg(2))
    os.symlink(data / "inside.jpg", data / "a.jpg")
    (data / "labels.csv").write_text("path,label\na.jpg,1\n")
    vet = listing.vet_file

    def swap_then_vet(path):  # the race: the link changes between the check and the vetting
        if path != data / "labels.csv" and (data / "a.jpg").is_symlink():
            (data / "a.jpg").unlink()
            os.symlink(tmp_path / "secret.jpg", data / "a.jpg")
        return vet(path)

    monkeypatch.setattr(listing, "vet_file", swap_then_vet)
    entries = listing.from_table(data / "labels.csv", follow=False, skipped=[])
    assert [e.file.real for e in entries] == [data / "inside.jpg"]
