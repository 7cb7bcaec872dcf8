"""Batches of a user's own dataset (`hpctrain.task`), in a deterministic order, on the device.

A map-style dataset (``__len__``, ``__getitem__``) is read in `GlobalOrderSampler`'s order, the
token loader's: seeded, reshuffled every epoch, each epoch's remainder dropped so that every rank
gets the same number of samples (no end-of-epoch hang). Its position is the number of global
batches consumed, so a resume continues exactly where the checkpoint was.

An iterable is read whole by every rank, each keeping its own slots of every global batch. It
resumes exactly only if it can report and restore its position (``state_dict()`` /
``load_state_dict()``); otherwise hpctrain says so once and a resume reads it from its start.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from itertools import islice
from typing import Any

import torch
from torch.utils.data import default_collate

from hpctrain.data.order import BatchLayout, GlobalOrderSampler
from hpctrain.errors import ConfigError, DataError
from hpctrain.task import call_user

log = logging.getLogger("hpctrain.data")


def is_map_style(dataset: Any) -> bool:
    """Whether ``dataset`` is indexable with a length (else it is read as an iterable)."""
    return hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")


def build_sample_loader(dataset: Any, layout: BatchLayout, seed: int, device: torch.device,
                        collate: Callable | None, prefetch: int) -> SampleLoader | StreamLoader:
    """The loader for ``dataset``: map-style in the global order, or an iterable stream."""
    collate = collate or default_collate
    if is_map_style(dataset):
        return SampleLoader(dataset, layout, seed, device, collate, prefetch)
    if hasattr(dataset, "__iter__"):
        if iter(dataset) is dataset:
            # A generator or iterator can be read once: the FLOP count's peek would eat its
            # first batch and a second pass would find it empty.
            raise ConfigError(f"Task(data=...) is a one-shot {type(dataset).__name__} (an "
                              "iterator: iter() of it returns itself)",
                              expected="a map-style dataset, or an iterable whose iter() "
                              "starts a new pass each time (e.g. an IterableDataset)",
                              hint="wrap the generator in a class whose __iter__ creates it")
        return StreamLoader(dataset, layout, seed, device, collate)
    raise ConfigError(f"Task(data=...) is a {type(dataset).__name__}",
                      expected="a map-style dataset (__len__ and __getitem__) or an iterable "
                      "of samples")


def to_device(batch: Any, device: torch.device, pin: bool = False) -> Any:
    """``batch`` (tensors in tuples, lists and dicts) with every tensor on ``device``."""
    if isinstance(batch, torch.Tensor):
        if pin:
            return batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device, pin) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, pin) for k, v in batch.items()}
    return batch


class SampleLoader:
    """A map-style dataset's micro-batches in the global order, prefetched by a daemon thread."""

    def __init__(self, dataset: Any, layout: BatchLayout, seed: int, device: torch.device,
                 collate: Callable, prefetch: int = 2):
        n = call_user(len, "the dataset's __len__", dataset)
        if n < layout.global_batch:
            raise DataError(
                f"the dataset holds {n} samples, fewer than one global batch "
                f"({layout.global_batch} = micro_batch {layout.micro_batch} x grad_accum "
                f"{layout.grad_accum} x {layout.world_size} ranks)",
                hint="lower train.micro_batch or train.grad_accum, or give more samples")
        self.dataset = dataset
        self.sampler = GlobalOrderSampler(n, layout, seed)
        self.device = device
        self.collate = collate
        self.prefetch = prefetch
        self._pin = device.type == "cuda"
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.consumed = 0  # global batches handed to training (the prefetcher runs ahead)

    def _read(self, indices) -> Any:
        return self.collate([self.dataset[int(i)] for i in indices])

    def _host_step(self) -> list[Any]:
        return [to_device(call_user(self._read, "reading the dataset", ix), self.device,
                          self._pin) for ix in self.sampler.next_step()]

    def peek(self, n: int) -> Any:
        """The first ``n`` samples as one batch on the device; the position does not move."""
        return to_device(call_user(self._read, "reading the dataset", range(n)), self.device)

    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                self._queue.put(self._host_step())
        except BaseException as e:  # surfaced to the training thread at its next fetch
            self._queue.put(e)

    def next_step(self) -> list[Any]:
        """The ``grad_accum`` micro-batches of this rank's next optimizer step, on the device."""
        if self.prefetch == 0:
            host = self._host_step()
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=self._worker, daemon=True,
                                                name="hpctrain-samples")
                self._thread.start()
            host = self._queue.get() if self._error is None else self._error
            if isinstance(host, BaseException):
                self._error = host  # the worker has stopped: keep failing, never wait
                raise host
        self.consumed += 1
        return [to_device(b, self.device) for b in host]

    def state_dict(self) -> dict[str, int]:
        """The position training has reached (not the prefetcher's)."""
        return {**self.sampler.state_dict(), "step": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after ``state['step']`` global batches; call before the first fetch."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before the first batch is fetched")
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.step

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._stop.set()
        if self._queue is not None:
            while not self._queue.empty():  # unblock a worker waiting on a full queue
                self._queue.get_nowait()


