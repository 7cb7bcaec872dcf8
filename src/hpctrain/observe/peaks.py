"""Peak dense TFLOP/s per accelerator and dtype, and MFU from them.

MFU = tokens/s x FLOPs/token / peak. An unknown device gives no peak and no MFU, never a guess:
nanoGPT hard-coded the A100 peak and printed 104% MFU on an H100. Runs in fp8 state MFU against
the bf16 peak (``mfu_peak_dtype``).

    peak = peak_tflops(torch.cuda.get_device_name(), "bf16")  # 989.0 on "NVIDIA H100 80GB HBM3"
    mfu(tokens_per_s=50_000, flops_per_token=6 * 1.1e9, peak_tflops=peak)  # 0.334
"""

from __future__ import annotations

import re

# Source: vendor datasheets, dense, no sparsity (datasheets often quote 2x "with sparsity").
# NVIDIA "fp32" is the non-tensor-core rate; "tf32" is the tensor-core rate. AMD fp32/tf32 are
# matrix-core rates. Only values read off a datasheet are listed; a missing dtype gives None.
_PEAKS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.0, "fp32": 60.0, "fp8": 1670.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.0, "fp32": 60.0, "fp8": 1670.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6, "fp8": 733.0},
    "MI250X": {"bf16": 383.0, "fp16": 383.0},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4, "fp8": 2614.9},
}

# (pattern on the lower-cased device name, table key); first match wins, so variants come before
# the plain chip name. Word boundaries keep GB200 from matching B200 and L40 from matching L40S.
_NAME_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bh100\b.*\bnvl\b"), "H100 NVL"),
    (re.compile(r"\bh100\b.*\bpcie\b"), "H100 PCIe"),
    # SXM shows up as e.g. "NVIDIA H100 80GB HBM3" or "NVIDIA H100 SXM5 80GB".
    (re.compile(r"\bh100\b"), "H100 SXM"),
    (re.compile(r"\bh200\b.*\bnvl\b"), "H200 NVL"),
    (re.compile(r"\bh200\b"), "H200"),
    (re.compile(r"\bb200\b"), "B200"),
    (re.compile(r"\ba100\b"), "A100"),
    (re.compile(r"\bl40s\b"), "L40S"),
    # ROCm may report "AMD Instinct MI250X/MI250"; the MI250's peak is lower, so that is unknown.
    (re.compile(r"\bmi250x\b(?!/mi250)"), "MI250X"),
    (re.compile(r"\bmi300x\b"), "MI300X"),
]

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8",
    "float8": "fp8",
}


def peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """Return the dense peak TFLOP/s of `device_name` for `dtype`, or None when not known."""
    key = _device_key(device_name)
    dtype_key = _DTYPE_ALIASES.get(dtype.lower().removeprefix("torch."))
    if key is None or dtype_key is None:
        return None
    return _PEAKS[key].get(dtype_key)


def mfu_peak_dtype(precision: str) -> str:
    """The dtype whose peak MFU is measured against for a run in ``precision``: bf16 for fp8.

    An fp8 run computes only its block matmuls in float8 (attention, norms, the output layer
    stay bf16), so its MFU is stated against the bf16 peak, comparable with bf16 runs; against
    the fp8 datasheet rate it would halve and say nothing about the speed-up.
    """
    return "bf16" if precision == "fp8" else precision


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Return model FLOPs utilisation as a fraction (0.41 = 41%), or None without a peak."""
    if peak_tflops is None or peak_tflops <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def _device_key(device_name: str) -> str | None:
    name = device_name.lower()
    for pattern, key in _NAME_RULES:
        if pattern.search(name):
            return key
    return None
