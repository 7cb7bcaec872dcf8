"""Continue token sequences with a model: greedy or sampled, with a KV cache.

The prompt goes through the model once (prefill); each new token then costs one forward of one
position, the earlier positions' keys and values coming from the cache (`KVCache`). Sampling:
``temperature`` scales the logits (0 = greedy: the most likely token), ``top_k`` keeps the k
most likely tokens, ``top_p`` the smallest set whose probability reaches p (nucleus sampling);
``generator`` makes a sample reproducible.

    ids = generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_p=0.95,
                   stop_ids={eos_id})
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.models.registry import family_of


def next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """Pick a token from one position's logits ``[vocab]``."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        # Drop a token once the ones before it already reach top_p (the first always stays).
        drop = cumulative - ordered.softmax(-1) >= top_p
        logits = logits.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids: Collection[int] = (), generator: torch.Generator | None = None
             ) -> list[int]:
    """The tokens that follow ``prompt`` (at most ``max_new_tokens``; a stop id ends the
    continuation and is included); ``model`` is of a family with a KV cache."""
    if not prompt:
        raise ConfigError("the prompt encodes to no tokens", hint="give a non-empty --prompt")
    limit = model.args.max_seq_len
    total = min(len(prompt) + max_new_tokens, limit)
    if len(prompt) >= limit:
        raise ConfigError(f"the prompt has {len(prompt)} tokens, the model at most {limit}",
                          hint="shorten the prompt")
    family = family_of(model)
    if family.kv_cache is None:
        raise ConfigError(f"model family {family.name!r} cannot generate",
                          expected="a family with a KV cache (ModelFamily.kv_cache)")
    device = next(model.parameters()).device
    cache = family.kv_cache(model, 1, total)
    logits = model(torch.tensor([prompt], device=device), cache=cache)
    out: list[int] = []
    while len(prompt) + len(out) < total:
        token = next_token(logits[0, -1], temperature, top_k, top_p, generator)
        out.append(token)
        if token in stop_ids or len(prompt) + len(out) == total:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache)
    return out
