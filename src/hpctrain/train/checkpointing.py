"""What a checkpoint of the Trainer holds, and putting it back.

Tensors (model and optimizer, sharded as they live) go through DCP; everything else is plain
JSON in the manifest: step, tokens seen, LR schedule, data position, loss scaler, and hashes of
the config, so a resume with another model shape is refused instead of silently mis-loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from hpctrain.config import to_dict
from hpctrain.errors import ConfigError

if TYPE_CHECKING:
    from hpctrain.train.trainer import Trainer

log = logging.getLogger("hpctrain.train")

# Optimizer state keyed by parameter name, param-group settings included (``param_groups.<fqn>
# .lr``): no entry depends on how parameters are grouped per rank, so a checkpoint saved by a
# pipeline stage loads into any other layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# Sections that may change between a save and a resume without changing what is trained.
_RUNTIME_SECTIONS = ("run", "metrics", "checkpoint", "preempt", "watchdog", "parallel")


def config_hashes(cfg) -> dict[str, str]:
    """Hashes of the model section and of everything that shapes training."""
    full = to_dict(cfg)

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]

    training = {k: v for k, v in full.items() if k not in _RUNTIME_SECTIONS}
    # Extending a run (more steps) is the common reason to resume; it is not a change.
    training["train"] = {k: v for k, v in training["train"].items() if k != "steps"}
    return {"model_hash": digest(full["model"]), "config_hash": digest(training)}


def tensor_state(trainer: Trainer) -> dict[str, Any]:
    """Model and optimizer state dicts with canonical names (no DDP/compile/AC prefixes)."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def meta_state(trainer: Trainer) -> dict[str, Any]:
    """The JSON part: counters, schedule, data position, scaler, config hashes."""
    loader = trainer.loader.state_dict()
    return {
        "step": trainer.step,
        "tokens_seen": loader["step"] * trainer.layout.global_batch * trainer.cfg.data.seq_len,
        "world_size": trainer.dist.world_size,
        "strategy": trainer.cfg.parallel.strategy,
        "scheduler": trainer.scheduler.state_dict(),
        "loader": loader,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "saved_at": time.time(),
        **config_hashes(trainer.cfg),
    }


def restore(trainer: Trainer, path: Path, manifest: dict[str, Any], *, data: bool) -> None:
    """Load ``path`` into the trainer; ``data=False`` keeps the loader where it is (rollback)."""
    mine = config_hashes(trainer.cfg)
    if manifest.get("model_hash") != mine["model_hash"]:
        raise ConfigError(
            f"checkpoint {path} was saved for another model shape",
            expected="the same model section as the run that saved it",
            hint="resume with the original config, or start a new run (run.name=...)",
        )
    if manifest.get("config_hash") != mine["config_hash"]:
        log.warning("resuming %s with a changed training config (data/train/optim sections)",
                    path.name)
    start = time.perf_counter()
    state = tensor_state(trainer)
    with trainer.watchdog.paused("checkpoint load"):
        trainer.ckpt.load(path, state)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"],
                   options=_OPTIONS)
    trainer.metrics.write({"event": "checkpoint_load", "checkpoint": path.name,
                           "step": int(manifest["step"]),
                           "load_s": time.perf_counter() - start})
    trainer.scheduler.load_state_dict(manifest["scheduler"])
    if trainer.scaler is not None and manifest.get("scaler"):
        trainer.scaler.load_state_dict(manifest["scaler"])
    if data:
        trainer.loader.load_state_dict(manifest["loader"])
    trainer.step = int(manifest["step"])
    log.info("resumed from %s: step %d, %s tokens seen (saved with %s on %d ranks)", path.name,
             trainer.step, f"{manifest['tokens_seen']:,}", manifest["strategy"],
             manifest["world_size"])
