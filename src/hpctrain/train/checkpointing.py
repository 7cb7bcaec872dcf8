"""What a checkpoint of a training run holds, checking it, and putting it back.

Tensors (model and optimizer, sharded as they live) go through DCP; everything else is plain
JSON in the manifest: step, tokens seen, LR schedule, data position, loss scaler, and hashes of
the config, so a resume with another model shape is refused instead of silently mis-loaded.

The loop's side (train/run_checkpoints.py) hands a :class:`TrainState` (the objects a checkpoint
fills) and calls these functions; nothing here knows the Trainer. A manifest is untrusted input:
``check_meta`` refuses values of the wrong type or that contradict each other as a damaged
checkpoint, which resume falls back past.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import MANIFEST, DamagedCheckpoint, is_int
from hpctrain.config import JobConfig, to_dict
from hpctrain.errors import ConfigError

log = logging.getLogger("hpctrain.train")

# Optimizer state keyed by parameter name, param-group settings included (``param_groups.<fqn>
# .lr``): no entry depends on how parameters are grouped per rank, so a checkpoint saved by a
# pipeline stage loads into any other layout. The manifest names the layout; one without the
# field was written by hpctrain 0.1.0 (PyTorch's default: ``param_groups`` as one list), which
# is still read so that a run checkpointed before an upgrade continues.
OPTIM_LAYOUT = "by_param"
_OPTIONS = {OPTIM_LAYOUT: StateDictOptions(flatten_optimizer_state_dict=True),
            None: StateDictOptions()}

# Sections that may change between a save and a resume without changing what is trained.
_RUNTIME_SECTIONS = ("run", "metrics", "checkpoint", "preempt", "watchdog", "parallel")


class DataPosition(Protocol):
    """Where the data stream stands (the token loader)."""

    def state_dict(self) -> dict[str, int]:
        """The position, as JSON."""
        ...

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        ...


@dataclass
class TrainState:
    """The objects a checkpoint saves and fills."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataPosition
    scaler: torch.amp.GradScaler | None
    # What one sample counts as in tokens_seen; None: data.seq_len (the token loader's window).
    tokens_per_sample: int | None = None
    # A user's own model (hpctrain.task): its parameters' shapes, which the config's model
    # section does not describe; None: the built-in model, described by that section.
    model_signature: dict[str, list[int]] | None = None


def model_signature(model: torch.nn.Module) -> dict[str, list[int]]:
    """Every parameter's name and shape: what a checkpoint of a user's model must match."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def config_hashes(cfg: JobConfig, signature: dict[str, list[int]] | None = None
                  ) -> dict[str, str]:
    """Hashes of the model (its config section, or a user model's ``signature``) and of
    everything that shapes training."""
    full = to_dict(cfg)

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]

    training = {k: v for k, v in full.items() if k not in _RUNTIME_SECTIONS}
    if training.get("task") is None:  # the built-in model: hashes as before the key existed
        training.pop("task", None)
    # Extending a run (more steps) is the common reason to resume; it is not a change.
    training["train"] = {k: v for k, v in training["train"].items() if k != "steps"}
    model = full["model"] if signature is None else signature
    return {"model_hash": digest(model), "config_hash": digest(training)}


def tensor_state(s: TrainState, layout: str | None = OPTIM_LAYOUT) -> dict[str, Any]:
    """Model and optimizer state dicts with canonical names (no DDP/compile/AC prefixes), the
    optimizer's in ``layout`` (see ``OPTIM_LAYOUT``)."""
    model_sd, optim_sd = get_state_dict(s.model, s.optimizer, options=_OPTIONS[layout])
    return {"model": model_sd, "optim": optim_sd}


def meta_state(s: TrainState, cfg: JobConfig, *, step: int, world_size: int) -> dict[str, Any]:
    """The JSON part: counters, schedule, data position, scaler, config hashes."""
    loader = s.loader.state_dict()
    return {
        "step": step,
        "tokens_seen": loader["step"] * loader["global_batch"]
        * (s.tokens_per_sample or cfg.data.seq_len),
        "world_size": world_size,
        "strategy": cfg.parallel.strategy,
        "scheduler": s.scheduler.state_dict(),
        "loader": loader,
        "scaler": s.scaler.state_dict() if s.scaler is not None else None,
        "saved_at": time.time(),
        "optim_layout": OPTIM_LAYOUT,
        **config_hashes(cfg, s.model_signature),
    }


def _numbers(value: object, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in value))


