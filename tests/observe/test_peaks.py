"""Peak TFLOP/s lookup by device name, and MFU."""

from __future__ import annotations

import pytest

from hpctrain.observe.peaks import mfu, peak_tflops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA L40S", 362.0),
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI250X", 383.0),
    ],
)
def test_bf16_peaks(name: str, peak: float) -> None:
    assert peak_tflops(name) == peak


def test_other_dtypes() -> None:
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "torch.bfloat16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp8") is None  # no FP8 on Ampere


@pytest.mark.parametrize(
    "name",
    [
        "cpu",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA GB200",
        "NVIDIA L40",
        "AMD Instinct MI250X/MI250",
        "Tesla V100-SXM2-16GB",
        "",
    ],
)
def test_unknown_is_none(name: str) -> None:
    assert peak_tflops(name) is None


def test_unknown_dtype_is_none() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "int4") is None


def test_mfu_arithmetic() -> None:
    # 50k tok/s x 6.6 GFLOP/token = 330 TFLOP/s of 989 -> 33.4%.
    assert mfu(50_000, 6.6e9, 989.0) == pytest.approx(330 / 989)
    assert mfu(50_000, 6.6e9, None) is None
    assert mfu(50_000, 6.6e9, 0.0) is None
