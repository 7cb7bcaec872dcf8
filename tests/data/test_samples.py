"""`hpctrain.data.samples.to_device`: what a collate already put on a device stays there."""

from __future__ import annotations

import torch

from hpctrain.data.samples import to_device


def test_pinning_leaves_tensors_that_are_not_on_the_host_alone() -> None:
    # A collate that decodes on the GPU returns device tensors: pinning is for host memory
    # (pin_memory() of a CUDA tensor raises; a copy would be a wasted round trip). The meta
    # device stands in for the GPU on a machine without one.
    on_device = torch.ones(3, device="meta")
    batch = to_device({"x": on_device, "n": [on_device], "k": "key"}, torch.device("cpu"),
                      pin=True)
    assert batch["x"] is on_device and batch["n"][0] is on_device and batch["k"] == "key"
