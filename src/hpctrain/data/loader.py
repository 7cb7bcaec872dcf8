"""Token samples in a global order that does not depend on the number of ranks.

A sample is a window of ``seq_len + 1`` tokens (inputs and the shifted targets). Each optimizer
step consumes one *global batch* of ``micro_batch * grad_accum * world_size`` samples taken from a
permutation that is a pure function of (seed, epoch, dataset); rank ``r`` takes its slice of each
micro-step. So one rank with micro-batch 2B and two ranks with B see the same samples per step,
and the loader state is one integer (steps consumed), which resumes exactly.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hpctrain.data.config import DataConfig
from hpctrain.data.stdlib_corpus import read_stdlib_bytes
from hpctrain.errors import ConfigError


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


def build_dataset(cfg: DataConfig) -> TokenDataset:
    """The token source named by ``data.source``."""
    return ContiguousTokens(read_stdlib_bytes(cfg.max_bytes), cfg.seq_len)


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


class GlobalOrderSampler:
    """Sample indices of rank ``layout.rank`` for each micro-step, in the global order."""

    def __init__(self, num_samples: int, layout: BatchLayout, seed: int):
        if num_samples < layout.global_batch:
            raise ConfigError(
                f"the dataset holds {num_samples} samples, fewer than one global batch "
                f"({layout.global_batch} = micro_batch {layout.micro_batch} x grad_accum "
                f"{layout.grad_accum} x {layout.world_size} ranks)",
                hint="lower train.micro_batch or data.seq_len, or raise data.max_bytes",
            )
        self.num_samples = num_samples
        self.layout = layout
        self.seed = seed
        # Whole global batches per epoch: the remainder is left out of that epoch (a different
        # remainder each epoch, since the order is reshuffled), so every rank gets equal counts.
        self.steps_per_epoch = num_samples // layout.global_batch
        self.step = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_step(self) -> list[np.ndarray]:
        """Indices for this rank's ``grad_accum`` micro-batches of the next optimizer step."""
        lay = self.layout
        epoch, within = divmod(self.step, self.steps_per_epoch)
        start = within * lay.global_batch
        batch = self._permutation(epoch)[start : start + lay.global_batch]
        per_micro = lay.micro_batch * lay.world_size
        out = []
        for a in range(lay.grad_accum):
            lo = a * per_micro + lay.rank * lay.micro_batch
            out.append(batch[lo : lo + lay.micro_batch])
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Position in the global order: optimizer steps consumed and the batch they assume."""
        return {"step": self.step, "global_batch": self.layout.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state['step']`` global batches of the same size and seed."""
        for key, mine in (("global_batch", self.layout.global_batch), ("seed", self.seed)):
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

    def _assemble(self, indices: np.ndarray) -> torch.Tensor:
        rows = np.stack([self.dataset.window(int(i)) for i in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t.pin_memory() if self._pin else t

    def _host_step(self) -> list[torch.Tensor]:
        return [self._assemble(ix) for ix in self.sampler.next_step()]

    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                self._queue.put(self._host_step())
        except BaseException as e:  # surfaced to the training thread at its next fetch
            self._queue.put(e)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``grad_accum`` micro-batches of the next optimizer step, on the device."""
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
        out = []
        for t in host:
            t = t.to(self.device, non_blocking=True)
            out.append((t[:, :-1], t[:, 1:]))
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
