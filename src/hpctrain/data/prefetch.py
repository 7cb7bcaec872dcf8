"""Steps of batches read ahead by daemon threads, while the device trains on the current one.

`Prefetcher` is what the token loader (`hpctrain.data.loader.TokenLoader`) and the loader of a
user's samples (`hpctrain.data.samples.SampleLoader`) share: the thread, its bounded queue, an
error raised in the thread surfacing (again and again) at the training thread's next fetch, and
a position that is the steps handed to training, not the steps the thread has read ahead.

A subclass whose steps have a second, separate part (``two_stage``: reading the files, then
decoding on the GPU) gets a thread per part, so that reading step k+1 overlaps finishing step k;
each thread takes the steps in order from the one before it, so the order is the sampler's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hpctrain.data.order import GlobalOrderSampler

_POLL_S = 0.05  # how often a thread blocked on a queue looks whether close() was called


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` on ``q`` once there is room; False if ``stop`` came first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def read_ahead(items: Iterable[Any], make: Callable[[Any], Any], device: torch.device,
               depth: int = 2, name: str = "hpctrain-read-ahead") -> Iterator[Any]:
    """``make(item)`` of each of ``items``, in order, made up to ``depth`` ahead on a thread
    whose current device is ``device`` (validation: reading and decoding the next batches while
    the model runs on this one).

    An error in ``make`` (or in ``items``) is raised here, in its place; the thread is gone once
    the iteration ends, fails or is abandoned (the generator closed)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    device = with_index(device)

    def work() -> None:
        try:
            use_device(device)
            for item in items:
                if not _put(q, (True, make(item)), stop):
                    return
            _put(q, (True, _END), stop)
        except BaseException as e:  # raised in the consuming thread, at its place
            _put(q, (False, e), stop)

    thread = threading.Thread(target=work, daemon=True, name=name)
    thread.start()
    try:
        while True:
            ok, value = q.get()
            if not ok:
                raise value
            if value is _END:
                return
            yield value
    finally:
        stop.set()
        thread.join()


_END = object()  # the end of read_ahead's items, or of a queue that close() stopped


def with_index(device: torch.device | str | None) -> torch.device | None:
    """``device`` with its index: "cuda" alone means the calling thread's current GPU, so it is
    pinned here, in the thread that makes the loader (a loader thread's current GPU is cuda:0,
    and torch.cuda.set_device refuses "cuda" alone)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device | None) -> None:
    """Make ``device`` this thread's current CUDA device (a no-op for others): a new thread's
    is cuda:0 whatever the rank's, and what it allocates or pins "on cuda" would land there."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class Prefetcher:
    """Runs ``_host_step()`` ``prefetch`` steps ahead on a thread; ``_fetch()`` takes the next.

    Subclasses give ``_host_step`` (one step read on the host, in ``sampler``'s order) and turn
    what ``_fetch`` returns into device batches. ``prefetch=0`` reads in the calling thread.
    With ``two_stage`` set, ``_finish_step`` (what turns a read step into the one handed over)
    runs on a second thread, one step behind the reading thread.
    """

    thread_name = "hpctrain-prefetch"
    two_stage = False
    _device: torch.device | None = None

    @property
    def device(self) -> torch.device | None:
        """The device the steps go to: each thread makes it its current one (`use_device`), so
        that a collate's ``.cuda()`` or a pinned copy lands on this rank's GPU, not GPU 0."""
        return self._device

    @device.setter
    def device(self, device: torch.device | str | None) -> None:
        self._device = with_index(device)  # set by the subclass's __init__: the maker's thread

    def __init__(self, sampler: GlobalOrderSampler, prefetch: int):
        self.sampler = sampler
        self.prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        # Steps handed to training; the sampler runs ahead of this by the prefetch depth.
        self.consumed = sampler.step

    def _host_step(self) -> Any:
        raise NotImplementedError

    def _finish_step(self, host: Any) -> Any:
        """The step handed to training, made from what ``_host_step`` read (``two_stage``)."""
        return host

    def _get(self, q: queue.Queue) -> Any:
        """The next item of ``q``; ``_END`` if close() came first."""
        while not self._stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        return _END

    def _reader(self, out: queue.Queue) -> None:
        try:
            use_device(self.device)
            while _put(out, self._host_step() if self.two_stage
                       else self._finish_step(self._host_step()), self._stop):
                pass
        except BaseException as e:  # surfaced to the training thread at its next fetch
            _put(out, e, self._stop)

    def _finisher(self, read: queue.Queue) -> None:
        try:
            use_device(self.device)
            while (host := self._get(read)) is not _END:
                if isinstance(host, BaseException):
                    raise host  # the reader's error, passed on in order
                if not _put(self._queue, self._finish_step(host), self._stop):
                    return
        except BaseException as e:
            _put(self._queue, e, self._stop)

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        if self.two_stage:
            read: queue.Queue = queue.Queue(maxsize=1)
            self._threads = [threading.Thread(target=self._reader, args=(read,), daemon=True,
                                              name=f"{self.thread_name}-read"),
                             threading.Thread(target=self._finisher, args=(read,), daemon=True,
                                              name=self.thread_name)]
        else:
            self._threads = [threading.Thread(target=self._reader, args=(self._queue,),
                                              daemon=True, name=self.thread_name)]
        for t in self._threads:
            t.start()

    def _fetch(self) -> Any:
        """The next step as ``_host_step`` (and ``_finish_step``) made it (counted as
        consumed)."""
        if self.prefetch == 0:
            host = self._finish_step(self._host_step())
        else:
            if not self._threads:
                self._start()
            host = self._queue.get() if self._error is None else self._error
            if isinstance(host, BaseException):
                self._error = host  # the worker has stopped: keep failing, never wait
                raise host
        self.consumed += 1
        return host

    def state_dict(self) -> dict[str, Any]:
        """The position training has reached (not the prefetcher's)."""
        return {**self.sampler.state_dict(), "step": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after ``state['step']`` global batches; call before the first fetch."""
        if self._threads:
            raise RuntimeError("load_state_dict must come before the first batch is fetched")
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.step

    def close(self, timeout: float = 30.0) -> None:
        """Stop the prefetch threads and wait for them, so that the dataset can be closed after
        this returns without a thread still reading it (it would find its files closed
        mid-read, or change their table while the closer walks it). The steps read ahead
        are dropped: finished GPU batches would otherwise hold their memory until the loader
        itself is collected."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._queue is not None:
            _drain(self._queue)


def _drain(q: queue.Queue) -> None:
    """Drop what ``q`` holds."""
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
