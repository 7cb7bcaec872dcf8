"""Users' own models, data and steps: the contract hpctrain trains through.

A task file defines ``task()`` (or ``make()``) that returns a :class:`Task`:

    # my_task.py
    import torch
    from torch import nn
    from hpctrain.task import Task

    def task() -> Task:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        return Task(model=lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)),
                    data=torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                    loss=nn.functional.mse_loss)

    hpctrain train my_task.py --nproc 2 parallel.strategy=ddp train.steps=100

or a config names it (``task: my_task.py:task``, ``task: mypkg.tasks:make``), or a script passes
it to :func:`hpctrain.fit`. Everything else (DDP/FSDP, mixed precision, checkpoints with exact
resume, preemption, the guard, metrics, goodput, reports) is the run's config, as for the
built-in model. Errors in the user's code name the user's file and line (:class:`TaskError`).

Random augmentation in a dataset draws from :func:`sample_rng` (``torch.rand(...,
generator=sample_rng())``): a generator seeded from ``run.seed``, the epoch and the sample's
index, so a sample reads the same on any number of ranks and after a resume. Samples are read by a
background thread beside training, so torch's global generator would give other numbers on every
run (and disturb the training step's own draws, such as dropout).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import numbers
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.distributed import DistBackendError

from hpctrain.errors import ConfigError, HpctrainError

if TYPE_CHECKING:
    from hpctrain.config import JobConfig

log = logging.getLogger("hpctrain.task")

# The function a task file or module is asked for when the spec names none, in this order.
DEFAULT_FACTORIES = ("task", "make")

StepResult = torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]


class TaskError(HpctrainError):
    """The user's task code raised, or returned something hpctrain cannot train on."""


@dataclass
class Task:
    """What a user brings: a model factory, samples, and a loss or a whole step.

    ``data`` is a map-style dataset (``__len__`` and ``__getitem__``: read in hpctrain's
    deterministic global order, equal counts per rank, exact resume), or an iterable of samples
    (every rank reads it and takes every world-size-th sample; exact resume only if it has
    ``state_dict()``/``load_state_dict()`` with JSON-able state). Samples are batched by
    ``collate`` (PyTorch's ``default_collate`` unless given); random augmentation draws from
    :func:`sample_rng`. Buffers the forward updates (BatchNorm's statistics) are rank 0's on
    every rank after each step.

    ``loss(model(inputs), targets)`` trains on batches of ``(inputs, targets)``; ``step(model,
    batch)`` is for anything else: it returns the loss (a scalar tensor, the mean over its
    batch), or ``(loss, {"name": scalar tensor, ...})`` of metrics to log. Give one of the two.

    ``flops_per_sample`` (forward and backward, for MFU) is counted once with PyTorch's flop
    counter on one micro-batch when not given. ``tokens_per_sample`` makes tokens/s mean tokens
    (1: a sample is a token, tokens/s is samples/s). ``shard_units(model)`` lists the modules
    FSDP shards one by one (default: the model's top-level children that hold parameters).

    ``samples_in_batch(batch)`` counts the samples a micro-batch's loss is the mean over, for
    batches whose size varies (a collate that skips samples it cannot read, as the image task's
    skips corrupt JPEGs): a step's loss is then the mean over every counted sample of its
    micro-batches and ranks, each weighing the same, not the mean of the micro-batch means.
    It returns a Python ``int`` (a tensor would cost a host sync per micro-batch). A micro-batch
    of 0 samples (all dropped) adds nothing to the step's loss or metrics: its step still runs
    (the backward, and DDP's or FSDP's gradient exchange with the other ranks), and a NaN or
    infinite loss of it (a mean over nothing) is replaced by a zero tied to the graph.
    Per-sample metrics (one value per sample) are averaged over the samples they hold.
    """

    model: Callable[[], nn.Module]
    data: Any
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    step: Callable[[nn.Module, Any], StepResult] | None = None
    eval_data: Any = None
    collate: Callable[[list[Any]], Any] | None = None
    eval_collate: Callable[[list[Any]], Any] | None = None
    flops_per_sample: float | None = None
    tokens_per_sample: int = 1
    shard_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    samples_in_batch: Callable[[Any], int] | None = None

    def __post_init__(self) -> None:
        if (self.loss is None) == (self.step is None):
            raise TaskError(
                "Task needs exactly one of loss= and step=",
                expected="loss=fn(outputs, targets) for (inputs, targets) batches, or "
                "step=fn(model, batch) returning the loss",
                hint="e.g. Task(model=..., data=..., loss=torch.nn.functional.cross_entropy)")
        if not callable(self.model):
            raise TaskError(f"Task(model=...) is a {type(self.model).__name__}, not a factory",
                            expected="a function that builds the model, e.g. lambda: MyNet()",
                            hint="pass the class or a lambda: each rank builds its own copy")
        if not isinstance(self.tokens_per_sample, int) or self.tokens_per_sample < 1:
            raise TaskError(f"Task(tokens_per_sample={self.tokens_per_sample!r})",
                            expected="a positive integer")

    def build_model(self) -> nn.Module:
        """The user's model, built by their factory (errors name their file and line)."""
        model = call_user(self.model, "the model factory")
        if not isinstance(model, nn.Module):
            raise TaskError(f"the model factory {_where(self.model)} returned a "
                            f"{type(model).__name__}", expected="a torch.nn.Module")
        return model

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """The modules FSDP shards one by one before the root: ``shard_units(model)``, else
        the model's top-level children that hold parameters."""
        if self.shard_units is not None:
            return list(self.shard_units(model))
        return [m for m in model.children() if any(True for _ in m.parameters())]

    def count_samples(self, batch: Any) -> int | None:
        """``samples_in_batch(batch)``, checked to be a count (None if the task gives none)."""
        if self.samples_in_batch is None:
            return None
        n = call_user(self.samples_in_batch, "Task.samples_in_batch", batch)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise TaskError(f"Task.samples_in_batch {_where(self.samples_in_batch)} returned "
                            f"{n!r} ({type(n).__name__})",
                            expected="a Python int >= 0: the samples the micro-batch's loss is "
                            "the mean over",
                            hint="count on the host, e.g. len(labels), not labels.numel() or "
                            "a tensor sum (each would wait for the device)")
        return int(n)

    def run_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """One micro-batch's loss and metrics, checked (no host sync)."""
        if self.step is not None:
            fn = self.step
            out = call_user(fn, "the step function", model, batch)
        else:
            fn = self.loss
            if not (isinstance(batch, list | tuple) and len(batch) == 2):
                raise TaskError(
                    f"Task(loss=...) needs batches of (inputs, targets), got a "
                    f"{type(batch).__name__}" + (f" of {len(batch)}"
                                                 if isinstance(batch, list | tuple) else ""),
                    hint="give Task(step=fn(model, batch)) for batches of another shape")
            inputs, targets = batch
            outputs = call_user(model, "the model's forward", inputs)
            out = call_user(fn, "the loss function", outputs, targets)
        metrics: Any = {}
        if isinstance(out, tuple) and len(out) == 2:
            out, metrics = out
        check_loss(out, fn)
        if not isinstance(metrics, dict):
            raise TaskError(f"{_where(fn)} returned metrics as a {type(metrics).__name__}",
                            expected="(loss, {'name': scalar tensor, ...})")
        return out, metrics


