"""The benchmark scripts that start ranks count, name and time the GPUs without initialising
CUDA in their own process: a context there holds ~0.5 GB of GPU 0 for every run they measure.
Each script's parent path runs here (its runs replaced by rows that say so) on a CPU made to look
like a node with H100s (tests/gpu_node.py: NVML a stand-in, CUDA's initialisation fails the
test)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gpu_node import H100_NAME, gpu_node

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> ModuleType:
    """benchmarks/<name> as a module (its neighbours importable, as when it runs)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{Path(name).stem}", BENCH / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.fixture()
def h100s(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    gpu_node(monkeypatch, nvml=True)
    return monkeypatch


def _not_run(name: str, *args, **kwargs) -> dict:
    return {"variant": name, "error": "not run in this test"}


def test_train_throughput(h100s: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    bench = _script("train_throughput.py")
    h100s.setattr(bench, "run_variant", _not_run)
    h100s.setattr(sys, "argv", ["train_throughput.py", "--only", "1gpu-eager",
                                "--out", str(tmp_path)])
    bench.main()
    assert f"Device: {H100_NAME};" in capsys.readouterr().out
    assert not torch.cuda.is_initialized()


def test_observe_gpu(h100s: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = _script("observe_gpu.py")
    h100s.setattr(bench, "overhead", lambda *a: {"cost_span_pct": 0.0, "cost_window_pct": 0.0})
    h100s.setattr(sys, "argv", ["observe_gpu.py", "--only", "overhead", "--out", str(tmp_path)])
    bench.main()
    results = json.loads((tmp_path / "observe_gpu.json").read_text())
    assert (results["device"], results["gpus"]) == (H100_NAME, 2)
    assert not torch.cuda.is_initialized()


def test_checkpoint_probe(h100s: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = _script("checkpoint.py")
    h100s.setattr(bench.Bench, "probe", lambda self: (1.0, 0.1))
    bench.run_variants(bench.Bench(tmp_path, "gpu", "1gpu", False), ["probe"])
    assert json.loads((tmp_path / "1gpu" / "probe.json").read_text())["device"] == H100_NAME
    assert not torch.cuda.is_initialized()


def test_compare_and_the_peers_mfu(h100s: pytest.MonkeyPatch, compare, tmp_path: Path,
                                   capsys) -> None:
    """compare.py runs both sides from one process; the peer's MFU is computed in it too."""
    def row(side: str):
        return lambda name, *a: {"side": side, "layout": name, "error": "not run in this test"}

    h100s.setattr(compare, "run_ours", row("hpctrain"))
    h100s.setattr(compare, "run_theirs", row("torchtitan"))
    h100s.setattr(sys, "argv", ["compare.py", "--layouts", "1b-1gpu", "--repeat", "1",
                                "--out", str(tmp_path)])
    compare.main()
    assert f"Device: {H100_NAME};" in capsys.readouterr().out
    assert sys.modules["torchtitan_peer"].hpctrain_mfu("1b", 2048, 10_000.0) > 0
    assert not torch.cuda.is_initialized()


def test_bench_gpu_times_its_plain_matmul_in_a_child(h100s: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """bench_gpu's reference matmul ran in its own process, whose context then stayed for
    every run after it (membw, collectives, the training runs)."""
    bench = _script("bench_gpu.py")

    def run(cmd: list[str], dry: bool, timeout: float = 300) -> None:
        if cmd[3:5] == ["bench", "gemm"]:  # what `bench gemm` writes, for the summary
            (tmp_path / "gemm").mkdir()
            (tmp_path / "gemm" / "gemm.json").write_text(json.dumps(
                {"rows": [{"dtype": "bf16", "m": 8192, "tflops": 700.0}]}))

    h100s.setattr(bench, "run", run)
    h100s.setattr(bench, "plain_matmul_in_child", lambda: 800.0)
    h100s.setattr(sys, "argv", ["bench_gpu.py", "--out", str(tmp_path), "--skip", "allreduce",
                                "model", "roofline", "node"])
    bench.main()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gemm_bf16_8192"]["ratio"] == 700.0 / 800.0
    assert not torch.cuda.is_initialized()
