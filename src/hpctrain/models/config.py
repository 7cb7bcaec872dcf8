"""The `model:` section of a run config: a preset name plus optional per-field overrides.

Example YAML::

    model:
      size: tiny
      n_layers: 2        # override one field of the preset

or pretrained weights, whose shape comes with them (`hpctrain.models.init_source`)::

    model:
      init_from: hf:/models/Llama-3.2-1B
      max_seq_len: 4096  # the one field that may be set: the RoPE table's length
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.errors import ConfigError
from hpctrain.models.sizes import PRESETS, ModelArgs

# Override fields that must be strictly positive when given.
_POSITIVE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "rope_theta",
    "norm_eps",
    "max_seq_len",
)

# Fields that choose something other than a shape override.
_NOT_SHAPE = ("size", "init_from", "attention_backend")


@dataclass
class ModelConfig:
    """User-facing model choice: `size` names a preset, any non-None field overrides it."""

    size: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    max_seq_len: int | None = None
    # Start from pretrained weights: "hf:DIR" (a Hugging Face model folder) or an hpctrain
    # checkpoint directory (`hpctrain import hf` output, a run's step-N). `size` is then unused.
    init_from: str | None = None
    # The attention kernel (``hpctrain.models.sdpa_backend``): a choice of kernel, not of shape,
    # so it may be set with init_from too. auto: PyTorch picks.
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"

    def _merged(self) -> dict[str, Any]:
        """Return the preset's fields with this config's overrides applied (size must be valid)."""
        merged = dataclasses.asdict(PRESETS[self.size])
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in _NOT_SHAPE and value is not None:
                merged[field.name] = value
        return merged

    def validate(self) -> None:
        """Raise `ConfigError` if the size is unknown or the resolved shape is inconsistent."""
        if self.init_from:
            self._validate_pretrained()
            return
        if self.size not in PRESETS:
            raise ConfigError(
                f"model.size={self.size!r} is not a known model size",
                expected=f"one of {', '.join(PRESETS)}",
                hint="pick a preset and override single fields (e.g. model.n_layers) if needed",
            )
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(
                    f"model.{name}={value!r} must be positive",
                    expected="a number > 0",
                    hint=f"remove model.{name} to use the {self.size!r} preset's value",
                )
        _check_shape(self._merged())

    def _validate_pretrained(self) -> None:
        """Shape fields come with pretrained weights: setting one is refused by name."""
        from hpctrain.models.hf_config import max_seq_len_limit
        from hpctrain.models.init_source import init_from_args, origin, parse_init_from

        fixed = [f.name for f in dataclasses.fields(self)
                 if f.name not in (*_NOT_SHAPE, "max_seq_len")
                 and getattr(self, f.name) is not None]
        if fixed:
            raise ConfigError(
                f"model.{fixed[0]} is set together with model.init_from = {self.init_from!r}",
                expected="the shape of the pretrained model (only model.max_seq_len may be set)",
                hint=f"remove model.{fixed[0]}: the weights fix it")
        args = init_from_args(self.init_from)
        if self.max_seq_len is not None:
            if not self.max_seq_len > 0:
                raise ConfigError(f"model.max_seq_len={self.max_seq_len!r} must be positive")
            hf = origin(parse_init_from(self.init_from)).hf_config
            window = max_seq_len_limit(hf) if hf is not None else None
            if window is not None and self.max_seq_len > window:
                raise ConfigError(
                    f"model.max_seq_len={self.max_seq_len} exceeds the sliding attention "
                    f"window ({window}) of {self.init_from!r}",
                    expected=f"at most {window}: up to the window, sliding attention is the "
                    "full causal attention hpctrain computes",
                    hint=f"set model.max_seq_len <= {window}")
        _check_shape(dataclasses.asdict(args))

    def resolve(self) -> ModelArgs:
        """Validate and return the concrete shape: the preset with overrides applied, or the
        pretrained model's shape."""
        self.validate()
        if self.init_from:
            from hpctrain.models.init_source import init_from_args

            args = init_from_args(self.init_from)
            if self.max_seq_len is not None:
                args = dataclasses.replace(args, max_seq_len=self.max_seq_len)
            return args
        merged = self._merged()
        # YAML reads `rope_theta: 10000` as an int; keep ModelArgs' float fields float.
        merged["rope_theta"] = float(merged["rope_theta"])
        merged["norm_eps"] = float(merged["norm_eps"])
        return ModelArgs(**merged)


def _check_shape(m: dict[str, Any]) -> None:
    """Raise `ConfigError` unless heads divide the width evenly (even head_dim) and the KV heads
    divide the query heads."""
    if m["dim"] % m["n_heads"] != 0:
        raise ConfigError(
            f"model.dim={m['dim']} is not divisible by model.n_heads={m['n_heads']}",
            expected="dim to be a multiple of n_heads (head_dim = dim / n_heads)",
            hint="change dim or n_heads so that dim % n_heads == 0",
        )
    if (m["dim"] // m["n_heads"]) % 2 != 0:
        raise ConfigError(
            f"head_dim = model.dim / model.n_heads = {m['dim']} / {m['n_heads']} is odd",
            expected="an even head_dim, since RoPE rotates pairs of channels",
            hint="change dim or n_heads so that dim / n_heads is even",
        )
    if m["n_heads"] % m["n_kv_heads"] != 0:
        raise ConfigError(
            f"model.n_heads={m['n_heads']} is not divisible by "
            f"model.n_kv_heads={m['n_kv_heads']}",
            expected="n_heads to be a multiple of n_kv_heads (grouped-query attention)",
            hint="set n_kv_heads to a divisor of n_heads (n_kv_heads = n_heads disables GQA)",
        )

