"""A Hugging Face ``config.json`` of a Qwen model as a `QwenArgs`, and back.

Reads ``Qwen3ForCausalLM`` (q/k norms, no biases, its own ``head_dim``) and
``Qwen2ForCausalLM`` (Qwen2 and Qwen2.5: q/k/v biases), tied or untied. ``import hf`` and
``init_from: hf:DIR`` bring a Qwen3 folder here by its architecture; a Qwen2 folder goes to the
Llama family (which computes the same network) unless the qwen family is asked for by name
(``--family qwen``, ``model.family: qwen``). Every key is accounted for: it sets the
shape, is checked against the one value hpctrain computes, or is metadata that does not change
what the weights compute; any other key or value is refused by name.

Sliding attention windows: where a config lets layers slide (``use_sliding_window``,
``layer_types``), attention over sequences no longer than the window is the full causal
attention hpctrain computes, so ``max_seq_len`` is capped at the window.
"""

from __future__ import annotations

from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.models.hf_values import positive_int, positive_number
from hpctrain.models.hf_weights import CONFIG
from hpctrain.models.qwen.sizes import QwenArgs

# The architecture `import hf` routes to this family (Qwen2's goes to Llama's by default).
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}
# The one it reads when asked for by name (model.family: qwen, import hf --family qwen).
ALSO_READS = {"Qwen2ForCausalLM": "qwen2"}
# Every architecture this family reads, with its model_type.
READS = {**ALSO_READS, **ARCHITECTURES}
METADATA_KEYS = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
    "torch_dtype", "transformers_version", "_name_or_path", "initializer_range", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class",
    "max_length", "do_sample", "temperature", "top_p", "top_k", "_attn_implementation_autoset",
})
SHAPE_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
    "hidden_act", "attention_bias", "attention_dropout", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "use_mrope",
})
_HINT = ("hpctrain imports Qwen2, Qwen2.5 and Qwen3 dense decoders as their Hugging Face "
         "configs describe them; convert the model with its own tools, or train it with them")


def _refuse(where: str, key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {key} = {value!r} is not supported", expected=expected,
                       hint=_HINT)


def _rope_theta(raw: dict, where: str) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4); only the
    default RoPE (no YaRN or other scaling)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _refuse(where, "rope_parameters", params, "a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" or set(params) - {"rope_type", "type", "rope_theta"}:
        raise _refuse(where, "rope_parameters", params,
                      "the default RoPE (rope_type 'default', no scaling)")
    return positive_number(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta",
                   where)


def _window(raw: dict, n_layers: int, where: str) -> int | None:
    """The sliding attention window some layer uses, if any."""
    if raw.get("use_mrope"):
        raise _refuse(where, "use_mrope", raw["use_mrope"], "false (text-only RoPE)")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not set(layer_types) <= {
                "full_attention", "sliding_attention"}:
            raise _refuse(where, "layer_types", layer_types,
                          "a list of 'full_attention' / 'sliding_attention'")
        slides = "sliding_attention" in layer_types
    else:  # transformers 4: the layers from max_window_layers (default 28) on slide
        slides = bool(raw.get("use_sliding_window")) and positive_int(
            raw, "max_window_layers", where, default=28) < n_layers
    if not slides:
        return None
    window = raw.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse(where, "sliding_window", window, "a positive window length")
    return window


def _model_type(raw: dict[str, Any], where: str) -> str:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    model_type = raw.get("model_type")
    if arch not in READS or READS[arch] != model_type:
        raise ConfigError(
            f"{where}: architecture {arch!r} (model_type {model_type!r}) is not a Qwen model",
            expected=", ".join(f"{a} (model_type {t!r})" for a, t in READS.items()), hint=_HINT)
    return model_type


def args_from_hf_config(raw: dict[str, Any], where: str = CONFIG) -> QwenArgs:
    """The `QwenArgs` of a Qwen2/Qwen3 Hugging Face config; ConfigError naming what is not
    supported."""
    model_type = _model_type(raw, where)
    unknown = sorted(k for k in raw if k not in SHAPE_KEYS | METADATA_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
            f"supported by hpctrain's {model_type} import",
            expected="only the keys the model has in transformers", hint=_HINT)
    # Qwen2's attention always has q/k/v biases; Qwen3's attention_bias would add an o bias.
    checks = [("hidden_act", raw.get("hidden_act", "silu"), ("silu", "swish")),
              ("attention_dropout", raw.get("attention_dropout", 0.0), (0,))]
    if model_type == "qwen3":
        checks.append(("attention_bias", raw.get("attention_bias", False), (False,)))
    for key, value, allowed in checks:
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise _refuse(where, key, value, " or ".join(repr(a) for a in allowed))
    dim = positive_int(raw, "hidden_size", where)
    heads = positive_int(raw, "num_attention_heads", where)
    n_layers = positive_int(raw, "num_hidden_layers", where)
    # transformers takes head_dim from the config when it is there, for both generations.
    head_dim = dim // heads if raw.get("head_dim") is None else positive_int(raw, "head_dim", where)
    max_pos = positive_int(raw, "max_position_embeddings", where, default=32768)
    window = _window(raw, n_layers, where)
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _refuse(where, "tie_word_embeddings", tie, "true or false")
    return QwenArgs(
        dim=dim, n_layers=n_layers, n_heads=heads,
        n_kv_heads=positive_int(raw, "num_key_value_heads", where, default=heads),
        head_dim=head_dim, ffn_dim=positive_int(raw, "intermediate_size", where),
        vocab_size=positive_int(raw, "vocab_size", where),
        rope_theta=_rope_theta(raw, where),
        norm_eps=positive_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        tie_embeddings=tie, max_seq_len=min(max_pos, window) if window else max_pos,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


def max_seq_len_limit(raw: dict[str, Any]) -> int | None:
    """The sliding window of a config whose layers slide: longer sequences are refused."""
    return _window(raw, positive_int(raw, "num_hidden_layers", CONFIG), CONFIG)


def hf_config_from_args(args: QwenArgs, base: dict[str, Any] | None, dtype: str,
                        token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``args``: ``base`` (the imported model's) with the weights' dtype,
    or a new Qwen3 (q/k norms) or Qwen2 (q/k/v biases) config for a model trained here."""
    if base is not None:
        config = dict(base)
        # transformers 5 writes "dtype", 4 "torch_dtype"; 5 reads both.
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
            config[key] = dtype
        return config
    if args.qk_norm == args.qkv_bias:
        raise ConfigError(
            f"a Qwen model with qk_norm={args.qk_norm} and qkv_bias={args.qkv_bias} has no "
            "Hugging Face architecture", expected="q/k norms (Qwen3) or q/k/v biases (Qwen2), "
            "one of the two", hint="train from a qwen2.5-* or qwen3-* preset to export")
    qwen3 = args.qk_norm
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
        "model_type": "qwen3" if qwen3 else "qwen2",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0, "use_sliding_window": False, "torch_dtype": dtype,
    }
    if qwen3:
        config["attention_bias"] = False
    config.update(token_ids or {})
    return config
