"""The `model:` section of a run config: a preset name plus optional per-field overrides.

Example YAML::

    model:
      size: tiny
      n_layers: 2        # override one field of the preset
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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

    def _merged(self) -> dict[str, Any]:
        """Return the preset's fields with this config's overrides applied (size must be valid)."""
        merged = dataclasses.asdict(PRESETS[self.size])
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "size" and value is not None:
                merged[field.name] = value
        return merged

    def validate(self) -> None:
        """Raise `ConfigError` if the size is unknown or the resolved shape is inconsistent."""
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
        m = self._merged()
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

    def resolve(self) -> ModelArgs:
        """Validate and return the concrete shape: the preset with overrides applied."""
        self.validate()
        merged = self._merged()
        # YAML reads `rope_theta: 10000` as an int; keep ModelArgs' float fields float.
        merged["rope_theta"] = float(merged["rope_theta"])
        merged["norm_eps"] = float(merged["norm_eps"])
        return ModelArgs(**merged)
