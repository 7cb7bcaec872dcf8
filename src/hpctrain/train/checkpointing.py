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
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import MANIFEST, DamagedCheckpoint
from hpctrain.config import JobConfig, to_dict
from hpctrain.errors import ConfigError
from hpctrain.records import MAX_COUNT, BadRecord, Bool, Int, List, Real, Record, Str
from hpctrain.shown import quoted

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
    train = {k: v for k, v in training["train"].items() if k != "steps"}
    if train["global_batch_tokens"] is None:
        del train["global_batch_tokens"]  # hashes as before the key existed
    else:  # the batch is fixed in tokens: how it is split (plan/auto.py per GPU count) is not
        del train["micro_batch"], train["grad_accum"]
    training["train"] = train
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


# The trainer's part of a manifest (read_manifest has checked step, files and format).
# Learning rates and loss scales are finite and non-negative; counts fit MAX_COUNT.
_LRS = List(Real(0.0), max_len=10_000, optional=True)
_META = Record({
    "world_size": Int(1, 1 << 24),
    "tokens_seen": Int(),
    "strategy": Str(64),
    "model_hash": Str(64),
    "config_hash": Str(64),
    "optim_layout": Str(choices=(OPTIM_LAYOUT,), optional=True, nullable=True),
    "saved_at": Real(0.0, optional=True),
    "scheduler": Record({"last_epoch": Int(), "base_lrs": _LRS, "_last_lr": _LRS,
                         "_step_count": Int(optional=True), "_is_initial": Bool(optional=True),
                         "_get_lr_called_within_step": Bool(optional=True),
                         "lr_lambdas": List(Record({}, nullable=True), max_len=10_000,
                                            optional=True)}),
    "loader": Record({"step": Int(), "global_batch": Int(1), "seed": Int(0, 2**64 - 1),
                      "shuffle_window": Int(1, optional=True)}),
    # Empty for a disabled scaler; which keys this run needs is checked below.
    "scaler": Record({"scale": Real(0.0, optional=True),
                      "growth_factor": Real(0.0, optional=True),
                      "backoff_factor": Real(0.0, optional=True),
                      "growth_interval": Int(1, optional=True),
                      "_growth_tracker": Int(optional=True)}, nullable=True),
})


def check_meta(s: TrainState, path: Path, manifest: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse a manifest whose values are malformed, out of range or inconsistent
    (DamagedCheckpoint), or that was saved for another model shape (ConfigError: the
    checkpoint is fine, the config is not)."""
    where = path / MANIFEST
    step = manifest["step"]  # an integer matching the folder name: read_manifest checked it

    def damaged(what: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{where}: {what}")

    try:
        _META.check(manifest, where)
    except BadRecord as e:
        raise DamagedCheckpoint(e.what, expected=e.expected) from None
    scheduler = manifest["scheduler"]
    groups = len(s.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):
        if key in scheduler and len(scheduler[key]) != groups:
            raise damaged(f"scheduler.{key} holds {len(scheduler[key])} learning rates, this "
                          f"run's optimizer has {groups} parameter groups")
    # LambdaLR puts each saved lr_lambda's dict into the attributes of the live one: only
    # what this run's schedule itself saves (None for plain functions) is accepted.
    mine = s.scheduler.state_dict().get("lr_lambdas")
    if "lr_lambdas" in scheduler and scheduler["lr_lambdas"] != mine:
        raise damaged(f"scheduler.lr_lambdas = {quoted(scheduler['lr_lambdas'])} is not what "
                      f"this run's LR schedule saves ({quoted(mine)})")
    # The schedule steps once per optimizer step, and a rollback restores both together.
    if scheduler["last_epoch"] != step:
        raise damaged(f"the LR schedule is at step {scheduler['last_epoch']}, the checkpoint "
                      f"at step {step}")
    loader = manifest["loader"]
    # Each step consumes one batch; a rollback skips batches, so the data may be ahead, but
    # never behind.
    if loader["step"] < step:
        raise damaged(f"the data position ({loader['step']} batches) is behind step {step}")
    # tokens_seen is written as batches x global batch x sequence length: a data position
    # that does not divide it was not written by a save.
    batches, tokens = loader["step"] * loader["global_batch"], manifest["tokens_seen"]
    if batches > MAX_COUNT or (tokens % batches if batches else tokens):
        raise damaged(f"the data position ({loader['step']} batches of "
                      f"{loader['global_batch']}) does not match tokens_seen = {tokens}")
    scaler = manifest["scaler"]
    if s.scaler is not None and scaler and not all(k in scaler for k in s.scaler.state_dict()):
        raise damaged(f"scaler = {quoted(scaler)} is not a loss scaler's state")
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
