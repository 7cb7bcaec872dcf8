"""What refuses a run before its first step, checked before anything is written.

A run refused here leaves its run directory as it found it: the records of the run that lives
there (``exit_info.json``, ``goodput.json``, its config, logs and metrics) still describe that
run, and ``hpctrain runs`` still shows it as it ended. ``job.claim_run_dir`` calls these in
order: the checks that need only the config (before ``--fresh`` archives anything), then, under
the run's lock, the checks against what the directory holds.

The same rules are enforced again where the work happens (the layout when the mesh is built, the
checkpoint's model when it loads); these are the early copies that make a refusal harmless.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import torch
import yaml

from hpctrain.checkpoint.manifest import DamagedCheckpoint, read_manifest, step_of
from hpctrain.config import JobConfig, from_dict, to_dict
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.models.config import ModelConfig
from hpctrain.parallel.layout import check_layout, check_task_config
from hpctrain.runtime.dist import pick_device
from hpctrain.runtime.rundir import RunDir
from hpctrain.train.checkpointing import config_hashes


def check_config(cfg: JobConfig, world_size: int) -> None:
    """The rules that need only the config and the number of ranks: the parallel layout (a
    task's: data parallelism only; the built-in model's: against its shape), and a GPU named by
    run.device where none is visible."""
    if cfg.task:
        # The config's model section says nothing of a task's model: no rule may read it.
        check_task_config(cfg, world_size)
    else:
        check_layout(cfg, world_size)
    if not torch.cuda.is_available():
        # The rank's own choice of device, here where it cannot touch a GPU (none is visible):
        # it refuses cuda names and returns the CPU for auto and cpu.
        pick_device(cfg.run.device, 0, setting="run.device", host=socket.gethostname())


def check_run_dir(cfg: JobConfig, run_dir: RunDir) -> None:
    """The checkpoint this run would resume from exists and was saved for this model.

    ``checkpoint.resume=auto`` resumes the newest checkpoint whose manifest reads (a damaged one
    is passed over at load, so here too); a path must be a checkpoint directory.
    """
    how = cfg.checkpoint.resume
    if how == "never":
        if run_dir.committed_checkpoints():
            raise ConfigError(
                f"{run_dir.root} already holds checkpoints and checkpoint.resume=never",
                hint=f"rerun without --resume never to continue that run; {_NEW_RUN}")
        return
    if how == "auto":
        candidates = sorted(run_dir.committed_checkpoints(),
                            key=lambda p: step_of(p.name) or 0, reverse=True)
    else:
        path = Path(how)
        if not path.is_dir():
            raise ConfigError(f"--resume {how}: no such checkpoint directory",
                              expected="a step-NNNNNNNN directory, 'auto' or 'never'")
        candidates = [path]
    for path in candidates:
        try:
            manifest = read_manifest(path)
        except DamagedCheckpoint:
            continue  # the load says why, and falls back or refuses
        saved = manifest.get("model_hash")
        # A task's checkpoint is keyed by its model's parameters (train/checkpointing.py),
        # which exist only once the model is built: its load checks them.
        if (not cfg.task and isinstance(saved, str)
                and saved != config_hashes(cfg)["model_hash"]):
            raise _another_model(cfg, run_dir, path, resumed=how == "auto")
        return


# Both ways out of a run directory that holds another run, for every refusal that names one.
_NEW_RUN = ("add --fresh to archive it and start over (the old run is kept, renamed), or "
            "choose another run.name=NAME to train beside it")


def _another_model(cfg: JobConfig, run_dir: RunDir, path: Path, *, resumed: bool
                   ) -> HpctrainError:
    """The refusal of a checkpoint saved for another model, naming the fields that differ."""
    differ = _model_difference(cfg, run_dir)
    what = f"checkpoint {path} was saved for another model shape"
    if differ:
        what += f" ({differ})"
    if resumed:
        hint = (f"{run_dir.root} holds an earlier run, which this command would continue: "
                f"{_NEW_RUN}; or resume it with its own config "
                f"({run_dir.config_dir / 'config.yaml'})")
    else:
        hint = "resume with the config that saved it, or drop --resume to start from step 0"
    return ConfigError(what, expected="the same model section as the run that saved it",
                       hint=hint)


def _model_difference(cfg: JobConfig, run_dir: RunDir) -> str:
    """``model.vocab_size 257 there, 256 here`` from the run's recorded config, or ""."""
    try:
        raw = yaml.safe_load((run_dir.config_dir / "config.yaml").read_text(encoding="utf-8"))
        theirs = _shape(from_dict(ModelConfig, raw["model"], "model"))
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError, HpctrainError):
        return ""
    try:
        ours = _shape(cfg.model)
    except HpctrainError:
        ours = to_dict(cfg)["model"]
    keys = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    return ", ".join(f"model.{k} {theirs.get(k)} there, {ours.get(k)} here" for k in keys)


def _shape(model: ModelConfig) -> dict[str, Any]:
    """The resolved shape: a preset's value and the same value set by hand compare equal."""
    return dataclasses.asdict(model.resolve())
