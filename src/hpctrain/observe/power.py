"""GPU power and energy through NVML (``nvidia-ml-py``, a dependency, imported as ``pynvml``).

    sampler = PowerSampler(devices=[0, 1])       # CUDA indices, mapped through CUDA_VISIBLE_DEVICES
    sampler.start()
    ...                                          # the work to measure
    sampler.stop()
    sampler.joules(), sampler.mean_watts()       # summed over the devices
    sampler.joules(t0, t1)                       # only the span t0..t1 (time.time() seconds)

A background thread samples every ``interval_s``. Where the driver offers the cumulative energy
counter (``nvmlDeviceGetTotalEnergyConsumption``, Volta and newer) energy is the counter's
difference, interpolated at the span's ends: exact whatever the sampling rate. Otherwise the
power readings (``nvmlDeviceGetPowerUsage``) are integrated with the trapezoid rule. The numbers
are the GPUs' board power only: no CPU, memory, network or cooling.

Where NVML cannot start (no NVIDIA driver: its library is missing; the driver not loaded; no
permission) `PowerUnavailable` says which; `sampler_factory` turns that into a note for callers
that can go on without power.

A training run meters its energy with `EnergyMeter` (a running total, one reading a second) on
rank 0; goodput.json turns it into kWh, tokens per joule and CO2e (observe/goodput.py).

Why not CodeCarbon (its ``OfflineEmissionsTracker``): for the GPUs it reads the same NVML
counters as here; what it adds is the CPU (RAPL where readable, else a TDP guess) and memory (a
guess from its size) of the whole machine, which on a shared node is other people's jobs too,
and its own country table of grid intensities. It would pull pandas and a dozen other packages
into every training process and keep its own CSV, knowing nothing of attempts and requeues. We
report what we measure (GPU board energy) and take the grid intensity from the config.
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import ModuleType

import torch

from hpctrain.errors import HpctrainError

log = logging.getLogger("hpctrain.observe")


class PowerUnavailable(HpctrainError):
    """NVML cannot read the GPUs here: no NVIDIA driver or GPU (or a broken install)."""


# Why nvmlInit fails on a machine, by NVML's error code (pynvml's constant for it).
_CANNOT_START = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "its library, libnvidia-ml.so.1, which the NVIDIA driver "
                                    "installs, is not on this machine",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded",
    "NVML_ERROR_NO_PERMISSION": "this user may not open the GPUs (/dev/nvidia*)",
}


def load_nvml() -> ModuleType:
    """Import pynvml (nvidia-ml-py, one of hpctrain's dependencies) or raise PowerUnavailable."""
    try:
        import pynvml
    except ImportError as e:
        raise PowerUnavailable(
            f"NVML's Python bindings (pynvml, from nvidia-ml-py) cannot be imported: {e}",
            expected="nvidia-ml-py, installed with hpctrain",
            hint="this environment's install of hpctrain is incomplete: pip install nvidia-ml-py",
        ) from None
    return pynvml


def start_nvml(nvml: ModuleType) -> None:
    """``nvmlInit()``, or PowerUnavailable saying why NVML cannot start on this machine."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        code = getattr(e, "value", None)
        why = next((text for name, text in _CANNOT_START.items()
                    if code is not None and getattr(nvml, name, None) == code), str(e))
        raise PowerUnavailable(f"NVML could not start: {why}",
                               hint="no NVIDIA GPU or driver on this machine? On a GPU node "
                               "`nvidia-smi` shows what the driver sees; a CPU run needs "
                               "neither") from None


def nvml_handle(nvml: ModuleType, cuda_index: int):
    """NVML handle of CUDA device ``cuda_index``, honouring CUDA_VISIBLE_DEVICES (NVML numbers
    every GPU of the machine; CUDA only the visible ones)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    try:
        if entries:
            if cuda_index >= len(entries):
                raise PowerUnavailable(
                    f"CUDA device {cuda_index} but CUDA_VISIBLE_DEVICES={visible}")
            entry = entries[cuda_index]
            if entry.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(entry))
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    except nvml.NVMLError as e:
        raise PowerUnavailable(f"NVML has no device for CUDA index {cuda_index}: {e}") from None


