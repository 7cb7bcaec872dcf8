"""Config sections ``train:`` (the loop) and ``optim:`` (AdamW and the LR schedule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError


@dataclass
class TrainConfig:
    """Loop length, batch shape, precision and numerical safety."""

    steps: int = 300
    # Samples per rank per micro-batch; the global batch is micro_batch * grad_accum * ranks.
    # auto (with global_batch_tokens): the largest that fits, chosen at start (plan/auto.py).
    micro_batch: int | Literal["auto"] = 8
    # Micro-batches accumulated per optimizer step. Unset: 1, or with global_batch_tokens
    # derived at start, global_batch_tokens / (micro_batch x data-parallel ranks x
    # data.seq_len). Given beside global_batch_tokens it must equal that (or, with micro_batch
    # auto, it fixes the micro-batch): unset and 1 differ, so a 1 the user wrote is never
    # silently replaced (plan/auto.py).
    grad_accum: int | None = None
    # The global batch in tokens per optimizer step (unset: micro_batch x grad_accum x ranks
    # samples). Fixed whatever the GPU count, micro-batch or grad_accum: `auto` and a resume
    # on another GPU count change how it is split, never the mathematics.
    global_batch_tokens: int | None = None
    # fp8: parameters and most ops in bf16, the blocks' Linear matmuls in float8 (torchao; needs
    # an H100-class GPU: see hpctrain.parallel.float8).
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    # With fp8: torchao's scaling recipe, one scale per tensor (fastest; FSDP gathers float8
    # weights) or per row (more accurate with outliers).
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    # With fp8, for tests and CPU debugging: computes in emulation (any device), slow.
    fp8_emulate: bool = False
    # The dtype the parameters, their gradients and AdamW's moments are kept in. fp32: master
    # weights, the forward computes in `precision` (autocast or FSDP's casts). bf16 (with
    # precision bf16): pure bf16 training, as torchtitan's --training.dtype bfloat16: half the
    # state memory and no casts, but an update below about 2^-9 of a weight rounds away
    # (README, "Pure bf16"). Checked against precision by ParallelConfig.check_precision.
    master_weights: Literal["fp32", "bf16"] = "fp32"
    # Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged).
    grad_clip: float = 1.0
    # Deterministic kernels and a fixed data order: the same config gives the same loss curve.
    deterministic: bool = False
    # Evaluate the held-out split (data.val_fraction > 0) every this many steps (0: only at
    # the end of training).
    val_every: int = 0
    # Held-out samples each validation evaluates, spread evenly over the split (the same ones
    # every time and on any number of ranks); 0 evaluates the whole split each time. Bounded by
    # default: the whole split took 81% of a short run's wall time.
    val_max_samples: int = 256
    # >0: the output layer and the loss run together over this many token chunks, so the
    # [tokens, vocab] logits (and their fp32 copy) never exist whole; 0: the plain loss.
    # Not with tensor parallelism (its loss never gathers the logits anyway) or pipelines.
    loss_chunks: int = 0

    def validate(self) -> None:
        """Check sizes and the clip value; an unset grad_accum without a batch in tokens is 1."""
        if self.grad_accum is None and self.global_batch_tokens is None:
            self.grad_accum = 1  # nothing to derive it from: no accumulation, as always
        for key in ("steps", "micro_batch", "grad_accum"):
            value = getattr(self, key)
            if value not in ("auto", None) and value < 1:
                raise ConfigError(f"train.{key} = {value} must be >= 1")
        if self.global_batch_tokens is not None and self.global_batch_tokens < 1:
            raise ConfigError(f"train.global_batch_tokens = {self.global_batch_tokens} must be "
                              ">= 1", hint="drop it to give the batch as micro_batch x "
                              "grad_accum x ranks samples")
        if self.micro_batch == "auto" and self.global_batch_tokens is None:
            raise ConfigError(
                "train.micro_batch = auto without train.global_batch_tokens",
                expected="a global batch in tokens that auto splits into micro-batches: it "
                "chooses the speed, never the batch the optimizer sees",
                hint="add train.global_batch_tokens (e.g. 1048576 = 512 samples of 2048 "
                "tokens), or give train.micro_batch a number")
        if self.loss_chunks < 0:
            raise ConfigError(f"train.loss_chunks = {self.loss_chunks} must be >= 0",
                              hint="0 computes the plain loss from the whole logits")
        if self.val_max_samples < 0:
            raise ConfigError(f"train.val_max_samples = {self.val_max_samples} must be >= 0",
                              hint="0 evaluates the whole held-out split")
        if self.val_every < 0:
            raise ConfigError(f"train.val_every = {self.val_every} must be >= 0",
                              hint="0 validates only at the end")
        if self.grad_clip < 0:
            raise ConfigError(
                f"train.grad_clip = {self.grad_clip} must be >= 0", hint="0 disables clipping"
            )


# AdamW's decoupled decay for LLMs; refused for SGD, whose coupled decay it would overscale.
ADAMW_WEIGHT_DECAY = 0.1


@dataclass
class OptimConfig:
    """AdamW (or SGD) hyper-parameters and a warmup + cosine (or constant) LR schedule."""

    # adamw: decoupled weight decay (LLMs, ViT); sgd: momentum SGD, e.g. nesterov for ResNet.
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = ADAMW_WEIGHT_DECAY
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # SGD only (AdamW's are beta1/beta2).
    momentum: float = 0.9
    nesterov: bool = False
    warmup_steps: int = 100
    schedule: Literal["cosine", "constant"] = "cosine"
    # The cosine decays to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1
    # Linear scaling rule (Goyal et al. 2017): lr is tuned for base_batch samples; with "linear"
    # the effective lr is lr * global_batch / base_batch.
    scale_lr: Literal["none", "linear"] = "none"
    base_batch: int = 256

    def validate(self) -> None:
        """Check ranges that AdamW and the schedule need."""
        if self.lr <= 0:
            raise ConfigError(f"optim.lr = {self.lr} must be positive")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(
                f"optim.beta1/beta2 = {self.beta1}/{self.beta2} must lie in [0, 1)",
                hint="typical values are 0.9 and 0.95",
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum = {self.momentum} must lie in [0, 1)",
                              hint="0.9 is the usual value for SGD")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ConfigError(f"optim.nesterov = true with optim.name = {self.name} and "
                              f"optim.momentum = {self.momentum}",
                              expected="nesterov only for SGD with momentum > 0",
                              hint="set optim.name=sgd optim.momentum=0.9, or nesterov=false")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps = {self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio = {self.min_lr_ratio} must lie in [0, 1]")
        if self.base_batch < 1:
            raise ConfigError(f"optim.base_batch = {self.base_batch} must be >= 1")
        if self.name == "sgd" and self.weight_decay == ADAMW_WEIGHT_DECAY:
            # SGD's decay is coupled L2 (added to the gradient, scaled by lr): AdamW's default
            # is ~1000x what SGD recipes use, and it would crush the weights silently.
            raise ConfigError(
                f"optim.weight_decay = {self.weight_decay} (AdamW's default) with "
                "optim.name = sgd",
                expected="an SGD weight decay, typically 1e-4 to 5e-5 (coupled L2)",
                hint="set optim.weight_decay (e.g. 1e-4; 0 for none)")

    def effective_lr(self, global_batch: int) -> float:
        """The peak learning rate after the scaling rule, for this global batch in samples."""
        if self.scale_lr == "linear":
            return self.lr * global_batch / self.base_batch
        return self.lr
