"""The training loop: ``train`` → ``train_step`` → ``forward_backward``.

``forward_backward`` is the seam a pipeline schedule replaces later: it takes one step's
micro-batches and returns the step's mean loss with gradients accumulated. Everything that can be
decided once (model, mesh, optimizer, precision) is built in ``__init__``.

Host syncs are kept to the logging cadence: losses, bad-step flags and token counts accumulate
on the device (train/window.py) and are read every ``metrics.log_every`` steps. Between steps the
ranks exchange one small CPU message (preemption, time-based saves) and the checkpoint cadence
runs (train/run_checkpoints.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain import faults
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import DamagedCheckpoint
from hpctrain.config import JobConfig
from hpctrain.data.loader import (
    BatchLayout,
    GlobalOrderSampler,
    TokenLoader,
    build_dataset,
)
from hpctrain.errors import HpctrainError
from hpctrain.models.registry import family_of_args
from hpctrain.models.sdpa_backend import attention_backend
from hpctrain.observe.goodput import GoodputClock
from hpctrain.observe.live import RunObserver
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.peaks import mfu_peak_dtype, peak_tflops
from hpctrain.observe.power import start_energy_meter
from hpctrain.observe.progress import TrainProgress
from hpctrain.parallel.float8 import Float8Training
from hpctrain.parallel.grad_norm import clip_divisor, clip_grads_, global_grad_norm
from hpctrain.parallel.layout import check_layout
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.tensor import reduce_partial_grads
from hpctrain.pretrained.weights import load_pretrained, starts_from_pretrained
from hpctrain.runtime.dist import MESH_AXES, Distributed
from hpctrain.runtime.watchdog import Watchdog
from hpctrain.train import checkpointing
from hpctrain.train.compile_cache import CompileCache, run_compile_cache
from hpctrain.train.guard import BadStepGuard
from hpctrain.train.loss import build_loss_fn
from hpctrain.train.optim import build_optimizer, build_scheduler
from hpctrain.train.preemption import ControlChannel, PreemptionFlag
from hpctrain.train.run_checkpoints import RunCheckpoints
from hpctrain.train.validate import evaluate
from hpctrain.train.window import Throughput, Window

log = logging.getLogger("hpctrain.train")


class NonFiniteLossError(HpctrainError):
    """The loss became NaN or infinite (or spiked) and the guard could not recover."""


@dataclass
class TrainResult:
    """What a finished run reports: the last logged global loss and its throughput."""

    steps: int
    final_loss: float
    tokens_per_s: float | None  # per rank, as train.window.Throughput defines it
    mfu: float | None
    goodput: dict | None = None  # the run's account (rank 0; see observe/goodput.py)
    # Resumed at or past train.steps: nothing was trained (the saved result is the run's).
    already_complete: bool = False


class Trainer:
    """Builds everything a run needs from a :class:`JobConfig` and trains it."""

    def __init__(self, cfg: JobConfig, dist_ctx: Distributed, metrics: MetricsWriter, *,
                 ckpt: CheckpointManager, watchdog: Watchdog, preempt: PreemptionFlag,
                 control: ControlChannel, goodput: GoodputClock | None = None):
        self.cfg = cfg
        self.dist = dist_ctx
        self.device = dist_ctx.device
        self.metrics = metrics
        self.ckpt = ckpt
        # Where the wall time goes (rank 0 keeps the run's ledger; other ranks count only).
        self.goodput = goodput or GoodputClock()
        self.watchdog = watchdog
        # Built first: a background writer starts while the model is built.
        self.checkpoints = RunCheckpoints(cfg, ckpt, dist_ctx, metrics=metrics,
                                          goodput=self.goodput, watchdog=watchdog,
                                          preempt=preempt, control=control,
                                          state=self._train_state, loaded=self._loaded)
        tc = cfg.train
        if tc.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic; read when its handle is made.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        torch.manual_seed(cfg.run.seed)  # every rank builds the same initial weights
        self._build()
        # fp16 overflows without loss scaling; the sharded scaler agrees on inf/NaN across
        # ranks so no rank skips a step the others take.
        self.scaler = None
        if tc.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler_cls = (ShardedGradScaler if cfg.parallel.strategy == "fsdp"
                          else torch.amp.GradScaler)
            self.scaler = scaler_cls(self.device.type)
        self.peak_lr = cfg.optim.effective_lr(self.layout.global_batch)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.peak_lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, tc.steps)
        self.guard = BadStepGuard(cfg.guard, self.device)
        self.lr_applied = 0.0  # the learning rate of the last update (for the metrics)
        self._skipped_logged = 0.0  # bad steps already reported (the guard counts them all)
        self.step = 0
        self.throughput = Throughput()  # this attempt's tokens/s per rank, for its summaries
        # fp8's MFU counts against the bf16 peak: the fp8 datasheet rate applies to its GEMMs only.
        self.peak = cfg.metrics.peak_tflops or self._device_peak(mfu_peak_dtype(tc.precision))
        self._announce()
        self.metrics.write(self._layout_record())
        # Stragglers, profiles, trackers. The forward is a rank's own time only where it
        # holds no collective (one process, DDP); see observe/stragglers.py.
        self.observe = RunObserver(
            cfg, dist_ctx.rank, dist_ctx.world_size, self.device, metrics, self.model,
            watchdog.hosts, watchdog=watchdog, group=dist_ctx.control_group,
            forward_is_local=self.forward_is_local)

    def _build(self) -> None:
        """Check the layout, build and spread the model, open the data: sets ``par``,
        ``layout``, ``model``, ``pipeline``, ``after_update``, ``autocast``, ``attention``,
        ``pp_group``, ``holds_loss``, ``loader``, ``val_dataset``, ``tokens_per_step``,
        ``flops_per_token`` and ``forward_is_local`` (what the loop reads)."""
        cfg, dist_ctx, ckpt = self.cfg, self.dist, self.ckpt
        tc, pc = cfg.train, cfg.parallel
        # Every layout rule (degrees against the world size, heads, vocabulary, layers,
        # micro-batches) is checked before anything is built.
        self.par = check_layout(cfg, dist_ctx.world_size)
        local = dist_ctx.env.local_world_size
        if self.par.tp > 1 and (local % self.par.tp or self.par.tp > local):
            # Ranks are numbered node by node and tp is the innermost mesh axis: a TP group
            # stays inside a node only if tp divides the ranks per node.
            log.warning("parallel.tp = %d does not divide the %d ranks per node: tensor-"
                        "parallel groups span nodes, and their per-block collectives cross "
                        "the network", self.par.tp, local)
        self.model_args = cfg.model.resolve()
        # The model's family says how to build, count and spread it (hpctrain.models.spec).
        self.family = family = family_of_args(self.model_args)
        mesh = dist_ctx.mesh
        self.loss_fn = build_loss_fn(self.par.tp, mesh, self.model_args.vocab_size,
                                     compile=pc.compile)
        model = family.build(self.model_args)
        local_batch = tc.micro_batch * tc.grad_accum
        parallel = parallelize(model, pc, self.par, mesh, self.device, tc.precision,
                               cfg.run.seed, loss_fn=self.loss_fn, seq_len=cfg.data.seq_len,
                               microbatch_tokens=local_batch // self.par.microbatches
                               * cfg.data.seq_len,
                               fp8=Float8Training(tc.fp8_recipe, tc.fp8_emulate),
                               master_weights=tc.master_weights)
        self.model, self.pipeline = parallel.model, parallel.pipeline
        # Whatever derives from the weights (float8 scales) is refreshed after each update.
        self.after_update = parallel.after_update
        # Pretrained weights start a run; a resumed one takes its own from its checkpoint.
        if cfg.model.init_from and starts_from_pretrained(cfg.checkpoint.resume,
                                                          bool(ckpt.committed())):
            load_pretrained(self.model, cfg.model.init_from, self.model_args, ckpt.verify,
                            ckpt.group)
        self.autocast = parallel.autocast
        # The attention kernel for whole steps (backward and recomputation included).
        self.attention = attention_backend(cfg.model.attention_backend, self.device)
        self.pp_group = mesh["pp"].get_group() if self.par.pp > 1 else None
        # Ranks of one tensor-parallel group hold the same loss and only the last pipeline
        # stage holds it at all: one rank per model replica contributes it to global sums.
        self.holds_loss = (mesh.get_local_rank("tp") == 0
                           and (self.pipeline is None or self.pipeline.has_last))
        self.forward_is_local = (pc.strategy != "fsdp" and self.par.tp == 1
                                 and self.pipeline is None)

        # Batches go to data-parallel coordinates: the ranks of one model replica (its tensor-
        # and pipeline-parallel ranks) read the same samples.
        dp_rank, dp_size = dist_ctx.dp
        self.layout = BatchLayout(tc.micro_batch, tc.grad_accum, dp_size, dp_rank)
        # With the model's vocabulary: a token id it cannot embed is refused here, shard named.
        vocab = self.model_args.vocab_size
        dataset = build_dataset(cfg.data, vocab_size=vocab)
        self.val_dataset = (build_dataset(cfg.data, split="val", vocab_size=vocab)
                            if cfg.data.val_fraction else None)
        sampler = GlobalOrderSampler(len(dataset), self.layout, cfg.run.seed,
                                     remainder=cfg.data.remainder, seq_len=cfg.data.seq_len)
        self.loader = TokenLoader(dataset, sampler, self.device, cfg.data.prefetch)
        # Per GPU: a model replica's tokens are counted once, shared by its tp x pp ranks.
        self.tokens_per_step = (self.layout.micro_batch * tc.grad_accum * cfg.data.seq_len
                                / (self.par.tp * self.par.pp))
        self.flops_per_token = family.flops_per_token(self.model_args, cfg.data.seq_len)

    def _announce(self) -> None:
        """One log line: the model, its size, layout, batch, learning rate and device peak."""
        cfg, tc = self.cfg, self.cfg.train
        n_params = self.family.count_params(self.model_args, include_embedding=True)
        log.info(
            "model %s: %.1fM params, strategy %s, layout %s, global batch %d samples = %d "
            "tokens, peak lr %.3g, device peak %s",
            cfg.model.init_from or cfg.model.size, n_params / 1e6, cfg.parallel.strategy,
            self.par.describe(), self.layout.global_batch,
            self.layout.global_batch * cfg.data.seq_len, self.peak_lr,
            f"{self.peak:.0f} TFLOP/s ({mfu_peak_dtype(tc.precision)}, MFU's reference)"
            if self.peak else "unknown device (MFU not reported)",
        )

    def _layout_record(self) -> dict:
        """The layout event: degrees, this rank's coordinates, with PP its stages, and the dtype
        whose peak MFU is stated against (bf16 for an fp8 run)."""
        mesh = self.dist.mesh
        record = {"event": "layout", "pp": self.par.pp, "dp_replicate": self.par.dp_replicate,
                  "dp_shard": self.par.dp_shard, "tp": self.par.tp,
                  "coords": {axis: mesh.get_local_rank(axis) for axis in MESH_AXES},
                  "tokens_per_step_per_gpu": self.tokens_per_step,
                  "mfu_peak_dtype": mfu_peak_dtype(self.cfg.train.precision)}
        if self.pipeline is not None:
            bounds = self.pipeline.bounds
            record.update(
                schedule=self.par.schedule, microbatches=self.par.microbatches,
                pp_bubble=self.pipeline.bubble,
                stages={stage.stage_index: [bounds[stage.stage_index],
                                            bounds[stage.stage_index + 1]]
                        for stage in self.pipeline.stages})
        return record

    def _device_peak(self, precision: str) -> float | None:
        if self.device.type != "cuda":
            return None
        return peak_tflops(torch.cuda.get_device_name(self.device), precision)

    # -- the named steps ---------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> torch.Tensor:
        """Forward and backward over one step's micro-batches (gradients synchronised across
        ranks on the last one only); returns this rank's share of the step's global mean loss.

        Each micro-batch contributes its summed token loss over the step's global count of
        real target tokens, so padding and uneven micro-batches weigh exactly what they hold.
        Data parallelism averages gradients over its replicas, hence the ``dp`` factor. Only
        the ranks holding the loss (``holds_loss``) return their share; the others return 0,
        so a sum over all ranks counts each replica once.

        With pipeline parallelism the micro-batches make one batch that the schedule cuts into
        ``parallel.pp_microbatches`` and runs forward and backward through the stages.
        """
        n = len(micro_batches)
        dp = self.layout.world_size
        # All targets that count in the global batch; a step of prompts only adds nothing.
        denom = float(max(1, self.loader.last_target_tokens))
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        poison = faults.active("nan", self.step + 1)
        if self.pipeline is not None:
            inputs = torch.cat([x for x, _ in micro_batches])
            targets = torch.cat([y for _, y in micro_batches])
            summed = self.pipeline.step(inputs, targets, scale=dp / denom, poison=bool(poison))
            if summed is not None and self.holds_loss:
                total += summed.detach() / dp
            return total
        for i, (inputs, targets) in enumerate(micro_batches):
            with self._grad_sync(last=i == n - 1), self._autocast():
                loss = self._summed_loss(inputs, targets)
            if poison:
                loss = loss * float("nan")
            share = loss / denom
            if self.scaler is not None:
                self.scaler.scale(share * dp).backward()
            else:
                (share * dp).backward()
            total += share.detach()
        return total if self.holds_loss else total.zero_()

    def _summed_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward: its summed token loss (``train.loss_chunks`` > 0: the
        model applies its output layer and the loss together, chunk by chunk)."""
        chunks = self.cfg.train.loss_chunks
        if chunks:
            return self.model(inputs, targets=targets, loss_chunks=chunks)
        return self.loss_fn(self.model(inputs), targets)

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: gradients, clipping, update, schedule. Returns (loss, grad norm).

        The loss returned is the global mean over ranks; a bad one (non-finite, or a spike)
        makes the fused optimizer skip the update on the device.
        """
        with self.attention():
            loss = self.forward_backward(micro_batches)
        if self.dist.world_size > 1:
            dist.all_reduce(loss)  # the sum of the ranks' shares: every rank judges one value
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # The norm of the whole model's gradient (all stages and shards), equal on every rank.
        params = list(self.model.parameters())
        if self.par.tp > 1:
            reduce_partial_grads(params)
        norm = global_grad_norm(params, self.pp_group)
        clip = self.cfg.train.grad_clip
        if clip > 0 and self.scaler is None:
            # The fused AdamW divides each gradient by grad_scale as it reads it: clipping there
            # spares a pass that reads and writes every gradient. fp16's GradScaler sets
            # grad_scale itself, so fp16 scales the gradients first.
            self.optimizer.grad_scale = clip_divisor(norm, clip)
        elif clip > 0:
            clip_grads_(params, clip, norm)
        bad = self.guard.check(loss, norm)
        self.lr_applied = self.optimizer.param_groups[0]["lr"]
        if self.scaler is not None:
            # The scaler passes its own found_inf (overflow) to the fused kernel.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.found_inf = bad
            self.optimizer.step()
        self.after_update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def train(self, progress: bool = True) -> TrainResult:
        """Run until ``train.steps``: log, checkpoint, answer preemption, guard bad steps."""
        tc, every = self.cfg.train, self.cfg.metrics.log_every
        if self.complete:
            # Resumed from the last step (or past it): an earlier attempt finished the run.
            self.checkpoints.finish(self.step)
            self.loader.close()
            self.observe.close(self.step)
            return TrainResult(self.step, float("nan"), None, None, already_complete=True)
        window = Window(self.device)
        last_loss = float("nan")
        last_mfu = None
        show = progress and self.cfg.metrics.progress and self.dist.rank == 0
        cache = self._compile_cache()
        if cache is not None:
            cache.load()  # before the first step compiles
            self.goodput.startup_part("compile_cache")
        first = self.step + 1
        self.goodput.started(self.step if self.last_checkpoint else None)
        if self.dist.rank == 0 and self.cfg.metrics.energy:  # rank 0 keeps the run's ledger
            self._meter_energy()
        with TrainProgress(tc.steps, self.dist.env, enabled=show, plain_every=1) as bar:
            bar.update(self.step, None, None, None)
            while self.step < tc.steps:
                self.observe.step_start(self.step + 1)
                hang = faults.active("hang", self.step + 1)
                if hang:
                    seconds = float(hang.get("seconds", 3600))
                    # Said before it happens: a log that shows the fault, and a test that must
                    # act inside the hang (not between the last step and this one) can see it.
                    log.warning("HPCTRAIN_FAULTS: hanging %.0f s before step %d", seconds,
                                self.step + 1)
                    self._hang(seconds, hang.get("until"))
                self.watchdog.beat(self.step, "data")
                t0 = time.perf_counter()
                with self.goodput.part("data_wait"):
                    micro_batches = self.loader.next_step()
                window.data_time += time.perf_counter() - t0
                self.watchdog.beat(self.step, "forward_backward")
                loss, norm = self.train_step(micro_batches)
                self.step += 1
                self.observe.step_end(self.step)
                self.goodput.step_done(self.step, writing=self.ckpt.in_flight)
                if cache is not None and self.step == first:
                    cache.save()  # what the first step compiled, for the next attempt
                window.add(loss, norm)
                if self.step % every == 0 or self.step == tc.steps:
                    record = self._log(window)
                    last_loss = record["loss"]
                    last_mfu = record["mfu"]
                    self.throughput.add(window.steps * self.tokens_per_step,
                                        window.steps * record["step_time_s"])
                    bar.update(self.step, record["loss"], record["tokens_per_s"], record["mfu"])
                    window = Window(self.device)
                if tc.val_every and self.step % tc.val_every == 0 and self.step < tc.steps:
                    started = time.perf_counter()
                    with self.goodput.part("validation"):
                        self.validate()
                    # Not training time: the window's tokens/s and step time leave it out.
                    window.start += time.perf_counter() - started
                # Last: a preemption exits from here, after this step's metrics are written.
                self.watchdog.beat(self.step, "checkpoint/control")
                self.checkpoints.between_steps(self.step)
        self.checkpoints.start_final(self.step)  # written while the last validation runs
        with self.goodput.part("validation"):
            self.validate()
        self.checkpoints.finish(self.step)
        self.loader.close()
        self.observe.close(self.step)
        account = self.goodput.finish(exit_code=0)
        if account is not None:
            self.metrics.write({"event": "goodput", **account})
        return TrainResult(self.step, last_loss, self.throughput.tokens_per_s, last_mfu,
                           account)

    def _compile_cache(self) -> CompileCache | None:
        """This rank's compile cache in the run directory, when the model is compiled."""
        return run_compile_cache(self.cfg, self.metrics.run_dir.root, self.dist.world_size,
                                 self.dist.rank, self.device)

    def _meter_energy(self) -> None:
        """Count the GPUs' energy in goodput from here (none on a CPU run or without NVML)."""
        meter = start_energy_meter(self.device, self.dist.env.local_world_size)
        if meter is not None:
            # tokens_per_step is per GPU and the trainer's own (a task's tokens_per_sample,
            # not data.seq_len): the job's tokens per step are that times the GPUs.
            self.goodput.meter_energy(
                meter, tokens_per_step=self.tokens_per_step * self.dist.world_size,
                gpus=self.dist.world_size, grid_gco2_per_kwh=self.cfg.metrics.grid_gco2_per_kwh)

    def _hang(self, seconds: float, until: str | None = None) -> None:
        """The ``hang`` fault: sleep, unless a preemption signal arrives meanwhile or the file
        ``until`` appears.

        A held run answers a signal as a busy one does, at this step (the fault's purpose is
        to hold the run at a known step while a test acts), without sitting out the rest; a
        test that has acted lets it go on by creating ``until``."""
        deadline = time.monotonic() + seconds
        while self.checkpoints.preempt.requested is None:
            left = deadline - time.monotonic()
            if left <= 0 or (until is not None and os.path.exists(until)):
                return
            time.sleep(min(left, 0.05))

    def validate(self) -> dict | None:
        """Evaluate the held-out data (if any) and log it like the training metrics."""
        if self.val_dataset is None:
            return None
        self.watchdog.beat(self.step, "validation")
        record = {"step": self.step, **self._evaluate()}
        self.metrics.write(record)
        log.info("validation at step %d: %s", self.step, self._described(record))
        return record

    def _evaluate(self) -> dict:
        """Exact global loss and perplexity over the held-out split (train/validate.py)."""
        tc = self.cfg.train
        # Through a pipeline, batches have the training step's shape (the schedule's).
        micro_batch = tc.micro_batch * tc.grad_accum if self.pipeline else tc.micro_batch
        with self.attention():
            return evaluate(
                self.model, self.val_dataset, micro_batch=micro_batch, rank=self.layout.rank,
                world_size=self.layout.world_size, device=self.device, autocast=self.autocast,
                loss_fn=self.loss_fn if self.par.tp > 1 else None, pipeline=self.pipeline,
                holds_loss=self.holds_loss, loss_chunks=tc.loss_chunks,
                max_samples=tc.val_max_samples)

    def _described(self, record: dict) -> str:
        """The validation record in words, for the log."""
        r = record
        bounded = ("" if r["val_samples"] == r["val_split_samples"]
                   else "; train.val_max_samples bounds it, 0 takes all")
        return (f"loss {r['val_loss']:.4f}, perplexity {r['val_ppl']:.2f} over "
                f"{r['val_tokens']} tokens ({r['val_samples']} of the {r['val_split_samples']} "
                f"held-out samples, {r['val_batches']} batches per rank{bounded})")

    @property
    def complete(self) -> bool:
        """Whether the run is at (or past) ``train.steps``: resumed from its last step."""
        return self.step >= self.cfg.train.steps

    @property
    def last_checkpoint(self) -> str | None:
        """The newest checkpoint known to be committed (what exit_info reports and a restart
        resumes from): an async save counts once its commit is known, never when it starts."""
        return self.ckpt.last_committed

    def resume(self, how: str) -> None:
        """Start from a checkpoint: ``auto`` (the newest that verifies and loads; damaged ones
        are skipped, and refused when all are), ``never``, or a path (damage is an error)."""
        self.checkpoints.resume(how)

    def _train_state(self) -> checkpointing.TrainState:
        return checkpointing.TrainState(self.model, self.optimizer, self.scheduler, self.loader,
                                        self.scaler)

    def _loaded(self, step: int) -> None:
        """A checkpoint was put back into this trainer's objects: continue from its step."""
        self.after_update()  # the loaded weights' float8 scales
        self.step = step

    def _rollback(self, streak: int) -> None:
        """Restore the newest good checkpoint, keeping the data position (skips bad batches);
        damaged checkpoints are passed over as on resume."""
        skipped_from = self.step
        what = (f"{streak} bad steps in a row (loss NaN or infinite, or spiking) up to step "
                f"{self.step}, and no checkpoint to roll back to")
        hint = ("lower optim.lr, raise optim.warmup_steps, enable train.grad_clip, or use "
                "train.precision=bf16 instead of fp16")
        try:
            path = self.checkpoints.roll_back(skipped_from)
        except DamagedCheckpoint as e:
            raise NonFiniteLossError(f"{what} that is not damaged: {e.what}", hint=hint) from None
        if path is None:
            raise NonFiniteLossError(what, hint=hint)
        self.guard.reset_consecutive()
        log.warning("rollback: %d bad steps in a row up to step %d; restored %s and skipped "
                    "the batches since it", streak, skipped_from, path.name)
        self.metrics.write({"event": "rollback", "step": self.step, "from_step": skipped_from,
                            "checkpoint": path.name, "bad_streak": streak})

    # -- helpers -----------------------------------------------------------------------------

    def _extend_record(self, record: dict, w: Window) -> None:
        """Add what this trainer measures beyond the window's line: the pipeline's bubble."""
        if self.pipeline is not None:
            record["pp_bubble"] = self.pipeline.bubble

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

    def _log(self, w: Window) -> dict:
        """Read the window's device accumulators once (the one host sync), write a line."""
        (good_sum, good, skipped, streak), elapsed = w.read(self.guard.skipped,
                                                           self.guard.consecutive)
        self.goodput.window_closed()  # after the sync: the window's device time is in
        if skipped > self._skipped_logged:
            new = int(skipped - self._skipped_logged)
            log.warning("%d bad step(s) skipped in steps %d..%d (loss NaN/inf or a spike)", new,
                        self.step - w.steps + 1, self.step)
            self.metrics.write({"event": "bad_steps", "step": self.step, "skipped": new})
            if self.cfg.guard.action == "stop":
                raise NonFiniteLossError(
                    f"the loss was NaN or infinite (or spiked) in steps "
                    f"{self.step - w.steps + 1}..{self.step}",
                    hint="guard.action=skip skips such steps; or lower optim.lr",
                )
        self._skipped_logged = skipped
        loss = good_sum / good if good else float("nan")
        record = w.record(self.step, loss, elapsed, lr=self.lr_applied,
                          tokens_per_step=self.tokens_per_step,
                          flops_per_token=self.flops_per_token, peak=self.peak,
                          device=self.device)
        self._extend_record(record, w)
        self.observe.window(record)  # own time, straggler exchange (one message per window)
        self.metrics.write(record)
        if streak >= self.cfg.guard.max_consecutive:
            self._rollback(int(streak))
        # DEBUG: the rank log gets every line; the console shows the progress display instead.
        log.debug("step %d loss %.4f lr %.3g grad_norm %.3f %.0f tok/s step %.3fs data %.4fs",
                 self.step, loss, record["lr"], record["grad_norm"], record["tokens_per_s"],
                 record["step_time_s"], record["data_time_s"])
        return record
