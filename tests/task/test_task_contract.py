"""The task contract in one process: loading a task, checking what user code returns, naming the
user's file and line when it fails, and the sample loaders' order and position."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.data.order import BatchLayout
from hpctrain.data.samples import SampleLoader, StreamLoader, build_sample_loader
from hpctrain.errors import ConfigError
from hpctrain.task import Task, TaskError, check_finite, load_task

CPU = torch.device("cpu")


def _write(tmp_path: Path, body: str, name: str = "user_task.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


TASK_FILE = """\
import torch
from torch import nn
from hpctrain.task import Task

def bad_step(model, batch):
    x, y = batch
    raise ValueError("boom in the user's step")

def task():
    x = torch.randn(8, 3)
    return Task(model=lambda: nn.Linear(3, 1), data=torch.utils.data.TensorDataset(x, x[:, :1]),
                step=bad_step)

def make():
    return 42
"""


def test_load_task_by_file_and_function(tmp_path: Path) -> None:
    path = _write(tmp_path, TASK_FILE)
    assert isinstance(load_task(str(path)), Task)  # task() is the default
    with pytest.raises(TaskError, match="task .*:make' gave a int"):
        load_task(f"{path}:make")
    with pytest.raises(ConfigError, match="defines no nothing_here"):
        load_task(f"{path}:nothing_here")
    with pytest.raises(ConfigError, match="does not exist"):
        load_task(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="cannot be found"):
        load_task("no_such_package_here.tasks:make")


def test_exception_in_step_names_user_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, TASK_FILE)
    task = load_task(str(path))
    model = task.build_model()
    with pytest.raises(TaskError) as e:
        task.run_step(model, (torch.randn(2, 3), torch.randn(2, 1)))
    assert "the step function raised ValueError: boom in the user's step" in e.value.what
    assert f"{path.resolve()}:7 (in bad_step)" in e.value.expected


def test_import_error_names_user_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "import torch\n\nx = 1 / 0\n", "broken_task.py")
    with pytest.raises(TaskError, match="ZeroDivisionError") as e:
        load_task(str(path))
    assert f"{path.resolve()}:3" in e.value.expected


@pytest.mark.parametrize(("returned", "message"), [
    (lambda loss: loss.item(), "returned a float as the loss"),
    (lambda loss: loss.reshape(1).expand(3), r"returned a tensor of shape \(3,\)"),
    (lambda loss: loss.detach(), "does not require grad"),
    (lambda loss: (loss, [1]), "returned metrics as a list"),
    (lambda loss: "loss", "returned a str as the loss"),
])
def test_wrong_return_is_refused_naming_the_step(returned, message) -> None:
    def step(model, batch):
        return returned(model(batch).pow(2).mean())

    task = Task(model=lambda: nn.Linear(3, 1), data=torch.zeros(4, 3), step=step)
    with pytest.raises(TaskError, match=message) as e:
        task.run_step(task.build_model(), torch.randn(2, 3))
    assert "test_task_contract.py:" in e.value.what  # where the step is defined


def test_loss_needs_input_target_pairs_and_finite_values() -> None:
    task = Task(model=lambda: nn.Linear(3, 1), data=torch.zeros(4, 3),
                loss=nn.functional.mse_loss)
    with pytest.raises(TaskError, match="batches of \\(inputs, targets\\)"):
        task.run_step(task.build_model(), torch.randn(2, 3))
    with pytest.raises(TaskError, match="returned a loss of nan"):
        check_finite(torch.tensor(float("nan")), nn.functional.mse_loss)
    with pytest.raises(TaskError, match="exactly one of loss= and step="):
        Task(model=lambda: nn.Linear(3, 1), data=torch.zeros(4, 3))


def _read(loader, steps: int) -> list[list[float]]:
    """The values of each step's micro-batches (a TensorDataset's come as a 1-list)."""
    def values(batch):
        return (batch if isinstance(batch, torch.Tensor) else batch[0]).flatten().tolist()

    return [[v for b in loader.next_step() for v in values(b)] for _ in range(steps)]


def test_sample_loader_splits_ranks_evenly_and_resumes_exactly() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(22.0))  # 22 = 2 global batches + 6
    loaders = [SampleLoader(data, BatchLayout(2, 2, 2, r), 5, CPU, _collate, prefetch=0)
               for r in range(2)]
    epoch = [_read(loader, 2) for loader in loaders]
    seen = sorted(v for rank in epoch for step in rank for v in step)
    assert len(seen) == len(set(seen)) == 16  # disjoint, equal counts, remainder dropped
    whole = SampleLoader(data, BatchLayout(2, 2, 2, 1), 5, CPU, _collate, prefetch=2)
    expected = _read(whole, 5)
    whole.close()
    first = SampleLoader(data, BatchLayout(2, 2, 2, 1), 5, CPU, _collate, prefetch=2)
    _read(first, 3)
    state = first.state_dict()  # the position training reached, not the prefetcher's
    first.close()
    resumed = SampleLoader(data, BatchLayout(2, 2, 2, 1), 5, CPU, _collate, prefetch=2)
    resumed.load_state_dict(state)
    assert state["step"] == 3 and _read(resumed, 2) == expected[3:]
    resumed.close()


def _collate(items):
    return torch.utils.data.default_collate(items)


class Counter:
    """An iterable of 0, 1, 2, ... that can report and restore its position."""

    def __init__(self):
        self.next = 0

    def __iter__(self):
        while self.next < 1000:
            self.next += 1
            yield torch.tensor([float(self.next - 1)])

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def test_stream_loader_resumes_from_the_streams_position(caplog) -> None:
    with caplog.at_level(logging.WARNING, "hpctrain.data"):
        loader = StreamLoader(Counter(), BatchLayout(2, 1, 2, 1), 0, CPU, _collate)
    assert "cannot report its position" not in caplog.text
    assert _read(loader, 2) == [[2.0, 3.0], [6.0, 7.0]]  # rank 1's slots of each global batch
    again = StreamLoader(Counter(), BatchLayout(2, 1, 2, 1), 0, CPU, _collate)
    again.load_state_dict(loader.state_dict())
    assert _read(again, 1) == [[10.0, 11.0]]


def test_stream_without_position_is_accepted_with_one_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, "hpctrain.data"):
        loader = StreamLoader(iter_only(), BatchLayout(2, 1, 1, 0), 0, CPU, _collate)
        assert _read(loader, 2) == [[0.0, 1.0], [2.0, 3.0]]
    warnings = [r for r in caplog.records if "cannot report its position" in r.getMessage()]
    assert len(warnings) == 1
    assert "the resume will not be exact" in warnings[0].getMessage()
    assert "state_dict()" in warnings[0].getMessage()


class iter_only:  # noqa: N801 - reads like the plain generator it stands for
    """An iterable with no position to report."""

    def __iter__(self):
        return (torch.tensor([float(i)]) for i in range(100))


def test_a_one_shot_generator_is_refused() -> None:
    """Read once, it would lose the batch the FLOP count peeks at and end after one pass."""
    numbers = (torch.tensor([float(i)]) for i in range(100))
    with pytest.raises(ConfigError, match="one-shot generator"):
        build_sample_loader(numbers, BatchLayout(2, 1, 1, 0), 0, CPU, _collate, 0)
    build_sample_loader(iter_only(), BatchLayout(2, 1, 1, 0), 0, CPU, _collate, 0)


def test_fit_refuses_what_is_not_a_task() -> None:
    import hpctrain

    with pytest.raises(TaskError, match="got a int"):
        hpctrain.fit(42)
    with pytest.raises(TaskError, match="the task factory gave a str"):
        hpctrain.fit(lambda: "not a task")
    with pytest.raises(ConfigError, match="was given no task"):
        hpctrain.fit()


def _task_state(width: int):
    from hpctrain.config import load_config
    from hpctrain.train import checkpointing
    from hpctrain.train.optim import build_optimizer, build_scheduler

    cfg = load_config(None, ["task=my_task.py", "train.steps=4"])
    model = nn.Linear(3, width)
    optimizer = build_optimizer(model, cfg.optim, 1e-3)
    loader = SampleLoader(torch.zeros(8, 3), BatchLayout(2, 1, 1, 0), 0, CPU, _collate, 0)
    state = checkpointing.TrainState(model, optimizer, build_scheduler(optimizer, cfg.optim, 4),
                                     loader, None, tokens_per_sample=1,
                                     model_signature=checkpointing.model_signature(model))
    return cfg, state


def test_resume_with_another_user_model_shape_is_refused(tmp_path: Path) -> None:
    """The config's model section says nothing of a task's model: its parameters' shapes do."""
    from hpctrain.train import checkpointing

    cfg, saved = _task_state(4)
    manifest = checkpointing.meta_state(saved, cfg, step=0, world_size=1)
    _, same = _task_state(4)
    checkpointing.check_meta(same, tmp_path, manifest, cfg)
    _, wider = _task_state(5)
    with pytest.raises(ConfigError, match="saved for another model shape"):
        checkpointing.check_meta(wider, tmp_path, manifest, cfg)


