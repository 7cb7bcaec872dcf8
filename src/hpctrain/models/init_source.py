"""Where a model's first weights come from (``model.init_from``), and what comes with them.

    model:
      init_from: hf:/models/Llama-3.2-1B      # a Hugging Face folder: config.json + safetensors
      init_from: /ckpt/llama-3.2-1b           # what `hpctrain import hf` wrote
      init_from: runs/pre/checkpoints/step-00001000   # another run's checkpoint

The shape comes with the weights: from ``config.json`` (`hpctrain.models.hf_config`), from the
``model_args`` an import records in its checkpoint manifest, or from the ``config/config.yaml``
of the run a checkpoint belongs to. So do the original Hugging Face config and the folder
holding the tokenizer files, which export writes back out (`origin`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml

from hpctrain.errors import ConfigError
from hpctrain.models.hf_config import CONFIG, args_from_hf_config, read_hf_config
from hpctrain.models.sizes import ModelArgs, RopeScaling

HF_PREFIX = "hf:"
MANIFEST = "manifest.json"  # the checkpoint manifest (hpctrain.checkpoint.manifest.MANIFEST)
RUN_CONFIG = Path("config") / "config.yaml"  # a run's resolved config, from its root
# The tokenizer (and generation) files of a Hugging Face folder that travel with its weights.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "chat_template.jinja")
_MAX_CHAIN = 8  # init_from of a run whose own init_from ... (a cycle ends here)


@dataclass(frozen=True)
class InitSource:
    """A parsed ``init_from``: a Hugging Face folder or an hpctrain checkpoint directory."""

    kind: Literal["hf", "checkpoint"]
    path: Path

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.path}" if self.kind == "hf" else str(self.path)


@dataclass(frozen=True)
class Origin:
    """A model's shape, and what an export needs of where it came from."""

    args: ModelArgs
    hf_config: dict[str, Any] | None = None  # the imported model's config.json
    assets: Path | None = None  # folder holding its tokenizer files (ASSET_FILES)


def parse_init_from(text: str) -> InitSource:
    """``hf:DIR`` or a checkpoint directory (ConfigError if neither)."""
    if text.startswith(HF_PREFIX):
        path = Path(text[len(HF_PREFIX):]).expanduser()
        if not (path / CONFIG).is_file():
            raise ConfigError(f"model.init_from = {text!r}: {str(path / CONFIG)!r} does not "
                              "exist", expected="a Hugging Face model folder (config.json and "
                              "*.safetensors)")
        return InitSource("hf", path)
    path = Path(text).expanduser()
    if not (path / MANIFEST).is_file():
        raise ConfigError(
            f"model.init_from = {text!r} is neither hf:DIR nor a checkpoint directory",
            expected="hf:<Hugging Face folder>, the --out of `hpctrain import hf`, or a "
            "run's checkpoints/step-NNNNNNNN", hint="a Hugging Face folder needs the hf: prefix")
    return InitSource("checkpoint", path)


def args_to_json(args: ModelArgs) -> dict[str, Any]:
    """`ModelArgs` as plain JSON (what an import records in its manifest)."""
    return dataclasses.asdict(args)


def args_from_json(raw: object, where: str) -> ModelArgs:
    """`ModelArgs` back from `args_to_json`'s output (read as untrusted input)."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelArgs)}
    if not isinstance(raw, dict) or set(raw) - set(fields):
        raise ConfigError(f"{where}: model_args = {raw!r} is not a model shape")
    raw = dict(raw)
    scaling = raw.get("rope_scaling")
    try:
        if scaling is not None:
            raw["rope_scaling"] = RopeScaling(**scaling)
        args = ModelArgs(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: model_args = {raw!r} is not a model shape: {e}") from None
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                 "max_seq_len"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: model_args.{name} = {value!r} is not a positive integer")
    return args


def _manifest(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(path / MANIFEST)!r} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(path / MANIFEST)!r} is not a checkpoint manifest")
    return raw


def run_model_section(run_root: Path) -> dict[str, Any]:
    """The ``model`` section of the resolved config a run saved."""
    path = run_root / RUN_CONFIG
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{str(path)!r} cannot be read: {e}",
                          expected="the config a training run saved in its run directory") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ConfigError(f"{str(path)!r} holds no model section")
    return raw["model"]


def origin_of_model_section(section: dict[str, Any], depth: int = 0) -> Origin:
    """The `Origin` of a config's ``model`` section (a preset, or an init_from chain)."""
    from hpctrain.models.config import ModelConfig  # which imports this module

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
    inner = origin(parse_init_from(mc.init_from), depth + 1)
    return Origin(args, inner.hf_config, inner.assets)


def origin(src: InitSource, depth: int = 0) -> Origin:
    """Shape, Hugging Face config and tokenizer folder of an init_from source."""
    if src.kind == "hf":
        raw = read_hf_config(src.path)
        return Origin(args_from_hf_config(raw, str(src.path / CONFIG)), raw, src.path)
    manifest = _manifest(src.path)
    where = str(src.path / MANIFEST)
    if "model_args" in manifest:  # written by `hpctrain import hf`
        hf = manifest.get("hf_config")
        if hf is not None and not isinstance(hf, dict):
            raise ConfigError(f"{where}: hf_config is not a config")
        return Origin(args_from_json(manifest["model_args"], where), hf, src.path)
    run_root = src.path.parent.parent  # <run>/checkpoints/step-NNNNNNNN
    if not (run_root / RUN_CONFIG).is_file():
        raise ConfigError(f"{str(src.path)!r} records no model shape and is not inside a run "
                          f"directory (no {RUN_CONFIG} two levels up)",
                          hint="name a checkpoint of a run, or the output of `hpctrain import hf`")
    return origin_of_model_section(run_model_section(run_root), depth)


@lru_cache(maxsize=32)
def _cached_args(text: str, stamp: tuple[int, ...]) -> ModelArgs:
    return origin(parse_init_from(text)).args


def init_from_args(text: str) -> ModelArgs:
    """The shape an init_from source implies (cached per source file version)."""
    src = parse_init_from(text)
    probe = src.path / (CONFIG if src.kind == "hf" else MANIFEST)
    st = probe.stat()
    return _cached_args(text, (st.st_mtime_ns, st.st_size))