def check_loss(loss: Any, fn: Callable) -> None:
    """Refuse a loss that is not a scalar floating tensor with a gradient (no host sync)."""
    what = None
    if not isinstance(loss, torch.Tensor):
        what = f"a {type(loss).__name__}"
    elif loss.dim() != 0:
        what = f"a tensor of shape {tuple(loss.shape)}"
    elif not loss.is_floating_point():
        what = f"a {loss.dtype} tensor"
    elif torch.is_grad_enabled() and not loss.requires_grad:
        what = "a tensor that does not require grad (detached, or computed under no_grad)"
    if what is not None:
        raise TaskError(f"{_where(fn)} returned {what} as the loss",
                        expected="a scalar floating-point tensor (the mean over the batch) "
                        "computed from the model's output",
                        hint="reduce it with .mean(); return (loss, {metrics}) for more values")


def check_finite(loss: torch.Tensor, fn: Callable) -> None:
    """Refuse a NaN or infinite loss (a host sync: for the first step only)."""
    if not torch.isfinite(loss.detach()).item():
        raise TaskError(f"{_where(fn)} returned a loss of {loss.item()} at the first step",
                        expected="a finite loss",
                        hint="check the model's initialisation and the loss's inputs "
                        "(log of 0, division by 0)")


def call_user(fn: Callable, role: str, *args: Any) -> Any:
    """``fn(*args)``; an exception becomes a TaskError naming the user's file and line."""
    try:
        return fn(*args)
    except (HpctrainError, torch.OutOfMemoryError, DistBackendError):
        raise  # not the user's code: ours, the device's, or a peer rank that died
    except Exception as e:
        # The whole traceback goes to this rank's log file (DEBUG), the console gets the line.
        log.debug("%s raised", role, exc_info=e)
        raise TaskError(f"{role} raised {type(e).__name__}: {e}",
                        expected=f"at {user_location(e) or _where(fn)}",
                        hint="the traceback is in this rank's log under the run directory "
                        "(logs/)") from e


def user_location(e: BaseException) -> str | None:
    """``file:line`` of the last traceback frame in user code (not hpctrain, torch, stdlib)."""
    if isinstance(e, SyntaxError) and e.filename:  # raised while compiling: no frame of its own
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    for frame in reversed(frames):
        if _is_user_file(frame.filename):
            return f"{frame.filename}:{frame.lineno} (in {frame.name})"
    return None


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(__file__).resolve().parent))  # hpctrain itself, installed or editable
    return tuple(str(Path(r).resolve()) for r in roots)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    if path in _task_files:
        return True  # the task's own module, even if installed among the packages
    return not any(path.startswith(root + "/") for root in _library_roots())


