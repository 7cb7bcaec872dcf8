"""Sampling: greedy, temperature, top-k and top-p pick from the right set; reproducible by seed;
a stop id or the model's length ends the continuation."""

from __future__ import annotations

import pytest
import torch

from hpctrain.errors import ConfigError
from hpctrain.models import ModelArgs, Transformer
from hpctrain.models.generate import generate, next_token

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def _picks(n: int = 200, **kw) -> set[int]:
    g = torch.Generator().manual_seed(0)
    return {next_token(LOGITS, generator=g, **kw) for _ in range(n)}


def test_greedy_top_k_and_top_p_keep_the_right_tokens() -> None:
    assert _picks(temperature=0.0, top_k=0, top_p=1.0) == {0}
    assert _picks(temperature=1.0, top_k=0, top_p=1.0) == {0, 1, 2, 3}
    assert _picks(temperature=1.0, top_k=2, top_p=1.0) == {0, 1}
    # The smallest set reaching 0.7 is {0, 1}; reaching 0.9: {0, 1, 2}.
    assert _picks(temperature=1.0, top_k=0, top_p=0.7) == {0, 1}
    assert _picks(temperature=1.0, top_k=0, top_p=0.9) == {0, 1, 2}
    assert _picks(temperature=1.0, top_k=0, top_p=0.01) == {0}


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                 vocab_size=50, max_seq_len=24)).eval()


def test_sampling_is_reproducible_by_seed_and_stops(model: Transformer) -> None:
    def sample(seed: int) -> list[int]:
        return generate(model, [1, 2, 3], 10, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed))

    assert sample(1) == sample(1) and len(sample(1)) == 10
    assert any(sample(1) != sample(s) for s in range(2, 6))
    greedy = generate(model, [1, 2, 3], 10)
    stop = greedy[3]
    assert generate(model, [1, 2, 3], 10, stop_ids={stop}) == greedy[: greedy.index(stop) + 1]
    assert len(generate(model, [1, 2, 3], 100)) == 24 - 3  # the model's length ends it


def test_prompts_the_model_cannot_hold_are_refused(model: Transformer) -> None:
    with pytest.raises(ConfigError, match="no tokens"):
        generate(model, [], 5)
    with pytest.raises(ConfigError, match="at most 24"):
        generate(model, list(range(24)), 5)
