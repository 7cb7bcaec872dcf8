"""The training loader: token samples in the global order (`hpctrain.data.order`), on the device.

A sample is a window of ``seq_len + 1`` tokens (`hpctrain.data.windows`); `build_dataset` makes
the source that ``data.source`` names and holds its token ids against the model's vocabulary;
`TokenLoader` prefetches each step's micro-batches; `ValidationSampler` splits a validation set
exactly over the ranks. Targets the loss must skip are ``IGNORE_INDEX``: the padding rows of an
epoch's last step, and the prompt tokens of fine-tuning examples (shards with loss masks,
`hpctrain.data.chat`): target ``j`` (token ``j + 1`` of the window) counts only where the mask of
token ``j + 1`` is 1.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.data.config import DataConfig
from hpctrain.data.mixing import MixedTokens
from hpctrain.data.order import BatchLayout, GlobalOrderSampler
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.shard_dataset import ShardTokens, Split, check_split_size
from hpctrain.data.shards import check_token_ids, load_manifest
from hpctrain.data.stdlib_corpus import read_stdlib_bytes
from hpctrain.data.windows import (
    ContiguousTokens,
    SliceWindows,
    TokenDataset,
    gather_masks,
    gather_windows,
)
from hpctrain.errors import ConfigError, DataError

# Names other modules import from here (the loader's public face).
__all__ = [
    "IGNORE_INDEX", "BatchLayout", "ContiguousTokens", "GlobalOrderSampler", "TokenDataset",
    "TokenLoader", "ValidationSampler", "build_dataset", "gather_masks", "gather_windows",
    "validation_batches",
]

# Target id that the loss skips (PyTorch's cross_entropy default): marks padding rows.
IGNORE_INDEX = -100


def build_dataset(cfg: DataConfig, split: Split = "train",
                  vocab_size: int | None = None) -> TokenDataset:
    """The token source named by ``data.source``; ``split="val"`` is the held-out part.

    The validation split is the last ``floor(windows * data.val_fraction)`` windows (of each shard
    for ``shards``; of the corpus for ``stdlib``); the training split is the rest. With
    ``vocab_size`` (the model's), a token id the model cannot embed is refused here, before
    training, naming the shard (an IndexError mid-run on a CPU, a device-side assert on a GPU).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    if split == "val" and cfg.val_fraction <= 0:
        raise ConfigError("a validation split was requested but data.val_fraction = 0",
                          hint="set data.val_fraction, e.g. data.val_fraction=0.01")
    if cfg.source == "shards":
        ds: TokenDataset = _shards(cfg, str(cfg.path), split, vocab_size)
    elif cfg.source == "mix":
        parts = [_shards(cfg, m.path, split, vocab_size) for m in cfg.mix or []]
        ds = MixedTokens(parts, [m.weight for m in cfg.mix or []],
                         epoch_samples=cfg.mix_epoch_samples,
                         names=[m.path for m in cfg.mix or []], weighted=split == "train")
    else:
        tokens = read_stdlib_bytes(cfg.max_bytes)
        largest = int(tokens.max()) if len(tokens) else -1
        if vocab_size is not None and largest >= vocab_size:
            raise DataError(f"data.source 'stdlib' holds token id {largest} (a byte value), but "
                            f"the model's vocabulary has {vocab_size} ids",
                            hint="set model.vocab_size >= 256")
        base = ContiguousTokens(tokens, cfg.seq_len)
        n_val = int(len(base) * cfg.val_fraction)
        if n_val == 0 and split == "train":
            ds = base
        else:
            n_train = len(base) - n_val
            ds = SliceWindows(base, n_train, n_val) if split == "val" else SliceWindows(
                base, 0, n_train)
    check_split_size(len(ds), split, cfg.val_fraction)
    return ds


def _shards(cfg: DataConfig, path: str, split: Split, vocab_size: int | None) -> ShardTokens:
    """One prepared directory as a dataset (staged to node-local disk when data.stage_to)."""
    if cfg.stage_to:
        from hpctrain.data.staging import stage_dataset
        from hpctrain.runtime.env import detect_env

        path = str(stage_dataset(path, cfg.stage_to, detect_env().local_rank))
    manifest = load_manifest(path)
    # Every shard, not only this split's windows: the two splits share the shards.
    check_token_ids(manifest, vocab_size)
    return ShardTokens(manifest, cfg.seq_len, split=split, val_fraction=cfg.val_fraction,
                       window_shards=cfg.shuffle_window, vocab_size=vocab_size)


class TokenLoader(Prefetcher):
    """Iterates (inputs, targets) micro-batches on ``device``, prefetched by a daemon thread.

    Batches are assembled in pinned host memory and copied with ``non_blocking`` so the copy
    overlaps the previous step's compute.
    """

    def __init__(self, dataset: TokenDataset, sampler: GlobalOrderSampler, device: torch.device,
                 prefetch: int = 2):
        super().__init__(sampler, prefetch)
        self.dataset = dataset
        self.device = device
        self._pin = device.type == "cuda"
        self.last_valid_samples = sampler.layout.global_batch
        # Targets that count in the step's whole global batch (all ranks): the denominator of
        # an exact per-token mean. Padding rows and, for loss-masked data, prompt tokens don't.
        self.last_target_tokens = sampler.layout.global_batch * dataset.seq_len
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

    def _host_step(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], int, int]:
        indices, masks, valid = self.sampler.next_step_masked()
        rows = []
        for ix, mask in zip(indices, masks, strict=True):
            t = torch.from_numpy(gather_windows(self.dataset, ix))
            rows.append((t.pin_memory() if self._pin else t,
                         ignored_targets(self.dataset, ix, mask)))
        return rows, valid, counted_targets(self.dataset, self.sampler.last_batch)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``grad_accum`` micro-batches of the next optimizer step, on the device.

        Targets of padding rows are ``IGNORE_INDEX``; ``last_valid_samples`` then tells how
        many samples of the step's global batch are real.
        """
        host = self._fetch()
        rows, self.last_valid_samples, self.last_target_tokens = host
        out = []
        for t, ignored in rows:
            t = t.to(self.device, non_blocking=True)
            targets = t[:, 1:]
            if ignored is not None:  # padding rows, prompt tokens: no such target counts
                targets = targets.masked_fill(ignored.to(self.device), IGNORE_INDEX)
            out.append((t[:, :-1], targets))
        return out


def counted_targets(dataset: TokenDataset, real_indices: np.ndarray) -> int:
    """Targets that count in samples ``real_indices`` (a step's real global batch).

    Every rank computes the same number from the masks of the whole batch (a byte per token,
    memory-mapped), so the exact per-token mean needs no collective.
    """
    loss = gather_masks(dataset, real_indices)
    if loss is None:
        return len(real_indices) * dataset.seq_len
    return int(loss[:, 1:].sum())


def ignored_targets(dataset: TokenDataset, indices: np.ndarray, real: np.ndarray
                    ) -> torch.Tensor | None:
    """``[rows, seq_len]`` bool, true where a target must not count: every target of a padding
    row (``real`` false) and those the loss mask leaves out; None when every target counts."""
    loss = gather_masks(dataset, indices)
    if loss is None:
        return None if real.all() else torch.from_numpy(~real)[:, None].expand(
            -1, dataset.seq_len).contiguous()
    return torch.from_numpy(~loss[:, 1:] | ~real[:, None])


class ValidationSampler:
    """Each rank's exact share of a validation split, in equal-length padded micro-batches.

    Rank ``r`` of ``W`` takes samples ``r, r + W, r + 2W, ...``; every rank runs the same number
    of micro-batches (no hang in collectives), and slots past the end repeat sample 0 with
    ``mask = False``, so summing only masked-in samples counts each sample exactly once globally.

    ``max_samples`` > 0 bounds the share: that many samples spread evenly over the split (the
    same ones on any number of ranks, so evaluations stay comparable across layouts).
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, micro_batch: int,
                 max_samples: int = 0):
        if num_samples < 1:
            raise ConfigError("the validation split holds no samples",
                              hint="raise data.val_fraction or prepare more data")
        self.split_samples = num_samples
        self.num_samples = min(num_samples, max_samples) if max_samples > 0 else num_samples
        self.world_size = world_size
        self.rank = rank
        self.micro_batch = micro_batch
        per_rank = -(-self.num_samples // world_size)
        self.num_batches = -(-per_rank // micro_batch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        """Yields (indices, mask) numpy arrays of length ``micro_batch``."""
        slots = self.num_batches * self.micro_batch
        idx = self.rank + self.world_size * np.arange(slots, dtype=np.int64)
        mask = idx < self.num_samples
        idx = np.where(mask, idx, 0)
        # The j-th of n samples taken from a split of N: floor(j * N / n), distinct for n <= N.
        idx = idx * self.split_samples // self.num_samples
        for b in range(self.num_batches):
            sl = slice(b * self.micro_batch, (b + 1) * self.micro_batch)
            yield idx[sl], mask[sl]


def validation_batches(dataset: TokenDataset, sampler: ValidationSampler, device: torch.device):
    """Yields (inputs, targets, mask) on ``device``; ``mask[b]`` is False for padding rows, and
    targets a loss mask leaves out are ``IGNORE_INDEX``."""
    for indices, mask in sampler:
        t = torch.from_numpy(gather_windows(dataset, indices)).to(device, non_blocking=True)
        targets = t[:, 1:]
        loss = gather_masks(dataset, indices)
        if loss is not None:
            targets = targets.masked_fill(torch.from_numpy(~loss[:, 1:]).to(device),
                                          IGNORE_INDEX)
        yield t[:, :-1], targets, torch.from_numpy(mask).to(device, non_blocking=True)
