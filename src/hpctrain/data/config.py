"""Config section ``data:``: which tokens the model sees and in which order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpctrain.errors import ConfigError, HpctrainError

BYTE_VOCAB = 256


@dataclass
class MixSource:
    """One dataset of a mixture: a prepared directory and its share of the samples."""

    path: str
    weight: float = 1.0


@dataclass
class DataConfig:
    """The token source and sample shape."""

    # "stdlib": the Python standard library's own sources, read as bytes; exists on every
    # machine with Python, so a demo or benchmark needs no download.
    # "shards": a directory written by `hpctrain data prepare` (data.path).
    # "mix": several prepared directories drawn in proportion to their weights (data.mix).
    source: Literal["stdlib", "shards", "mix"] = "stdlib"
    # The prepared directory (holding manifest.json) when source is "shards".
    path: str | None = None
    # source "mix": [{path: DIR, weight: W}, ...]; weights are normalized to sum to 1.
    mix: list[MixSource] | None = None
    # Samples per epoch of a mixture; 0 = the sum of the sources' sample counts.
    mix_epoch_samples: int = 0
    # Node-local directory (e.g. $SLURM_TMPDIR; environment variables are expanded) where local
    # rank 0 of each node copies the shards before training; None reads the shared path.
    stage_to: str | None = None
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
    # The end of an epoch, when the samples do not fill a last global batch: drop the rest
    # (reshuffled each epoch, so nothing is lost for good) or pad it with masked slots that
    # never count in the loss. Either way every rank runs the same number of steps.
    remainder: Literal["drop", "pad"] = "drop"

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids the source produces (from the manifest for shards)."""
        from hpctrain.data.shards import manifest_vocab_size

        if self.source == "shards" and self.path:
            return manifest_vocab_size(self.path)
        if self.source == "mix" and self.mix:
            return max(manifest_vocab_size(m.path) for m in self.mix)
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
        if self.mix_epoch_samples < 0:
            raise ConfigError(f"data.mix_epoch_samples = {self.mix_epoch_samples} must be >= 0 "
                              "(0 = the sum of the sources' samples)")
        if self.stage_to is not None and not self.stage_to.strip():
            raise ConfigError("data.stage_to is empty", hint="unset it or name a local directory")
        if self.source != "mix" and self.mix is not None:
            raise ConfigError(f"data.mix is set but data.source is {self.source!r}",
                              hint="set data.source=mix")
        if self.source == "shards":
            if not self.path:
                raise ConfigError("data.source is 'shards' but data.path is not set",
                                  expected="the directory written by hpctrain data prepare",
                                  hint=_PREPARE_HINT)
            _check_prepared("data.path", self.path)
        if self.source == "mix":
            if self.path is not None:
                raise ConfigError(f"data.path = {self.path!r} is set but data.source is 'mix'",
                                  hint="list the directories in data.mix instead")
            if not self.mix:
                raise ConfigError("data.source is 'mix' but data.mix is empty",
                                  expected="a list of {path: DIR, weight: W}",
                                  hint="data.mix='[{path: data/a, weight: 3}, "
                                  "{path: data/b, weight: 1}]'")
            tokenizers = {}
            for i, m in enumerate(self.mix):
                if not m.weight > 0:
                    raise ConfigError(f"data.mix[{i}].weight = {m.weight} must be > 0")
                _check_prepared(f"data.mix[{i}].path", m.path)
                from hpctrain.data.shards import load_manifest

                tokenizers[m.path] = load_manifest(m.path).raw.get("tokenizer", {}).get("hash")
            if len(set(tokenizers.values())) > 1:
                raise ConfigError(
                    "data.mix sources were prepared with different tokenizers: "
                    + ", ".join(f"{p} ({h})" for p, h in tokenizers.items()),
                    expected="one tokenizer for every source of a mixture",
                    hint="prepare every source with the same --tokenizer")


_PREPARE_HINT = "run `hpctrain data prepare INPUT... --out DIR`, then set data.path=DIR"


def _check_prepared(key: str, path: str) -> None:
    """Raise ConfigError unless ``path`` holds a readable manifest.json."""
    if not (Path(path) / "manifest.json").is_file():
        raise ConfigError(
            f"{key} = {path!r} holds no manifest.json"
            + ("" if Path(path).is_dir() else " (the directory does not exist)"),
            expected="a directory written by hpctrain data prepare", hint=_PREPARE_HINT)
    try:
        from hpctrain.data.shards import manifest_vocab_size

        manifest_vocab_size(path)
    except HpctrainError as e:
        raise ConfigError(f"{key} = {path!r}: {e.what}", hint=e.hint) from None
