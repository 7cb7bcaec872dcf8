"""`bench roofline`: GEMM arithmetic intensity, roofs, placement of measured points, the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.bench.roofline import (
    attainable_tflops,
    build_roofline,
    compute_roofs,
    gemm_intensity,
)
from hpctrain.cli import main

H100 = "NVIDIA H100 80GB HBM3"


def test_gemm_intensity_is_2n3_over_bytes_of_a_b_c() -> None:
    n = 8192
    assert gemm_intensity(n, "bf16") == pytest.approx(2 * n**3 / (3 * n * n * 2))  # n/3
    assert gemm_intensity(n, "fp32") == pytest.approx(n / 6)
    assert gemm_intensity(n, "fp8") == pytest.approx(2 * n**3 / (n * n * (1 + 1 + 2)))  # n/2
    assert gemm_intensity(1024, "bf16") == pytest.approx(341.33, abs=0.01)


def test_attainable_is_the_lower_roof() -> None:
    # H100 SXM bf16: 989 TFLOP/s, 3,350 GB/s -> ridge at 295.2 FLOP/byte.
    assert attainable_tflops(100, 989, 3350) == pytest.approx(335.0)
    assert attainable_tflops(1000, 989, 3350) == pytest.approx(989.0)
    assert attainable_tflops(1000, None, None) is None
    assert compute_roofs(H100) == {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0, "fp16": 989.0,
                                   "fp8": 1979.0}
    assert compute_roofs("CPU x86_64") == {}


def test_points_placed_under_the_roofs() -> None:
    gemm = [{"dtype": "bf16", "m": 8192, "tflops": 790.0},
            {"dtype": "bf16", "m": 256, "tflops": 50.0},
            {"dtype": "fp8", "m": 8192, "tflops": None, "note": "unsupported"}]
    res = build_roofline(H100, gemm, [{"size": 1 << 30, "gbps": 3000.0}])
    copy, big, small = res.rows
    assert copy["kind"] == "copy" and copy["pct_of_roof"] == pytest.approx(100 * 3000 / 3350)
    assert big["bound"] == "compute" and big["roof"] == 989.0
    assert big["pct_of_roof"] == pytest.approx(100 * 790 / 989)
    # 256: I = 85.3 FLOP/byte, below the ridge: memory-bound, roof 3,350 GB/s x 85.3.
    assert small["bound"] == "memory"
    assert small["roof"] == pytest.approx(3350 * 256 / 3 / 1000)
    assert res.meta["bandwidth_roof"] == "datasheet"


def test_cpu_roofline_runs_and_draws_a_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "roof"
    main(["bench", "roofline", "--device", "cpu", "-w", "1", "-n", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert "unknown for this device" in text and "measured copy" in text
    png = out / "roofline.png"
    assert png.is_file() and png.stat().st_size > 10_000, text
    rows = json.loads((out / "roofline.json").read_text())["rows"]
    assert {r["kind"] for r in rows} == {"gemm", "copy"}
    assert all(r["roof"] is None for r in rows if r["kind"] == "gemm")  # no CPU datasheet
    # The measurements it ran are reused with --from (nothing is measured again).
    out2 = tmp_path / "again"
    main(["bench", "roofline", "--from", str(out), "--out", str(out2)])
    assert "gemm: " in capsys.readouterr().out
    assert not (out2 / "gemm").exists() and (out2 / "roofline.png").stat().st_size > 10_000


def test_missing_from_folder_is_a_user_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "roofline", "--from", str(tmp_path / "none")])
    assert exc.value.code == 2 and "no such folder" in capsys.readouterr().err