class Augmented(torch.utils.data.Dataset):
    """Each read of sample ``i``: ``i`` plus noise from hpctrain's generator for that sample."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        from hpctrain.task import sample_rng

        return float(i) + torch.rand(2, generator=sample_rng())


def _read_while_training(loader, steps: int) -> list[list[float]]:
    """``_read``, with the training thread drawing from torch's global generator meanwhile
    (dropout does), as the prefetch thread reads ahead."""
    out = []
    for _ in range(steps):
        torch.rand(1000)
        out += _read(loader, 1)
    return out


def test_random_augmentation_repeats_exactly_after_a_resume() -> None:
    """Sample ``i`` of an epoch draws the same numbers on any rank count and after a resume
    (the prefetch thread reads ahead of the position a checkpoint saves)."""
    def loader(rank: int = 0, ranks: int = 1, seed: int = 7) -> SampleLoader:
        return SampleLoader(Augmented(), BatchLayout(4 // ranks, 1, ranks, rank), seed, CPU,
                            _collate, prefetch=2)

    whole = loader()
    expected = _read_while_training(whole, 6)  # 3 steps an epoch: 6 are two epochs
    whole.close()
    first = loader()
    _read_while_training(first, 4)
    state = first.state_dict()
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    assert _read_while_training(resumed, 2) == expected[4:6]
    resumed.close()
    halves = [loader(rank, 2) for rank in range(2)]
    by_rank = [_read(h, 6) for h in halves]
    assert [a + b for a, b in zip(*by_rank, strict=True)] == expected
    values = torch.tensor(expected).reshape(-1, 2)
    assert len(set(values[:, 1].tolist())) == 24  # fresh noise per sample and epoch
    assert _read(loader(seed=8), 1) != expected[:1]


class GlobalNoise(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2)


def test_a_dataset_drawing_from_the_global_generator_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, "hpctrain.data"):
        SampleLoader(Augmented(), BatchLayout(2, 1, 1, 0), 0, CPU, _collate, 0)
        assert "global random generator" not in caplog.text
        SampleLoader(GlobalNoise(), BatchLayout(2, 1, 1, 0), 0, CPU, _collate, 0)
    assert "draws from torch's global random generator" in caplog.text
    assert "hpctrain.task.sample_rng()" in caplog.text


def test_sample_rng_outside_a_read_is_refused() -> None:
    from hpctrain.task import sample_rng

    with pytest.raises(TaskError, match="outside the reading of a sample"):
        sample_rng()


class NoisyCounter(Counter):
    """``Counter`` with noise from hpctrain's generator for each sample."""

    def __iter__(self):
        from hpctrain.task import sample_rng

        for value in super().__iter__():
            yield value + torch.rand(1, generator=sample_rng())


