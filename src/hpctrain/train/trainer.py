"""The training loop: ``train`` → ``train_step`` → ``forward_backward``.

``forward_backward`` is the seam a pipeline schedule replaces later: it takes one step's
micro-batches and returns the step's mean loss with gradients accumulated. Everything that can be
decided once (model, mesh, optimizer, precision) is built in ``__init__``.

Host syncs are kept to the logging cadence: losses, non-finite flags and token counts accumulate
on the device and are read every ``metrics.log_every`` steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hpctrain.config import JobConfig
from hpctrain.data.loader import BatchLayout, GlobalOrderSampler, TokenLoader, build_dataset
from hpctrain.errors import HpctrainError
from hpctrain.models import Transformer, count_params, flops_per_token
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.peaks import mfu, peak_tflops
from hpctrain.observe.progress import TrainProgress
from hpctrain.parallel.parallelize import autocast_dtype, parallelize
from hpctrain.runtime.dist import Distributed
from hpctrain.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("hpctrain.train")


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class NonFiniteLossError(HpctrainError):
    """The loss became NaN or infinite."""


@dataclass
class TrainResult:
    """What a finished run reports: the last logged global loss and the mean throughput."""

    steps: int
    final_loss: float
    tokens_per_s: float
    mfu: float | None


class Trainer:
    """Builds everything a run needs from a :class:`JobConfig` and trains it."""

    def __init__(self, cfg: JobConfig, dist_ctx: Distributed, metrics: MetricsWriter):
        self.cfg = cfg
        self.dist = dist_ctx
        self.device = dist_ctx.device
        self.metrics = metrics
        tc, pc = cfg.train, cfg.parallel

        if tc.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic; read when its handle is made.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        torch.manual_seed(cfg.run.seed)

        self.model_args = cfg.model.resolve()
        with torch.device("meta"):
            model = Transformer(self.model_args)
        self.model = parallelize(model, pc, dist_ctx.mesh, self.device, tc.precision,
                                 cfg.run.seed)
        self.autocast = autocast_dtype(pc, tc.precision)
        # Compiled, the fp32 upcast, log-softmax and gather fuse instead of materialising the
        # [tokens, vocab] fp32 logits several times.
        self.loss_fn = torch.compile(cross_entropy_loss) if pc.compile else cross_entropy_loss
        # fp16 overflows without loss scaling; the sharded scaler agrees on inf/NaN across
        # ranks so no rank skips a step the others take.
        self.scaler = None
        if tc.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler_cls = ShardedGradScaler if pc.strategy == "fsdp" else torch.amp.GradScaler
            self.scaler = scaler_cls(self.device.type)

        self.layout = BatchLayout(tc.micro_batch, tc.grad_accum, dist_ctx.world_size,
                                  dist_ctx.rank)
        peak_lr = cfg.optim.effective_lr(self.layout.global_batch)
        self.optimizer = build_optimizer(self.model, cfg.optim, peak_lr, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, tc.steps)

        dataset = build_dataset(cfg.data)
        sampler = GlobalOrderSampler(len(dataset), self.layout, cfg.run.seed)
        self.loader = TokenLoader(dataset, sampler, self.device, cfg.data.prefetch)

        self.step = 0
        self.tokens_per_step = self.layout.micro_batch * tc.grad_accum * cfg.data.seq_len
        self.flops_per_token = flops_per_token(self.model_args, cfg.data.seq_len)
        self.peak = cfg.metrics.peak_tflops or self._device_peak(tc.precision)
        n_params = count_params(self.model_args, include_embedding=True)
        log.info(
            "model %s: %.1fM params, strategy %s, global batch %d samples = %d tokens, "
            "peak lr %.3g, device peak %s",
            cfg.model.size, n_params / 1e6, pc.strategy, self.layout.global_batch,
            self.layout.global_batch * cfg.data.seq_len, peak_lr,
            f"{self.peak:.0f} TFLOP/s" if self.peak else "unknown device (MFU not reported)",
        )

    def _device_peak(self, precision: str) -> float | None:
        if self.device.type != "cuda":
            return None
        return peak_tflops(torch.cuda.get_device_name(self.device), precision)

    # -- the named steps ---------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; returns the mean loss (on device).

        Gradients are synchronised across ranks only on the last micro-batch.
        """
        n = len(micro_batches)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self._grad_sync(last=i == n - 1), self._autocast():
                loss = self.loss_fn(self.model(inputs), targets)
            scaled = loss / n
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
            total += scaled.detach()
        return total

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: gradients, clipping, update, schedule. Returns (loss, grad norm)."""
        loss = self.forward_backward(micro_batches)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def train(self, progress: bool = True) -> TrainResult:
        """Run until ``train.steps``, logging every ``metrics.log_every`` steps."""
        tc, every = self.cfg.train, self.cfg.metrics.log_every
        window = _Window(self.device)
        rates: list[float] = []
        last_loss = float("nan")
        last_mfu = None
        show = progress and self.cfg.metrics.progress and self.dist.rank == 0
        with TrainProgress(tc.steps, self.dist.env, enabled=show, plain_every=1) as bar:
            bar.update(self.step, None, None, None)
            while self.step < tc.steps:
                t0 = time.perf_counter()
                micro_batches = self.loader.next_step()
                window.data_time += time.perf_counter() - t0
                loss, norm = self.train_step(micro_batches)
                self.step += 1
                window.add(loss, norm)
                if self.step % every == 0 or self.step == tc.steps:
                    record = self._log(window)
                    last_loss = record["loss"]
                    last_mfu = record["mfu"]
                    if self.step > every or tc.steps <= every:  # first window holds warm-up
                        rates.append(record["tokens_per_s"])
                    bar.update(self.step, record["loss"], record["tokens_per_s"], record["mfu"])
                    window = _Window(self.device)
        self.loader.close()
        mean_rate = sum(rates) / len(rates) if rates else 0.0
        return TrainResult(self.step, last_loss, mean_rate, last_mfu)

    # -- helpers -----------------------------------------------------------------------------

    def _grad_sync(self, last: bool):
        model = self.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if last else model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _log(self, w: _Window) -> dict:
        """Read the window's device accumulators once, reduce the loss over ranks, write a line."""
        elapsed = time.perf_counter() - w.start
        stats = torch.stack([w.loss_sum, w.nonfinite]).float()
        if self.dist.world_size > 1:
            dist.all_reduce(stats)
        loss_sum, nonfinite = stats.tolist()
        if nonfinite:
            raise NonFiniteLossError(
                f"the loss was NaN or infinite on some rank in steps {self.step - w.steps + 1}.."
                f"{self.step}",
                hint="lower optim.lr, raise optim.warmup_steps, enable train.grad_clip, or use "
                "train.precision=bf16 instead of fp16",
            )
        loss = loss_sum / (w.steps * self.dist.world_size)
        tokens_per_s = w.steps * self.tokens_per_step / elapsed
        record = {
            "step": self.step,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": w.last_norm.item(),
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / w.steps,
            "data_time_s": w.data_time / w.steps,
            "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak) if self.peak else None,
            "mem_gb": self._memory_gb(),
        }
        self.metrics.write(record)
        # DEBUG: the rank log gets every line; the console shows the progress display instead.
        log.debug("step %d loss %.4f lr %.3g grad_norm %.3f %.0f tok/s step %.3fs data %.4fs",
                 self.step, loss, record["lr"], record["grad_norm"], tokens_per_s,
                 record["step_time_s"], record["data_time_s"])
        return record

    def _memory_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        # Peak resident set of this process (Linux reports KiB).
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class _Window:
    """Device-side accumulators for one logging window: no host sync until it is read."""

    def __init__(self, device: torch.device):
        self.start = time.perf_counter()
        self.steps = 0
        self.data_time = 0.0
        self.loss_sum = torch.zeros((), device=device)
        self.nonfinite = torch.zeros((), device=device)
        self.last_norm = torch.zeros((), device=device)

    def add(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        self.steps += 1
        self.loss_sum += loss
        self.nonfinite += (~torch.isfinite(loss)).float()
        self.last_norm = norm.detach()
