"""Which FSDP blocks free their gathered parameters after forward (``parallel/data.py``).

In process, on a 1-rank gloo group: with resharding on (ZeRO-3, the default without a
pipeline) every block but the last is sharded again after forward, and the last stays gathered
for the backward that starts with it; with ``reshard_after_forward=false`` (ZeRO-2) all stay
gathered. FSDP2 registers the sharded parameters (DTensors) on a resharded module and the
gathered ones (plain tensors) on a gathered module, which is what is read here.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.models import Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import parallelize


def _gathered_after_forward(overrides: list[str]) -> list[bool]:
    """Per block: whether its parameters are still gathered after one forward."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*TINY, *QUIET, "train.precision=bf16", "parallel.strategy=fsdp",
                             "model.n_layers=3", *overrides])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    model = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "bf16",
                        seed=0).model
    tokens = torch.randint(0, cfg.model.resolve().vocab_size, (2, 16))
    model(tokens)
    return [not any(isinstance(p, DTensor) for p in block.parameters())
            for block in model.layers]


@pytest.mark.parametrize(("overrides", "gathered"), [
    ([], [False, False, True]),
    (["parallel.reshard_after_forward=false"], [True, True, True]),
])
def test_the_last_block_stays_gathered_for_backward(pg: None, overrides: list[str],
                                                    gathered: list[bool]) -> None:
    assert _gathered_after_forward(overrides) == gathered
