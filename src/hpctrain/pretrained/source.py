"""The model a command names: ``RUN`` (a run directory), a checkpoint directory, or ``hf:DIR``.

    hpctrain generate runs/finetune                     # the run's latest checkpoint
    hpctrain generate runs/finetune --step 200          # its checkpoints/step-00000200
    hpctrain generate ckpt/llama-3.2-1b                 # `hpctrain import hf` output
    hpctrain generate hf:/models/Llama-3.2-1B

A run's model is the one its saved config describes (``config/config.yaml``); a checkpoint of
a run is resolved the same way, an imported one carries its shape. With the weights come the
tokenizer the model knows: the Hugging Face folder's (directly or through an import, and for a
run through its ``model.init_from``), else the one its training data was prepared with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpctrain.checkpoint.manifest import step_dir_name, step_of
from hpctrain.data.chat import ChatTemplate, load_template
from hpctrain.data.tokenizer import TOKENIZER_JSON, ByteTokenizer, HFTokenizer, NoEosToken
from hpctrain.errors import ConfigError
from hpctrain.models.config import origin, origin_of_model_section
from hpctrain.models.init_source import (
    HF_PREFIX,
    MANIFEST,
    RUN_CONFIG,
    InitSource,
    Origin,
    parse_init_from,
    run_model_section,
)

LATEST = "latest"  # a run's pointer to its newest committed checkpoint


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are, what the model is, and the run it belongs to (if any)."""

    weights: InitSource
    origin: Origin
    run: Path | None = None

    @property
    def label(self) -> str:
        """How messages name it."""
        return str(self.weights)


def resolve_source(text: str, step: int | None = None) -> ModelSource:
    """The model ``text`` names (``--step`` picks a run's checkpoint)."""
    if text.startswith(HF_PREFIX):
        if step is not None:
            raise ConfigError("--step applies to a run, not to a Hugging Face folder")
        src = parse_init_from(text)
        return ModelSource(src, origin(src))
    path = Path(text).expanduser()
    if (path / RUN_CONFIG).is_file():
        ckpt = _run_checkpoint(path, step)
        return ModelSource(InitSource("checkpoint", ckpt),
                           origin_of_model_section(run_model_section(path)), path)
    if (path / MANIFEST).is_file():
        if step is not None:
            raise ConfigError("--step applies to a run directory, not to one checkpoint",
                              hint=f"name the run ({path.parent.parent}) with --step, or the "
                              "checkpoint alone")
        src = InitSource("checkpoint", path)
        run = path.parent.parent if (path.parent.parent / RUN_CONFIG).is_file() else None
        return ModelSource(src, origin(src), run)
    raise ConfigError(f"{text!r} is not a run directory, a checkpoint or hf:DIR",
                      expected=f"a run directory (holding {RUN_CONFIG}), a checkpoint directory "
                      f"(holding {MANIFEST}) or hf:<Hugging Face folder>",
                      hint="a Hugging Face folder needs the hf: prefix")


def _run_checkpoint(run: Path, step: int | None) -> Path:
    """``checkpoints/step-N`` of ``run``: the one asked for, else the one ``latest`` names."""
    root = run / "checkpoints"
    if step is not None:
        path = root / step_dir_name(step)
        if not (path / MANIFEST).is_file():
            have = sorted(p.name for p in root.glob("step-*") if step_of(p.name) is not None)
            raise ConfigError(f"{run} has no committed checkpoint at step {step}",
                              expected=f"one of: {', '.join(have) or '(none)'}")
        return path
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if step_of(name) is None or not (root / name / MANIFEST).is_file():
        raise ConfigError(f"{run} has no committed checkpoint ({root / LATEST} names none)",
                          hint="train it until a checkpoint is saved (checkpoint.save_at_end)")
    return root / name


def run_data_section(run: Path) -> dict[str, Any]:
    """The ``data`` section of the config a run saved."""
    raw = yaml.safe_load((run / RUN_CONFIG).read_text(encoding="utf-8"))
    data = raw.get("data") if isinstance(raw, dict) else None
    return data if isinstance(data, dict) else {}


def data_tokenizer(run: Path) -> dict[str, Any] | None:
    """The tokenizer a run's prepared data records in its manifest (``kind``, ``path``,
    ``eos_token``, ``hash``), if its data came from shards."""
    data = run_data_section(run)
    paths = [data.get("path")] if data.get("source") == "shards" else [
        m.get("path") for m in data.get("mix") or [] if isinstance(m, dict)]
    for p in paths:
        if not isinstance(p, str):
            continue
        try:
            raw = json.loads((Path(p) / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        tok = raw.get("tokenizer") if isinstance(raw, dict) else None
        if isinstance(tok, dict):
            return tok
    return None


@dataclass
class ModelTokenizer:
    """The tokenizer a model knows, its chat template and the ids that end a reply."""

    tokenizer: HFTokenizer | ByteTokenizer
    template: ChatTemplate | None
    stop_ids: set[int]


def model_tokenizer(source: ModelSource, override: str | None = None,
                    eos_token: str | None = None) -> ModelTokenizer:
    """The tokenizer of ``source`` (or the tokenizer.json / model folder ``override``); its
    EOS is ``eos_token``, else the tokenizer's own, else the model's ``eos_token_id``."""
    gen_config: Path | None = None
    if override is None and source.origin.assets is not None \
            and (source.origin.assets / TOKENIZER_JSON).is_file():
        gen_config = source.origin.assets / "generation_config.json"
    model_eos = model_eos_ids(gen_config, source.origin.hf_config)
    first = model_eos[0] if model_eos else None
    try:
        if override is not None:
            path = override.removeprefix(HF_PREFIX)
            tok, where = HFTokenizer(path, eos_token, first), path
        elif gen_config is not None:
            where = str(source.origin.assets)
            tok = HFTokenizer(where, eos_token, first)
        else:
            recorded = data_tokenizer(source.run) if source.run is not None else None
            if recorded is None:
                raise ConfigError(f"{source.label} knows no tokenizer (no tokenizer.json with "
                                  "its weights, no prepared data in its run)",
                                  hint="name one with --tokenizer PATH")
            if recorded.get("kind") == "bytes":
                return ModelTokenizer(ByteTokenizer(), None, {ByteTokenizer.eos_id})
            where = str(recorded.get("path"))
            tok = HFTokenizer(where, eos_token or recorded.get("eos_token"), first)
    except NoEosToken as e:
        raise NoEosToken(e.what, hint="the model names no eos_token_id (generation_config.json "
                         "or config.json) that the tokenizer has; pass --eos-token TOKEN, "
                         "or --tokenizer PATH with one that names its EOS") from None
    return ModelTokenizer(tok, load_template(tok, where), {tok.eos_id, *model_eos})


def model_eos_ids(gen_config: Path | None, hf_config: dict[str, Any] | None) -> list[int]:
    """The model's own ``eos_token_id`` (an int or a list): its generation_config.json's, else
    its config.json's; [] when neither names one."""
    for raw in (_json_object(gen_config), hf_config or {}):
        eos = raw.get("eos_token_id")
        ids = [i for i in (eos if isinstance(eos, list) else [eos])
               if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31]
        if ids:
            return ids
    return []


def _json_object(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
