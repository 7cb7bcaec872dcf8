"""Batches of a user's own dataset (`hpctrain.task`), in a deterministic order, on the device.

A map-style dataset (``__len__``, ``__getitem__``) is read in `GlobalOrderSampler`'s order, the
token loader's: seeded, reshuffled every epoch, each epoch's remainder dropped so that every rank
gets the same number of samples (no end-of-epoch hang). Its position is the number of global
batches consumed, so a resume continues exactly where the checkpoint was.

An iterable is read whole by every rank, each keeping its own slots of every global batch. It
resumes exactly only if it can report and restore its position (``state_dict()`` /
``load_state_dict()``); otherwise hpctrain says so once and a resume reads it from its start.

Each sample is read inside `hpctrain.task.reading_sample`, so a dataset's random augmentation can
draw from ``hpctrain.task.sample_rng()``: seeded from (seed, epoch, sample index), the same numbers
on any number of ranks and after a resume, although a thread reads ahead of training. A dataset
that draws from a global generator instead is warned about once, at the start. A dataset that
draws nothing while reading may offer ``read_samples(indices)`` (`ImageShards` does): a
micro-batch is then read in one call, with no per-sample seeding to pay for (not for a subclass
that overrides ``__getitem__``: its own is what reads a sample then).

A ``collate`` with two parts, ``gather(samples)`` (cheap, on the host) and ``finish(gathered)``
(decoding on the GPU: `DecodeAhead`), gets a thread per part: reading and gathering step k+1
overlaps finishing step k, in the same order.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from hpctrain.data.order import BatchLayout, GlobalOrderSampler, resume_batch_hint
from hpctrain.data.prefetch import Prefetcher
from hpctrain.errors import ConfigError, DataError
from hpctrain.task import call_user, reading_sample

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
    """``batch`` (tensors in tuples, lists and dicts) with every tensor on ``device``
    (``pin``: host tensors pinned instead, for a later non-blocking copy)."""
    if isinstance(batch, torch.Tensor):
        if pin:
            # Only host memory pins: a tensor a collate put on the GPU stays where it is.
            return batch.pin_memory() if batch.device.type == "cpu" else batch
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device, pin) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, pin) for k, v in batch.items()}
    return batch


class SampleLoader(Prefetcher):
    """A map-style dataset's micro-batches in the global order, prefetched by a daemon thread.

    Sample ``i`` read in epoch ``e`` draws from ``sample_rng()`` seeded by (seed, e, i)."""

    thread_name = "hpctrain-samples"

    def __init__(self, dataset: Any, layout: BatchLayout, seed: int, device: torch.device,
                 collate: Callable, prefetch: int = 2):
        n = call_user(len, "the dataset's __len__", dataset)
        if n < layout.global_batch:
            raise DataError(
                f"the dataset holds {n} samples, fewer than one global batch "
                f"({layout.global_batch} = micro_batch {layout.micro_batch} x grad_accum "
                f"{layout.grad_accum} x {layout.world_size} ranks)",
                hint="lower train.micro_batch or train.grad_accum, or give more samples")
        super().__init__(GlobalOrderSampler(n, layout, seed), prefetch)
        self.dataset = dataset
        self.seed = seed
        self.device = device
        self.collate = collate
        self.two_stage = callable(getattr(collate, "gather", None)) and callable(
            getattr(collate, "finish", None))
        self._read_many = batch_reader(dataset)
        self._pin = device.type == "cuda"
        # Seconds of thread CPU time spent reading and gathering (what the loader costs the
        # host besides decoding: `hpctrain.data.images.throughput` reports it per batch).
        self.read_cpu_s = 0.0
        warn_if_global_rng(lambda: self._read(range(1), epoch=0))

    def _read(self, indices, epoch: int) -> Any:
        """One micro-batch read and collated (only gathered, for a two-part collate)."""
        if self._read_many is not None:
            items = self._read_many([int(i) for i in indices])
        else:
            items = []
            for i in indices:
                with reading_sample(self.seed, epoch, int(i)):
                    items.append(self.dataset[int(i)])
        return (self.collate.gather if self.two_stage else self.collate)(items)

    def _host_step(self) -> list[Any]:
        t0 = time.thread_time()
        epoch = self.sampler.step // self.sampler.steps_per_epoch
        out = [call_user(self._read, "reading the dataset", ix, epoch)
               for ix in self.sampler.next_step()]
        self.read_cpu_s += time.thread_time() - t0
        return out

    def _finish(self, host: Any) -> Any:
        """One micro-batch as the collate hands it over (its second part, if it has one)."""
        return call_user(self.collate.finish, "collating samples", host) if self.two_stage \
            else host

    def _finish_step(self, host: list[Any]) -> list[Any]:
        return [to_device(self._finish(h), self.device, self._pin) for h in host]

    def peek(self, n: int) -> Any:
        """The first ``n`` samples as one batch on the device; the position does not move."""
        return to_device(self._finish(call_user(self._read, "reading the dataset", range(n), 0)),
                         self.device)

    def next_step(self) -> list[Any]:
        """The ``grad_accum`` micro-batches of this rank's next optimizer step, on the device."""
        return [to_device(b, self.device) for b in self._fetch()]


