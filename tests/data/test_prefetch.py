"""The prefetch thread is gone once ``close()`` returns, so the dataset it reads can be closed
right after (the image loader's throughput helper closed its shards while the thread was still
opening one: "dictionary keys changed during iteration")."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hpctrain.data.order import BatchLayout, GlobalOrderSampler
from hpctrain.data.prefetch import Prefetcher, read_ahead


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
    assert not any(t.is_alive() for t in steps._threads)
    time.sleep(0.1)
    assert not steps.read_after_close


class TwoStage(Prefetcher):
    """Reading on one thread, finishing on another; each part may fail at a given step."""

    two_stage = True

    def __init__(self, fail_read: int = -1, fail_finish: int = -1) -> None:
        super().__init__(GlobalOrderSampler(1000, BatchLayout(1, 1, 1, 0), 0), prefetch=2)
        self.fail_read, self.fail_finish = fail_read, fail_finish
        self.threads: set[str] = set()

    def _host_step(self) -> int:
        self.threads.add(threading.current_thread().name)
        step = self.sampler.step
        self.sampler.next_step()
        if step == self.fail_read:
            raise ValueError(f"shard-000001.tar: sample 'k{step}' is unreadable")
        return step

    def _finish_step(self, host: int) -> tuple[int, str]:
        if host == self.fail_finish:
            raise ValueError(f"sample 'k{host}' does not decode")
        return host, threading.current_thread().name


def test_two_stages_keep_the_order_and_pass_each_error_on_in_place() -> None:
    steps = TwoStage(fail_read=5)
    got = [steps._fetch() for _ in range(5)]
    assert [s for s, _ in got] == [0, 1, 2, 3, 4]
    # Read on one thread, finished on another (neither the training thread).
    finishers = {name for _, name in got}
    assert len(finishers) == 1 and len(steps.threads) == 1 and not finishers & steps.threads
    for _ in range(2):  # the reader's error, naming what failed, again at every fetch
        with pytest.raises(ValueError, match="shard-000001.tar: sample 'k5'"):
            steps._fetch()
    assert steps.consumed == 5
    steps.close()
    assert not any(t.is_alive() for t in steps._threads)

    steps = TwoStage(fail_finish=2)
    assert [steps._fetch()[0] for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="'k2' does not decode"):
        steps._fetch()
    steps.close()
    assert not any(t.is_alive() for t in steps._threads)


def test_read_ahead_yields_in_order_raises_in_place_and_leaves_no_thread() -> None:
    cpu = torch.device("cpu")
    made_on: set[str] = set()

    def make(i: int) -> int:
        made_on.add(threading.current_thread().name)
        if i == 3:
            raise ValueError("sample 3 does not decode")
        return i * i

    got = []
    with pytest.raises(ValueError, match="sample 3"):
        for x in read_ahead(range(10), make, cpu):
            got.append(x)
    assert got == [0, 1, 4] and made_on == {"hpctrain-read-ahead"}
    assert list(read_ahead(range(5), lambda i: -i, cpu)) == [0, -1, -2, -3, -4]
    abandoned = read_ahead(range(1000), lambda i: i, cpu)
    assert next(abandoned) == 0
    abandoned.close()  # a loop left early: the thread is stopped and joined
    assert not any(t.name == "hpctrain-read-ahead" for t in threading.enumerate())


class _TwoParts:
    """A two-part collate (as `DecodeAhead`): gathering beside reading, finishing after."""

    def gather(self, items: list) -> list:
        return items

    def finish(self, gathered: list) -> list:
        return gathered


def test_loader_threads_make_the_ranks_gpu_their_current_device(monkeypatch) -> None:
    # A new thread's current device is cuda:0 whatever the rank's: a collate's ``.cuda()``
    # (or a pinned copy) in the reader or finisher thread landed on GPU 0 on every rank.
    # set_device is recorded, not run: the CPU stands in for the GPU here.
    from hpctrain.data.samples import SampleLoader

    calls: list[tuple[torch.device, str]] = []

    def set_device(d: torch.device) -> None:
        if torch.device(d).index is None:  # as torch 2.11 does: "cuda" alone is refused
            raise ValueError(f"Expected a torch.device with a specified index, but got:{d}")
        calls.append((torch.device(d), threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    gpu1 = torch.device("cuda", 1)
    loader = SampleLoader(list(range(40)), BatchLayout(2, 1, 1, 0), seed=0, device=gpu1,
                          collate=_TwoParts(), prefetch=2)
    loader.next_step()
    loader.close()
    assert {d for d, _ in calls} == {gpu1}
    assert {name for _, name in calls} == {"hpctrain-samples-read", "hpctrain-samples"}
    # "cuda" without an index is the creating thread's current GPU (the loader threads' own is
    # cuda:0): resolved when the loader is made (loader_throughput(device="cuda") crashed).
    calls.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    loader = SampleLoader(list(range(40)), BatchLayout(2, 1, 1, 0), seed=0,
                          device=torch.device("cuda"), collate=_TwoParts(), prefetch=2)
    loader.next_step()
    loader.close()
    assert list(read_ahead([1, 2], lambda x: x, torch.device("cuda"))) == [1, 2]
    assert {d for d, _ in calls} == {torch.device("cuda", 3)}
    assert len(calls) == 3


def test_close_drops_the_steps_read_ahead() -> None:
    # Finished GPU batches left in the queue would hold their memory until the loader itself
    # is collected.
    steps = TwoStage()
    steps._fetch()
    deadline = time.monotonic() + 10
    while not steps._queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)  # no event says that the queue filled: look
    assert steps._queue.full()
    steps.close()
    assert steps._queue.empty()
