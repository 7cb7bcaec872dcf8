"""The Trainer over a user's own task (`hpctrain.task`): their model, samples and loss.

Only what differs from the built-in model is here: the model comes from the task's factory and is
spread by DDP or FSDP2 (per the task's units), batches come from `hpctrain.data.samples`, and
``forward_backward`` runs the task's step. The loop, checkpoints with exact resume, preemption,
the bad-step guard, metrics and goodput are the Trainer's own, unchanged.

The random generators are seeded from (run.seed, step, rank) before each step, so dropout and
other random ops in user code draw the same numbers after a resume as in an uninterrupted run.
Buffers a forward updates (BatchNorm-style running statistics) are rank 0's on every rank after each
step (DDP's default semantics, one broadcast per dtype), so validation and checkpoints see one
model.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.flop_counter import FlopCounterMode

from hpctrain import faults
from hpctrain.config import JobConfig
from hpctrain.data.loader import ValidationSampler
from hpctrain.data.order import BatchLayout
from hpctrain.data.prefetch import read_ahead
from hpctrain.data.samples import build_sample_loader, is_map_style, to_device
from hpctrain.errors import ConfigError
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.parallel.data import DTYPES, apply_ddp, broadcast_buffers, dp_mesh, running_norms
from hpctrain.parallel.layout import check_task_config
from hpctrain.runtime.config import refuse_large_model_on_cpu
from hpctrain.runtime.dist import Distributed
from hpctrain.task import Task, TaskError, call_user, check_finite, load_task, reading_sample
from hpctrain.train import checkpointing
from hpctrain.train.exact_eval import ExactSums, rank_batches
from hpctrain.train.trainer import Trainer
from hpctrain.train.window import Window

log = logging.getLogger("hpctrain.train")


def build_trainer(cfg: JobConfig, task: Task | None, dist_ctx: Distributed,
                  metrics: MetricsWriter, **kwargs) -> Trainer:
    """A TaskTrainer for a user's task (given, or named by ``cfg.task``), else the Trainer of the
    built-in model."""
    if task is None and cfg.task:
        task = load_task(cfg.task, cfg.task_args)
    if task is None:
        return Trainer(cfg, dist_ctx, metrics, **kwargs)
    return TaskTrainer(cfg, dist_ctx, metrics, task=task, **kwargs)


def refuse_large_task_on_cpu(cfg: JobConfig, task: Task) -> None:
    """Refuse a GPU-sized task model that run.device=auto would put on the CPU (no GPU
    visible), its parameters counted on the meta device before the real build."""
    if cfg.run.device != "auto" or torch.cuda.is_available():
        return
    # The factory runs twice (here on meta, then for real): through build_model as the real
    # build, so an HpctrainError it raises on purpose (a bad task_args value) stops the run here,
    # once. Any other failure is a TaskError naming the user's line, kept for the log: a factory
    # may not work with meta tensors (it reads weights), and the real build reports what fails.
    try:
        with torch.device("meta"):
            model = task.build_model()
    except TaskError as e:
        log.debug("the task's model could not be counted on the meta device: %s", e)
        return
    n_params = sum(p.numel() for p in model.parameters())
    refuse_large_model_on_cpu(n_params, model=f"the task's model ({cfg.task})",
                              force="run.device=cpu")


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The buffers training updates: running statistics of BatchNorm-style norms that track
    them (constant buffers, such as a rotary table, are the same on every rank already)."""
    return [b for m in running_norms(model) for b in m.buffers(recurse=False)]


