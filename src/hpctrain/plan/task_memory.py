"""Per-GPU memory of training a user's own model (a config with ``task:``), from a measured step.

hpctrain has no model of a task's activations (its code is the user's), so on a CUDA GPU it
measures them: one real training step (the task's step, backward, the optimizer's update, in the
config's precision) at micro-batch 1 and at 2 on the GPU at hand, after a warm-up step, the
peaks read with ``torch.cuda.max_memory_allocated``: one over forward and backward, one over the
update (activations freed, the optimizer's temporaries allocated; at a small micro-batch this
one can be the larger, so the two are kept apart). Between micro-batch 1 and 2 the forward and
backward peak grows by one sample's activations, so at the configured micro-batch b::

    peak(b) = max(states + working + b * (fb(2) - fb(1)), states + update working)

The states (parameters, gradients, optimizer state) are counted from the model's own
parameters, as the config's strategy spreads them: DDP and one GPU hold them whole; FSDP2 shards
each tensor along its first dimension (padded to a multiple of the shard group) over the
data-parallel shard ranks and gathers units in the compute dtype: the root's own parameters
(those of no unit: backward starts with them), the unit running and the one prefetched (all
units with ``parallel.reshard_after_forward=false``), and one unit's unsharded gradients before
their reduce-scatter. What the measured peak holds beyond the measured step's own states and
activations (autocast's weight copies, workspaces, the update's temporaries) is the working
memory, kept as measured. The step is measured as the trainer computes: under autocast on one
GPU and DDP, with the model in the compute dtype for FSDP (whose casts compute so).

On a CPU nothing is measured: the states alone are reported, and labelled so.

    hpctrain plan memory my_task.yaml --gpus 8 --gpu h100
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hpctrain.config import JobConfig
from hpctrain.data.order import BatchLayout
from hpctrain.data.samples import build_sample_loader
from hpctrain.parallel.data import DTYPES, running_norms
from hpctrain.parallel.layout import check_task_config
from hpctrain.plan.memory_options import gpu_memory_bytes
from hpctrain.task import Task, TaskError, load_task

MEASURED_BATCHES = (1, 2)  # the micro-batches whose peaks give the per-sample slope


@dataclass
class TaskMemory:
    """Bytes per GPU of training a task; the measured terms are None where nothing was
    measured (no CUDA GPU)."""

    n_params: int
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's gathered parameters and unsharded gradients (0 without FSDP)
    working: float | None  # beside the states at forward and backward's peak
    activations: float | None
    per_sample: float | None  # activation bytes of one sample (the measured slope)
    update_working: float | None  # beside the states at the optimizer update's peak
    measured_on: str | None  # the GPU the step ran on
    gpu_bytes: float | None = None

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def peak_moment(self) -> str | None:
        """Where the step peaks: in forward and backward, or in the optimizer's update."""
        if self.working is None or self.activations is None or self.update_working is None:
            return None
        backward = self.gathered + self.working + self.activations
        return "backward" if backward >= self.update_working else "optimizer update"

    @property
    def peak(self) -> float | None:
        """The step's peak, or None where it was not measured."""
        if self.peak_moment is None:
            return None
        if self.peak_moment == "backward":
            return self.states + self.gathered + self.working + self.activations
        return self.states + self.update_working

    @property
    def fits(self) -> bool | None:
        """Whether the peak (else the states alone, which must fit too) plus 10% headroom fits
        the GPU; None without a GPU size."""
        if self.gpu_bytes is None:
            return None
        need = self.peak if self.peak is not None else self.states + self.gathered
        return need * 1.10 <= self.gpu_bytes


