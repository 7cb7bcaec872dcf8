"""Health check of one node: each GPU's GEMM, memory and host-link bandwidth against its siblings
and the datasheet, and an all_reduce across them, so a bad node is found before a big job starts.

    hpctrain bench node                 # every visible GPU (or the CPU), ~1 minute on 8 GPUs
    hpctrain bench node --tolerance 0.05

Per device, one after the other (so they do not compete for host memory or PCIe): bf16 GEMM
8192³ (fp32 512³ on a CPU), a 1 GiB device copy, pinned host<->device copies of 256 MiB; then an
all_reduce of 256 MiB over all local GPUs (``bench collective --nproc N``; 2 gloo ranks on a CPU).

A device is flagged when a metric is more than ``tolerance`` below the median of its siblings
("GPU 3 GEMM 12% below its siblings"), when GEMM or copy bandwidth falls under a fraction of the
datasheet, when a benchmark fails, or when the all_reduce returns a wrong value. Any flag makes
the command exit 1, so a job script can gate on it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from hpctrain.errors import HpctrainError


class NodeUnhealthy(HpctrainError):
    """At least one device or the interconnect was flagged."""

    exit_code = 1


# metric -> (label in messages, unit)
METRICS = {"gemm_tflops": ("GEMM", "TFLOP/s"), "membw_gbps": ("memory bandwidth", "GB/s"),
           "h2d_gbps": ("host->device", "GB/s"), "d2h_gbps": ("device->host", "GB/s")}


@dataclass
class DeviceResult:
    """What one device measured; None where it was not measured (or there is no datasheet)."""

    device: str  # "GPU 3" or "CPU"
    name: str
    gemm_dtype: str = "bf16"
    gemm_tflops: float | None = None
    gemm_peak_tflops: float | None = None
    membw_gbps: float | None = None
    membw_datasheet_gbps: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    error: str | None = None


@dataclass
class CollectiveResult:
    """The all_reduce across the node's devices."""

    ranks: int
    size: int
    busbw_gbps: float | None = None
    wrong: int | None = None
    error: str | None = None


@dataclass
class Thresholds:
    """When a device is flagged."""

    tolerance: float = 0.10  # below the siblings' median by more than this fraction
    min_peak_frac: float = 0.60  # GEMM under this fraction of the datasheet peak
    min_membw_frac: float = 0.70  # device copy under this fraction of the datasheet
    min_busbw_gbps: float | None = None  # all_reduce busbw floor, when the fabric is known


@dataclass
class Finding:
    """One reason to distrust the node."""

    device: str
    metric: str
    message: str


@dataclass
class NodeReport:
    """Measurements and findings; healthy when there are no findings."""

    devices: list[DeviceResult]
    collective: CollectiveResult | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        """True when nothing was flagged."""
        return not self.findings

    def to_json(self) -> dict:
        """Plain data for node.json."""
        return {"healthy": self.healthy, "devices": [asdict(d) for d in self.devices],
                "collective": asdict(self.collective) if self.collective else None,
                "findings": [asdict(f) for f in self.findings]}


def assess(devices: list[DeviceResult], collective: CollectiveResult | None,
           thresholds: Thresholds | None = None) -> NodeReport:
    """Compare every device with its siblings and the datasheet; return the findings."""
    th = thresholds or Thresholds()
    findings: list[Finding] = []
    for d in devices:
        if d.error:
            findings.append(Finding(d.device, "error", f"{d.device}: benchmark failed: {d.error}"))
    for key, (label, unit) in METRICS.items():
        for d in devices:
            value = getattr(d, key)
            siblings = [getattr(o, key) for o in devices
                        if o is not d and getattr(o, key) is not None]
            if value is None or not siblings:
                continue
            med = statistics.median(siblings)
            if med > 0 and value < (1 - th.tolerance) * med:
                findings.append(Finding(d.device, key, (
                    f"{d.device} {label} {100 * (1 - value / med):.0f}% below its siblings "
                    f"({value:,.1f} vs median {med:,.1f} {unit})")))
    for d in devices:
        if d.gemm_tflops is not None and d.gemm_peak_tflops:
            frac = d.gemm_tflops / d.gemm_peak_tflops
            if frac < th.min_peak_frac:
                findings.append(Finding(d.device, "gemm_peak", (
                    f"{d.device} GEMM {d.gemm_dtype} {d.gemm_tflops:,.1f} TFLOP/s is "
                    f"{100 * frac:.0f}% of the datasheet peak {d.gemm_peak_tflops:g} "
                    f"(expected >= {100 * th.min_peak_frac:.0f}%)")))
        if d.membw_gbps is not None and d.membw_datasheet_gbps:
            frac = d.membw_gbps / d.membw_datasheet_gbps
            if frac < th.min_membw_frac:
                findings.append(Finding(d.device, "membw_datasheet", (
                    f"{d.device} memory bandwidth {d.membw_gbps:,.0f} GB/s is {100 * frac:.0f}% "
                    f"of the datasheet {d.membw_datasheet_gbps:,.0f} "
                    f"(expected >= {100 * th.min_membw_frac:.0f}%)")))
    c = collective
    if c is not None:
        where = f"all_reduce over {c.ranks} ranks"
        if c.error:
            findings.append(Finding("node", "all_reduce", f"{where} failed: {c.error}"))
        elif c.wrong:
            findings.append(Finding("node", "all_reduce",
                                    f"{where}: {c.wrong} wrong elements (bad GPU, link or NCCL)"))
        elif (th.min_busbw_gbps is not None and c.busbw_gbps is not None
              and c.busbw_gbps < th.min_busbw_gbps):
            findings.append(Finding("node", "all_reduce", (
                f"{where}: busbw {c.busbw_gbps:,.1f} GB/s below the expected "
                f"{th.min_busbw_gbps:,.1f}")))
    return NodeReport(devices, collective, findings)


def measure_device(device, *, quick: bool = False) -> DeviceResult:
    """GEMM, device copy and (on a GPU) pinned host<->device copies on one device."""
    import torch

    from hpctrain.bench.common import device_name
    from hpctrain.bench.gemm import run_gemm
    from hpctrain.bench.h2d import run_h2d
    from hpctrain.bench.membw import run_membw

    on_gpu = device.type == "cuda"
    label = f"GPU {device.index}" if on_gpu else "CPU"
    result = DeviceResult(label, device_name(device), gemm_dtype="bf16" if on_gpu else "fp32")
    try:
        size = (2048 if quick else 8192) if on_gpu else 512
        g = run_gemm([result.gemm_dtype], [size], device, warmup=5, iters=20 if on_gpu else 5)
        row = g.rows[0]
        result.gemm_tflops, result.gemm_peak_tflops = row.get("tflops"), row.get("peak_tflops")
        m = run_membw([(256 if quick else 1024) * 1024**2 if on_gpu else 64 * 1024**2], device,
                      warmup=3, iters=10 if on_gpu else 5)
        result.membw_gbps = m.rows[0]["gbps"]
        result.membw_datasheet_gbps = m.rows[0]["datasheet_gbps"]
        if on_gpu:
            h = run_h2d([(64 if quick else 256) * 1024**2], device, warmup=2, iters=5)
            for r in h.rows:
                if r["host_memory"] == "pinned" and r["non_blocking"]:
                    setattr(result, f"{r['direction']}_gbps", r["gbps"])
    except Exception as e:  # a sick GPU raises (ECC, Xid); report it rather than stop the check
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if on_gpu:
            torch.cuda.empty_cache()
    return result
