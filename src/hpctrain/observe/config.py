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

    def validate(self) -> None:
        """Require a positive cadence and a positive peak when given."""
        if self.log_every < 1:
            raise ConfigError(f"metrics.log_every = {self.log_every} must be >= 1")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"metrics.peak_tflops = {self.peak_tflops} must be positive")
        if self.straggler_threshold <= 0:
            raise ConfigError(f"metrics.straggler_threshold = {self.straggler_threshold} must be "
                              "positive", expected="a fraction of the step time, e.g. 0.1")
        if self.straggler_windows < 0:
            raise ConfigError(f"metrics.straggler_windows = {self.straggler_windows} must be >= 0")
