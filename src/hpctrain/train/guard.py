"""Bad-step guard: skip the update on a non-finite loss or a loss spike, without a host sync.

The decision is a device tensor handed to the fused AdamW kernel as ``found_inf`` (the same
mechanism GradScaler uses): the kernel leaves parameters, moments and step counts untouched when
it is set. The loss it judges is the global mean, so every rank decides the same way. Counts are
read on the host only at logging steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hpctrain.errors import ConfigError


@dataclass
class GuardConfig:
    """Config section ``guard:``."""

    # skip: drop the update and go on; stop: fail the run at the next logging step.
    action: Literal["skip", "stop"] = "skip"
    # A loss above mean + spike_sigma * std of the last `window` good losses is a spike.
    spike_sigma: float = 6.0
    window: int = 50
    # Spikes are only judged once this many good losses are in the window.
    min_history: int = 20
    # After this many bad steps in a row, roll back to the last checkpoint.
    max_consecutive: int = 5

    def validate(self) -> None:
        """Positive window and thresholds."""
        if self.spike_sigma <= 0 or self.window < 2 or self.max_consecutive < 1:
            raise ConfigError("guard: spike_sigma must be > 0, window >= 2, max_consecutive >= 1")
        if not 1 <= self.min_history <= self.window:
            raise ConfigError(f"guard.min_history = {self.min_history} must lie in "
                              f"[1, guard.window = {self.window}]")


class BadStepGuard:
    """Device-side loss history and bad-step counters."""

    def __init__(self, cfg: GuardConfig, device: torch.device):
        self.cfg = cfg
        self.history = torch.zeros(cfg.window, device=device)
        self.good = torch.zeros((), dtype=torch.long, device=device)
        self.consecutive = torch.zeros((), dtype=torch.long, device=device)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)

    @torch.no_grad()
    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 where this step must be skipped, else 0.0 (a float tensor, as found_inf).

        A finite loss can still come with non-finite gradients (an overflow in backward);
        applying those would poison every weight, so the gradient norm is judged too.
        """
        n = self.good.clamp(max=self.cfg.window)
        denom = n.clamp(min=1).float()
        mask = (torch.arange(self.cfg.window, device=loss.device) < n).float()
        mean = (self.history * mask).sum() / denom
        std = (((self.history - mean) * mask) ** 2).sum().div(denom).sqrt()
        spike = (n >= self.cfg.min_history) & (loss > mean + self.cfg.spike_sigma * std)
        bad = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm) | spike
        slot = (self.good % self.cfg.window).view(1)
        kept = torch.where(bad, self.history.index_select(0, slot), loss.view(1).float())
        self.history.index_copy_(0, slot, kept)
        self.good += (~bad).long()
        self.consecutive = (self.consecutive + 1) * bad.long()
        self.skipped += bad.long()
        return bad.float()

    def reset_consecutive(self) -> None:
        """Forget the current streak (after a rollback)."""
        self.consecutive.zero_()
