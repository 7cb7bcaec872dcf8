"""A Hugging Face ``config.json`` as a `ModelArgs`, and back: what can be imported, and how.

Supported: ``LlamaForCausalLM`` (Llama 2 and 3, incl. Llama 3.1's RoPE scaling),
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (biases on q/k/v), tied or untied embeddings,
grouped-query attention.
Every key of the config is accounted for: it sets the shape, is checked against the one value
hpctrain computes (``hidden_act: silu``, ``attention_bias: false``, ...), or is metadata that
does not change what the weights compute (``bos_token_id``, ``initializer_range``, ...). Any
other key, architecture or value is refused by name, so a model is never imported into a
network that computes something else.

A sliding attention window (Mistral v0.1, Qwen2 with ``use_sliding_window``) equals full causal
attention on sequences no longer than the window: ``max_seq_len`` is capped at the window.

    args = args_from_hf_config(read_hf_config(Path("Llama-3.2-1B")))  # hf_weights.read_hf_config
"""

from __future__ import annotations

from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.models.hf_values import positive_int, positive_number
from hpctrain.models.hf_weights import CONFIG
from hpctrain.models.llama.sizes import ModelArgs, RopeScaling

# architecture -> model_type
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}
# Keys that do not change what the weights compute: token ids (the tokenizer's business), the
# stored dtype (weights are cast on import), initialisation and generation settings, bookkeeping.
# Llama 2's pretraining_tp only split matmuls into slices to mimic Meta's tensor parallelism.
METADATA_KEYS = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
    "torch_dtype", "transformers_version", "_name_or_path", "initializer_range", "use_cache",
    "pretraining_tp", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "max_length", "do_sample", "temperature", "top_p", "top_k",
    "_attn_implementation_autoset",
})
# Keys read into the shape or checked for the one value hpctrain supports.
SHAPE_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "head_dim",
    "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "use_mrope",
    "partial_rotary_factor",
})
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "partial_rotary_factor"}
_HINT = ("hpctrain imports Llama 2/3, Mistral and Qwen2 decoders as their Hugging Face configs "
         "describe them; convert the model with its own tools, or train it with them")


def _refuse(where: str, key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {key} = {value!r} is not supported", expected=expected,
                       hint=_HINT)


def _rope(raw: dict, where: str, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4, most configs on the Hub)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _refuse(where, "rope_parameters", params, "a mapping")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise _refuse(where, f"rope_parameters.{unknown[0]}", params[unknown[0]],
                      "only rope_type default or llama3 with its four parameters")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    theta = positive_number(theta, "rope_theta", where)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse(where, "partial_rotary_factor", partial, "1.0 (RoPE on every channel)")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _refuse(where, "rope_type", kind, "'default' or 'llama3'")
    try:
        scaling = RopeScaling(
            factor=positive_number(params["factor"], "factor", where),
            low_freq_factor=positive_number(params["low_freq_factor"], "low_freq_factor", where),
            high_freq_factor=positive_number(params["high_freq_factor"], "high_freq_factor", where),
            original_max_seq_len=int(positive_number(
                params.get("original_max_position_embeddings", max_pos),
                "original_max_position_embeddings", where)))
    except KeyError as e:
        raise ConfigError(f"{where}: the llama3 RoPE scaling lacks {e.args[0]}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise _refuse(where, "rope_parameters", params,
                      "high_freq_factor > low_freq_factor")
    return theta, scaling


def _window(raw: dict, model_type: str, where: str) -> int | None:
    """The sliding attention window that applies, if any."""
    if raw.get("use_mrope"):
        raise _refuse(where, "use_mrope", raw["use_mrope"], "false (text-only RoPE)")
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or not set(
            layer_types) <= {"full_attention", "sliding_attention"}):
        raise _refuse(where, "layer_types", layer_types,
                      "a list of 'full_attention' / 'sliding_attention'")
    if model_type == "qwen2":
        uses = bool(raw.get("use_sliding_window")) or "sliding_attention" in (layer_types or [])
    else:
        uses = window is not None
    if not uses:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse(where, "sliding_window", window, "a positive window length")
    return window


def args_from_hf_config(raw: dict[str, Any], where: str = CONFIG) -> ModelArgs:
    """The `ModelArgs` of a supported Hugging Face config; ConfigError naming what is not."""
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    model_type = raw.get("model_type")
    if arch not in ARCHITECTURES or ARCHITECTURES[arch] != model_type:
        raise ConfigError(
            f"{where}: architecture {arch!r} (model_type {model_type!r}) is not supported",
            expected=", ".join(f"{a} (model_type {t!r})" for a, t in ARCHITECTURES.items()),
            hint=_HINT)
    unknown = sorted(k for k in raw if k not in SHAPE_KEYS | METADATA_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
            f"supported by hpctrain's {arch} import",
            expected=f"only the keys {arch} has in transformers, with the values hpctrain "
            "computes", hint=_HINT)
    for key, value, allowed in (("hidden_act", raw.get("hidden_act", "silu"), ("silu", "swish")),
                                ("attention_bias", raw.get("attention_bias", False), (False,)),
                                ("mlp_bias", raw.get("mlp_bias", False), (False,)),
                                ("attention_dropout", raw.get("attention_dropout", 0.0), (0,))):
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise _refuse(where, key, value, " or ".join(repr(a) for a in allowed))
    dim = positive_int(raw, "hidden_size", where)
    heads = positive_int(raw, "num_attention_heads", where)
    kv_heads = positive_int(raw, "num_key_value_heads", where, default=heads)
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        raise _refuse(where, "head_dim", head_dim,
                      f"hidden_size / num_attention_heads = {dim // heads}")
    max_pos = positive_int(raw, "max_position_embeddings", where, default=2048)
    theta, scaling = _rope(raw, where, max_pos)
    window = _window(raw, model_type, where)
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _refuse(where, "tie_word_embeddings", tie, "true or false")
    return ModelArgs(
        dim=dim, n_layers=positive_int(raw, "num_hidden_layers", where), n_heads=heads,
        n_kv_heads=kv_heads, ffn_dim=positive_int(raw, "intermediate_size", where),
        vocab_size=positive_int(raw, "vocab_size", where), rope_theta=theta,
        norm_eps=positive_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        tie_embeddings=tie, max_seq_len=min(max_pos, window) if window else max_pos,
        qkv_bias=model_type == "qwen2", rope_scaling=scaling)


def max_seq_len_limit(raw: dict[str, Any]) -> int | None:
    """The sliding window of a config that has one in use: longer sequences are refused."""
    return _window(raw, raw.get("model_type"), CONFIG)


def hf_config_from_args(args: ModelArgs, base: dict[str, Any] | None, dtype: str,
                        token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for `args`: ``base`` (the imported model's) with the weights' dtype, or
    a new ``LlamaForCausalLM`` config for a model hpctrain trained from scratch."""
    if base is not None:
        config = dict(base)
        # transformers 5 writes "dtype", 4 "torch_dtype"; 5 reads both.
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
        for key in keys:
            config[key] = dtype
        return config
    if args.qkv_bias:
        raise ConfigError("a model with q/k/v biases that was not imported cannot be exported",
                          hint="only imported Qwen2 models have them")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "torch_dtype": dtype,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len}
    config.update(token_ids or {})
    return config