def test_a_streams_random_draws_repeat_after_a_resume() -> None:
    whole = StreamLoader(NoisyCounter(), BatchLayout(2, 1, 1, 0), 3, CPU, _collate)
    expected = _read(whole, 3)
    first = StreamLoader(NoisyCounter(), BatchLayout(2, 1, 1, 0), 3, CPU, _collate)
    _read(first, 1)
    resumed = StreamLoader(NoisyCounter(), BatchLayout(2, 1, 1, 0), 3, CPU, _collate)
    resumed.load_state_dict(first.state_dict())
    assert _read(resumed, 2) == expected[1:]
    assert len({round(v % 1, 6) for step in expected for v in step}) == 6  # fresh per sample


def test_only_running_statistics_are_broadcast_after_a_step() -> None:
    """The per-step broadcast carries what training updates (BatchNorm's and InstanceNorm's
    tracked statistics), not constant buffers; nothing when no norm tracks statistics."""
    from hpctrain.train.task_trainer import running_stats

    class Net(nn.Module):
        def __init__(self, track: bool) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4, track_running_stats=track)
            self.inorm = nn.InstanceNorm1d(4, track_running_stats=track)
            self.register_buffer("table", torch.arange(8.0))  # e.g. a rotary table
            self.register_buffer("mask", torch.ones(4), persistent=False)

    net = Net(track=True)
    expected = [net.bn.running_mean, net.bn.running_var, net.bn.num_batches_tracked,
                net.inorm.running_mean, net.inorm.running_var, net.inorm.num_batches_tracked]
    assert [id(b) for b in running_stats(net)] == [id(b) for b in expected]
    assert running_stats(Net(track=False)) == []