# Files task specs were loaded from (a task module installed as a package is still user code).
_task_files: set[str] = set()


def _where(fn: Callable) -> str:
    """``file:line`` where ``fn`` is defined, or its repr."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        file = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return repr(fn)
    return f"{getattr(fn, '__qualname__', repr(fn))} ({file}:{line})"


# The generator of the sample this thread is reading (set by the loaders, `reading_sample`).
_reading = threading.local()


def sample_rng() -> torch.Generator:
    """The random generator of the sample being read: seeded from run.seed, the epoch and the
    sample's index (the same numbers on any rank count, thread or attempt)."""
    generator = getattr(_reading, "generator", None)
    if generator is None or not _reading.active:
        raise TaskError("hpctrain.task.sample_rng() was called outside the reading of a sample",
                        expected="a call inside the dataset's __getitem__ (or __iter__) while "
                        "hpctrain reads it",
                        hint="draw random augmentations there: torch.rand(..., "
                        "generator=sample_rng())")
    return generator


@contextlib.contextmanager
def reading_sample(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Within: :func:`sample_rng` on this thread is seeded for sample ``index`` of ``epoch``."""
    generator = getattr(_reading, "generator", None)
    if generator is None:
        generator = _reading.generator = torch.Generator()
    entropy = np.random.SeedSequence([seed % (1 << 64), epoch, index])
    generator.manual_seed(int(entropy.generate_state(1, np.uint64)[0]))
    was, _reading.active = getattr(_reading, "active", False), True
    try:
        yield
    finally:
        _reading.active = was


def file_overrides(path: Path, world_size: int, overrides: list[str],
                   seen_as: str | None = None) -> list[str]:
    """The overrides that train task file ``path`` (``seen_as``: its path where the ranks run):
    the task, a run named after the file, DDP on several ranks; the user's own ``overrides``
    come last and win."""
    # Values of overrides are parsed as YAML: quoted, a file named 123.py, on.py or "a #1.py"
    # stays the string it is (not a number, a boolean or a comment).
    defaults = [f"task={json.dumps(str(seen_as or path))}", f"run.name={json.dumps(path.stem)}"]
    if world_size > 1:
        defaults.append("parallel.strategy=ddp")
    return [*defaults, *overrides]


def load_run_config(config: str | Path, overrides: list[str], world_size: int) -> JobConfig:
    """The config of a run started from ``config``: a YAML file and ``overrides``, or a task
    file (``.py``) with :func:`file_overrides` for ``world_size`` ranks."""
    from hpctrain.config import load_config

    if Path(config).suffix == ".py":
        return load_config(None, file_overrides(Path(config), world_size, list(overrides)))
    return load_config(config, list(overrides))


def load_task(spec: str, args: dict[str, Any] | None = None) -> Task:
    """The Task that ``spec`` names: ``file.py[:fn]`` or ``package.module[:fn]``, its factory
    called with ``args`` (the config's ``task_args``) as keyword arguments."""
    where, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    module = _import_file(Path(where)) if where.endswith(".py") else _import_module(where)
    _task_files.add(str(Path(module.__file__ or "").resolve()))
    names = [name] if name else list(DEFAULT_FACTORIES)
    factory = next((getattr(module, n) for n in names if hasattr(module, n)), None)
    if factory is None:
        raise ConfigError(
            f"task {spec!r}: {module.__file__} defines no {' or '.join(names)}",
            expected="a function returning hpctrain.task.Task",
            hint=f"define `def task() -> Task:` there, or name the function: {where}:my_fn")
    if args and not callable(factory):
        raise ConfigError(f"task {spec!r} is a {type(factory).__name__}, but task_args are set",
                          expected="a function to pass task_args to",
                          hint="make it a function, or drop task_args")
    task = (call_user(functools.partial(factory, **(args or {})), f"the task factory {spec}")
            if callable(factory) else factory)
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} gave a {type(task).__name__}",
                        expected="an hpctrain.task.Task",
                        hint="return Task(model=..., data=..., loss=...) from the function")
    return task


def _import_file(path: Path):
    """Import a task file as a script would run: its folder first on sys.path."""
    if not path.is_file():
        raise ConfigError(f"task file {str(path)!r} does not exist",
                          hint="give the path from the directory you run hpctrain in")
    path = path.resolve()
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its helper modules beside it import as in a script
    name = f"hpctrain_task_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    _task_files.add(str(path))
    call_user(spec.loader.exec_module, f"importing {path}", module)
    return module


def _import_module(name: str):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(f"task module {name!r} cannot be found",
                          expected="file.py[:function] or package.module[:function]",
                          hint="install the package (pip install -e .) or give a file path")
    if spec.origin:
        _task_files.add(str(Path(spec.origin).resolve()))
    return call_user(importlib.import_module, f"importing {name}", name)
