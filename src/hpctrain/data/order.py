"""Token samples in a global order that does not depend on the number of ranks.

Each optimizer step consumes one *global batch* of ``micro_batch * grad_accum * world_size``
samples taken from a permutation that is a pure function of (seed, epoch, dataset); rank ``r``
takes its slice of each micro-step. So one rank with micro-batch 2B and two ranks with B see the
same samples per step, and the state is one integer (steps consumed), which resumes exactly.

Over token shards the permutation works in *windows of shards* (as Mosaic and litdata do): each
epoch permutes the shards, cuts that order into windows of a few shards and permutes the samples
inside each window, so at any time the ranks read from a few files, sequentially (Lustre-friendly),
and the order is still a pure function of (seed, epoch, manifest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpctrain.errors import ConfigError


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


def resume_batch_hint(saved: int, seq_len: int | None) -> str:
    """How to resume with the saved global batch of ``saved`` samples: in tokens for a token
    model (``seq_len``), in samples for a task's."""
    samples = f"train.micro_batch x train.grad_accum x ranks = {saved} samples"
    if seq_len is None:
        return f"resume with the saved batch: {samples}"
    return (f"resume with the saved batch: train.global_batch_tokens={saved * seq_len} "
            f"({saved} samples of {seq_len} tokens; or {samples})")


# A dataset's own global order: sample indices at positions [start, stop) of an epoch.
OrderFn = Callable[[int, int, int, int], np.ndarray]


class GlobalOrderSampler:
    """Sample indices of rank ``layout.rank`` for each micro-step, in the global order."""

    def __init__(self, num_samples: int, layout: BatchLayout, seed: int,
                 group_sizes: np.ndarray | None = None, window_groups: int = 4,
                 remainder: str = "drop", seq_len: int | None = None):
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
        self.seq_len = seq_len  # a token model's samples, for the resume hint; None: a task's
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
        # The step's real samples on every rank: what a per-token mean over the global batch
        # must count (read by the loader for loss-masked data).
        self.last_batch = batch[:valid_total]
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
                    hint=(resume_batch_hint(int(state[key]), self.seq_len)
                          if key == "global_batch" else f"resume with the saved {key}"),
                )
        self.step = int(state["step"])
