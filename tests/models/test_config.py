"""ModelConfig: preset resolution, overrides and the errors users see."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelConfig


def test_resolve_applies_overrides_to_preset() -> None:
    args = ModelConfig(size="1b", n_layers=2, rope_theta=500000, tie_embeddings=True).resolve()
    expected = dataclasses.replace(
        PRESETS["1b"], n_layers=2, rope_theta=500000.0, tie_embeddings=True
    )
    assert args == expected
    assert isinstance(args.rope_theta, float)
    assert ModelConfig().resolve() == PRESETS["tiny"]


def test_type_hints_resolve_for_generic_loader() -> None:
    hints = typing.get_type_hints(ModelConfig)
    assert hints["size"] is str
    assert hints["dim"] == int | None
    assert hints["tie_embeddings"] == bool | None


def test_unknown_size_lists_valid_sizes() -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig(size="70b").validate()
    message = str(info.value)
    assert "'70b'" in message
    for size in ("tiny", "125m", "1b", "8b"):
        assert size in message


def test_dim_not_divisible_by_heads_names_values() -> None:
    with pytest.raises(ConfigError, match=r"model.dim=250 .* model.n_heads=8"):
        ModelConfig(size="tiny", dim=250).resolve()


def test_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(ConfigError, match=r"model.n_heads=8 .* model.n_kv_heads=3"):
        ModelConfig(n_kv_heads=3).validate()


@pytest.mark.parametrize("field", ["dim", "n_layers", "vocab_size", "norm_eps", "rope_theta"])
def test_non_positive_values_rejected(field: str) -> None:
    with pytest.raises(ConfigError, match=f"model.{field}=0 must be positive"):
        ModelConfig(**{field: 0}).validate()
