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
from hpctrain.data.tokenizer import TOKENIZER_JSON, ByteTokenizer, HFTokenizer
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


def model_tokenizer(source: ModelSource, override: str | None = None) -> ModelTokenizer:
    """The tokenizer of ``source`` (or the tokenizer.json / model folder ``override``)."""
    gen_config: Path | None = None
    if override is not None:
        path = override.removeprefix(HF_PREFIX)
        tok, where = HFTokenizer(path), path
    elif source.origin.assets is not None and (source.origin.assets / TOKENIZER_JSON).is_file():
        where = str(source.origin.assets)
        tok = HFTokenizer(where)
        gen_config = source.origin.assets / "generation_config.json"
    else:
        recorded = data_tokenizer(source.run) if source.run is not None else None
        if recorded is None:
            raise ConfigError(f"{source.label} knows no tokenizer (no tokenizer.json with its "
                              "weights, no prepared data in its run)",
                              hint="name one with --tokenizer PATH")
        if recorded.get("kind") == "bytes":
            return ModelTokenizer(ByteTokenizer(), None, {ByteTokenizer.eos_id})
        where = str(recorded.get("path"))
        tok = HFTokenizer(where, recorded.get("eos_token"))
    stop = {tok.eos_id}
    if gen_config is not None and gen_config.is_file():
        try:
            eos = json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        stop |= {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    return ModelTokenizer(tok, load_template(tok, where), stop)
