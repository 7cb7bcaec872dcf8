"""Where a profiled step's GPU time went, from the Chrome traces that ``profile.steps`` writes.

    hpctrain train cfg.yaml profile.steps=[20,22]
    hpctrain profile runs/llama-1234                     # every profile of the run, every rank
    hpctrain profile runs/llama-1234/profiles/step-000020-000022/rank-000.trace.json

Per trace (one rank), over the span from its first GPU event to its last:

- kernel time by kind: GEMM, attention, communication (NCCL), optimizer, fused pointwise
  (Triton, i.e. torch.compile's kernels), memory copies and sets, other; a kind's time counts
  its kernels' durations, so kinds on concurrent streams can sum past the span;
- busy: the union of all GPU activity, and idle = span - busy: the GPU waiting for the CPU
  (launch gaps, host syncs, data) or for another rank;
- communication exposed vs overlapped: the union of NCCL kernels minus its overlap with the
  union of every other kernel. Exposed communication is what overlapping would win;
- the idle gaps, largest first, each with the kernels around it and when the CPU launched the
  kernel that ended it (matched by the trace's correlation ids). Idle before that launch is the
  GPU waiting for the CPU to issue work (launch-bound: Python, dispatch, a host sync before it);
  idle after it is the launch's own latency or a wait on another stream or rank.

Kinds are read from kernel names (cuBLAS/CUTLASS ``gemm``/``nvjet``/``xmma``, flash/cuDNN
attention, ``nccl``, fused/multi-tensor Adam, ``triton_``), which is how profilers summarise
them too; a kernel that matches none is "other".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.errors import HpctrainError

KINDS = ("gemm", "attention", "communication", "optimizer", "fused pointwise (Triton)",
         "memcpy/memset", "other")
_PATTERNS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|_foreach", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|matmul|splitk", re.I)),
    ("fused pointwise (Triton)", re.compile(r"^triton_")),
)
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# Host-side calls that enqueue GPU work (cudaLaunchKernel, cudaMemcpyAsync, cuLaunchKernelEx...).
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
GAPS_SHOWN = 5
_FOLDER = re.compile(r"step-(\d+)-(\d+)$")


class TraceError(HpctrainError):
    """A trace that cannot be summarised."""


@dataclass(frozen=True)
class Gap:
    """A stretch of the span with no GPU activity at all."""

    at_us: float  # from the span's start
    length_us: float
    before: str  # the kernel whose end opened it
    after: str  # the kernel whose start closed it
    # When the CPU launched ``after``, from the gap's start (> 0: the GPU had run dry and waited
    # for that launch); None where the trace holds no matching launch.
    launch_lag_us: float | None

    @property
    def waiting_for_launch_us(self) -> float:
        """The part of the gap before the CPU had launched the kernel that ended it."""
        if self.launch_lag_us is None:
            return 0.0
        return min(self.length_us, max(0.0, self.launch_lag_us))


@dataclass
class TraceSummary:
    """One rank's profiled span."""

    path: Path
    steps: int | None
    span_us: float = 0.0
    busy_us: float = 0.0
    comm_us: float = 0.0
    comm_exposed_us: float = 0.0
    kinds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    top: list[tuple[str, float, int]] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)  # the largest, longest first
    n_gaps: int = 0
    idle_launch_us: float = 0.0  # idle before the next kernel's launch, over all gaps

    @property
    def idle_us(self) -> float:
        """Time in the span with no GPU activity at all."""
        return max(0.0, self.span_us - self.busy_us)


