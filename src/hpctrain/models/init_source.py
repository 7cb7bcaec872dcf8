"""Where a model's first weights come from (``model.init_from``), and what comes with them.

    model:
      init_from: hf:/models/Llama-3.2-1B      # a Hugging Face folder: config.json + safetensors
      init_from: /ckpt/llama-3.2-1b           # what `hpctrain import hf` wrote
      init_from: runs/pre/checkpoints/step-00001000   # another run's checkpoint

The shape comes with the weights: from ``config.json`` (`hpctrain.models.hf_config`), from the
``model_args`` an import records in its checkpoint manifest, or from the ``config/config.yaml``
of the run a checkpoint belongs to. So do the original Hugging Face config and the folder
holding the tokenizer files, which export writes back out (`Origin`). This module reads
each kind of source; following a run's config (whose own ``init_from`` may name another
source) is ``hpctrain.models.config.origin``'s, so this module needs nothing of the config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from hpctrain.errors import ConfigError
from hpctrain.models.hf_weights import CONFIG, read_hf_config
from hpctrain.models.registry import DEFAULT, family_for_hf, get_family

HF_PREFIX = "hf:"
MANIFEST = "manifest.json"  # the checkpoint manifest (hpctrain.checkpoint.manifest.MANIFEST)
RUN_CONFIG = Path("config") / "config.yaml"  # a run's resolved config, from its root
# The tokenizer (and generation) files of a Hugging Face folder that travel with its weights.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "chat_template.jinja")


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

    args: Any  # the shape, an instance of its family's args_class
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


def args_to_json(args: Any) -> dict[str, Any]:
    """A shape as plain JSON (what an import records in its manifest)."""
    return dataclasses.asdict(args)


def args_from_json(raw: object, where: str, family: object = DEFAULT) -> Any:
    """A shape of ``family`` back from `args_to_json`'s output (read as untrusted input)."""
    if not isinstance(family, str):
        raise ConfigError(f"{where}: model_family = {family!r} is not a family name")
    return get_family(family).args_from_json(raw, where)


def read_checkpoint_manifest(path: Path) -> dict[str, Any]:
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


def hf_origin(path: Path, family: str | None = None) -> Origin:
    """Shape, config and tokenizer folder of a Hugging Face model folder, in ``family`` (None:
    the family its architecture names)."""
    raw = read_hf_config(path)
    where = str(path / CONFIG)
    chosen = family_for_hf(raw, where, family)
    return Origin(chosen.hf.args_from_config(raw, where), raw, path)


def imported_origin(path: Path, manifest: dict[str, Any]) -> Origin | None:
    """The `Origin` an import recorded in its checkpoint manifest (None: not an import)."""
    if "model_args" not in manifest:  # written by `hpctrain import hf`
        return None
    where = str(path / MANIFEST)
    hf = manifest.get("hf_config")
    if hf is not None and not isinstance(hf, dict):
        raise ConfigError(f"{where}: hf_config is not a config")
    args = args_from_json(manifest["model_args"], where, manifest.get("model_family", DEFAULT))
    return Origin(args, hf, path)
