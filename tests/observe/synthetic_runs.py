"""Run directories written by hand, in the layout `hpctrain train` writes, for report tests.

`write_run` makes a run of `ranks` ranks over `steps` logged windows in which rank `slow_rank`
(on host `slow_host`) spends `slow_by` more seconds per step in its own time: a known straggler.
Everything else (config, provenance, checkpoints, a rollback, a restart, bad steps, a
preemption in the log, profiles, goodput.json) is there too, so every part of the report has
something to draw.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

T0 = 1_790_000_000.0


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_run(root: Path, *, ranks: int = 4, steps: int = 30, slow_rank: int | None = 2,
              slow_host: str = "node-b", slow_by: float = 0.08, lr: float = 1e-3,
              goodput: bool = True, exit_code: int = 0, host_names: list[str] | None = None,
              config_extra: dict[str, Any] | None = None) -> Path:
    """Write a synthetic run directory at ``root``; returns it."""
    hosts = host_names or [slow_host if r == slow_rank else f"node-a{r}" for r in range(ranks)]
    config = {"run": {"name": root.name, "seed": 0}, "optim": {"lr": lr, "warmup_steps": 5},
              "train": {"steps": steps, "micro_batch": 2}, "metrics": {"log_every": 1}}
    for section, values in (config_extra or {}).items():
        config.setdefault(section, {}).update(values)
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "provenance").mkdir(exist_ok=True)
    (root / "provenance" / "provenance.json").write_text(json.dumps(
        {"git_sha": "abc123", "git_dirty": False, "torch": "2.13.0", "python": "3.11.7",
         "hosts": sorted(set(hosts)), "argv": ["hpctrain", "train", "x.yaml"]}))
    for rank in range(ranks):
        t = T0
        records: list[dict[str, Any]] = [
            {"ts": t, "rank": rank, "host": hosts[rank], "event": "layout", "pp": 1},
            {"ts": t + 0.1, "rank": rank, "host": hosts[rank], "event": "observe",
             "pid": 1000 + rank, "own_time": "data+forward", "profile_signal": "SIGURG"}]
        for step in range(1, steps + 1):
            t += 0.5
            own = 0.1 + 0.001 * ((rank + step) % 3) + (slow_by if rank == slow_rank else 0.0)
            records.append({
                "ts": t, "rank": rank, "host": hosts[rank], "step": step,
                "loss": 5.0 / (1 + 0.1 * step), "lr": lr * min(1.0, step / 5),
                "grad_norm": 1.0 + 0.5 / step, "tokens_per_s": 2000.0 + 10 * step,
                "step_time_s": 0.5, "data_time_s": 0.01, "mfu": 0.3 + 0.001 * step,
                "mem_gb": 10.0 + 0.1 * rank, "fwd_time_s": own - 0.01, "own_time_s": own})
            if rank == 0 and step % 10 == 0:
                records.append({"ts": t + 0.01, "rank": 0, "host": hosts[0],
                                "event": "checkpoint", "step": step, "write_s": 0.4})
                records.append({"ts": t + 0.02, "rank": 0, "host": hosts[0], "step": step,
                                "val_loss": 5.2 / (1 + 0.1 * step), "val_ppl": 100.0,
                                "val_tokens": 1000})
            if rank == 0 and step == 12:
                records.append({"ts": t + 0.03, "rank": 0, "host": hosts[0],
                                "event": "bad_steps", "step": 12, "skipped": 1})
            if rank == 0 and step == 15:
                records.append({"ts": t + 0.04, "rank": 0, "host": hosts[0],
                                "event": "rollback", "step": 10, "from_step": 15,
                                "checkpoint": "step-00000010", "bad_streak": 3})
            if step == 20:
                records.append({"ts": t + 0.05, "rank": rank, "host": hosts[rank],
                                "event": "layout", "pp": 1})
                records.append({"ts": t + 0.06, "rank": rank, "host": hosts[rank],
                                "event": "checkpoint_load", "checkpoint": "step-00000020",
                                "step": 20, "load_s": 0.3})
            if step == 4:
                records.append({"ts": t + 0.07, "rank": rank, "host": hosts[rank],
                                "event": "profile", "first_step": 3, "last_step": 4,
                                "trigger": "config",
                                "trace": f"profiles/step-000003-000004/rank-{rank:03d}.trace.json",
                                "memory_snapshot": None})
        _write_jsonl(root / "metrics" / f"rank-{rank:03d}.jsonl", records)
        trace = root / "profiles" / "step-000003-000004" / f"rank-{rank:03d}.trace.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text('{"traceEvents": []}')
    (root / "logs").mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + 9.0))
    (root / "logs" / "rank-000.log").write_text(
        f"{stamp},250 [rank 0/{ranks} {hosts[0]}] WARNING hpctrain.train: preemption (SIGUSR2):"
        " checkpointing at step 18 and stopping\n")
    end = T0 + 0.5 * steps + 1
    (root / "exit_info.json").write_text(json.dumps(
        {"exit_code": exit_code, "reason": "completed" if exit_code == 0 else "it broke",
         "last_checkpoint": "step-00000030", "timestamp": end, "extra": {}}))
    if goodput:
        parts = {"productive": 10.0, "startup": 2.0, "checkpoint": 1.0, "data_wait": 0.3,
                 "validation": 0.5, "lost_work": 1.2, "restart_gap": 0.8, "hang": 0.0}
        (root / "goodput.json").write_text(json.dumps(
            {"version": 1, "wall_s": sum(parts.values()), "parts": parts,
             "goodput": 10.0 / sum(parts.values()),
             "attempts": [{"attempt": 1, "start": T0, "end": T0 + 9.2, "exit_code": 75,
                           "resumed_from_step": None, "last_step": 18},
                          {"attempt": 2, "start": T0 + 10.0, "end": end, "exit_code": 0,
                           "resumed_from_step": 18, "last_step": steps}]}))
    return root
