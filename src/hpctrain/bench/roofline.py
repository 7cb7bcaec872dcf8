"""Roofline of a device: compute roofs per dtype, the memory-bandwidth roof, measured points on it.

    hpctrain bench roofline                               # runs gemm and membw briefly first
    hpctrain bench roofline --from runs/bench-gpu         # reuse gemm.json / membw.json found there

Attainable TFLOP/s at arithmetic intensity I (FLOP per byte of memory traffic) is
``min(peak, bandwidth × I)``. Compute roofs come from `hpctrain.observe.peaks` (dense datasheet
peaks per dtype), the bandwidth roof from `hpctrain.bench.membw`'s datasheet table; a device that
is in neither (every CPU) gets the measured copy bandwidth as its only roof.

A square n³ GEMM does 2n³ FLOPs and moves at least A + B + C once:
``I = 2n³ / (n²·(bytes(A) + bytes(B) + bytes(C)))`` (fp8: 1-byte inputs, bf16 output). Large GEMMs
sit far right of the ridge (compute-bound), small ones approach it. A copy does no FLOPs, so it
has no place on the x axis: it is drawn as the measured-bandwidth line under the datasheet roof,
and the table gives its GB/s against the datasheet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.bench.common import Results
from hpctrain.bench.membw import datasheet_gbps
from hpctrain.observe.peaks import peak_tflops

# Bytes per element of the inputs and of the output of each GEMM dtype (see bench/gemm.py).
IN_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OUT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}

COLUMNS = ["kind", "dtype", "size", "intensity", "achieved", "unit", "roof", "pct_of_roof",
           "bound"]


def gemm_intensity(n: int, dtype: str) -> float:
    """FLOP per byte of a square n x n x n GEMM: 2n³ / (bytes of A + B + C)."""
    return 2.0 * n**3 / (n * n * (2 * IN_BYTES[dtype] + OUT_BYTES[dtype]))


def attainable_tflops(intensity: float, peak: float | None, bandwidth_gbps: float | None
                      ) -> float | None:
    """min(peak, bandwidth × intensity) in TFLOP/s; None when neither roof is known."""
    limits = []
    if peak is not None:
        limits.append(peak)
    if bandwidth_gbps is not None:
        limits.append(bandwidth_gbps * intensity / 1000)
    return min(limits) if limits else None


def compute_roofs(device: str) -> dict[str, float]:
    """Datasheet peak TFLOP/s per GEMM dtype for `device` (only the known ones)."""
    return {d: p for d in IN_BYTES if (p := peak_tflops(device, d)) is not None}


def build_roofline(device: str, gemm_rows: list[dict[str, Any]],
                   membw_rows: list[dict[str, Any]]) -> Results:
    """Place measured GEMM and copy results under the roofs of `device`."""
    roofs = compute_roofs(device)
    sheet_bw = datasheet_gbps(device)
    measured_bw = max((r["gbps"] for r in membw_rows if r.get("gbps")), default=None)
    bw = sheet_bw if sheet_bw is not None else measured_bw
    res = Results("roofline", COLUMNS, meta={
        "device": device, "compute_roofs_tflops": roofs, "datasheet_gbps": sheet_bw,
        "measured_copy_gbps": measured_bw,
        "bandwidth_roof": "datasheet" if sheet_bw is not None else "measured copy"})
    for r in membw_rows:
        if r.get("gbps") is None:
            continue
        res.add(kind="copy", dtype="-", size=r["size"], intensity=None, achieved=r["gbps"],
                unit="GB/s", roof=sheet_bw,
                pct_of_roof=100 * r["gbps"] / sheet_bw if sheet_bw else None, bound="memory")
    for r in gemm_rows:
        if r.get("tflops") is None or r["dtype"] not in IN_BYTES:
            continue
        n = int(r["m"])
        intensity = gemm_intensity(n, r["dtype"])
        peak = roofs.get(r["dtype"])
        # Without a compute roof the attainable rate is unknown (bw × I alone overstates it).
        roof = attainable_tflops(intensity, peak, bw) if peak is not None else None
        bound = None
        if peak is not None and bw is not None:
            bound = "compute" if bw * intensity / 1000 >= peak else "memory"
        res.add(kind="gemm", dtype=r["dtype"], size=n, intensity=intensity,
                achieved=r["tflops"], unit="TFLOP/s", roof=roof,
                pct_of_roof=100 * r["tflops"] / roof if roof else None, bound=bound)
    return res


def plot_roofline(path: Path, res: Results) -> str:
    """Draw the roofline PNG (log-log) if matplotlib is installed; return a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    meta = res.meta
    roofs: dict[str, float] = meta["compute_roofs_tflops"]
    sheet_bw, measured_bw = meta["datasheet_gbps"], meta["measured_copy_gbps"]
    gemms = [r for r in res.rows if r["kind"] == "gemm"]
    xs = [r["intensity"] for r in gemms] or [1.0]
    x_lo, x_hi = min(0.1, min(xs) / 4), max(1e4, max(xs) * 4)
    grid = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = dict(zip(IN_BYTES, ("tab:gray", "tab:purple", "tab:blue", "tab:green",
                                 "tab:red"), strict=True))
    bw = sheet_bw if sheet_bw is not None else measured_bw
    by_peak: dict[float, list[str]] = {}
    for dtype, peak in roofs.items():
        by_peak.setdefault(peak, []).append(dtype)
    for peak, dtypes in sorted(by_peak.items()):
        # The flat part of each roof starts at its ridge point, peak / bandwidth.
        ridge = peak * 1000 / bw if bw else x_lo
        ax.plot([max(ridge, x_lo), x_hi], [peak, peak], color=colors[dtypes[0]], lw=1.5,
                label=f"{'/'.join(dtypes)} roof {peak:g} TFLOP/s")
    top = max(roofs.values(), default=None)
    for line_bw, style, label in ((sheet_bw, "-", "datasheet"),
                                  (measured_bw, "--", "measured copy")):
        if line_bw is not None:
            xs_bw = [x for x in grid if top is None or line_bw * x / 1000 <= top * 1.05]
            ax.plot(xs_bw, [line_bw * x / 1000 for x in xs_bw], color="black", ls=style, lw=1,
                    label=f"{label} {line_bw:,.0f} GB/s")
    for dtype in IN_BYTES:
        pts = [r for r in gemms if r["dtype"] == dtype]
        if pts:
            ax.scatter([r["intensity"] for r in pts], [r["achieved"] for r in pts],
                       color=colors[dtype], edgecolor="black", zorder=3,
                       label=f"measured GEMM {dtype}")
            for r in pts:
                ax.annotate(str(r["size"]), (r["intensity"], r["achieved"]), fontsize=7,
                            xytext=(4, -10), textcoords="offset points")
    ys_all = [r["achieved"] for r in gemms] + list(roofs.values())
    y_hi = max(ys_all, default=1.0) * 2
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(max(y_hi / 1e5, 1e-4), y_hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline: {meta['device']}")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def find_results(folders: list[Path], name: str) -> Path | None:
    """The first ``<name>.json`` in any of `folders` or their direct sub-folders."""
    for folder in folders:
        for candidate in (folder / f"{name}.json", *sorted(folder.glob(f"*/{name}.json"))):
            if candidate.is_file():
                return candidate
    return None
