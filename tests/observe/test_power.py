"""PowerSampler against a fake NVML module.

The fake is injected through the one seam the sampler has for it, the ``nvml`` module object
(``PowerSampler(nvml=...)`` / ``sys.modules["pynvml"]``). CI machines have no GPU and no NVIDIA
driver, so this is the only way to run the sampling and integration logic there; the real module
is exercised by ``hpctrain bench model`` on the GPU machine (benchmarks/bench_gpu.py).
"""

from __future__ import annotations

import sys
import time
import types

import pytest

from hpctrain.observe.power import PowerSampler, PowerUnavailable, load_nvml, sampler_factory


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_nvml(watts, clock, *, gpus: int = 2, energy: bool = True, fail_init: bool = False):
    """A module with NVML's functions: power `watts(index, t)` W; energy its exact integral.

    Power is reported in mW and energy in mJ, as NVML does.
    """
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.calls = []

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")
        m.calls.append("init")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    m.nvmlDeviceGetHandleByUUID = lambda u: ("h", int(u.rsplit("-", 1)[1]))
    m.nvmlDeviceGetPowerUsage = lambda h: watts(h[1], clock()) * 1000
    if energy:
        # Exact integral of the linear-in-time power used below: a + b t -> a t + b t^2 / 2.
        def energy_mj(h):
            t = clock()
            a, b = watts(h[1], 0.0), watts(h[1], 1.0) - watts(h[1], 0.0)
            return (a * t + b * t * t / 2) * 1000

        m.nvmlDeviceGetTotalEnergyConsumption = energy_mj
    return m


def _sample_every_second(sampler: PowerSampler, clock: FakeClock, until: float) -> None:
    while clock.t <= until:
        sampler.sample()
        clock.t += 1.0


@pytest.mark.parametrize("energy", [True, False], ids=["energy-counter", "power-only"])
def test_constant_power_two_gpus(energy: bool) -> None:
    clock = FakeClock()
    nvml = fake_nvml(lambda i, t: 300.0, clock, energy=energy)
    s = PowerSampler(nvml=nvml, clock=clock)
    assert s.has_energy_counter is energy and len(s.handles) == 2
    _sample_every_second(s, clock, 10)
    # 2 GPUs x 300 W x 6 s between t=2 and t=8, also between samples (2.5 .. 8.5).
    assert s.joules(2, 8) == pytest.approx(3600)
    assert s.joules(2.5, 8.5) == pytest.approx(3600)
    assert s.joules() == pytest.approx(6000)
    assert s.mean_watts() == pytest.approx(600)


@pytest.mark.parametrize("energy", [True, False], ids=["energy-counter", "power-only"])
def test_ramp_is_integrated_exactly(energy: bool) -> None:
    # GPU 0: 100 + 10 t W; GPU 1: 200 W. 0..10 s: 1,500 J + 2,000 J.
    clock = FakeClock()
    nvml = fake_nvml(lambda i, t: 100 + 10 * t if i == 0 else 200.0, clock, energy=energy)
    s = PowerSampler(nvml=nvml, clock=clock)
    _sample_every_second(s, clock, 10)
    assert s.joules(0, 10) == pytest.approx(3500)
    assert s.mean_watts(0, 10) == pytest.approx(350)
    # A span beyond the samples is clipped to them.
    assert s.joules(-5, 50) == pytest.approx(3500)


def test_background_thread_samples_until_stopped() -> None:
    nvml = fake_nvml(lambda i, t: 250.0, time.time, gpus=1, energy=False)
    s = PowerSampler(nvml=nvml, interval_s=0.01).start()
    time.sleep(0.1)
    s.stop()
    assert len(s.samples) >= 3
    assert s.mean_watts() == pytest.approx(250)
    assert nvml.calls[-1] == "shutdown"


def test_cuda_visible_devices_maps_to_nvml_indices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-uuid-3")
    nvml = fake_nvml(lambda i, t: 10.0 * i, FakeClock(), gpus=4)
    s = PowerSampler([0, 1], nvml=nvml)
    assert s.handles == [("h", 2), ("h", 3)]
    assert s.sample().watts == (20.0, 30.0)
    with pytest.raises(PowerUnavailable, match="CUDA_VISIBLE_DEVICES"):
        PowerSampler([2], nvml=nvml)


def test_missing_module_and_missing_driver_say_what_to_do(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(PowerUnavailable) as exc:
        load_nvml()
    assert "nvidia-ml-py" in str(exc.value) and "pip install" in str(exc.value)
    factory, note = sampler_factory()
    assert factory is None and "nvidia-ml-py" in note

    broken = fake_nvml(lambda i, t: 0.0, FakeClock(), fail_init=True)
    with pytest.raises(PowerUnavailable, match="no NVIDIA GPU or driver"):
        PowerSampler(nvml=broken)
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    factory, note = sampler_factory()
    assert factory is None and "Driver Not Loaded" in note


def test_the_real_bindings_without_a_driver_name_what_is_missing(monkeypatch) -> None:
    """nvidia-ml-py is a dependency: on a machine without the NVIDIA driver (this CI one; forced
    here so that a GPU node runs it too) nvmlInit raises NVMLError_LibraryNotFound. Power and
    the GPU's reading say the driver's library is missing, not to install nvidia-ml-py."""
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(PowerUnavailable) as exc:
        PowerSampler()
    assert "libnvidia-ml.so.1" in exc.value.what and "pip install" not in str(exc.value)
    factory, note = sampler_factory()
    assert factory is None and "libnvidia-ml.so.1" in note and "pip install" not in note
    from hpctrain.plan.gpu import gpu_name

    assert "libnvidia-ml.so.1" in gpu_name(0)
