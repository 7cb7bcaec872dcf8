"""Pipeline parallelism on ``torch.distributed.pipelining``: stages, schedule, loss, bubble.

The model is cut into ``pp x stages_per_rank`` stages of consecutive blocks; the first stage also
holds the modules before the blocks (its family's ``first``: the embedding), the last those after
them (``last``: the final norm and the output layer). Each stage is the model class itself with
the parts it does not hold set to None, so parameter names stay canonical (block 7's parameters
keep their names on whichever stage holds block 7) and checkpoints reshard to any other layout.
Stages are balanced by modelled cost, the first and last parts included (``parallel/stages.py``).

Each optimizer step's batch per data-parallel rank flows through the schedule as micro-batches;
the loss is computed on the last stage, each micro-batch's summed token loss divided by the
step's global token count (so accumulation over micro-batches is exact), and backward runs inside
the schedule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from hpctrain.errors import ConfigError
from hpctrain.models.registry import family_of
from hpctrain.models.spec import ModelFamily
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.stages import bubble_estimate, stage_indices

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def split_model(model: nn.Module, layout: ParallelLayout, pp_rank: int,
                bounds: tuple[int, ...]) -> list[tuple[int, nn.Module]]:
    """This rank's stages of ``model`` (on meta): (stage index, a pruned copy of the model)."""
    family = family_of(model)
    n_blocks = len(family.block_list(model))
    parts = []
    for s in stage_indices(pp_rank, layout.pp, layout.stages_per_rank, layout.schedule):
        part = copy.deepcopy(model)
        blocks = family.block_list(part)
        for i in range(n_blocks):
            if not bounds[s] <= i < bounds[s + 1]:
                blocks[i] = None
        if s != 0:
            for name in family.first:
                setattr(part, name, None)
        if s != layout.num_stages - 1:
            for name in family.last:
                setattr(part, name, None)
        parts.append((s, part))
    return parts


class StageUnion(nn.Module):
    """This rank's stages seen as one model under canonical names, for the optimizer and
    checkpoints; it is never run (the schedule runs the stages)."""

    def __init__(self, parts: list[nn.Module], n_layers: int,
                 family: ModelFamily | None = None):
        super().__init__()
        family = family or family_of(parts[0])
        for name in (*family.first, *family.last):
            setattr(self, name, None)
        blocks = nn.ModuleList([None] * n_layers)
        setattr(self, family.blocks, blocks)
        for part in parts:
            for name in (*family.first, *family.last):
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))
            for i, block in enumerate(family.block_list(part)):
                if block is not None:
                    blocks[i] = block

    def forward(self, *args, **kwargs):
        """Not runnable: pipeline stages run through `Pipeline`."""
        raise RuntimeError("a pipeline-parallel model runs through its schedule (Pipeline.step)")


