"""``hpctrain.fit``: train a user's task from Python, e.g. in a script that srun or torchrun starts.

    import hpctrain
    from my_task import task

    result = hpctrain.fit(task, overrides={"train.steps": 100, "run.name": "mine"})

Each rank calls it; it learns its place from the environment as ``hpctrain train`` does, and the
run is the same: run directory, lock, checkpoints with exact resume, preemption and requeue,
metrics, goodput. Rerunning the script resumes the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.task import Task, TaskError, call_user


def fit(task: Task | Callable[[], Task] | str | None = None, config: str | Path | None = None,
        *, overrides: Mapping[str, Any] | Sequence[str] = (), fresh: bool = False):
    """Train ``task`` (a Task, a function making one, or a spec ``file.py:fn``) as this rank;
    returns the run's :class:`~hpctrain.train.trainer.TrainResult`."""
    from hpctrain.train.job import run_training

    items = ([f"{k}={json.dumps(str(v) if isinstance(v, Path) else v)}"
              for k, v in overrides.items()]
             if isinstance(overrides, Mapping) else list(overrides))
    defaults = []
    if config is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        defaults.append("parallel.strategy=ddp")  # as `hpctrain train my_task.py` does
    if isinstance(task, str):
        defaults.append(f"task={json.dumps(task)}")
    cfg = load_config(config, [*defaults, *items])
    if isinstance(task, str):
        task = None  # the trainer loads cfg.task on each rank
    described = (f"{getattr(task, '__module__', '?')}:{getattr(task, '__qualname__', '?')}"
                 if callable(task) and not isinstance(task, Task) else "hpctrain.fit(Task(...))")
    if task is not None and not isinstance(task, Task):
        if not callable(task):
            raise TaskError(f"hpctrain.fit(task=...) got a {type(task).__name__}",
                            expected="a Task, a function returning one, or 'file.py:fn'")
        made = call_user(task, "the task factory")
        if not isinstance(made, Task):
            raise TaskError(f"the task factory gave a {type(made).__name__}",
                            expected="an hpctrain.task.Task")
        task = made
    if task is None and not cfg.task:
        raise ConfigError("hpctrain.fit() was given no task",
                          hint="pass a Task, or a config whose task: names one")
    if task is not None:
        # Recorded in the run's config (and its hash), and marks the run as a task's.
        cfg.task = cfg.task or described
    return run_training(cfg, fresh=fresh, task=task)
