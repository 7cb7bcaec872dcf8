"""`hpctrain bench` as a user runs it: CPU gemm/membw, a 2-rank launch, and input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from hpctrain.bench.busbw import OPS
from hpctrain.bench.common import select_device
from hpctrain.bench.gemm import run_gemm
from hpctrain.cli import main
from hpctrain.errors import RuntimeEnvError


def test_gemm_on_cpu_reports_unknown_peak() -> None:
    res = run_gemm(["fp32", "tf32"], [64], select_device("cpu"), warmup=1, iters=3)
    fp32, tf32 = res.rows
    assert fp32["tflops"] > 0 and fp32["peak_tflops"] is None
    assert "peak unknown" in fp32["note"]
    assert "tf32" in tf32["note"] and tf32.get("tflops") is None


def test_gemm_and_membw_write_results(tmp_path: Path, capsys) -> None:
    main(["bench", "gemm", "--device", "cpu", "--sizes", "64", "--dtypes", "fp32",
          "-w", "1", "-n", "2", "--out", str(tmp_path / "g")])
    main(["bench", "membw", "--device", "cpu", "--sizes", "1M", "-w", "1", "-n", "2",
          "--out", str(tmp_path / "m")])
    out = capsys.readouterr().out
    assert "GEMM on CPU" in out
    assert "plot: " in out or "matplotlib is not installed" in out
    data = json.loads((tmp_path / "g" / "gemm.json").read_text())
    assert data["rows"][0]["tflops"] > 0
    assert (tmp_path / "m" / "membw.csv").read_text().startswith("size,")


def test_gemm_on_cpu_shows_progress_and_an_estimate_first(tmp_path: Path, capsys) -> None:
    """8192³ on a CPU takes minutes: each size says how long before it starts, then its rate."""
    main(["bench", "gemm", "--device", "cpu", "--sizes", "64", "128", "--dtypes", "fp32",
          "-w", "1", "-n", "2", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("bench gemm [1/2] fp32 64³: ~") and "a CPU is slow" in err[0], err
    assert err[1].startswith("bench gemm [1/2] fp32 64³: ") and err[1].endswith("TFLOP/s"), err
    assert err[2].startswith("bench gemm [2/2] fp32 128³: ~"), err


def test_the_cpu_estimate_scales_with_the_cube_of_the_size(monkeypatch) -> None:
    """From one timed probe (fixed here: two real timings under load differ by more than any
    bound a test could state) the estimate scales as size³."""
    from hpctrain.bench import gemm

    assert gemm.estimate_cpu_seconds("fp32", 64, probe=32) > 0  # the real probe runs
    monkeypatch.setattr(gemm, "time_each", lambda fn, device, warmup, iters: [0.01] * iters)
    small, large = gemm.estimate_cpu_seconds("fp32", 256), gemm.estimate_cpu_seconds("fp32", 8192)
    assert small == pytest.approx(0.01) and large == pytest.approx(0.01 * 32**3)


@pytest.mark.parametrize("argv, message", [
    (["bench", "collective", "-b", "12Q"], "not a byte size"),
    (["bench", "collective", "-b", "1M", "-e", "1K"], "below"),
    (["bench", "gemm", "--device", "tpu"], "unknown device"),
    (["bench", "gemm", "--device", "cpu", "--dtypes", "int4"], "unknown GEMM dtype"),
    (["bench", "h2d", "--device", "cpu"], "CUDA device"),
    (["bench", "collective", "--device", "cpu", "--cuda-graph"], "uses the CPU (gloo)"),
    (["bench", "collective", "--device", "cpu", "--cuda-graph", "-3"],
     "--cuda-graph: -3 is out of range"),
])
def test_user_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_select_device_rejects_missing_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeEnvError, match="--device = 'cuda' but no CUDA") as info:
        select_device("cuda")
    assert "set --device to cpu" in info.value.hint


def test_collective_nproc_2_through_the_launcher(tmp_path: Path) -> None:
    out = tmp_path / "coll"
    done = run_cli(["bench", "collective", "--nproc", "2", "-b", "1K", "-e", "4K", "-f", "4",
                    "-w", "0", "-n", "2", "--out", str(out)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "collective.json").read_text())["rows"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in OPS for s in (1024, 4096)]
    for r in rows:  # 2 ranks: every op exact in every mode it offers
        modes = [m for m in ("oop", "ip") if r[f"{m}_time_us"] is not None]
        assert modes and all(r[f"{m}_wrong"] == 0 for m in modes), r
    assert "busbw" in done.stdout or "busbw" in done.stderr