@pytest.mark.parametrize("stem", ["123", "true", "on", "a #1", "x: y"])
def test_a_task_file_of_any_name_names_its_run(tmp_path: Path, stem: str) -> None:
    """The file's stem and path reach the config as strings, whatever YAML would read them as."""
    from hpctrain.task import load_run_config

    path = tmp_path / f"{stem}.py"
    cfg = load_run_config(path, [], 1)
    assert (cfg.run.name, cfg.task) == (stem, str(path))


def test_the_model_is_built_before_any_sample_is_collated(tmp_path: Path) -> None:
    """A collate may need the device the model was built on (the image task decodes there):
    the loader's first read (the global-generator check) once came before the model factory,
    and the image task decoded every batch of a GPU run on the CPU, then failed in the model."""
    from torch.utils.data import TensorDataset, default_collate

    import hpctrain

    calls = []

    def model() -> nn.Module:
        calls.append("model")
        return nn.Linear(3, 1)

    def collate(items):
        calls.append("collate")
        return default_collate(items)

    x = torch.zeros(8, 3)
    task = Task(model=model, data=TensorDataset(x, x.sum(1, keepdim=True)),
                loss=nn.functional.mse_loss, collate=collate)
    hpctrain.fit(task, overrides={"run.out_dir": tmp_path, "train.steps": 1,
                                  "train.micro_batch": 2, "metrics.progress": False})
    assert calls[0] == "model", calls


def test_fsdp_in_bf16_shards_a_flat_sequential_whose_unit_is_a_batchnorm(pg: None) -> None:
    """Task's default units are the children holding parameters: the BatchNorm is a unit and
    its own fp32 group, sharded once (before: fully_shard's 'already applied' assertion)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from hpctrain.train.task_trainer import shard_units

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 2))
    task = Task(model=lambda: model, data=[], loss=nn.functional.cross_entropy)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    shard_units(model, task.fsdp_units(model), mesh,
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                reshard=True)
    assert all(isinstance(m, FSDPModule) for m in (model, model[0], model[1], model[4]))
    model(torch.randn(2, 3, 6, 6)).float().sum().backward()
    assert model[1].weight.grad is not None and model[1].weight.dtype == torch.float32


def test_samples_in_batch_must_count_on_the_host() -> None:
    """A tensor count would wait for the device once per micro-batch: refused, with a hint."""
    def task(count) -> Task:
        return Task(model=lambda: nn.Linear(1, 1), data=[], loss=nn.functional.mse_loss,
                    samples_in_batch=count)

    assert task(len).count_samples([1, 2, 3]) == 3
    assert task(None).count_samples([1]) is None
    for bad in (lambda b: torch.tensor(len(b)), lambda b: -1, lambda b: 2.0):
        with pytest.raises(TaskError, match="samples_in_batch") as info:
            task(bad).count_samples([1, 2])
        assert info.value.expected and info.value.hint
