"""``auto`` from `hpctrain tune`'s measurements (hpctrain.plan.auto, its docstring's step 1):
the fastest measured setting this run may take, where tune measured on this GPU kind and count
for this model, sequence length, precision and global batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from hpctrain.errors import ConfigError
from hpctrain.plan.auto_search import AUTO, Pick, accepted, from_model, pick_key, zeros
from hpctrain.plan.gpu import Gpu


def from_tune(cfg, world_size: int, gpu: Gpu, replica: int, dp: int,
              reasons: list[str], must_fit: bool = True, *, model: bool = True) -> Pick | None:
    """The fastest measured setting of tune's results that this run may take
    (hpctrain.plan.auto, 1.); None (said in ``reasons``) where there are none. Where none
    of the measured settings applies, the memory model chooses (``model``; else None: a task's
    model has none)."""
    path = cfg.parallel.tune_results
    if path is None:
        return None
    doc, why = _tune_doc(cfg, Path(path), world_size, gpu, replica * dp)
    if doc is None:
        reasons.append(f"tune results {path} not used: {why}")
        return None
    try:
        allowed, failed = _measured(cfg, doc, replica)
    except (KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"parallel.tune_results={path}: its candidates are not tune's "
                          f"results ({type(e).__name__}: {e})",
                          expected="the results.json `hpctrain tune` writes",
                          hint="rerun `hpctrain tune`, or drop parallel.tune_results") from None
    if not allowed:
        reasons.append(f"tune results {path}: no measured setting fits the config's fixed "
                       "values" + ("; the memory model chooses" if model else ""))
        if not model:
            return None
        return from_model(cfg, world_size, gpu, replica, dp, reasons, frozenset(failed),
                           must_fit=must_fit)
    tps, _, pick = max(allowed)
    reasons.append(f"tune's measurements ({path}, {world_size} x {gpu.name}): the fastest of "
                   f"{len(allowed)} measured settings this config allows, {tps:,.0f} tokens/s "
                   "per GPU")
    return pick


def _measured(cfg, doc: dict, replica: int) -> tuple[list, set]:
    """(settings tune measured that this config allows, with their speed; keys of those that
    failed) from a results document."""
    allowed, failed = [], set()
    for c in doc["candidates"]:
        s = c.get("settings") or {}
        pick = Pick(s.get("strategy"), s.get("zero", 3), s.get("ac"), s.get("micro_batch", 0),
                    s.get("grad_accum", 0), s.get("ac_every", 0))
        if c.get("status") == "failed":
            failed.add(pick_key(pick))
        if c.get("status") == "ok" and _fits_config(cfg, s, pick, replica):
            allowed.append((c["measured"]["tokens_per_s_per_gpu"], -len(allowed), pick))
    return allowed, failed


def _tune_doc(cfg, path: Path, world_size: int, gpu: Gpu, samples: int
              ) -> tuple[dict | None, str]:
    """(tune's results.json, "") where it was measured for this run, else (None, why not)."""
    results = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(results.read_text())
        meta = doc["meta"]
        best = yaml.safe_load((results.parent / "best.yaml").read_text())
    except FileNotFoundError as e:
        return None, f"{e.filename} does not exist (no tuning finished there)"
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise ConfigError(f"parallel.tune_results = {path}: cannot be read ({e})",
                          expected="the --out folder of `hpctrain tune` (results.json, "
                          "best.yaml)", hint="rerun tune, or drop parallel.tune_results") from None
    model = dataclasses.asdict(cfg.model)
    best = best if isinstance(best, dict) else {}
    checks = [("GPU", meta.get("device_name"), gpu.name),
              ("GPU count", meta.get("gpus"), world_size),
              ("global batch (samples)", meta.get("global_batch"), samples),
              ("model", best.get("model"), model),
              ("task", _task_file(best.get("task")), _task_file(cfg.task)),
              ("task_args", best.get("task_args"), cfg.task_args)]
    # The values tune keeps as its config gives them (it varies the others per candidate):
    # measured with others, its speeds are another program's.
    fsdp = (best.get("parallel") or {}).get("strategy") == "fsdp"
    for key in _TUNE_KEEPS:
        section, name = key.split(".")
        ours = getattr(getattr(cfg, section), name)
        # FSDP's scheduling options are set to their defaults where tune's winner is not FSDP.
        if ours != AUTO and (fsdp or name not in ("fsdp_prefetch", "fsdp_group_blocks")):
            checks.append((key, (best.get(section) or {}).get(name), ours))
    for what, theirs, ours in checks:
        if theirs != ours:
            return None, f"measured for another {what} ({_short(theirs)}, this run: " \
                         f"{_short(ours)})"
    return doc, ""


_TUNE_KEEPS = ("data.seq_len", "parallel.compile", "train.master_weights", "parallel.ac_save_mm",
               "train.fp8_recipe", "parallel.fsdp_prefetch", "parallel.fsdp_group_blocks",
               "parallel.reduce_precision")


def _fits_config(cfg, s: dict, pick: Pick, replica: int) -> bool:
    """Whether a measured setting keeps the config's fixed values and global batch."""
    pc, tc = cfg.parallel, cfg.train
    same = {"tp": pc.tp, "pp": pc.pp, "dp_replicate": pc.dp_replicate,
            "precision": tc.precision, "mixed_precision": pc.mixed_precision,
            "loss_chunks": tc.loss_chunks}
    if any(s.get(k) != v for k, v in same.items()):
        return False
    if pc.pp > 1 and s.get("pp_microbatches", 0) not in (0, pc.pp_microbatches):
        return False
    if pick.micro_batch * pick.grad_accum != replica:
        return False
    if tc.grad_accum is not None and pick.grad_accum != tc.grad_accum:  # given: it fixes the split
        return False
    fixed = (pc.strategy, pc.activation_checkpointing, tc.micro_batch)
    for given, value in zip(fixed, (pick.strategy, pick.ac, pick.micro_batch), strict=True):
        if given != AUTO and given != value:
            return False
    if pick.ac == "every_k" and pc.activation_checkpointing == AUTO and pick.ac_every < 1:
        return False
    if (pc.reshard_after_forward != AUTO and pick.strategy == "fsdp"
            and pick.zero != zeros(cfg, "fsdp")[0]):
        return False
    return accepted(cfg, pick)  # the parallel section's own rules, as for the model's picks


def _task_file(spec: str | None) -> str | None:
    """A task spec with its file made absolute (``my_task.py:fn`` as tune's best.yaml names
    it, from wherever the run starts); a module's spec as it is."""
    if not spec:
        return spec
    where, colon, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    return str(Path(where).resolve()) + colon + name if where.endswith(".py") else spec


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