def kind_of(name: str, category: str) -> str:
    """The kind of one GPU event."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memcpy/memset"
    for kind, pattern in _PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end)."""
    return sum(e - s for s, e in _merged(intervals))


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise_trace(path: Path, steps: int | None = None, top: int = 8) -> TraceSummary:
    """Read one Chrome trace and account for its GPU time."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read the trace {path}: {e}",
                         hint="pass a rank-NNN.trace.json written by profile.steps") from e
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    gpu = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
           and e.get("cat") in _GPU_CATS and isinstance(e.get("dur"), int | float)]
    if not gpu:
        raise TraceError(f"{path} holds no GPU kernels",
                         expected="a trace of a CUDA run (CPU runs record no GPU time)",
                         hint="profile a GPU run: profile.steps=[a,b] with run.device=cuda")
    res = TraceSummary(Path(path), steps)
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    res.span_us = max(e for _, e in spans) - min(s for s, _ in spans)
    comm, compute = [], []
    by_name: dict[str, list[float]] = {}
    for e, interval in zip(gpu, spans, strict=True):
        kind = kind_of(str(e.get("name", "")), e["cat"])
        res.kinds[kind] += float(e["dur"])
        (comm if kind == "communication" else compute).append(interval)
        by_name.setdefault(str(e.get("name", "")), []).append(float(e["dur"]))
    res.busy_us = union_length(spans)
    comm_m, compute_m = _merged(comm), _merged(compute)
    res.comm_us = sum(e - s for s, e in comm_m)
    res.comm_exposed_us = res.comm_us - _overlap(comm_m, compute_m)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    res.top = [(name, sum(durs), len(durs)) for name, durs in ranked]
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if isinstance(e, dict) and e.get("cat") in _LAUNCH_CATS
                and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    gaps = idle_gaps(gpu, launches, origin=min(s for s, _ in spans))
    res.n_gaps = len(gaps)
    res.idle_launch_us = sum(g.waiting_for_launch_us for g in gaps)
    res.gaps = sorted(gaps, key=lambda g: -g.length_us)[:GAPS_SHOWN]
    return res


def idle_gaps(gpu: list[dict], launches: dict, origin: float) -> list[Gap]:
    """Every gap between GPU events (on any stream), in time order."""
    gaps = []
    ordered = sorted(gpu, key=lambda e: float(e["ts"]))
    last = ordered[0]
    end = float(last["ts"]) + float(last["dur"])
    for e in ordered[1:]:
        start = float(e["ts"])
        if start > end:
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            launched = launches.get(args.get("correlation"))
            gaps.append(Gap(end - origin, start - end, str(last.get("name", "")),
                            str(e.get("name", "")),
                            None if launched is None else launched - end))
        if float(e["ts"]) + float(e["dur"]) > end:
            last, end = e, float(e["ts"]) + float(e["dur"])
    return gaps


def find_traces(target: Path) -> list[tuple[Path, int | None]]:
    """Traces under a run directory (or the one given), each with its step count if known."""
    target = Path(target)
    paths = [target] if target.is_file() else sorted(target.glob("profiles/*/rank-*.trace.json"))
    if not paths:
        raise TraceError(f"no profiler traces under {target}",
                         expected="RUN/profiles/step-A-B/rank-NNN.trace.json",
                         hint="train with profile.steps=[a,b] (or signal a running job: "
                         "kill -URG <pid>), then run this on the run directory")
    out = []
    for p in paths:
        m = _FOLDER.search(p.parent.name)
        out.append((p, int(m[2]) - int(m[1]) + 1 if m else None))
    return out


def markdown(summaries: list[TraceSummary]) -> str:
    """One table row per trace, then each trace's largest kernels."""
    per = "per step " if all(s.steps for s in summaries) else ""
    head = ["trace", f"span ms {per}".strip(), "GPU idle", *KINDS, "comm exposed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        div = 1000.0 * (s.steps or 1)

        def pct(us: float, s: TraceSummary = s) -> str:
            return f"{100 * us / s.span_us:.1f}%" if s.span_us else "-"

        name = f"{s.path.parent.name}/{s.path.name}"
        cells = [name, f"{s.span_us / div:.1f}", pct(s.idle_us),
                 *(pct(s.kinds[k]) for k in KINDS), pct(s.comm_exposed_us)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Kinds: kernel time over the span (concurrent streams can sum past 100%); "
                 "comm exposed: NCCL time with no other kernel running.")
    for s in summaries:
        lines.append(f"\nLargest kernels, {s.path.parent.name}/{s.path.name}:")
        for name, us, n in s.top:
            lines.append(f"- {us / 1000:.1f} ms in {n} calls: {name[:110]}")
        lines += _gap_lines(s)
    return "\n".join(lines)


def _gap_lines(s: TraceSummary) -> list[str]:
    """Where the idle time of one trace sits, and how much of it waited for a launch."""
    if not s.gaps:
        return []
    div = 1000.0 * (s.steps or 1)
    share = 100 * s.idle_launch_us / s.idle_us if s.idle_us else 0.0
    out = [f"\nIdle, {s.path.parent.name}/{s.path.name}: {s.idle_us / div:.2f} ms"
           f"{' a step' if s.steps else ''} in {s.n_gaps} gaps; {share:.0f}% of it before the "
           "CPU had launched the next kernel (launch-bound). Largest gaps:"]
    for g in s.gaps:
        when = ("launch not in the trace" if g.launch_lag_us is None else
                f"launched {g.launch_lag_us / 1000:+.3f} ms from the gap's start")
        out.append(f"- {g.length_us / 1000:.3f} ms at {g.at_us / 1000:.1f} ms, after "
                   f"{g.before[:60]}, before {g.after[:60]} ({when})")
    return out