class StreamLoader:
    """An iterable's micro-batches: every rank reads the stream and keeps its own slots."""

    def __init__(self, dataset: Any, layout: BatchLayout, seed: int, device: torch.device,
                 collate: Callable):
        self.dataset = dataset
        self.layout = layout
        self.seed = seed
        self.device = device
        self.collate = collate
        self.consumed = 0
        self._it = None
        self.exact = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None))
        if not self.exact:
            log.warning(
                "data: the iterable %s cannot report its position, so a resumed run reads it "
                "again from its start: the resume will not be exact. HINT: give it "
                "state_dict() (its position, as JSON) and load_state_dict(state) (continue "
                "from there), or make it map-style (__len__ and __getitem__)",
                type(dataset).__name__)

    def _take(self, n: int) -> list[Any]:
        if self._it is None:
            self._it = call_user(iter, "the dataset's __iter__", self.dataset)
        items = call_user(lambda: list(islice(self._it, n)), "reading the dataset")
        if len(items) < n:  # the end of a pass: every rank starts the next one together
            self._it = call_user(iter, "the dataset's __iter__", self.dataset)
            items = call_user(lambda: list(islice(self._it, n)), "reading the dataset")
            if len(items) < n:
                raise DataError(f"the iterable dataset gave {len(items)} samples in a pass, "
                                f"fewer than one global batch ({n})",
                                hint="lower train.micro_batch, or give more samples")
        return items

    def peek(self, n: int) -> Any:
        """The stream's first ``n`` samples as one batch on the device; the position does not
        move (a new iterator, or the saved position put back)."""
        state = self.dataset.state_dict() if self.exact else None
        items = call_user(lambda: list(islice(iter(self.dataset), n)), "reading the dataset")
        if state is not None:
            call_user(self.dataset.load_state_dict, "the dataset's load_state_dict", state)
        return to_device(call_user(self.collate, "collating samples", items), self.device)

    def next_step(self) -> list[Any]:
        """The ``grad_accum`` micro-batches of this rank's next optimizer step, on the device."""
        lay = self.layout
        items = self._take(lay.global_batch)
        per_micro = lay.micro_batch * lay.world_size
        out = []
        for a in range(lay.grad_accum):
            lo = a * per_micro + lay.rank * lay.micro_batch
            batch = call_user(self.collate, "collating samples", items[lo:lo + lay.micro_batch])
            out.append(to_device(batch, self.device))
        self.consumed += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Global batches consumed, and the stream's own position when it can tell it."""
        state: dict[str, Any] = {"step": self.consumed, "global_batch": self.layout.global_batch,
                                 "seed": self.seed}
        if self.exact:
            state["dataset"] = call_user(self.dataset.state_dict, "the dataset's state_dict")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the stream's own, when it has one)."""
        if int(state["global_batch"]) != self.layout.global_batch:
            raise ConfigError(
                f"the saved data position assumes global_batch {state['global_batch']}, this "
                f"run has {self.layout.global_batch}",
                hint="keep micro_batch x grad_accum x ranks unchanged on resume")
        self.consumed = int(state["step"])
        if self.exact and "dataset" in state:
            call_user(self.dataset.load_state_dict, "the dataset's load_state_dict",
                      state["dataset"])

    def close(self) -> None:
        """Nothing runs in the background."""