class TaskTrainer(Trainer):
    """Trains a :class:`~hpctrain.task.Task` with the Trainer's loop, checkpoints and metrics:
    only ``_build`` (the task's model, spread, and samples) and the step differ."""

    def __init__(self, cfg: JobConfig, dist_ctx: Distributed, metrics: MetricsWriter, *,
                 task: Task, **kwargs):
        self.task = task
        super().__init__(cfg, dist_ctx, metrics, **kwargs)

    def _build(self) -> None:
        """The task's model (DDP or FSDP2), its samples in the global order, its FLOPs."""
        cfg, task = self.cfg, self.task
        tc, pc = cfg.train, cfg.parallel
        self.par = check_task_config(cfg, self.dist.world_size)
        dp_rank, dp_size = self.dist.dp
        self.layout = BatchLayout(tc.micro_batch, tc.grad_accum, dp_size, dp_rank)
        # The model first: a collate may use the device the factory was called under (the
        # image task decodes there), and the loader reads and collates a sample at once.
        refuse_large_task_on_cpu(cfg, task)
        with self.device:
            model = task.build_model()
        model.to(self.device).train()
        self.loader = build_sample_loader(task.data, self.layout, cfg.run.seed, self.device,
                                          task.collate, cfg.data.prefetch)
        self.val_dataset = task.eval_data
        # One GPU and DDP compute bf16/fp16 through autocast; FSDP casts the parameters itself.
        self.autocast = (DTYPES[tc.precision] if tc.precision != "fp32"
                         and pc.strategy != "fsdp" else None)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_sample = task.flops_per_sample or self._count_flops(model)
        self.signature = checkpointing.model_signature(model)  # before DDP/FSDP rename or shard
        # Buffers each rank updates from its own batch (BatchNorm's statistics): rank 0's are
        # broadcast after every step, so the ranks agree and a checkpoint holds what all hold.
        self.buffers = running_stats(model) if self.dist.world_size > 1 else []
        self.model = self._spread(model)
        self.pipeline = None
        self.after_update = _nothing
        self.attention = contextlib.nullcontext
        self.pp_group = None
        self.holds_loss = True
        self.forward_is_local = pc.strategy != "fsdp"
        # Per metric: the window's sum on the device, and how many values it holds (host).
        self._metric_sums: dict[str, tuple[torch.Tensor, int]] = {}
        tokens = task.tokens_per_sample
        self.tokens_per_step = self.layout.micro_batch * tc.grad_accum * tokens
        self.flops_per_token = self.flops_per_sample / tokens

    def _announce(self) -> None:
        """One log line: the task, its model's size, strategy, batch and learning rate."""
        log.info("task %s: %.2fM params, strategy %s, global batch %d samples, %.3g FLOPs per "
                 "sample, peak lr %.3g", self.cfg.task or type(self.model).__name__,
                 self.n_params / 1e6, self.cfg.parallel.strategy, self.layout.global_batch,
                 self.flops_per_sample, self.peak_lr)

    def _spread(self, model: nn.Module) -> nn.Module:
        """DDP, FSDP2 over the task's units then the root, or the model as it is."""
        pc, tc = self.cfg.parallel, self.cfg.train
        mesh = self.dist.mesh
        if pc.compile:
            model.compile()
        if pc.strategy == "ddp":
            return apply_ddp(model, mesh, self.device)
        if pc.strategy == "fsdp":
            mp = MixedPrecisionPolicy(param_dtype=DTYPES[tc.precision],
                                      reduce_dtype=DTYPES[pc.reduce_precision])
            reshard = pc.reshard_after_forward is not False
            # FSDP2 shards contiguous parameters only: a channels_last model's conv weights
            # become contiguous (channels_last inputs still run channels_last convolutions:
            # either operand in that layout picks it).
            with torch.no_grad():
                for p in model.parameters():
                    if not p.is_contiguous():
                        p.data = p.data.contiguous()
            shard_units(model, self.task.fsdp_units(model), dp_mesh(mesh), mp, reshard)
        return model

    def _count_flops(self, model: nn.Module) -> float:
        """Forward and backward FLOPs per sample, counted on the first micro-batch."""
        batch = self.loader.peek(self.layout.micro_batch)
        buffers = [b.detach().clone() for b in model.buffers()]  # e.g. BatchNorm's statistics
        with FlopCounterMode(display=False) as counter, self._autocast():
            loss, _ = self.task.run_step(model, batch)
            loss.backward()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        return counter.get_total_flops() / self.layout.micro_batch

    def _layout_record(self) -> dict:
        return {**super()._layout_record(), "task": self.cfg.task,
                "flops_per_sample": self.flops_per_sample,
                "tokens_per_sample": self.task.tokens_per_sample}

    def _first_loss_finite(self, loss: torch.Tensor) -> None:
        """Refuse a NaN first loss on every rank together: one rank raising alone would leave
        the others waiting in the gradients' all-reduce (later steps: the bad-step guard)."""
        bad = (~torch.isfinite(loss.detach().float())).to(torch.int32).reshape(())
        if self.dist.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            check_finite(loss, self.task.step or self.task.loss)  # names the user's code here
            raise TaskError("another rank's loss at the first step is not finite",
                            expected="a finite loss on every rank",
                            hint="that rank's log (logs/) names the code that returned it")

    def _train_state(self) -> checkpointing.TrainState:
        return checkpointing.TrainState(self.model, self.optimizer, self.scheduler, self.loader,
                                        self.scaler,
                                        tokens_per_sample=self.task.tokens_per_sample,
                                        model_signature=self.signature)

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """The task's step over one step's micro-batches (gradients synchronised on the last);
        returns this rank's share of the step's global mean loss."""
        n, dp = len(micro_batches), self.layout.world_size
        torch.manual_seed((self.cfg.run.seed * 1_000_003 + self.step) * 65_537 + self.dist.rank)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        poison = faults.active("nan", self.step + 1)
        counts = [self.task.count_samples(b) for b in micro_batches]
        weights = self._sample_weights(counts)
        for i, batch in enumerate(micro_batches):
            with self._grad_sync(last=i == n - 1), self._autocast():
                loss, metrics = self.task.run_step(self.model, batch)
            empty = counts[i] == 0
            if empty:
                # Nothing to learn from (a mean over no samples is NaN): a zero still tied to
                # the graph, so the backward and the ranks' gradient exchange run as on the
                # others. nan_to_num's gradient is 0 where the loss was not finite.
                loss = loss.float().nan_to_num(0.0, 0.0, 0.0) * 0
            if self.step == 0 and i == 0:
                self._first_loss_finite(loss)
            if poison:
                loss = loss * float("nan")
            # DDP and FSDP average the gradients over the ranks.
            share = loss.float() / n if weights is None else loss.float() * weights[i]
            if self.scaler is not None:
                self.scaler.scale(share).backward()
            else:
                share.backward()
            total += share.detach()
            if not empty:
                self._add_metrics(metrics)
        if self.buffers:
            broadcast_buffers(self.buffers)
        return total / dp

    def _sample_weights(self, counts: list[int | None]) -> list[torch.Tensor] | None:
        """Each micro-batch's weight when the task counts its samples: its count x ranks /
        the count over all micro-batches and ranks (1/n when none was dropped), so the ranks'
        averaged gradient is that of the mean over every counted sample. None: 1/n each."""
        if self.task.samples_in_batch is None:
            return None
        # A fill, not a copy from the host: the all-reduce stays queued on the device.
        total = torch.full((), float(sum(counts)), device=self.device, dtype=torch.float32)
        if self.dist.world_size > 1:
            dist.all_reduce(total)
        scale = self.layout.world_size / total.clamp_min(1)  # none kept anywhere: weight 0
        return [scale * c for c in counts]

    def _add_metrics(self, metrics: dict) -> None:
        """Sum a micro-batch's metrics on the device (read with the window's line): a scalar
        counts once, one value per sample (e.g. top-1 hits) once per sample it holds."""
        for name, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.dim() > 1:
                raise TaskError(f"the step's metric {name!r} is a {type(value).__name__}"
                                + (f" of shape {tuple(value.shape)}"
                                   if isinstance(value, torch.Tensor) else ""),
                                expected="a scalar tensor, or one value per sample")
            value = value.detach().float()
            count = value.numel() if value.dim() == 1 else 1  # a shape: no sync
            total, seen = self._metric_sums.get(name, (0, 0))
            self._metric_sums[name] = (total + value.sum(), seen + count)

    def _extend_record(self, record: dict, w: Window) -> None:
        """Samples/s, and the task's metrics as means over the window (this rank's)."""
        record["samples_per_s"] = record["tokens_per_s"] / self.task.tokens_per_sample
        # A metric no sample of the window had (every per-sample vector empty) is left out.
        sums = {k: (total, seen) for k, (total, seen) in self._metric_sums.items() if seen}
        if sums:
            values = torch.stack([total for total, _ in sums.values()]).tolist()
            record.update({k: v / seen for (k, (_, seen)), v
                           in zip(sums.items(), values, strict=True)})
        self._metric_sums = {}

    def _evaluate(self) -> dict:
        """The task's loss (and metrics) over ``eval_data``: exact global means over samples."""
        data = self.val_dataset
        if not is_map_style(data):
            raise ConfigError("Task(eval_data=...) is not map-style",
                              expected="__len__ and __getitem__ (each rank reads its share)")
        sampler = ValidationSampler(call_user(len, "len(Task.eval_data)", data),
                                    self.layout.world_size, self.layout.rank,
                                    self.cfg.train.micro_batch,
                                    max_samples=self.cfg.train.val_max_samples)
        collate = (self.task.eval_collate or self.task.collate
                   or torch.utils.data.default_collate)
        # DDP's forward would add its buffer and bucket bookkeeping; FSDP needs its own forward
        # (all ranks run the same number of batches).
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) \
            else self.model
        sums = ExactSums(self.device)

        def collated(rank_batch: tuple) -> tuple:
            indices, n = rank_batch
            items = [self._eval_sample(data, int(i)) for i in indices]
            return call_user(collate, "Task.collate", items), n

        model.eval()
        try:
            with torch.no_grad():
                # The next batches are read and collated (decoded, for images) on a thread
                # while the model runs on this one.
                for host, n in read_ahead(rank_batches(sampler), collated, self.device):
                    batch = to_device(host, self.device)
                    with self._autocast():
                        loss, metrics = self.task.run_step(model, batch)
                    sums.add({"val_loss": loss,
                              **{f"val_{k}": v for k, v in metrics.items()}}, n)
        finally:
            model.train()
        means, count = sums.reduce()
        return {**means, "val_samples": count}

    def _eval_sample(self, data, i: int):
        """Held-out sample ``i`` (its ``sample_rng()`` seeded as in epoch 0)."""
        with reading_sample(self.cfg.run.seed, 0, i):
            return call_user(data.__getitem__, "Task.eval_data[i]", i)

    def _described(self, record: dict) -> str:
        return f"loss {record['val_loss']:.4f} over {record['val_samples']} samples"


