"""The prefetch thread is gone once ``close()`` returns, so the dataset it reads can be closed
right after (the image loader's throughput helper closed its shards while the thread was still
opening one: "dictionary keys changed during iteration")."""

from __future__ import annotations

import threading
import time

from hpctrain.data.order import BatchLayout, GlobalOrderSampler
from hpctrain.data.prefetch import Prefetcher


class SlowSteps(Prefetcher):
    """Each step takes a while to read; records whether a read ran after close() returned."""

    def __init__(self) -> None:
        super().__init__(GlobalOrderSampler(1000, BatchLayout(1, 1, 1, 0), 0), prefetch=2)
        self.closed = threading.Event()
        self.read_after_close = False

    def _host_step(self) -> int:
        time.sleep(0.05)
        if self.closed.is_set():
            self.read_after_close = True
        return self.sampler.step


def test_close_waits_for_the_thread() -> None:
    steps = SlowSteps()
    steps._fetch()
    time.sleep(0.12)  # the thread is mid-read or waiting on the full queue
    steps.close()
    steps.closed.set()
    assert not steps._thread.is_alive()
    time.sleep(0.1)
    assert not steps.read_after_close
