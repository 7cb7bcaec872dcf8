"""The image path end to end on real data: scikit-learn's handwritten digits (1,797 8x8 images,
10 classes), upsampled to 32x32, encoded as JPEGs and packed into shards with a held-out split.

A tiny ResNet trained in this process reaches >= 90% top-1 on the held-out split (exact over
all of it); then examples/resnet50_images.py on 2 FSDP ranks in bf16 (stages sharded, BatchNorm
kept in fp32, channels_last inputs) is killed with kill -9 mid-run and rerun: the steps it redoes
after the resume log bit-identical losses, and its losses are those of one process that runs
the same micro-batches as gradient accumulation. Three images of its first steps are corrupt
(two on one rank, one on the other): they are skipped, and both runs train on the mean over the
images that decoded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from lifecycle import kill_tree_of, start
from run_records import assert_close, logged

sklearn_datasets = pytest.importorskip("sklearn.datasets")
Image = pytest.importorskip("PIL.Image")

# Trains at 16x16 crops of the 32x32 JPEGs: the digits hold 8x8 pixels of information, and a
# quarter of the pixels is a quarter of the CPU time.
TASK = {"model": "resnet_tiny", "image_size": 16, "eval_resize": 16, "crop_scale_min": 0.5,
        "hflip": False, "label_smoothing": 0.0}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits as class folders of 32x32 JPEGs, packed with a 20% held-out split."""
    from hpctrain.data.images.pack import PackSettings, pack_images

    root = tmp_path_factory.mktemp("digits")
    digits = sklearn_datasets.load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), "L")
        path = root / "src" / str(label) / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        gray.resize((32, 32), Image.BILINEAR).convert("RGB").save(path, quality=95)
    pack_images(root / "src", root / "shards", PackSettings(val_fraction=0.2))
    return root / "shards"


def test_tiny_resnet_reaches_90_percent_on_held_out_digits(shards: Path, tmp_path: Path) -> None:
    from hpctrain import fit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on a loaded 2-core machine spin: 20x slower
    try:
        fit(overrides={"task": "hpctrain.tasks.images:classifier",
                       "task_args": {**TASK, "data": str(shards)},
                       "train.steps": 120, "train.micro_batch": 32, "train.precision": "fp32",
                       "train.val_max_samples": 0, "optim.lr": 3e-3, "optim.warmup_steps": 10,
                       "optim.weight_decay": 0.0, "optim.min_lr_ratio": 0.0,
                       "run.out_dir": str(tmp_path), "run.name": "digits",
                       "run.device": "cpu", "checkpoint.interval": "none",
                       "checkpoint.save_at_end": False, "metrics.progress": False,
                       "metrics.log_every": 40})
    finally:
        torch.set_num_threads(threads)
    (val,) = [r for r in _records(tmp_path / "digits") if "val_top1" in r]
    assert val["val_samples"] == 359  # the whole held-out split, each image once
    assert val["val_top1"] >= 0.90, val
    assert val["val_top5"] >= val["val_top1"]


def _corrupt_first_steps(shards: Path) -> list[str]:
    """Zero the bytes after the JPEG marker (in place) of two images rank 1 reads at step 1 and
    one rank 0 reads at step 2 (micro-batches of 8 on 2 ranks, run.seed 0); their keys."""
    from hpctrain.data.images.reader import ImageShards
    from hpctrain.data.order import BatchLayout, GlobalOrderSampler

    root = shards / "train"
    ds = ImageShards(root)
    starts = np.cumsum(ds.shard_sample_counts) - ds.shard_sample_counts
    shards_meta = json.loads((root / "manifest.json").read_text())["shards"]
    keys = []
    for rank, step, count in ((1, 1, 2), (0, 2, 1)):
        sampler = GlobalOrderSampler(len(ds), BatchLayout(8, 1, 2, rank), seed=0)
        for _ in range(step):
            (indices,) = sampler.next_step()
        for i in indices[:count].tolist():
            s = int(np.searchsorted(starts, i, side="right")) - 1
            index = json.loads((root / shards_meta[s]["idx"]).read_text())
            j = i - int(starts[s])
            (offset, size), = [(o, n) for ext, o, n in index["members"][j] if ext == "jpg"]
            with open(root / shards_meta[s]["tar"], "r+b") as f:
                f.seek(offset + 4)
                f.write(bytes(size - 4))
            keys.append(index["keys"][j])
    ds.close()
    return keys


def test_example_killed_and_rerun_on_2_fsdp_ranks_resumes_bit_identically(
        shards: Path, tmp_path: Path) -> None:
    """Hang before step 6 once step 3's checkpoint is committed; kill -9 it all; rerun."""
    bad = _corrupt_first_steps(shards)
    args = [f"task_args.{k}={json.dumps(v)}" for k, v in {**TASK, "data": str(shards)}.items()]
    common = ["train.precision=bf16", "train.deterministic=true", "metrics.log_every=1",
              "metrics.progress=false", "optim.warmup_steps=2", "optim.lr=3e-3",
              f"run.out_dir={tmp_path}"]
    argv = ["train", "examples/resnet50_images.py", "--nproc", "2", *args, "train.steps=6",
            "train.micro_batch=8", "parallel.strategy=fsdp", *common, "run.suffix=none",
            "checkpoint.every=3", "run.name=killed"]
    run = start(argv, tmp_path / "killed.log", tmp_path / "killed",
                env={"HPCTRAIN_FAULTS": "hang@step=6,seconds=600"})
    try:
        run.wait_for("step 5 and the checkpoint of step 3",
                     lambda: run.steps() >= 5 and run.latest() == "step-00000003", timeout=200)
    finally:
        kill_tree_of(run)
    before = logged(tmp_path, "killed")
    rerun = start(argv, tmp_path / "rerun.log", tmp_path / "killed")
    assert rerun.proc.wait(timeout=240) == 0, rerun.output()[-3000:]
    after = logged(tmp_path, "killed")  # the rerun's records of steps 4-6 come last
    assert "resumed from step-00000003" in rerun.output()
    assert [after[s] for s in (4, 5)] == [before[s] for s in (4, 5)]
    (val,) = [r for r in _records(tmp_path / "killed") if "val_top1" in r]
    assert val["val_samples"] == 256  # train.val_max_samples of the 359 held out
    logs = {r: (tmp_path / "killed" / "logs" / f"rank-00{r}.log").read_text(errors="replace")
            for r in (0, 1)}
    assert all(f"skipping image {k!r}" in logs[0] + logs[1] for k in bad), bad

    # One process, the same 16 images a step as two micro-batches of 8 (rank 0's, rank 1's):
    # the same BatchNorm batches, crops and weights, so the same losses (bf16: to rounding,
    # 5e-4 seen).
    from hpctrain import fit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit(overrides=[*args, *common, f"task={REPO / 'examples' / 'resnet50_images.py'}",
                       "train.steps=5", "train.micro_batch=8", "train.grad_accum=2",
                       "run.name=one",
                       "checkpoint.interval=none", "checkpoint.save_at_end=false",
                       "train.val_every=0"], fresh=True)
    finally:
        torch.set_num_threads(threads)
    one = logged(tmp_path, "one")
    for step in range(1, 6):
        assert_close(before[step], one[step], 2e-3, f"FSDP on 2 ranks vs one process, step {step}")


def _records(run_dir: Path) -> list[dict]:
    from hpctrain.observe.metrics import read_metrics

    return read_metrics(run_dir / "metrics" / "rank-000.jsonl")