def shard_units(model: nn.Module, units: list[nn.Module], mesh, mp: MixedPrecisionPolicy,
                reshard: bool) -> None:
    """FSDP2 over each unit, then the root; each unit's BatchNorm-style norms are a group of
    their own that keeps fp32 parameters first (see `_norms_in_fp32`)."""
    for unit in [*units, model]:
        _norms_in_fp32(unit, mesh, mp, reshard)
        # A unit that is itself such a norm (a flat Sequential's child) is sharded now:
        # fully_shard refuses a module twice.
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


def _norms_in_fp32(unit: nn.Module, mesh, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """Shard ``unit``'s BatchNorm-style layers (those with running statistics, not sharded yet)
    as one FSDP group that keeps fp32 parameters and leaves its inputs' dtype alone: their
    fp32 statistics with bf16/fp16 weights are refused by the kernels, while bf16 activations
    with fp32 weights and statistics are what autocast runs too (one all-gather per unit)."""
    if mp.param_dtype in (None, torch.float32):
        return
    norms = [m for m in running_norms(unit) if m.affine and not isinstance(m, FSDPModule)]
    if norms:
        fully_shard(norms, mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=MixedPrecisionPolicy(reduce_dtype=mp.reduce_dtype,
                                                   cast_forward_inputs=False))


def _nothing() -> None:
    """No weights-derived state to refresh after an update (no float8 here)."""
