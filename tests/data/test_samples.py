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


class Squares:
    """A dataset that draws nothing while reading, so it offers read_samples (as ImageShards)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i * i

    def read_samples(self, indices: list[int]) -> list[int]:
        self.calls.append(indices)
        return [self[i] for i in indices]


def test_a_dataset_that_reads_a_micro_batch_at_once_is_read_so_in_the_same_order() -> None:
    from hpctrain.data.order import BatchLayout
    from hpctrain.data.samples import SampleLoader

    def batches(dataset) -> list[list[int]]:
        loader = SampleLoader(dataset, BatchLayout(4, 2, 1, 0), seed=7,
                              device=torch.device("cpu"), collate=list, prefetch=0)
        return [b for _ in range(3) for b in loader.next_step()]

    fast = Squares()
    want = batches(type("PerSample", (), {"__len__": Squares.__len__,
                                          "__getitem__": Squares.__getitem__})())
    assert batches(fast) == want
    # One call per micro-batch (the first is the start-up check for global random draws).
    assert [len(c) for c in fast.calls] == [1] + [4] * 6
