"""Float8 training (``train.precision=fp8``): the blocks' Linear layers compute in float8 (torchao).

    hpctrain train configs/demo.yaml model.size=8b parallel.strategy=fsdp train.precision=fp8 \\
        train.fp8_recipe=tensorwise --nproc 8

Parameters, optimizer state, gradients and every other op stay as with bf16 (FSDP casts the
parameters to bf16, autocast where bf16 uses autocast); only the matmuls inside the model's
blocks (for Llama: attention's and the FFN's) cast their inputs, weights and output gradients to
float8 with dynamic scales (torchao's ``Float8Linear``). The embedding and the output layer stay
in bf16, as torchtitan's float8 configs keep the output layer (its ``filter_fqns``; its command
line's default converts it too): the output layer's logits feed the loss and are the
most sensitive to rounding.

Recipes (``train.fp8_recipe``), torchao's names:

- ``tensorwise``: one scale per tensor, cuBLAS's float8 GEMM, the fastest. Under FSDP the weights
  are all-gathered in float8 (half the bf16 bytes): torchao's weight subclass casts each shard
  with a scale common to all ranks, which ``Parallelized.after_update`` precomputes for every
  weight in one all-reduce after each optimizer step (``precompute_float8_dynamic_scale_for_fsdp``).
  The cast of each shard before its all-gather runs as one compiled kernel on a GPU
  (``fused_gather_cast``) instead of torchao's three.
- ``rowwise``: one scale per row, more accurate with outliers, somewhat slower. torchao's float8
  all-gather supports tensorwise scales only, so rowwise gathers bf16 weights.

The conversion runs first, before tensor parallelism, activation checkpointing, compile and
FSDP (``parallelize.py``), as torchtitan does: each later transform then wraps float8 layers.
It keeps the parameter names, so checkpoints move freely between fp8 and bf16
runs. Float8 matmuls need a CUDA GPU of compute capability 8.9 or newer (H100, H200, L40S);
``train.fp8_emulate=true`` computes them in emulation on any device (tests and CPU debugging,
slow). Needs ``pip install torchao`` (the ``fp8`` extra).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.models.registry import family_of

log = logging.getLogger("hpctrain.parallel")

FP8_RECIPES = ("tensorwise", "rowwise")

# float8 GEMMs (torch._scaled_mm) take matrices whose dimensions are multiples of 16.
_GEMM_MULTIPLE = 16


@dataclass(frozen=True)
class Float8Training:
    """How the block Linears compute in float8: the torchao recipe, and emulation for CPUs."""

    recipe: str = "tensorwise"
    emulate: bool = False


def compute_precision(precision: str) -> str:
    """The dtype name parameters and non-float8 ops compute in: bf16 for fp8, else itself."""
    return "bf16" if precision == "fp8" else precision


def float8_all_gather(fp8: Float8Training | None, strategy: str, dp_shard: int) -> bool:
    """Whether FSDP all-gathers the float8 weights (tensorwise recipe, weights sharded)."""
    # torchao's float8 all-gather casts with one scale per tensor; rowwise scales are per row
    # of the whole weight, which no shard can compute alone, so rowwise gathers bf16.
    return (fp8 is not None and fp8.recipe == "tensorwise" and strategy == "fsdp"
            and dp_shard > 1)


def block_linear_filter(blocks: str) -> Callable[[nn.Module, str], bool]:
    """Whether the module at ``fqn`` is a Linear inside the blocks (the model's ModuleList
    attribute ``blocks``)."""
    def is_block_linear(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn.split(".", 1)[0] == blocks

    return is_block_linear


def check_float8_device(device: torch.device, emulate: bool) -> None:
    """Refuse float8 training on a device without float8 matmuls, unless emulated."""
    if emulate:
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return
    name = (f"{torch.cuda.get_device_name(device)} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
            if device.type == "cuda" else f"the {device.type.upper()}")
    raise ConfigError(
        f"train.precision = fp8 on {name}",
        expected="a CUDA GPU of compute capability 8.9 or newer (H100, H200, L40S, B200): "
        "float8 matmuls run on its tensor cores",
        hint="use train.precision=bf16 on this device, or train.fp8_emulate=true to compute "
        "float8 in emulation (for tests and CPU debugging: slow)",
    )


def import_float8() -> ModuleType:
    """torchao's float8 training module, or a ConfigError saying how to install it."""
    # torchao loads its CUDA kernels at import and logs a warning for each that does not load
    # (every one on a CPU build of PyTorch); float8 training does not use them.
    ao_log = logging.getLogger("torchao")
    level = ao_log.level
    ao_log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(
            f"train.precision = fp8 needs torchao, which is not importable ({e})",
            expected="torchao installed in this environment (float8 training comes from it)",
            hint="pip install torchao (or pip install 'hpctrain[fp8]'); on a machine without "
            "internet, install its wheel (benchmarks/peers/fetch_wheels.sh downloads it)",
        ) from None
    finally:
        ao_log.setLevel(level)
    return float8


