"""Turn meta-device parameters into real, initialised ones, identically on any world size.

Each parameter is initialised from its own generator, seeded by (seed, parameter name), as a
full tensor on the device; a sharded parameter then keeps only its local slice. So the initial
weights are the same for 1 rank, DDP on N and FSDP on N (on a given device type), which makes
runs comparable across layouts (and across parameter dtypes: bf16 parameters are the fp32 draws,
rounded). The full tensor exists for one parameter at a time only.

`load_weights` fills the parameters from pretrained weights instead: each rank asks a reader for
the box of each parameter it holds (its FSDP/TP shard, as DCP computes it), so no rank reads or
holds more than its part (`hpctrain.models.hf_weights.HFWeights` reads those boxes from
memory-mapped safetensors).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# (canonical parameter name, offset, size) -> that box of the full parameter
BoxReader = Callable[[str, Sequence[int], Sequence[int]], torch.Tensor]

# Wrappers add these to parameter names; the canonical name is the model's own.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    """A parameter's name as the unwrapped model spells it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate storage on ``device`` and initialise every parameter and buffer of ``model``."""
    model.to_empty(device=device)
    model.init_buffers()
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = canonical_name(name)
            gen = torch.Generator(device=device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            # Drawn in fp32 and rounded: bf16 parameters (train.master_weights=bf16) start
            # from the fp32 run's initial weights.
            full = torch.empty(param.shape, dtype=torch.float32, device=device)
            model.init_parameter(name, full, gen)
            full = full.to(param.dtype)
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank holds the same full tensor, so each just keeps
                # its slice and no communication happens.
                full = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None)
            param.copy_(full)


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) of the part of the full parameter this rank holds."""
    if isinstance(param, DTensor):
        size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                             param.placements)
        return tuple(offset), tuple(size)
    return (0,) * param.dim(), tuple(param.shape)


def load_weights(model: nn.Module, read: BoxReader) -> None:
    """Fill every parameter of a materialised ``model`` (sharded or not) with ``read``'s
    values for the part this rank holds; no communication."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset, size = local_box(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.numel() == 0:  # an uneven shard left this rank nothing
                continue
            local.copy_(read(canonical_name(name), offset, size))