def shard_numel(shape: torch.Size, shards: int) -> int:
    """Elements one rank holds of a tensor FSDP2 shards over ``shards`` ranks (dim 0 padded to
    a multiple of ``shards``)."""
    if shards == 1 or len(shape) == 0:
        return math.prod(shape)
    return -(-shape[0] // shards) * math.prod(shape[1:])


def optimizer_bytes(params: list[torch.Tensor], cfg: JobConfig, shards: int) -> float:
    """Optimizer state per rank: AdamW's two moments in the parameters' dtype and its fp32
    ``step`` per tensor (fused); SGD's momentum buffer (none without momentum)."""
    numel = sum(shard_numel(p.shape, shards) * p.element_size() for p in params)
    if cfg.optim.name == "sgd":
        return float(numel if cfg.optim.momentum else 0)
    return float(2 * numel + 4 * len(params))


def gathered_bytes(task: Task, model: nn.Module, cfg: JobConfig, shards: int) -> float:
    """FSDP's gathered parameters (compute dtype) and one unit's unsharded gradients (reduce
    dtype) at the step's peak; 0 without FSDP."""
    if cfg.parallel.strategy != "fsdp":
        return 0.0
    compute = DTYPES[cfg.train.precision].itemsize
    reduce = DTYPES[cfg.parallel.reduce_precision].itemsize
    units = task.fsdp_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    root = compute * sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    sizes = sorted((sum(p.numel() for p in u.parameters()) for u in units), reverse=True)
    if cfg.parallel.reshard_after_forward is False:
        held = compute * sum(sizes)  # every unit stays gathered
    else:
        held = compute * sum(sizes[:2])  # the unit running and the one prefetched
    return float(root + held + reduce * (sizes[0] if sizes else 0))


def _states(model: nn.Module, cfg: JobConfig, shards: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per rank of the model as built."""
    trained = [p for p in model.parameters() if p.requires_grad]
    params = sum(shard_numel(p.shape, shards) * p.element_size() for p in model.parameters())
    grads = sum(shard_numel(p.shape, shards) * p.element_size() for p in trained)
    return float(params), float(grads), optimizer_bytes(trained, cfg, shards)


@dataclass
class MeasuredStep:
    """Peak bytes of measured training steps, and of the states resident in them."""

    forward_backward: dict[int, float]  # by micro-batch
    update: float  # the optimizer's update (the same at any micro-batch)
    states: float


def extrapolate(m: MeasuredStep, micro_batch: int) -> tuple[float, float, float, float]:
    """(working, activations at ``micro_batch``, per-sample activations, update working) from
    the steps measured at micro-batch 1 and 2."""
    fb = m.forward_backward
    per_sample = max(0.0, fb[2] - fb[1])
    working = max(0.0, fb[1] - per_sample - m.states)
    return working, per_sample * micro_batch, per_sample, max(0.0, m.update - m.states)


def _optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer kind (fused AdamW, or SGD), for its state's memory."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(params, lr=1e-6, momentum=cfg.optim.momentum, fused=True)
    return torch.optim.AdamW(params, lr=1e-6, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             eps=cfg.optim.eps, fused=True)


def _resident(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Bytes of the parameters, gradients and optimizer state held now."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def measure_step(task: Task, cfg: JobConfig, device: torch.device,
                 sizes: tuple[int, ...] = MEASURED_BATCHES) -> MeasuredStep:
    """The peaks of one training step at each micro-batch of ``sizes`` on CUDA ``device``
    (after a warm-up step at the first)."""
    fsdp = cfg.parallel.strategy == "fsdp"
    dtype = DTYPES[cfg.train.precision]
    torch.manual_seed(cfg.run.seed)
    with device:
        model = task.build_model()
    model.to(device).train()
    if fsdp and cfg.train.precision != "fp32":
        model.to(dtype)  # FSDP's MixedPrecisionPolicy computes in the parameters' dtype
        for m in running_norms(model):  # ... but the task trainer keeps these norms fp32
            m.float()
    autocast = (torch.autocast(device.type, dtype=dtype) if cfg.train.precision != "fp32"
                and not fsdp else contextlib.nullcontext())
    opt = _optimizer(model, cfg)
    loader = build_sample_loader(task.data, BatchLayout(max(sizes), 1, 1, 0), cfg.run.seed,
                                 device, task.collate, prefetch=0)
    batches = {b: loader.peek(b) for b in sizes}
    def peak_of(work) -> float:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device))

    def forward_backward(batch) -> None:
        with autocast:
            loss, _ = task.run_step(model, batch)
        loss.backward()

    fb, update = {}, 0.0
    for b in (sizes[0], *sizes):  # the first allocates the optimizer's state
        opt.zero_grad(set_to_none=True)  # as the trainer does after each update
        fb[b] = peak_of(functools.partial(forward_backward, batches[b]))
        update = max(update, peak_of(opt.step))
    return MeasuredStep(fb, update, _resident(model, opt))


def _count_model(task: Task) -> nn.Module:
    """The task's model for counting: on the meta device where its factory allows, else real."""
    try:
        with torch.device("meta"):
            return task.build_model()
    except TaskError:  # a factory that reads weights cannot build on meta
        return task.build_model()


def task_memory(cfg: JobConfig, gpus: int, gpu_bytes: float | None = None,
                device: torch.device | None = None) -> TaskMemory:
    """Per-GPU memory of training ``cfg``'s task on ``gpus`` GPUs; measured on CUDA ``device``
    (default: the current GPU, if any), states only elsewhere."""
    layout = check_task_config(cfg, gpus)
    shards = layout.dp_shard if cfg.parallel.strategy == "fsdp" else 1
    task = load_task(cfg.task, cfg.task_args)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    model = _count_model(task)
    params, grads, optimizer = _states(model, cfg, shards)
    report = TaskMemory(n_params=sum(p.numel() for p in model.parameters()), params=params,
                        grads=grads, optimizer=optimizer,
                        gathered=gathered_bytes(task, model, cfg, shards), working=None,
                        activations=None, per_sample=None, update_working=None,
                        measured_on=None, gpu_bytes=gpu_bytes)
    if device is None or device.type != "cuda":
        return report
    del model
    (report.working, report.activations, report.per_sample,
     report.update_working) = extrapolate(measure_step(task, cfg, device), cfg.train.micro_batch)
    report.measured_on = torch.cuda.get_device_name(device)
    return report


def print_task_memory(cfg: JobConfig, report: TaskMemory, gpus: int, as_json: bool) -> None:
    """Print ``report`` as ``plan memory`` prints the built-in model's (or as JSON)."""
    if as_json:
        print(json.dumps({**asdict(report), "peak": report.peak,
                          "peak_moment": report.peak_moment, "fits": report.fits,
                          "gpus": gpus}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    pc, tc = cfg.parallel, cfg.train
    console = Console(width=160)
    n = report.n_params
    size = f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"
    console.print(f"task {cfg.task} ({size} params), {pc.strategy} over "
                  f"{gpus} GPU{'s' if gpus > 1 else ''}, {tc.precision}, micro-batch "
                  f"{tc.micro_batch}, {cfg.optim.name}")
    # A model of one's own is often small: MB until something reaches a GB.
    largest = max(report.peak or 0.0, report.states + report.gathered)
    unit, scale = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)
    table = Table()
    table.add_column("per GPU")
    table.add_column(unit, justify="right")
    rows = [("parameters", report.params), ("gradients", report.grads),
            (f"{cfg.optim.name} state", report.optimizer)]
    if pc.strategy == "fsdp":
        rows.append(("FSDP gathered parameters + unit gradients", report.gathered))
    for label, value in rows:
        table.add_row(label, f"{value / scale:.2f}")
    if report.peak is None:
        table.add_row("working buffers, activations", "not measured")
        table.add_row("states (counted)", f"{(report.states + report.gathered) / scale:.2f}",
                      style="bold")
    else:
        table.add_row("working buffers (measured)", f"{report.working / scale:.2f}")
        table.add_row(f"activations (measured: {report.per_sample / scale:.3g} {unit} per "
                      "sample)", f"{report.activations / scale:.2f}")
        table.add_row("optimizer update's working memory (measured)",
                      f"{report.update_working / scale:.2f}")
        table.add_row(f"peak ({report.peak_moment})", f"{report.peak / scale:.2f}",
                      style="bold")
    console.print(table)
    if report.peak is None:
        console.print("CPU: nothing measured. The states above are counted from the model's "
                      "parameters; the activations of a model of your own are measured only "
                      "on a CUDA GPU (run this there for the peak).")
    else:
        console.print(f"measured on {report.measured_on}: one step at micro-batch "
                      f"{' and '.join(map(str, MEASURED_BATCHES))}, eager, extrapolated to "
                      f"{tc.micro_batch}")
    if report.fits is not None:
        verdict = "fits" if report.fits else "does NOT fit"
        what = "peak" if report.peak is not None else "states alone"
        console.print(f"{verdict}: {what} + 10% headroom vs {report.gpu_bytes / 1e9:.0f} GB")


def plan_task_memory(cfg: JobConfig, gpus: int, gpu: str | None, as_json: bool) -> None:
    """``hpctrain plan memory`` of a config with ``task:`` on ``gpus`` GPUs (``gpu``: h100,
    80, ... to say whether it fits)."""
    gpu_bytes = gpu_memory_bytes(gpu) if gpu else None
    print_task_memory(cfg, task_memory(cfg, gpus, gpu_bytes), gpus, as_json)
