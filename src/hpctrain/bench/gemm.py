"""Matrix-multiply throughput per dtype over a size sweep, against the peak table.

    hpctrain bench gemm --dtypes bf16 fp8 --sizes 4096 8192

``C = A @ B`` with square M = N = K, random normal inputs, FLOPs = 2·M·N·K. ``fp32`` is run with
TF32 off and ``tf32`` with it on (CUDA only); ``fp8`` (e4m3, per-tensor scales, bf16 out) uses
``torch._scaled_mm`` on GPUs of compute capability 8.9 or newer. % of peak comes from
`hpctrain.observe.peaks`; a device not in that table (every CPU) reports the peak as unknown.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpctrain.bench.common import Results, device_name, median, time_each
from hpctrain.errors import ConfigError
from hpctrain.observe.peaks import peak_tflops

GEMM_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
COLUMNS = ["dtype", "m", "n", "k", "time_us", "tflops", "peak_tflops", "pct_of_peak", "note"]


def fp8_supported(device: torch.device) -> bool:
    """True where torch._scaled_mm runs e4m3 matmuls (CUDA, compute capability >= 8.9)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and hasattr(torch, "float8_e4m3fn")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def gemm_fn(dtype: str, size: int, device: torch.device, seed: int = 0):
    """Return a zero-argument function running one size x size x size matmul of `dtype`."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype == "fp8":
        a = torch.randn(size, size, device=device, generator=g).to(torch.float8_e4m3fn)
        # _scaled_mm wants B column-major: the transpose of a row-major tensor is.
        b = torch.randn(size, size, device=device, generator=g).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                   "fp16": torch.float16}[dtype]
    a = torch.randn(size, size, device=device, generator=g).to(torch_dtype)
    b = torch.randn(size, size, device=device, generator=g).to(torch_dtype)
    c = torch.empty(size, size, device=device, dtype=torch_dtype)
    return lambda: torch.mm(a, b, out=c)


def run_gemm(dtypes: list[str], sizes: list[int], device: torch.device, *, warmup: int = 5,
             iters: int = 20, echo: Callable[[str], None] | None = None) -> Results:
    """Time every dtype x size; rows hold median time, TFLOP/s and % of the datasheet peak.

    ``echo`` receives a progress line before and after each size; on a CPU the line before says
    how long the size will take, from one small matmul scaled by n³ (8192³ takes minutes)."""
    for dtype in dtypes:
        if dtype not in GEMM_DTYPES:
            raise ConfigError(f"unknown GEMM dtype {dtype!r}", expected=", ".join(GEMM_DTYPES))
    name = device_name(device)
    res = Results("gemm", COLUMNS, meta={"device": name, "warmup": warmup, "iters": iters})
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    say = echo or (lambda line: None)
    todo = [(d, n) for d in dtypes if not _unsupported(d, device) for n in sizes]
    try:
        for dtype in dtypes:
            skip = _unsupported(dtype, device)
            for size in sizes:
                if skip:
                    res.add(dtype=dtype, m=size, n=size, k=size, note=skip)
                    continue
                torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
                where = f"[{todo.index((dtype, size)) + 1}/{len(todo)}] {dtype} {size}³"
                if echo is not None and device.type == "cpu":
                    guess = estimate_cpu_seconds(dtype, size) * (warmup + iters)
                    say(f"bench gemm {where}: ~{_duration(guess)} for {warmup + iters} matmuls "
                        "on the CPU (a CPU is slow: smaller --sizes or -n finish sooner)")
                else:
                    say(f"bench gemm {where} ...")
                fn = gemm_fn(dtype, size, device)
                t = median(time_each(fn, device, warmup=warmup, iters=iters))
                tflops = 2.0 * size**3 / t / 1e12
                say(f"bench gemm {where}: {tflops:,.3g} TFLOP/s")
                peak = peak_tflops(name, dtype) if device.type == "cuda" else None
                res.add(dtype=dtype, m=size, n=size, k=size, time_us=t * 1e6, tflops=tflops,
                        peak_tflops=peak, pct_of_peak=100 * tflops / peak if peak else None,
                        note="" if peak else "peak unknown for this device")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return res


def estimate_cpu_seconds(dtype: str, size: int, probe: int = 256) -> float:
    """Seconds one ``size``³ matmul of ``dtype`` takes on this CPU, from a ``probe``³ one."""
    probe = min(probe, size)
    fn = gemm_fn(dtype, probe, torch.device("cpu"))
    fn()  # the first call pays for allocation and dispatch set-up
    t = median(time_each(fn, torch.device("cpu"), warmup=0, iters=3))
    return t * (size / probe) ** 3


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _unsupported(dtype: str, device: torch.device) -> str:
    if dtype == "tf32" and device.type != "cuda":
        return "tf32 is a CUDA tensor-core mode"
    if dtype == "fp8" and not fp8_supported(device):
        return "fp8 needs torch._scaled_mm on a GPU with compute capability >= 8.9"
    return ""