def convert_to_float8(model: nn.Module, fp8: Float8Training, *, all_gather: bool) -> list[str]:
    """Swap the Linears inside the blocks of ``model`` (or of a pipeline stage of it; on any
    device, meta included) for torchao's Float8Linear in place; returns the names of the
    converted modules."""
    if fp8.recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8_recipe = {fp8.recipe!r} is not a float8 recipe",
                          expected=f"one of: {', '.join(FP8_RECIPES)}")
    float8 = import_float8()
    is_block_linear = block_linear_filter(family_of(model).blocks)
    targets = [name for name, m in model.named_modules() if is_block_linear(m, name)]
    if not fp8.emulate:
        for name in targets:
            linear = model.get_submodule(name)
            if linear.in_features % _GEMM_MULTIPLE or linear.out_features % _GEMM_MULTIPLE:
                raise ConfigError(
                    f"train.precision = fp8 with {name} of shape {linear.out_features} x "
                    f"{linear.in_features}",
                    expected=f"Linear dimensions that are multiples of {_GEMM_MULTIPLE} "
                    "(float8 GEMMs require it)",
                    hint="make model.dim, model.ffn_dim and the head dimensions multiples of "
                    f"{_GEMM_MULTIPLE}, or use train.precision=bf16",
                )
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(fp8.recipe),
                                 emulate=fp8.emulate,
                                 enable_fsdp_float8_all_gather=all_gather)
    float8.convert_to_float8_training(model, module_filter_fn=is_block_linear, config=config)
    if all_gather:
        fused_gather_cast()
    return targets


def _scale_to_float8(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    # torchao's arithmetic exactly (fp32 product, saturating clamp, cast), so the bytes match.
    top = torch.finfo(dtype).max
    return (shard.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def _pre_all_gather(self, mesh):
    # Replaces WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather (self is such a weight
    # shard). Its return value is torchao's: the float8 bytes to gather, and the scale that
    # fsdp_post_all_gather wraps them with.
    scale = self._precomputed_scale
    if scale is None:  # no scales precomputed yet: torchao's own path (amax all-reduce)
        return _TORCHAO_PRE_ALL_GATHER(self, mesh)
    shard = self._tensor
    # Compiled on GPUs only: on a CPU (tests, fp8_emulate) the same arithmetic runs eagerly.
    cast = _COMPILED_CAST if shard.is_cuda else _scale_to_float8
    data = cast(shard.reshape(-1), scale, self._dtype).view(shard.shape)
    return (data,), (scale,)


_TORCHAO_PRE_ALL_GATHER = None
_COMPILED_CAST = None


def fused_gather_cast() -> bool:
    """Make FSDP's float8 all-gather cast each weight shard in one kernel; True if it does.

    Before each all-gather torchao casts the fp32 shard with three eager kernels (scale,
    clamp, cast: 21 bytes moved per element), for every weight of every block: on 8b over 2
    H200s, 28 ms of GPU time in a 575 ms step. The same arithmetic compiled is one kernel that
    moves 5 bytes per element, with the same bytes (benchmarks/float8_gather_cast.py). Measured
    on 2 H200s (benchmarks/RESULTS.md): +1.5% tokens/s on 8b, +9% on 1b. It replaces the method
    on torchao's weight class, once per process; a torchao whose method differs from the one
    this was written against (``fsdp_pre_all_gather(self, mesh)``) keeps its own, with a warning.
    """
    global _TORCHAO_PRE_ALL_GATHER, _COMPILED_CAST
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as weight

    original = weight.fsdp_pre_all_gather
    if original is _pre_all_gather:
        return True
    if list(inspect.signature(original).parameters) != ["self", "mesh"]:
        log.warning("torchao's fsdp_pre_all_gather%s is not the one hpctrain fuses: its own "
                    "cast stays (slower)", inspect.signature(original))
        return False
    if _COMPILED_CAST is None:
        # One graph for every shard length: the shards are flattened before the call.
        _COMPILED_CAST = torch.compile(_scale_to_float8, dynamic=True)
    _TORCHAO_PRE_ALL_GATHER = original
    weight.fsdp_pre_all_gather = _pre_all_gather
    return True


def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the float8 scales of the FSDP-sharded weights (one all-reduce for all of them)
    from their current values: after each optimizer step and after a checkpoint load."""
    import_float8().precompute_float8_dynamic_scale_for_fsdp(model)
