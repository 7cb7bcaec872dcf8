"""`bench node`: the health summary on synthetic measurements, and a real run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.bench.node import CollectiveResult, DeviceResult, Thresholds, assess
from hpctrain.cli import main

NAME = "NVIDIA H100 80GB HBM3"


def gpu(i: int, gemm: float = 780.0, membw: float = 3000.0, h2d: float = 50.0,
        d2h: float = 50.0, **kw) -> DeviceResult:
    return DeviceResult(f"GPU {i}", NAME, gemm_tflops=gemm, gemm_peak_tflops=989.0,
                        membw_gbps=membw, membw_datasheet_gbps=3350.0, h2d_gbps=h2d,
                        d2h_gbps=d2h, **kw)


def healthy_collective(ranks: int = 4) -> CollectiveResult:
    return CollectiveResult(ranks, 256 << 20, busbw_gbps=340.0, wrong=0)


def test_healthy_node_has_no_findings() -> None:
    # Spread of a few percent is normal.
    devs = [gpu(0, 780), gpu(1, 790), gpu(2, 772), gpu(3, 785, membw=2950)]
    report = assess(devs, healthy_collective())
    assert report.healthy and report.findings == []


def test_slow_gpu_is_named_against_its_siblings() -> None:
    devs = [gpu(0, 780), gpu(1, 790), gpu(2, 770), gpu(3, 0.88 * 780)]
    report = assess(devs, healthy_collective())
    assert [f.message.split(" (")[0] for f in report.findings] == [
        "GPU 3 GEMM 12% below its siblings"]
    assert "686.4 vs median 780.0 TFLOP/s" in report.findings[0].message
    # Within the tolerance: 8% below is fine at 10%, flagged at 5%.
    devs[3] = gpu(3, 0.92 * 780)
    assert assess(devs, None).healthy
    assert not assess(devs, None, Thresholds(tolerance=0.05)).healthy


def test_each_metric_and_two_gpu_nodes() -> None:
    devs = [gpu(0), gpu(1, h2d=20.0)]  # e.g. a GPU on a degraded PCIe link (x4 instead of x16)
    report = assess(devs, healthy_collective(2))
    assert [(f.device, f.metric) for f in report.findings] == [("GPU 1", "h2d_gbps")]
    assert "host->device 60% below its siblings" in report.findings[0].message


def test_all_equally_slow_is_caught_by_the_datasheet() -> None:
    # Siblings agree, but every GPU is throttled: 45% of peak, 60% of the HBM datasheet.
    devs = [gpu(i, gemm=445.0, membw=2010.0) for i in range(4)]
    report = assess(devs, healthy_collective())
    metrics = sorted({f.metric for f in report.findings})
    assert metrics == ["gemm_peak", "membw_datasheet"] and len(report.findings) == 8
    assert "GPU 0 GEMM bf16 445.0 TFLOP/s is 45% of the datasheet peak 989" in \
        report.findings[0].message


def test_errors_and_wrong_collectives_are_flagged() -> None:
    devs = [gpu(0), DeviceResult("GPU 1", NAME, error="RuntimeError: CUDA error: ECC")]
    bad = CollectiveResult(2, 1 << 20, busbw_gbps=300.0, wrong=12)
    report = assess(devs, bad)
    messages = [f.message for f in report.findings]
    assert messages[0] == "GPU 1: benchmark failed: RuntimeError: CUDA error: ECC"
    assert "12 wrong elements" in messages[1]
    slow = CollectiveResult(4, 1 << 28, busbw_gbps=90.0, wrong=0)
    assert assess([gpu(0)], slow).healthy  # no floor given: reported, not judged
    assert not assess([gpu(0)], slow, Thresholds(min_busbw_gbps=300.0)).healthy


def test_cpu_node_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "node"
    main(["bench", "node", "--device", "cpu", "--out", str(out)])
    text = capsys.readouterr().out
    assert "node healthy" in text and "over 2 ranks" in text
    data = json.loads((out / "node.json").read_text())
    assert data["healthy"] and data["devices"][0]["gemm_tflops"] > 0
    assert data["collective"]["wrong"] == 0


def test_bad_tolerance_is_a_user_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "node", "--device", "cpu", "--tolerance", "5"])
    assert exc.value.code == 2 and "tolerance" in capsys.readouterr().err


def test_flagged_node_exits_1(tmp_path: Path, monkeypatch, capsys) -> None:
    import hpctrain.bench.node as node

    monkeypatch.setattr(node, "measure_device", lambda device, quick=False: DeviceResult(
        "CPU", "CPU", gemm_tflops=1.0, error="RuntimeError: boom"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "node", "--device", "cpu", "--no-collective", "--out", str(tmp_path)])
    assert exc.value.code == 1
    captured = capsys.readouterr()
    assert "PROBLEM: CPU: benchmark failed: RuntimeError: boom" in captured.out
    assert "1 problem(s)" in captured.err
    assert json.loads((tmp_path / "node.json").read_text())["healthy"] is False
