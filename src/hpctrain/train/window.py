"""A logging window of the training loop: device-side accumulators and the metrics line they make.

Between two log lines (``metrics.log_every`` steps) losses, good-step counts and the last gradient
norm stay on the device; :meth:`Window.read` fetches them in the window's one host sync, and
:meth:`Window.record` turns them into the step event of the rank's metrics file.
"""

from __future__ import annotations

import resource
import time

import torch

from hpctrain.observe.peaks import mfu


class Window:
    """Device-side accumulators for one logging window: no host sync until it is read."""

    def __init__(self, device: torch.device):
        self.start = time.perf_counter()
        self.steps = 0
        self.data_time = 0.0
        self.good_loss_sum = torch.zeros((), device=device)
        self.good_steps = torch.zeros((), device=device)
        self.last_norm = torch.zeros((), device=device)
        # Seconds the host waited in the window's sync: how far ahead of the device it was.
        self.host_wait = 0.0

    def read(self, *extra: torch.Tensor) -> tuple[list[float], float]:
        """The loss sum, good-step count and ``extra`` in one host sync; the window's seconds.

        Timed after the sync: the CPU runs ahead of the device (about 70 ms, most of a step, for
        the 1b model on an H200), and a window closed before the sync counted work still queued
        on the device as done: tokens/s 6% too high at 10-step windows, 12% at 5-step ones.
        The sync's own duration is kept as ``host_wait``: near zero, the device had caught up
        with the host, i.e. it waited for launches (the run is bound by its CPU), which a
        profiler, adding CPU work of its own, cannot tell reliably.
        """
        synced = time.perf_counter()
        values = torch.stack([self.good_loss_sum, self.good_steps, *extra]).tolist()
        end = time.perf_counter()
        self.host_wait = end - synced
        return values, end - self.start

    def add(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """Count a step; a non-finite loss is left out of the mean (and flagged by the guard)."""
        self.steps += 1
        finite = torch.isfinite(loss)
        self.good_loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self.good_steps += finite.float()
        self.last_norm = norm.detach()

    def record(self, step: int, loss: float, elapsed: float, *, lr: float,
               tokens_per_step: float, flops_per_token: float, peak: float | None,
               device: torch.device) -> dict:
        """The window's step event: loss, lr, gradient norm, throughput, MFU (with a known
        peak), peak memory; ``elapsed`` as :meth:`read` returned it."""
        tokens_per_s = self.steps * tokens_per_step / elapsed
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": self.last_norm.item(),
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / self.steps,
            "data_time_s": self.data_time / self.steps,
            "host_wait_s": self.host_wait,
            "mfu": mfu(tokens_per_s, flops_per_token, peak) if peak else None,
            "mem_gb": memory_gb(device),
        }


class Throughput:
    """A run's tokens/s per rank: the one number its summaries show (the ``done:`` line,
    ``exit_info.json``, ``hpctrain runs``, the report).

    Definition: the tokens one rank trained in this attempt's logging windows, divided by the
    wall time of those windows. Left out: the first window (warm-up, compilation; counted only
    when it is the only one), start-up before the first step, and validation (not inside any
    window's time). Checkpoint stalls inside a window count: they are a cost of training, which
    goodput itemises. The rate of all ranks together is this times the number of ranks.
    """

    def __init__(self) -> None:
        self.windows = 0
        self.tokens = 0.0
        self.seconds = 0.0
        self._first = (0.0, 0.0)

    def add(self, tokens: float, seconds: float) -> None:
        """Count one closed logging window."""
        self.windows += 1
        if self.windows == 1:
            self._first = (tokens, seconds)
        else:
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second per rank; None before a window closed."""
        tokens, seconds = (self.tokens, self.seconds) if self.windows > 1 else self._first
        return tokens / seconds if seconds > 0 else None


def memory_gb(device: torch.device) -> float:
    """Peak memory of this rank so far: allocated on its GPU, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # Peak resident set of this process (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
