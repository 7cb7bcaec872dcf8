"""The `model:` section of a run config: a model family, a preset name plus optional per-field
overrides; and what a section resolves to (`origin`, following ``init_from`` chains).

Example YAML::

    model:
      family: llama      # the default; a registered family (hpctrain.models.registry)
      size: tiny         # one of the family's presets
      n_layers: 2        # override one field of the preset

or pretrained weights, whose shape and family come with them (`hpctrain.models.init_source`)::

    model:
      init_from: hf:/models/Llama-3.2-1B
      max_seq_len: 4096  # the one field that may be set: the RoPE table's length

``family`` beside ``init_from`` asks for a family the weights may be read as (a Qwen2 folder
is a llama unless ``family: qwen``); weights of another family are refused, not converted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from hpctrain.errors import ConfigError
from hpctrain.models.init_source import (
    CONFIG,
    MANIFEST,
    RUN_CONFIG,
    InitSource,
    Origin,
    hf_origin,
    imported_origin,
    parse_init_from,
    read_checkpoint_manifest,
    run_model_section,
)
from hpctrain.models.registry import DEFAULT, families, family_of_args, get_family

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
_NOT_SHAPE = ("family", "size", "init_from", "attention_backend")
_MAX_CHAIN = 8  # init_from of a run whose own init_from ... (a cycle ends here)


@dataclass
class ModelConfig:
    """User-facing model choice: `family` and its preset `size`, any non-None field overrides it."""

    # None: the default family (llama), or with init_from the one the weights name.
    family: str | None = None
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
        """Return the preset's fields with this config's overrides applied (size must be valid;
        a field the family's shape lacks is refused by name)."""
        family = get_family(self.family or DEFAULT)
        preset = family.presets[self.size]
        merged = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _NOT_SHAPE or value is None:
                continue
            if field.name not in merged:
                raise ConfigError(
                    f"model.{field.name}={value!r} is not a field of the {family.name!r} "
                    "family's shape", expected=f"overrides of {', '.join(merged)}",
                    hint=f"remove model.{field.name}")
            # YAML reads `rope_theta: 10000` as an int; keep the shape's float fields float.
            merged[field.name] = (float(value) if isinstance(merged[field.name], float)
                                  and not isinstance(value, bool) else value)
        return merged

    def validate(self) -> None:
        """Raise `ConfigError` if the size is unknown or the resolved shape is inconsistent;
        settle ``family`` (None: the default's, or the one the weights are read as), so the
        config a run saves names the family it trained."""
        if self.init_from:
            self._validate_pretrained()
            return
        family = get_family(self.family or DEFAULT)
        self.family = family.name
        if self.size not in family.presets:
            others = [name for name, f in families().items() if self.size in f.presets]
            raise ConfigError(
                f"model.size={self.size!r} is not a known model size",
                expected=f"one of {', '.join(family.presets)} ({family.name})",
                hint=f"model.family={others[0]} has it" if others else
                "pick a preset and override single fields (e.g. model.n_layers) if needed",
            )
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(
                    f"model.{name}={value!r} must be positive",
                    expected="a number > 0",
                    hint=f"remove model.{name} to use the {self.size!r} preset's value",
                )
        family.check_args(family.args_class(**self._merged()))

    def _validate_pretrained(self) -> None:
        """Shape fields come with pretrained weights: setting one is refused by name."""
        fixed = [f.name for f in dataclasses.fields(self)
                 if f.name not in (*_NOT_SHAPE, "max_seq_len")
                 and getattr(self, f.name) is not None]
        if fixed:
            raise ConfigError(
                f"model.{fixed[0]} is set together with model.init_from = {self.init_from!r}",
                expected="the shape of the pretrained model (only model.max_seq_len may be set)",
                hint=f"remove model.{fixed[0]}: the weights fix it")
        args = init_from_args(self.init_from, self.family)
        if self.max_seq_len is not None:
            if not self.max_seq_len > 0:
                raise ConfigError(f"model.max_seq_len={self.max_seq_len!r} must be positive")
            found = origin(parse_init_from(self.init_from), family=self.family)
            limit = family_of_args(found.args).hf
            window = (limit.max_seq_len_limit(found.hf_config)
                      if found.hf_config is not None and limit is not None else None)
            if window is not None and self.max_seq_len > window:
                raise ConfigError(
                    f"model.max_seq_len={self.max_seq_len} exceeds the sliding attention "
                    f"window ({window}) of {self.init_from!r}",
                    expected=f"at most {window}: up to the window, sliding attention is the "
                    "full causal attention hpctrain computes",
                    hint=f"set model.max_seq_len <= {window}")
        family = family_of_args(args)
        family.check_args(args)
        self.family = family.name

    def resolve(self) -> Any:
        """Validate and return the concrete shape (an instance of the family's ``args_class``):
        the preset with overrides applied, or the pretrained model's shape."""
        self.validate()
        if self.init_from:
            args = init_from_args(self.init_from, self.family)
            if self.max_seq_len is not None:
                args = dataclasses.replace(args, max_seq_len=self.max_seq_len)
            return args
        return get_family(self.family or DEFAULT).args_class(**self._merged())


def origin_of_model_section(section: dict[str, Any], depth: int = 0) -> Origin:
    """The `Origin` of a config's ``model`` section (a preset, or an init_from chain)."""
    if depth > _MAX_CHAIN:
        raise ConfigError("model.init_from leads through more than "
                          f"{_MAX_CHAIN} runs (a cycle?)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(section) - known:
        raise ConfigError(f"model section {section!r} has unknown keys "
                          f"{sorted(set(section) - known)}")
    mc = ModelConfig(**section)
    args = mc.resolve()
    if not mc.init_from:
        return Origin(args)
    inner = origin(parse_init_from(mc.init_from), depth + 1, mc.family)
    return Origin(args, inner.hf_config, inner.assets)


def origin(src: InitSource, depth: int = 0, family: str | None = None) -> Origin:
    """Shape, Hugging Face config and tokenizer folder of an init_from source, whose model must
    be of ``family`` if one is named (a Hugging Face folder is read as one if it can be)."""
    if src.kind == "hf":
        return hf_origin(src.path, family)
    found = imported_origin(src.path, read_checkpoint_manifest(src.path))
    if found is None:
        run_root = src.path.parent.parent  # <run>/checkpoints/step-NNNNNNNN
        if not (run_root / RUN_CONFIG).is_file():
            raise ConfigError(f"{str(src.path)!r} records no model shape and is not inside a "
                              f"run directory (no {RUN_CONFIG} two levels up)",
                              hint="name a checkpoint of a run, or the output of "
                              "`hpctrain import hf`")
        found = origin_of_model_section(run_model_section(run_root), depth)
    held = family_of_args(found.args).name
    if family is not None and held != family:
        raise ConfigError(
            f"model.family = {family!r}, but model.init_from = {str(src)!r} holds a {held!r} "
            "model", expected=f"the family the checkpoint was trained or imported as ({held!r})",
            hint=f"set model.family to {held!r} or leave it out (a checkpoint names its own); "
            f"a Hugging Face folder imported with `hpctrain import hf --family {family}` is "
            f"read as {family!r}")
    return found


@lru_cache(maxsize=32)
def _cached_args(text: str, family: str | None, stamp: tuple[int, ...]) -> Any:
    return origin(parse_init_from(text), family=family).args


def init_from_args(text: str, family: str | None = None) -> Any:
    """The shape an init_from source implies, as a model of ``family`` if one is named (cached
    per source file version)."""
    src = parse_init_from(text)
    probe: Path = src.path / (CONFIG if src.kind == "hf" else MANIFEST)
    st = probe.stat()
    return _cached_args(text, family, (st.st_mtime_ns, st.st_size))