def batch_reader(dataset: Any) -> Callable[[list[int]], list[Any]] | None:
    """``dataset.read_samples`` if it reads what ``dataset[i]`` would, else None.

    It does if the class that defines ``read_samples`` defines ``__getitem__`` as well, and no
    subclass overrides the latter: a subclass of `ImageShards` that relabels in ``__getitem__``
    (or draws from ``sample_rng()`` there) must be read item by item, seeded, through it."""
    read_many = getattr(dataset, "read_samples", None)
    if not callable(read_many):
        return None
    owner = next((c for c in type(dataset).__mro__ if "read_samples" in c.__dict__), None)
    if owner is None or type(dataset).__getitem__ is not owner.__dict__.get("__getitem__"):
        return None
    return read_many


def warn_if_global_rng(read: Callable[[], Any]) -> None:
    """Read a sample here, before any thread starts, and say once if the dataset draws from a
    global random generator (torch's, NumPy's, Python's): a background thread reads it beside
    training, so its numbers would differ on every run and after a resume."""
    torch_state, numpy_state, python_state = (torch.random.get_rng_state(),
                                              np.random.get_state(), random.getstate())
    try:
        call_user(read, "reading the dataset")
        used = [name for name, same in (
            ("torch's", torch.equal(torch.random.get_rng_state(), torch_state)),
            ("NumPy's", np.array_equal(np.random.get_state()[1], numpy_state[1])),
            ("Python's", random.getstate() == python_state)) if not same]
    finally:  # this read leaves no trace in the run's own draws
        torch.random.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    if used:
        log.warning("data: Task.data's __getitem__ draws from %s global random generator, "
                    "which hpctrain cannot seed per sample: its random augmentations will differ "
                    "on every run and after a resume. HINT: draw from "
                    "hpctrain.task.sample_rng() instead (torch.rand(..., "
                    "generator=sample_rng()), or "
                    "numpy.random.default_rng(sample_rng().initial_seed()))",
                    " and ".join(used))


_END = object()  # what next() gives at the end of a pass


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
        first = self.consumed * self.layout.global_batch
        items = call_user(self._read, "reading the dataset", self._it, n, first)
        if len(items) < n:  # the end of a pass: every rank starts the next one together
            self._it = call_user(iter, "the dataset's __iter__", self.dataset)
            items = call_user(self._read, "reading the dataset", self._it, n, first)
            if len(items) < n:
                raise DataError(f"the iterable dataset gave {len(items)} samples in a pass, "
                                f"fewer than one global batch ({n})",
                                hint="lower train.micro_batch, or give more samples")
        return items

    def _read(self, it: Iterator, n: int, first: int) -> list[Any]:
        """Up to ``n`` samples of ``it``; the k-th draws from ``sample_rng()`` seeded by
        (seed, 0, ``first + k``: its place in what the run has read)."""
        items = []
        for k in range(n):
            with reading_sample(self.seed, 0, first + k):
                item = next(it, _END)
            if item is _END:
                break
            items.append(item)
        return items

    def peek(self, n: int) -> Any:
        """The stream's first ``n`` samples as one batch on the device; the position does not
        move (a new iterator, or the saved position put back)."""
        state = self.dataset.state_dict() if self.exact else None
        it = call_user(iter, "the dataset's __iter__", self.dataset)
        items = call_user(self._read, "reading the dataset", it, n, 0)
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
                hint=resume_batch_hint(int(state["global_batch"]), None))
        self.consumed = int(state["step"])
        if self.exact and "dataset" in state:
            call_user(self.dataset.load_state_dict, "the dataset's load_state_dict",
                      state["dataset"])

    def close(self) -> None:
        """Nothing runs in the background."""
