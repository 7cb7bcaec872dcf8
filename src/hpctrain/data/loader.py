"""Token samples in a global order that does not depend on the number of ranks.

A sample is a window of ``seq_len + 1`` tokens (inputs and the shifted targets). Each optimizer
step consumes one *global batch* of ``micro_batch * grad_accum * world_size`` samples taken from a
permutation that is a pure function of (seed, epoch, dataset); rank ``r`` takes its slice of each
micro-step. So one rank with micro-batch 2B and two ranks with B see the same samples per step,
and the loader state is one integer (steps consumed), which resumes exactly.

Over token shards the permutation works in *windows of shards* (as Mosaic and litdata do): each
epoch permutes the shards, cuts that order into windows of a few shards and permutes the samples
inside each window, so at any time the ranks read from a few files, sequentially (Lustre-friendly),
and the order is still a pure function of (seed, epoch, manifest).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hpctrain.data.config import DataConfig
from hpctrain.data.shard_dataset import ShardTokens, Split, check_split_size
from hpctrain.data.shards import load_manifest
from hpctrain.data.stdlib_corpus import read_stdlib_bytes
from hpctrain.errors import ConfigError

# Target id that the loss skips (PyTorch's cross_entropy default): marks padding rows.
IGNORE_INDEX = -100


class TokenDataset(Protocol):
    """What the loader needs of a token source: a count and random access to windows."""

    seq_len: int

    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray:
        """Tokens ``seq_len + 1`` long for sample ``index``."""
        ...


class ContiguousTokens:
    """Non-overlapping windows over one token array (windows share one boundary token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class SliceWindows:
    """Windows ``[start, start + count)`` of another dataset, renumbered from 0."""

    def __init__(self, base: TokenDataset, start: int, count: int):
        self.base, self.start, self.count = base, start, count
        self.seq_len = base.seq_len

    def __len__(self) -> int:
        return self.count

    def window(self, index: int) -> np.ndarray:
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} out of range [0, {self.count})")
        return self.base.window(self.start + index)


def build_dataset(cfg: DataConfig, split: Split = "train") -> TokenDataset:
    """The token source named by ``data.source``; ``split="val"`` is the held-out part.

    The validation split is the last ``floor(windows * data.val_fraction)`` windows (of each shard
    for ``shards``; of the corpus for ``stdlib``); the training split is the rest.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    if split == "val" and cfg.val_fraction <= 0:
        raise ConfigError("a validation split was requested but data.val_fraction = 0",
                          hint="set data.val_fraction, e.g. data.val_fraction=0.01")
    if cfg.source == "shards":
        ds: TokenDataset = _shards(cfg, str(cfg.path), split)
    elif cfg.source == "mix":
        from hpctrain.data.mixing import MixedTokens

        parts = [_shards(cfg, m.path, split) for m in cfg.mix or []]
        ds = MixedTokens(parts, [m.weight for m in cfg.mix or []],
                         epoch_samples=cfg.mix_epoch_samples,
                         names=[m.path for m in cfg.mix or []], weighted=split == "train")
    else:
        base = ContiguousTokens(read_stdlib_bytes(cfg.max_bytes), cfg.seq_len)
        n_val = int(len(base) * cfg.val_fraction)
        if n_val == 0 and split == "train":
            ds = base
        else:
            n_train = len(base) - n_val
            ds = SliceWindows(base, n_train, n_val) if split == "val" else SliceWindows(
                base, 0, n_train)
    check_split_size(len(ds), split, cfg.val_fraction)
    return ds


def _shards(cfg: DataConfig, path: str, split: Split) -> ShardTokens:
    """One prepared directory as a dataset (staged to node-local disk when data.stage_to)."""
    if cfg.stage_to:
        from hpctrain.data.staging import stage_dataset
        from hpctrain.runtime.env import detect_env

        path = str(stage_dataset(path, cfg.stage_to, detect_env().local_rank))
    return ShardTokens(load_manifest(path), cfg.seq_len, split=split,
                       val_fraction=cfg.val_fraction, window_shards=cfg.shuffle_window)


def gather_windows(dataset: TokenDataset, indices: np.ndarray) -> np.ndarray:
    """Samples ``indices`` stacked as ``[len(indices), seq_len + 1]`` int64."""
    fast = getattr(dataset, "windows", None)
    if fast is not None:
        return fast(indices)
    out = np.empty((len(indices), dataset.seq_len + 1), dtype=np.int64)
    for row, i in enumerate(np.asarray(indices).tolist()):
        out[row] = dataset.window(i)
    return out


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch splits into micro-steps and ranks."""

    micro_batch: int
    grad_accum: int
    world_size: int
    rank: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.world_size


# A dataset's own global order: sample indices at positions [start, stop) of an epoch.
OrderFn = Callable[[int, int, int, int], np.ndarray]