@dataclass(frozen=True)
class Sample:
    """One reading: wall time, board power per device (W), energy counter per device (J)."""

    t: float
    watts: tuple[float, ...]
    joules: tuple[float, ...] | None


class PowerSampler:
    """Samples the board power of some GPUs in a background thread; integrates it to joules."""

    def __init__(self, devices: Sequence[int] | None = None, *, interval_s: float = 0.1,
                 nvml: ModuleType | None = None, clock: Callable[[], float] = time.time):
        self.nvml = nvml if nvml is not None else load_nvml()
        self.interval_s = interval_s
        self.clock = clock
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        start_nvml(self.nvml)
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self.nvml.NVMLError as e:
            raise PowerUnavailable(f"NVML could not count the GPUs: {e}") from None
        if count == 0:
            raise PowerUnavailable("NVML sees no GPU")
        wanted = list(devices) if devices is not None else list(range(count))
        self.handles = [nvml_handle(self.nvml, i) for i in wanted]
        self.devices = wanted
        try:
            for h in self.handles:
                self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)
            self.has_energy_counter = True
        except (self.nvml.NVMLError, AttributeError):
            self.has_energy_counter = False

    def sample(self) -> Sample:
        """Take one reading now and keep it."""
        s = self.read()
        self.samples.append(s)
        return s

    def read(self) -> Sample:
        """One reading of every device now (not kept)."""
        t = self.clock()
        watts = tuple(self.nvml.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in self.handles)
        joules = None
        if self.has_energy_counter:
            joules = tuple(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
                           for h in self.handles)
        return Sample(t, watts, joules)

    def start(self) -> PowerSampler:
        """Start sampling in a daemon thread (one reading immediately)."""
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="power-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except self.nvml.NVMLError:  # a transient read error loses one sample, not the run
                continue

    def stop(self) -> None:
        """Stop the thread, take a last reading, release NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with suppress(self.nvml.NVMLError):
            self.sample()
        with suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def joules(self, t0: float | None = None, t1: float | None = None) -> float:
        """Energy of all sampled devices between t0 and t1 (default: the whole sampling)."""
        if len(self.samples) < 2:
            return 0.0
        ts = [s.t for s in self.samples]
        t0 = ts[0] if t0 is None else max(t0, ts[0])
        t1 = ts[-1] if t1 is None else min(t1, ts[-1])
        if t1 <= t0:
            return 0.0
        if all(s.joules is not None for s in self.samples):
            total = [sum(s.joules) for s in self.samples]  # type: ignore[arg-type]
            return _interp(ts, total, t1) - _interp(ts, total, t0)
        return _trapezoid(ts, [sum(s.watts) for s in self.samples], t0, t1)

    def mean_watts(self, t0: float | None = None, t1: float | None = None) -> float:
        """Mean power of all sampled devices together between t0 and t1 (time-weighted)."""
        if len(self.samples) < 2:
            return sum(self.samples[0].watts) if self.samples else 0.0
        lo = self.samples[0].t if t0 is None else max(t0, self.samples[0].t)
        hi = self.samples[-1].t if t1 is None else min(t1, self.samples[-1].t)
        return self.joules(lo, hi) / (hi - lo) if hi > lo else 0.0


class EnergyMeter(PowerSampler):
    """A running total of the devices' energy for a whole training run: each reading is folded
    into the total and dropped (a run of days would otherwise keep millions of samples).

    Between two readings: the energy counters' difference where both have it (exact), else the
    trapezoid of the two power readings. ``joules()`` is the total up to the last reading.
    """

    def __init__(self, devices: Sequence[int] | None = None, *, interval_s: float = 1.0,
                 nvml: ModuleType | None = None, clock: Callable[[], float] = time.time):
        super().__init__(devices, interval_s=interval_s, nvml=nvml, clock=clock)
        self.total_j = 0.0
        self.last: Sample | None = None
        self._lock = threading.Lock()  # the sampling thread adds while the loop reads

    def sample(self) -> Sample:
        """Take one reading now and add the energy since the previous one."""
        s = self.read()
        with self._lock:
            if self.last is not None:
                self.total_j += _between(self.last, s)
            self.last = s
        return s

    def joules(self, t0: float | None = None, t1: float | None = None) -> float:
        """Energy of all sampled devices from the first reading to the last (no sub-spans:
        the readings are not kept)."""
        if t0 is not None or t1 is not None:
            raise ValueError("EnergyMeter keeps a total only; use PowerSampler for spans")
        with self._lock:
            return self.total_j


def _between(a: Sample, b: Sample) -> float:
    """Joules of all devices from reading ``a`` to reading ``b``."""
    if a.joules is not None and b.joules is not None:
        spent = sum(b.joules) - sum(a.joules)
        if spent >= 0:  # a counter that went back (driver reload) falls back to power
            return spent
    return (b.t - a.t) * (sum(a.watts) + sum(b.watts)) / 2


def energy_devices(device: torch.device, local_world_size: int) -> list[int]:
    """The CUDA devices rank 0 meters for the run: every GPU it sees that the node's ranks
    use (all of them under the local launcher or torchrun; its own where Slurm binds one GPU
    per task); none on a CPU run."""
    if device.type != "cuda":
        return []
    if local_world_size <= 1:
        return [device.index or 0]  # run.device=cuda:N puts a lone rank on GPU N
    return list(range(min(torch.cuda.device_count(), local_world_size)))


def start_energy_meter(device: torch.device, local_world_size: int) -> EnergyMeter | None:
    """An EnergyMeter started on rank 0's devices, or None (logged why) when energy cannot be
    read here: a CPU run, no NVIDIA driver, no GPU."""
    devices = energy_devices(device, local_world_size)
    if not devices:
        log.info("energy: not measured (NVML reads NVIDIA GPUs only; this run is on %s)",
                 device.type)
        return None
    try:
        meter = EnergyMeter(devices)
    except PowerUnavailable as e:
        log.info("energy: not measured: %s (%s)", e.what, e.hint or "")
        return None
    log.info("energy: metering GPUs %s through NVML (%s)", devices,
             "energy counters" if meter.has_energy_counter else "power readings, integrated")
    return meter.start()  # type: ignore[return-value]


def sampler_factory(interval_s: float = 0.1
                    ) -> tuple[Callable[[list[int]], PowerSampler | None] | None, str]:
    """(a function devices -> PowerSampler, a note) or (None, why power cannot be sampled)."""
    try:
        nvml = load_nvml()
        start_nvml(nvml)
    except PowerUnavailable as e:
        return None, f"power: not sampled: {e.what}"
    with suppress(nvml.NVMLError):
        nvml.nvmlShutdown()

    def factory(devices: list[int]) -> PowerSampler | None:
        try:
            return PowerSampler(devices, interval_s=interval_s, nvml=nvml)
        except PowerUnavailable as e:
            print(f"power: not sampled: {e.what}", file=sys.stderr)
            return None

    return factory, "power: sampled through NVML"


def _interp(ts: list[float], ys: list[float], t: float) -> float:
    """Piecewise-linear value of (ts, ys) at t (clamped to the ends)."""
    i = bisect.bisect_left(ts, t)
    if i <= 0:
        return ys[0]
    if i >= len(ts):
        return ys[-1]
    t_a, t_b = ts[i - 1], ts[i]
    if t_b == t_a:
        return ys[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - t_a) / (t_b - t_a)


def _trapezoid(ts: list[float], ys: list[float], t0: float, t1: float) -> float:
    """Integral of the piecewise-linear (ts, ys) from t0 to t1."""
    points = [t0, *(t for t in ts if t0 < t < t1), t1]
    values = [_interp(ts, ys, t) for t in points]
    return sum((points[k + 1] - points[k]) * (values[k + 1] + values[k]) / 2
               for k in range(len(points) - 1))
