"""benchmarks/images.py on the CPU at its tiny size: path (a) (tensors on the device), path (b)
(hpctrain from tar shards, through the recipe) and the loader alone run and give rates; (c)
and (d) need torchvision and Lightning, which exist on the GPU image only, and are skipped
saying so."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("PIL")


@pytest.fixture
def bench():
    """benchmarks/images.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_images", REPO / "benchmarks" / "images.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_decode_settings_parse_to_the_task_args(bench) -> None:
    parse = bench.parse_variant
    assert parse("gpu", 3) == bench.Variant("gpu", 3)
    assert parse("serial", 1).decode_ahead is False
    assert parse("split0.25t8", 1) == bench.Variant("split0.25t8", 8, 0.25)
    assert parse("cpu16r160", 1) == bench.Variant("cpu16r160", 16, 1.0, decode_min_side=160)
    assert parse("split0.5", 1).task_args() == [
        "task_args.decode_threads=1", "task_args.cpu_fraction=0.5",
        "task_args.decode_ahead=true", "task_args.decode_min_side=0",
        "task_args.gil_switch_ms=0.0", "task_args.cuda_graphs=false"]
    # The host-bound tests: the GIL switch interval (a task arg) and CUDA graphs (inductor's).
    assert parse("gpus0.5g", 1) == bench.Variant("gpus0.5g", 1, gil_switch_ms=0.5,
                                                 cuda_graphs=True)
    assert parse("gpug", 1).cuda_graphs and parse("gpus1", 1).gil_switch_ms == 1.0
    for bad in ("split1.5", "cpu0", "nvjpeg", "gpu8", "gpus0", "gpugs1"):
        with pytest.raises(ValueError, match="decode setting"):
            parse(bad, 1)


def test_tiny_cpu_run_of_paths_a_and_b(bench, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    import torch._inductor.config as inductor

    threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    try:
        # Two decode settings: ahead of the step (the default; with a 0.5 ms GIL switch
        # interval and inductor's CUDA graphs, unused on the CPU), and in the step at reduced
        # size.
        rows = bench.main(["--device", "cpu", "--tiny", "--models", "resnet50", "--paths",
                           "a", "b", "c", "d", "loader", "--jpegs", str(tmp_path / "jpegs"),
                           "--b-variants", "gpus0.5g,serialr16",
                           "--loader-crops", "batched", "per-image",
                           "--shards", str(tmp_path / "shards"),
                           "--out", str(tmp_path / "rows.json")])
    finally:
        torch.set_num_threads(threads)
    # The (b) row's task set both for this process; the row put them back.
    assert sys.getswitchinterval() == switch and not inductor.triton.cudagraphs
    assert [(r["path"], r["model"], r["ranks"], r.get("setting")) for r in rows][:3] == [
        ("a", "resnet_tiny", 1, None), ("b", "resnet_tiny", 1, "gpus0.5g"),
        ("b", "resnet_tiny", 1, "serialr16")]
    assert (rows[1]["gil_switch_ms"], rows[1]["cuda_graphs"]) == (0.5, True)
    assert all(r["images_per_s_per_gpu"] > 0 for r in rows)
    for r in rows:
        if r["path"] in ("b", "loader"):  # each says its setting, cores and decode time
            assert r["cores"] >= 1 and r["decode_threads"] == 1, r
            assert r["decode_ms_per_image"] > 0 and r["augment_ms_per_image"] > 0, r
    loader = [r for r in rows if r["path"] == "loader"]
    assert [(r["decode_ahead"], r["crops"]) for r in loader] == [
        (True, "batched"), (True, "per-image"), (False, "batched"), (False, "per-image")]
    for r in loader:  # where the loader threads' CPU goes, per batch
        assert all(r[f"{part}_cpu_ms_per_batch"] > 0 for part in ("read", "decode", "crop")), r
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    out = capsys.readouterr()
    assert "| resnet_tiny | (b) | gpus0.5g | 1 |" in out.out
    assert "| resnet_tiny | (b) | serialr16 | 1 |" in out.out
    assert "(per-image) |" in out.out and "(batched) |" in out.out
    for path, module in (("c", "torchvision"), ("d", "lightning")):
        ran = path in {r["path"] for r in rows}
        said = f"skipping ({path}) for resnet50: {module} does not import" in out.err
        assert ran != said, (path, out.err)  # run where it imports, else skipped saying why


def test_engine_use_averages_the_rows_timed_window_only(bench) -> None:
    # NVML's samples while a row ran: compiling first leaves the GPU idle for most of a short
    # row, so the mean is over the last seconds (the timed steps), not the whole row.
    args = bench.parse_args(["--device", "cpu", "--steps", "60", "--batch", "256"])
    use = bench.EngineUse(args)
    assert use.summary(5.0) == {}  # on the CPU: nothing sampled, nothing said
    use.samples = [(t, 0, 0) for t in range(40)] + [(40 + t, 20, 90) for t in range(5)]
    row = {"images_per_s_per_gpu": 30 * 256 / 4.0}  # 30 steps of 256 in 4 s
    assert bench._timed_s(args, row) == 4.0
    got = use.summary(bench._timed_s(args, row))
    assert (got["jpeg_engine_util_pct"], got["gpu_util_pct"], got["util_samples"]) == (20, 90, 5)
