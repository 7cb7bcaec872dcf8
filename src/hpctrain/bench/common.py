"""What every benchmark shares: size parsing, device choice, timing, and writing results.

Timing follows FIELD_NOTES "Measuring": on CUDA, events recorded on the device under test (inside
``torch.cuda.device(dev)``), warm-up first, the median of many repetitions, random inputs. On the
CPU, ``time.perf_counter`` around each repetition.
"""

from __future__ import annotations

import csv
import json
import platform
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpctrain.errors import ConfigError
from hpctrain.launch.local import kill_tree
from hpctrain.runtime.dist import pick_device

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
# Beyond any device's memory: a larger size is a typo, not a benchmark.
MAX_SIZE = 1024**4
MAX_SWEEP = 1000


def parse_size(text: str | int) -> int:
    """Parse a byte size like nccl-tests does: ``8``, ``64K``, ``1M``, ``1G`` (binary units)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise ConfigError(
                f"size {text!r} is not a byte size",
                expected="a number with an optional K/M/G/T suffix (powers of 1024), e.g. 64M",
                hint="nccl-tests style: -b 8 -e 128M -f 2",
            )
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not 0 < value <= MAX_SIZE:
        raise ConfigError(f"size {str(text)[:40]!r} is out of range",
                          expected="a size from 1 byte to 1T")
    return value


def size_sweep(begin: str | int, end: str | int, factor: float) -> list[int]:
    """Sizes from `begin` to `end` inclusive, each `factor` times the last (nccl-tests -b -e -f)."""
    b, e = parse_size(begin), parse_size(end)
    if e < b:
        raise ConfigError(f"end size {end} is below begin size {begin}",
                          expected="-b <= -e", hint="swap -b and -e")
    if factor <= 1:
        raise ConfigError(f"size factor {factor} must be > 1", expected="e.g. -f 2")
    sizes, s = [], b
    while s <= e:
        sizes.append(int(s))
        s = s * factor
        if len(sizes) > MAX_SWEEP:
            raise ConfigError(f"-b {begin} -e {end} -f {factor} is more than {MAX_SWEEP} sizes",
                              expected="a sweep of at most a few dozen sizes", hint="-f 2")
    return sizes


def human_bytes(n: int) -> str:
    """Format a byte count with binary units: 1024 -> '1K', 67108864 -> '64M'."""
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def select_device(name: str, local_rank: int = 0) -> torch.device:
    """The device to benchmark: ``auto`` (CUDA if present), ``cpu``, ``cuda``, ``cuda:N``; chosen as
    training chooses it (``hpctrain.runtime.dist.pick_device``)."""
    return pick_device(name, local_rank, setting="--device", host=socket.gethostname())


def device_name(device: torch.device) -> str:
    """Human name of the device (GPU model, or the CPU's architecture)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()}"


def sync(device: torch.device) -> None:
    """Wait for all queued work on `device`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_each(fn: Callable[[], Any], device: torch.device, *, warmup: int, iters: int,
              before: Callable[[], None] | None = None) -> list[float]:
    """Run `fn` warmup + iters times; return the seconds each timed repetition took.

    On CUDA each repetition is bracketed by events recorded on `device`'s current stream (no host
    sync between repetitions, so launch latency overlaps as in real use); on the CPU by
    perf_counter, after `before()` (e.g. a barrier so all ranks start together).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    sync(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            pairs = []
            for _ in range(iters):
                if before is not None:
                    before()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize(device)
            return [s.elapsed_time(e) / 1e3 for s, e in pairs]
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run_command(argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> tuple[int, str, float]:
    """Run a command in its own session; return (exit code, output tail, wall seconds).

    On timeout the whole process group (launcher and ranks) is killed, so no rank outlives it.
    """
    start = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        code = 124
        out += f"\nkilled after {timeout:.0f} s"
    finally:
        kill_tree(proc.pid)
    return code, (out or "")[-4000:], time.time() - start


def median(values: Sequence[float]) -> float:
    """Median of `values`."""
    return statistics.median(values)


@dataclass
class Results:
    """Rows of one benchmark plus what produced them; written as CSV + JSON (+ PNG if possible)."""

    name: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, **row: Any) -> None:
        """Append one row (keys are column names)."""
        self.rows.append(row)

    def print_table(self, title: str | None = None) -> None:
        """Print the rows as a rich table on stdout."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title or self.name)
        for col in self.columns:
            table.add_column(col, justify="right")
        for row in self.rows:
            table.add_row(*(human_bytes(row[c]) if c == "size" and isinstance(row.get(c), int)
                            else _fmt(row.get(c)) for c in self.columns))
        Console(width=200).print(table)

    def write(self, out_dir: Path) -> list[Path]:
        """Write ``<name>.csv`` and ``<name>.json`` into `out_dir`; return the paths."""
        out_dir.mkdir(parents=True, exist_ok=True)
        csv_path = out_dir / f"{self.name}.csv"
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            for row in self.rows:
                writer.writerow({c: row.get(c) for c in self.columns})
        json_path = out_dir / f"{self.name}.json"
        meta = {"host": socket.gethostname(), "torch": torch.__version__,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **self.meta}
        json_path.write_text(json.dumps({"meta": meta, "rows": self.rows}, indent=2) + "\n")
        return [csv_path, json_path]


def plot(path: Path, series: dict[str, tuple[list[float], list[float]]], *, xlabel: str,
         ylabel: str, title: str, logx: bool = True) -> str:
    """Draw `series` (label -> (x, y)) to a PNG if matplotlib is installed; return a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.1f}"
        return f"{value:.3g}" if value < 1 else f"{value:.2f}"
    return str(value)
