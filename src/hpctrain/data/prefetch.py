"""Steps of batches read ahead by a daemon thread, while the device trains on the current one.

`Prefetcher` is what the token loader (`hpctrain.data.loader.TokenLoader`) and the loader of a
user's samples (`hpctrain.data.samples.SampleLoader`) share: the thread, its bounded queue, an
error raised in the thread surfacing (again and again) at the training thread's next fetch, and
a position that is the steps handed to training, not the steps the thread has read ahead.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from hpctrain.data.order import GlobalOrderSampler


class Prefetcher:
    """Runs ``_host_step()`` ``prefetch`` steps ahead on a thread; ``_fetch()`` takes the next.

    Subclasses give ``_host_step`` (one step read on the host, in ``sampler``'s order) and turn
    what ``_fetch`` returns into device batches. ``prefetch=0`` reads in the calling thread.
    """

    thread_name = "hpctrain-prefetch"

    def __init__(self, sampler: GlobalOrderSampler, prefetch: int):
        self.sampler = sampler
        self.prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Steps handed to training; the sampler runs ahead of this by the prefetch depth.
        self.consumed = sampler.step

    def _host_step(self) -> Any:
        raise NotImplementedError

    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                self._queue.put(self._host_step())
        except BaseException as e:  # surfaced to the training thread at its next fetch
            self._queue.put(e)

    def _fetch(self) -> Any:
        """The next step as ``_host_step`` made it (counted as consumed)."""
        if self.prefetch == 0:
            host = self._host_step()
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=self._worker, daemon=True,
                                                name=self.thread_name)
                self._thread.start()
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
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before the first batch is fetched")
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.step

    def close(self, timeout: float = 30.0) -> None:
        """Stop the prefetch thread and wait for it, so that the dataset can be closed after
        this returns without the thread still reading it (it would find its files closed
        mid-read, or change their table while the closer walks it)."""
        self._stop.set()
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            while not self._queue.empty():  # unblock a worker waiting on a full queue
                self._queue.get_nowait()
            self._thread.join(0.05)
