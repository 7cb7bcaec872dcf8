"""Config section ``data:``: which tokens the model sees and in which order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError

BYTE_VOCAB = 256


@dataclass
class DataConfig:
    """The token source and sample shape."""

    # "stdlib": the Python standard library's own sources, read as bytes; exists on every
    # machine with Python, so a demo or benchmark needs no download.
    source: Literal["stdlib"] = "stdlib"
    seq_len: int = 256
    # Cap on corpus bytes read at start; the stdlib holds ~30 MB and reading it all is not
    # needed for a demo. 0 reads everything.
    max_bytes: int = 16_000_000
    # Tokens are fetched ahead of compute in a background thread.
    prefetch: int = 2

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids the source produces."""
        return BYTE_VOCAB

    def validate(self) -> None:
        """Check sizes."""
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len = {self.seq_len} must be >= 2")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes = {self.max_bytes} must be >= 0 (0 = no cap)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch = {self.prefetch} must be >= 0")
