"""``parallel.fsdp_group_blocks``: FSDP units of several consecutive blocks.

In process (1-rank gloo): the blocks of a unit share one FSDP state, a last unit holds what is
left, and explicit prefetch names units. On 2 real gloo ranks: training with units of 2 blocks
gives the default run's losses and gradient norms bit for bit, under ZeRO-3 and under ZeRO-2
with full activation checkpointing (each block recomputed on its own inside a unit), since the
same gradients are reduced, only in fewer collectives. Refused without FSDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import parallelize
from rank_jobs import launch
from run_records import logged

LAYERS = 5


def _units(group: int, prefetch: int) -> tuple[list[int], list[list[int]]]:
    """Per block, the index of its FSDP unit; per unit, the units it prefetches in forward."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*TINY, *QUIET, "parallel.strategy=fsdp", f"model.n_layers={LAYERS}",
                             f"parallel.fsdp_group_blocks={group}",
                             f"parallel.fsdp_prefetch={prefetch}"])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    model = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "fp32",
                        seed=0).model
    states = [block._get_fsdp_state() for block in model.layers]
    distinct = list({id(s): s for s in states}.values())
    index = {id(s): i for i, s in enumerate(distinct)}
    assert model._get_fsdp_state() not in distinct  # the root is a unit of its own
    return ([index[id(s)] for s in states],
            [[index[id(p)] for p in s._states_to_forward_prefetch] for s in distinct])


@pytest.mark.parametrize(("group", "unit_of_block"), [
    (1, [0, 1, 2, 3, 4]), (2, [0, 0, 1, 1, 2]), (3, [0, 0, 0, 1, 1]), (9, [0, 0, 0, 0, 0]),
])
def test_consecutive_blocks_share_a_unit(pg: None, group: int, unit_of_block: list) -> None:
    assert _units(group, 0)[0] == unit_of_block


def test_prefetch_counts_units(pg: None) -> None:
    assert _units(2, 1)[1] == [[1], [2], []]


def test_refused_without_fsdp_or_below_one() -> None:
    with pytest.raises(ConfigError, match="fsdp_group_blocks = 2 with strategy 'ddp'") as e:
        load_config(DEMO, ["parallel.strategy=ddp", "parallel.fsdp_group_blocks=2"])
    assert "parallel.strategy=fsdp" in e.value.hint
    with pytest.raises(ConfigError, match="fsdp_group_blocks = 0 must be >= 1"):
        load_config(DEMO, ["parallel.strategy=fsdp", "parallel.fsdp_group_blocks=0"])


def test_training_in_units_of_two_blocks_is_bit_identical(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    common = [*TINY, *QUIET, "parallel.strategy=fsdp", "train.micro_batch=2", "train.steps=4",
              f"model.n_layers={LAYERS}", "checkpoint.interval=none",
              "checkpoint.save_at_end=false"]
    zero2_ac = ["parallel.reshard_after_forward=false", "parallel.activation_checkpointing=full"]
    spec = {"config": DEMO, "common": common, "out": str(runs), "jobs": [
        {"name": "default", "overrides": []},
        {"name": "units", "overrides": ["parallel.fsdp_group_blocks=2"]},
        {"name": "zero2-ac", "overrides": zero2_ac},
        {"name": "zero2-ac-units", "overrides": [*zero2_ac, "parallel.fsdp_group_blocks=2"]},
    ]}
    launch(2, spec, tmp_path / "launch", 400)
    for base, grouped in (("default", "units"), ("zero2-ac", "zero2-ac-units")):
        for key in ("loss", "grad_norm"):
            expected = logged(runs, base, key)
            assert sorted(expected) == [1, 2, 3, 4]
            assert logged(runs, grouped, key) == expected, (grouped, key)
