"""Which kernel computes attention: ``model.attention_backend`` (PyTorch's SDPA backends).

    model:
      attention_backend: cudnn    # auto (PyTorch picks per call), flash, cudnn, efficient, math

``auto`` leaves the choice to PyTorch. Any other value restricts ``scaled_dot_product_attention``
to that one kernel for the whole training step: forward, backward and the forward that
activation checkpointing recomputes inside backward (a recomputation on another kernel would
save other tensors than the forward did). On a CPU only ``auto`` and ``math`` exist; the others
are refused before anything is built. A GPU kernel that cannot run a given shape or dtype fails
at the first step with PyTorch's own reasons (e.g. ``efficient`` and grouped-query attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpctrain.errors import ConfigError

BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CPU_BACKENDS = ("auto", "math")


def attention_backend(name: str, device: torch.device
                      ) -> Callable[[], AbstractContextManager[None]]:
    """A factory of contexts that run attention on backend ``name`` on ``device``; refuses a
    backend the device has not."""
    if name not in BACKENDS:
        raise ConfigError(f"model.attention_backend = {name!r} is not known",
                          expected=f"one of {', '.join(BACKENDS)}")
    if device.type != "cuda" and name not in CPU_BACKENDS:
        raise ConfigError(
            f"model.attention_backend = {name} on a {device.type} device",
            expected=f"one of {', '.join(CPU_BACKENDS)} on a {device.type} (the {name} kernel "
            "exists on CUDA GPUs only)",
            hint="set model.attention_backend=auto, or run on a GPU (run.device=cuda)",
        )
    backend = BACKENDS[name]
    if backend is None:
        return contextlib.nullcontext
    return lambda: sdpa_kernel(backend)
