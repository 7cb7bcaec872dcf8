"""Config section ``data:``: which tokens the model sees and in which order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpctrain.errors import ConfigError, HpctrainError

BYTE_VOCAB = 256


@dataclass
class DataConfig:
    """The token source and sample shape."""

    # "stdlib": the Python standard library's own sources, read as bytes; exists on every
    # machine with Python, so a demo or benchmark needs no download.
    # "shards": a directory written by `hpctrain data prepare` (data.path).
    source: Literal["stdlib", "shards"] = "stdlib"
    # The prepared directory (holding manifest.json) when source is "shards".
    path: str | None = None
    seq_len: int = 256
    # Cap on corpus bytes read at start (stdlib only); the stdlib holds ~30 MB and reading it all
    # is not needed for a demo. 0 reads everything.
    max_bytes: int = 16_000_000
    # Tokens are fetched ahead of compute in a background thread.
    prefetch: int = 2
    # Held-out share of the windows (of each shard) for validation; 0 = no validation split.
    val_fraction: float = 0.0
    # Shards per shuffle window: samples are permuted within windows of this many shards.
    shuffle_window: int = 4

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids the source produces (from the manifest for shards)."""
        if self.source == "shards" and self.path:
            from hpctrain.data.shards import manifest_vocab_size

            return manifest_vocab_size(self.path)
        return BYTE_VOCAB

    def validate(self) -> None:
        """Check sizes and that a shard directory exists."""
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len = {self.seq_len} must be >= 2")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes = {self.max_bytes} must be >= 0 (0 = no cap)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch = {self.prefetch} must be >= 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.val_fraction} must be in [0, 1)")
        if self.shuffle_window < 1:
            raise ConfigError(f"data.shuffle_window = {self.shuffle_window} must be >= 1")
        if self.source == "stdlib" and self.path is not None:
            raise ConfigError(
                f"data.path = {self.path!r} is set but data.source is 'stdlib'",
                hint="set data.source=shards to train on a prepared directory",
            )
        if self.source == "shards":
            hint = "run `hpctrain data prepare INPUT... --out DIR`, then set data.path=DIR"
            if not self.path:
                raise ConfigError("data.source is 'shards' but data.path is not set",
                                  expected="the directory written by hpctrain data prepare",
                                  hint=hint)
            if not (Path(self.path) / "manifest.json").is_file():
                raise ConfigError(
                    f"data.path = {self.path!r} holds no manifest.json"
                    + ("" if Path(self.path).is_dir() else " (the directory does not exist)"),
                    expected="a directory written by hpctrain data prepare", hint=hint)
            try:
                self.vocab_size  # noqa: B018 - reads and checks the manifest
            except HpctrainError as e:
                raise ConfigError(f"data.path = {self.path!r}: {e.what}", hint=e.hint) from None
