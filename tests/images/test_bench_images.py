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


def test_tiny_cpu_run_of_paths_a_and_b(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("bench_images", REPO / "benchmarks" / "images.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec.loader.exec_module(bench)
        rows = bench.main(["--device", "cpu", "--tiny", "--models", "resnet50", "--paths",
                           "a", "b", "c", "d", "loader", "--jpegs", str(tmp_path / "jpegs"),
                           "--shards", str(tmp_path / "shards"),
                           "--out", str(tmp_path / "rows.json")])
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(spec.name, None)
    assert [(r["path"], r["model"], r["ranks"]) for r in rows][:2] == [
        ("a", "resnet_tiny", 1), ("b", "resnet_tiny", 1)]
    assert all(r["images_per_s_per_gpu"] > 0 for r in rows)
    (loader,) = [r for r in rows if r["path"] == "loader"]
    assert loader["decode_ms_per_image"] > 0 and loader["augment_ms_per_image"] > 0
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    out = capsys.readouterr()
    assert "| resnet_tiny | (b) | 1 |" in out.out
    for path, module in (("c", "torchvision"), ("d", "lightning")):
        ran = path in {r["path"] for r in rows}
        said = f"skipping ({path}) for resnet50: {module} does not import" in out.err
        assert ran != said, (path, out.err)  # run where it imports, else skipped saying why