class PipelineLoss:
    """The schedule's loss on the last stage: each micro-batch's summed token loss scaled to
    its share of the step's global mean (times the data-parallel degree, which gradient
    averaging divides out again)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.scale = 1.0
        self.poison = False

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        if self.poison:  # fault injection (hpctrain.faults "nan")
            loss = loss * float("nan")
        return loss * self.scale


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    stages: list[PipelineStage]
    schedule: object
    loss: PipelineLoss
    layout: ParallelLayout
    bounds: tuple[int, ...]
    bubble: float
    group: dist.ProcessGroup

    @property
    def has_first(self) -> bool:
        """True where this rank holds stage 0 (it feeds the inputs)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        """True where this rank holds the last stage (it computes the loss)."""
        return any(stage.is_last for stage in self.stages)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float,
             poison: bool = False) -> torch.Tensor | None:
        """Forward and backward of one step's batch; the sum of the micro-batches' scaled
        losses on the last stage, None elsewhere."""
        self.loss.scale, self.loss.poison = scale, poison
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        return torch.stack(losses).sum() if self.has_last else None

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Summed token loss of one batch, forward only; None except on the last stage.

        Not through the training schedule (whose actions include backward): stage after stage
        in order, each running all micro-batches and sending its outputs on, so every receive
        has its send posted before and no two ranks wait on each other.
        """
        lay = self.layout
        me = self.group.rank()
        owner = {s: r for r in range(lay.pp)
                 for s in stage_indices(r, lay.pp, lay.stages_per_rank, lay.schedule)}
        mine = {stage.stage_index: stage.submod for stage in self.stages}
        m = lay.microbatches
        carried: list[torch.Tensor] = []  # outputs for the next stage when this rank holds it
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        total = None
        for s in range(lay.num_stages):
            if owner[s] != me:
                continue
            if s == 0:
                chunks = list(inputs.chunk(m))
            elif owner[s - 1] == me:
                chunks = carried
            else:
                chunks = [_recv(owner[s - 1], self.group, inputs.device) for _ in range(m)]
            outputs = [mine[s](x) for x in chunks]
            if s == lay.num_stages - 1:
                total = sum(self.loss.loss_fn(y, t).detach()
                            for y, t in zip(outputs, targets.chunk(m), strict=True))
            elif owner[s + 1] == me:
                carried = outputs
            else:
                for y in outputs:
                    sends += _send(y.contiguous(), owner[s + 1], self.group)
        for work, _ in sends:  # the tensors stay referenced until their sends complete
            work.wait()
        return total


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 6  # dtype, ndim, up to 4 sizes


def _send(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup
          ) -> list[tuple[dist.Work, torch.Tensor]]:
    """Send a header (dtype, shape) and the tensor to group rank ``peer``, without waiting."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dst = dist.get_global_rank(group, peer)
    return [(dist.isend(header, dst=dst, group=group), header),
            (dist.isend(tensor, dst=dst, group=group), tensor)]


def _recv(peer: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Receive one tensor sent by ``_send`` from group rank ``peer``."""
    src = dist.get_global_rank(group, peer)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor


def schedule_supported(schedule: str, device_type: str) -> bool:
    """False where the installed PyTorch cannot run ``schedule`` on this device type."""
    # Before PyTorch's P2P warm-up vote (2.13), a V-shaped pipeline's first step sends from a
    # rank to its own next stage through the process group, which gloo cannot do (seen with
    # 2.11: "Pair is not connected"); NCCL can.
    return not (schedule == "zbv" and device_type == "cpu"
                and not hasattr(PipelineStage, "_warmup_forward_vote"))


def build_pipeline(parts: list[tuple[int, nn.Module]], layout: ParallelLayout,
                   pp_mesh: DeviceMesh, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   bounds: tuple[int, ...]) -> Pipeline:
    """Stages over ``pp_mesh`` and the configured schedule (scaling left to the loss)."""
    if not schedule_supported(layout.schedule, device.type):
        raise ConfigError(
            f"parallel.pp_schedule = {layout.schedule} on {device.type} with PyTorch "
            f"{torch.__version__}",
            expected="PyTorch >= 2.13 for zbv on CPU (gloo), or a GPU",
            hint="use pp_schedule=interleaved_zb (zero bubble too) or interleaved_1f1b",
        )
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, stage_index=s, num_stages=layout.num_stages, device=device,
                            group=group) for s, module in parts]
    loss = PipelineLoss(loss_fn)
    cls = SCHEDULES[layout.schedule]
    first = stages[0] if layout.schedule in ("gpipe", "1f1b") else stages
    schedule = cls(first, n_microbatches=layout.microbatches, loss_fn=loss, scale_grads=False)
    bubble = bubble_estimate(layout.schedule, layout.pp, layout.microbatches,
                             layout.stages_per_rank)
    return Pipeline(stages, schedule, loss, layout, bounds, bubble, group)


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward (only) under autocast: a stage's forward is called by the
    schedule, which interleaves it with backward, so the trainer cannot wrap it."""
    active: list[torch.autocast] = []

    def enter(mod, args):
        ctx = torch.autocast(device_type, dtype=dtype)
        ctx.__enter__()
        active.append(ctx)

    def leave(mod, args, output):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
