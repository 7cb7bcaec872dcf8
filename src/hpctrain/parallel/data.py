"""Data parallelism: DDP (replicas), FSDP2 (shards) and HSDP (replicas of FSDP shard groups).

FSDP shards each of the model family's FSDP units (by default its blocks) and then the root
(whatever is left: for a language model the embedding, final norm and output layer), over the mesh
axis ``dp_shard``, or over ``(dp_replicate, dp_shard)`` for HSDP: parameters are sharded inside a
replica group, gradients reduce-scattered inside it and all-reduced across replicas. With tensor
parallelism the parameters are already DTensors on the ``tp`` axis and FSDP shards them further
(2-D). DDP needs whole parameters, so it wraps after they are materialised.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parallel import DistributedDataParallel

from hpctrain.models.registry import family_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# No buffer sync before each forward. PyTorch 2.13 renamed the argument (``broadcast_buffers`` is
# deprecated there and warned about on every rank); older PyTorch knows only the old name.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False})


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, precision: str,
               reshard_after_forward: bool, reduce_precision: str = "fp32", *,
               last_block_gathered: bool = False, prefetch: int = 0,
               group_blocks: int = 1) -> None:
    """Shard ``model``'s FSDP units (its family's; by default its blocks), ``group_blocks``
    consecutive ones per FSDP unit, then its root,
    in place (parameters may be on meta); forward in ``precision``, gradients reduced and
    accumulated in ``reduce_precision``.

    ``last_block_gathered``: where backward follows each forward at once (no pipeline), the
    last unit's backward comes first, so freeing its gathered parameters after its forward
    would only gather them again right away (torchtitan keeps the last block too).
    ``prefetch``: each unit issues the all-gathers of the next ``prefetch`` units in forward
    and of the previous ones in backward (``parallel.fsdp_prefetch``; 0: FSDP2's own).
    ``group_blocks``: ``parallel.fsdp_group_blocks`` (one collective and one set of FSDP's
    hooks per unit: fewer of them when the CPU sets the pace).
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision],
                              reduce_dtype=DTYPES[reduce_precision])
    shard_mesh = dp_mesh(mesh)
    blocks = family_of(model).fsdp_modules(model)
    units = [blocks[i:i + group_blocks] for i in range(0, len(blocks), group_blocks)]
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        # A list makes one FSDP unit of its modules (one parameter group, one state).
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=shard_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward
                    and not (last and last_block_gathered))
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if prefetch:
        # A unit is named by its first block: FSDP2 resolves any of its modules to its state.
        heads = [unit[0] for unit in units]
        for i, head in enumerate(heads):
            head.set_modules_to_forward_prefetch(heads[i + 1:i + 1 + prefetch])
            # Backward runs the units in reverse: unit i is followed by i - 1, i - 2, ...
            head.set_modules_to_backward_prefetch(heads[max(0, i - prefetch):i][::-1])


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device
              ) -> DistributedDataParallel:
    """Wrap ``model`` (materialised) for gradient all-reduce over ``dp_replicate``."""
    return DistributedDataParallel(
        model,
        device_mesh=mesh["dp_replicate"],
        device_ids=[device.index] if device.type == "cuda" else None,
        # Gradients are written into the communication buckets directly: one copy fewer.
        gradient_as_bucket_view=True,
        # The built-in model's only buffer (the RoPE table) is derived, identical on every
        # rank: broadcasting it before every forward would be a collective per step for
        # nothing. A model whose buffers change (BatchNorm) calls broadcast_buffers per step.
        **_NO_FORWARD_BUFFER_SYNC,
    )


def running_norms(model: nn.Module) -> list[nn.Module]:
    """``model``'s BatchNorm-style norms that track running statistics: the buffers each rank
    updates from its own batch, and the layers kept in fp32 under bf16/fp16 parameters."""
    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


def broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """Make every rank's ``buffers`` rank 0's, as DDP's default ``broadcast_buffers`` does,
    with one broadcast per dtype (BatchNorm's running statistics drift apart otherwise)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = _flatten_dense_tensors(same)
            dist.broadcast(flat, src=0)
            for b, synced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                b.copy_(synced)
