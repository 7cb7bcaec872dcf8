"""Config section ``metrics:``: how often and what each rank records."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError


@dataclass
class MetricsConfig:
    """Logging cadence and the peak used for MFU when the device is not in the table."""

    log_every: int = 10
    # Dense peak TFLOP/s of one device for the training dtype. None: look the device up in the
    # peak table and report MFU as unknown when it is not there, rather than guess.
    peak_tflops: float | None = None
    progress: bool = True
    # Live stragglers (observe/stragglers.py): a rank whose own time per step exceeds the
    # median rank's by this fraction of the median step time, for this many logging windows
    # in a row, is named. 0 windows: no straggler exchange at all.
    straggler_threshold: float = 0.1
    straggler_windows: int = 3
    # Meter the GPUs' energy through NVML (rank 0; observe/power.py EnergyMeter): kWh, tokens
    # per joule and CO2e in goodput.json, `hpctrain runs` and the report.
    energy: bool = True
    # Grid carbon intensity for CO2e, g CO2e per kWh. Default: the world average of 2023,
    # 480 g/kWh (Ember, Global Electricity Review 2024); set your site's (its provider, or
    # Electricity Maps for the region) for a number that means something.
    grid_gco2_per_kwh: float = 480.0

    def validate(self) -> None:
        """Require a positive cadence and a positive peak when given."""
        if self.log_every < 1:
            raise ConfigError(f"metrics.log_every = {self.log_every} must be >= 1")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"metrics.peak_tflops = {self.peak_tflops} must be positive")
        if self.straggler_threshold <= 0:
            raise ConfigError(f"metrics.straggler_threshold = {self.straggler_threshold} must be "
                              "positive", expected="a fraction of the step time, e.g. 0.1")
        if not 0 <= self.grid_gco2_per_kwh < 10_000:
            raise ConfigError(f"metrics.grid_gco2_per_kwh = {self.grid_gco2_per_kwh} is not a "
                              "grid intensity", expected="g CO2e per kWh, 0 to 10000",
                              hint="the world average is about 480; a hydro or nuclear grid "
                              "20 to 60")
        if self.straggler_windows < 0:
            raise ConfigError(f"metrics.straggler_windows = {self.straggler_windows} must be >= 0")