class GlobalOrderSampler:
    """Sample indices of rank ``layout.rank`` for each micro-step, in the global order."""

    def __init__(self, num_samples: int, layout: BatchLayout, seed: int,
                 group_sizes: np.ndarray | None = None, window_groups: int = 4,
                 remainder: str = "drop"):
        if remainder not in ("drop", "pad"):
            raise ValueError(f"remainder must be 'drop' or 'pad', not {remainder!r}")
        if num_samples < layout.global_batch and remainder == "drop":
            raise ConfigError(
                f"the dataset holds {num_samples} samples, fewer than one global batch "
                f"({layout.global_batch} = micro_batch {layout.micro_batch} x grad_accum "
                f"{layout.grad_accum} x {layout.world_size} ranks)",
                hint="lower train.micro_batch or data.seq_len, or raise data.max_bytes",
            )
        self.num_samples = num_samples
        self.layout = layout
        self.seed = seed
        # drop: whole global batches per epoch; the remainder is left out of that epoch (a
        # different one each epoch, since the order is reshuffled). pad: the last batch of an
        # epoch is filled up with masked slots. Either way every rank gets equal counts.
        self.remainder = remainder
        g = layout.global_batch
        self.steps_per_epoch = num_samples // g if remainder == "drop" else -(-num_samples // g)
        self.step = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self.group_sizes: np.ndarray | None = None
        self.window_groups = 0
        self._order_fn: OrderFn | None = None
        if group_sizes is not None:
            self.set_groups(group_sizes, window_groups)

    def set_groups(self, group_sizes: np.ndarray, window_groups: int) -> None:
        """Shuffle in windows of ``window_groups`` groups (shards) of consecutive samples."""
        sizes = np.asarray(group_sizes, dtype=np.int64)
        if int(sizes.sum()) != self.num_samples or (sizes < 0).any():
            raise ValueError(f"group sizes sum to {int(sizes.sum())}, not {self.num_samples}")
        if window_groups < 1:
            raise ConfigError(f"shuffle window of {window_groups} shards must be >= 1")
        self.group_sizes = sizes
        self._group_starts = np.cumsum(sizes) - sizes
        self.window_groups = window_groups
        self._perm_epoch = -1
        self._windows: dict[int, np.ndarray] = {}

    def set_order(self, order_fn: OrderFn) -> None:
        """Take the order from ``order_fn(seed, epoch, start, stop)`` (e.g. a data mixture's)."""
        self._order_fn = order_fn

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if self.group_sizes is None:
                self._perm = rng.permutation(self.num_samples)
            else:
                # Per epoch: the shard order and where each window of shards begins.
                order = rng.permutation(len(self.group_sizes))
                w = self.window_groups
                self._plan = [order[i : i + w] for i in range(0, len(order), w)]
                sizes = [int(self.group_sizes[g].sum()) for g in self._plan]
                self._window_ends = np.cumsum(sizes, dtype=np.int64)
                self._windows = {}
            self._perm_epoch = epoch
        return self._perm

    def _window_order(self, epoch: int, w: int) -> np.ndarray:
        if w not in self._windows:
            members = np.concatenate(
                [np.arange(self._group_starts[g], self._group_starts[g] + self.group_sizes[g])
                 for g in self._plan[w]])
            rng = np.random.default_rng([self.seed, epoch, w])
            self._windows = {w: members[rng.permutation(len(members))]}  # keep one window
        return self._windows[w]

    def order(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of epoch ``epoch``'s global order (sample indices)."""
        if self._order_fn is not None:
            return self._order_fn(self.seed, epoch, start, stop)
        perm = self._permutation(epoch)
        if self.group_sizes is None:
            return perm[start:stop]
        ends = self._window_ends
        parts = []
        w = int(np.searchsorted(ends, start, side="right"))
        pos = start
        while pos < stop:
            lo = 0 if w == 0 else int(ends[w - 1])
            win = self._window_order(epoch, w)
            take = win[pos - lo : min(stop, int(ends[w])) - lo]
            parts.append(take)
            pos += len(take)
            w += 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def next_step(self) -> list[np.ndarray]:
        """Indices for this rank's ``grad_accum`` micro-batches of the next optimizer step."""
        return self.next_step_masked()[0]

    def next_step_masked(self) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """(indices, valid mask) per micro-batch of this rank, and the step's valid samples
        over all ranks. Padding slots (``remainder="pad"``, last step of an epoch) repeat the
        step's first sample and are masked out."""
        lay = self.layout
        epoch, within = divmod(self.step, self.steps_per_epoch)
        start = within * lay.global_batch
        batch = self.order(epoch, start, min(start + lay.global_batch, self.num_samples))
        valid_total = len(batch)
        valid = np.arange(lay.global_batch) < valid_total
        if valid_total < lay.global_batch:
            batch = np.concatenate([batch, np.full(lay.global_batch - valid_total, batch[0])])
        per_micro = lay.micro_batch * lay.world_size
        indices, masks = [], []
        for a in range(lay.grad_accum):
            lo = a * per_micro + lay.rank * lay.micro_batch
            indices.append(batch[lo : lo + lay.micro_batch])
            masks.append(valid[lo : lo + lay.micro_batch])
        self.step += 1
        return indices, masks, valid_total

    def state_dict(self) -> dict[str, int]:
        """Position in the global order: optimizer steps consumed and the batch they assume."""
        state = {"step": self.step, "global_batch": self.layout.global_batch, "seed": self.seed}
        if self.group_sizes is not None:
            state["shuffle_window"] = self.window_groups
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state['step']`` global batches of the same size and seed."""
        checks = [("global_batch", self.layout.global_batch), ("seed", self.seed)]
        if "shuffle_window" in state:
            checks.append(("shuffle_window", self.window_groups))
        for key, mine in checks:
            if int(state[key]) != mine:
                raise ConfigError(
                    f"the saved data position assumes {key} {state[key]}, this run has {mine}",
                    expected=f"the same {key} as the run that saved it",
                    hint="keep micro_batch x grad_accum x ranks (and run.seed) unchanged on resume",
                )
        self.step = int(state["step"])


class TokenLoader:
    """Iterates (inputs, targets) micro-batches on ``device``, prefetched by a daemon thread.

    Batches are assembled in pinned host memory and copied with ``non_blocking`` so the copy
    overlaps the previous step's compute.
    """

    def __init__(self, dataset: TokenDataset, sampler: GlobalOrderSampler, device: torch.device,
                 prefetch: int = 2):
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.prefetch = prefetch
        self._pin = device.type == "cuda"
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Steps handed to training; the sampler runs ahead of this by the prefetch depth.
        self.consumed = sampler.step
        self.last_valid_samples = sampler.layout.global_batch
        # A shard dataset tells the sampler its shard boundaries, so the order shuffles within
        # windows of shards (the trainer builds the sampler from the sample count alone).
        # A mixture of datasets brings its own order (see `hpctrain.data.mixing`).
        order_fn = getattr(dataset, "global_order", None)
        if order_fn is not None and len(dataset) == sampler.num_samples:
            sampler.set_order(order_fn)
        counts = getattr(dataset, "shard_sample_counts", None)
        if (counts is not None and sampler.group_sizes is None
                and len(dataset) == sampler.num_samples):
            sampler.set_groups(counts, getattr(dataset, "window_shards", 4))

    def _host_step(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], int]:
        indices, masks, valid = self.sampler.next_step_masked()
        rows = []
        for ix, mask in zip(indices, masks, strict=True):
            t = torch.from_numpy(gather_windows(self.dataset, ix))
            pad = None if mask.all() else torch.from_numpy(~mask)
            rows.append((t.pin_memory() if self._pin else t, pad))
        return rows, valid

    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                self._queue.put(self._host_step())
        except BaseException as e:  # surfaced to the training thread at its next fetch
            self._queue.put(e)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``grad_accum`` micro-batches of the next optimizer step, on the device.

        Targets of padding rows are ``IGNORE_INDEX``; ``last_valid_samples`` then tells how
        many samples of the step's global batch are real.
        """
        if self.prefetch == 0:
            host = self._host_step()
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=self._worker, daemon=True,
                                                name="hpctrain-prefetch")
                self._thread.start()
            host = self._queue.get() if self._error is None else self._error
            if isinstance(host, BaseException):
                # The worker has stopped: keep failing instead of waiting on an empty queue.
                self._error = host
                raise host
        rows, self.last_valid_samples = host
        out = []
        for t, pad in rows:
            t = t.to(self.device, non_blocking=True)
            targets = t[:, 1:]
            if pad is not None:  # padding rows of an epoch's last step: no target counts
                targets = targets.masked_fill(pad.to(self.device)[:, None], IGNORE_INDEX)
            out.append((t[:, :-1], targets))
        self.consumed += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position training has reached (not the prefetcher's)."""
        return {**self.sampler.state_dict(), "step": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
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


class ValidationSampler:
    """Each rank's exact share of a validation split, in equal-length padded micro-batches.

    Rank ``r`` of ``W`` takes samples ``r, r + W, r + 2W, ...``; every rank runs the same number
    of micro-batches (no hang in collectives), and slots past the end repeat sample 0 with
    ``mask = False``, so summing only masked-in samples counts each sample exactly once globally.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, micro_batch: int):
        if num_samples < 1:
            raise ConfigError("the validation split holds no samples",
                              hint="raise data.val_fraction or prepare more data")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.micro_batch = micro_batch
        per_rank = -(-num_samples // world_size)
        self.num_batches = -(-per_rank // micro_batch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        """Yields (indices, mask) numpy arrays of length ``micro_batch``."""
        slots = self.num_batches * self.micro_batch
        idx = self.rank + self.world_size * np.arange(slots, dtype=np.int64)
        mask = idx < self.num_samples
        idx = np.where(mask, idx, 0)
        for b in range(self.num_batches):
            sl = slice(b * self.micro_batch, (b + 1) * self.micro_batch)
            yield idx[sl], mask[sl]


def validation_batches(dataset: TokenDataset, sampler: ValidationSampler, device: torch.device):
    """Yields (inputs, targets, mask) on ``device``; ``mask[b]`` is False for padding rows."""
    for indices, mask in sampler:
        t = torch.from_numpy(gather_windows(dataset, indices)).to(device, non_blocking=True)
        yield t[:, :-1], t[:, 1:], torch.from_numpy(mask).to(device, non_blocking=True)