def check_meta(s: TrainState, path: Path, manifest: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse a manifest whose values are malformed or inconsistent (DamagedCheckpoint), or
    that was saved for another model shape (ConfigError: the checkpoint is fine, the config
    is not)."""
    where = path / MANIFEST
    step = manifest["step"]  # an integer matching the folder name: read_manifest checked it

    def damaged(what: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{where}: {what}")

    for key, ok, expected in (
        ("world_size", is_int(manifest.get("world_size"), 1), "a rank count"),
        ("tokens_seen", is_int(manifest.get("tokens_seen")), "a token count"),
        ("strategy", isinstance(manifest.get("strategy"), str), "a strategy name"),
        ("model_hash", isinstance(manifest.get("model_hash"), str), "a hash"),
        ("config_hash", isinstance(manifest.get("config_hash"), str), "a hash"),
        ("scaler", isinstance(manifest.get("scaler"), dict | None), "the loss scaler's state"),
    ):
        if not ok:
            raise damaged(f"{key} = {manifest.get(key)!r} is not {expected}")
    if manifest.get("optim_layout") not in _OPTIONS:
        raise damaged(f"optim_layout = {manifest.get('optim_layout')!r} is not one this version "
                      f"reads ({OPTIM_LAYOUT!r}, or none for hpctrain 0.1.0)")
    scheduler = manifest.get("scheduler")
    groups = len(s.optimizer.param_groups)
    if not (isinstance(scheduler, dict) and is_int(scheduler.get("last_epoch"))
            and all(_numbers(scheduler[k], groups) for k in ("base_lrs", "_last_lr")
                    if k in scheduler)):
        raise damaged(f"scheduler = {scheduler!r} is not the state of this run's LR schedule")
    # The schedule steps once per optimizer step, and a rollback restores both together.
    if scheduler["last_epoch"] != step:
        raise damaged(f"the LR schedule is at step {scheduler['last_epoch']}, the checkpoint "
                      f"at step {step}")
    loader = manifest.get("loader")
    if not (isinstance(loader, dict) and all(
            is_int(loader.get(k)) for k in ("step", "global_batch", "seed"))):
        raise damaged(f"loader = {loader!r} is not a data position")
    # Each step consumes one batch; a rollback skips batches, so the data may be ahead, but
    # never behind.
    if loader["step"] < step:
        raise damaged(f"the data position ({loader['step']} batches) is behind step {step}")
    scaler = manifest["scaler"]
    if s.scaler is not None and scaler and not all(
            isinstance(scaler.get(k), Real) for k in s.scaler.state_dict()):
        raise damaged(f"scaler = {scaler!r} is not a loss scaler's state")
    if manifest["model_hash"] != config_hashes(cfg, s.model_signature)["model_hash"]:
        own = s.model_signature is not None
        raise ConfigError(
            f"checkpoint {path} was saved for another model shape",
            expected="the same parameter names and shapes as the model that saved it" if own
            else "the same model section as the run that saved it",
            hint="resume with the original " + ("model" if own else "config")
            + ", or start a new run (run.name=..., or --fresh)",
        )


def restore(s: TrainState, ckpt: CheckpointManager, path: Path, manifest: dict[str, Any],
            cfg: JobConfig, *, data: bool) -> int:
    """Load ``path`` into ``s``; returns its step. ``data=False`` keeps the loader where it is
    (a rollback skips the batches since the checkpoint)."""
    check_meta(s, path, manifest, cfg)
    if manifest["config_hash"] != config_hashes(cfg, s.model_signature)["config_hash"]:
        log.warning("resuming %s with a changed training config (data/train/optim sections)",
                    path.name)
    layout = manifest.get("optim_layout")
    state = tensor_state(s, layout)
    ckpt.load(path, state)
    set_state_dict(s.model, s.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTIONS[layout])
    # Only the keys this schedule has: ``load_state_dict`` sets whatever it is given as an
    # attribute of the scheduler.
    known = s.scheduler.state_dict()
    s.scheduler.load_state_dict({k: v for k, v in manifest["scheduler"].items() if k in known})
    if s.scaler is not None and manifest["scaler"]:
        s.scaler.load_state_dict(manifest["scaler"])
    if data:
        s.loader.load_state_dict(manifest["loader"])
    return manifest["step"]
