"""FSDP's scheduling options: ``parallel.fsdp_prefetch`` (each unit issues its neighbours'
all-gathers ahead of use) and ``parallel.fsdp_group_blocks`` (units of several blocks).

In process (1-rank gloo): the blocks FSDP2 is told to prefetch, in forward the next ones and in
backward the previous ones, nearest first, and none where the setting is 0 (FSDP2's implicit
prefetch); the blocks of a unit share one FSDP state, a last unit holds what is left, and
explicit prefetch names units. On 2 real gloo ranks: training with either option gives the
default run's losses and gradient norms bit for bit, units also under ZeRO-2 with full
activation checkpointing (each block recomputed on its own inside a unit), since only the order
of issuing and the number of collectives change. Both are refused without FSDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import DEMO, QUIET, TINY
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import parallelize
from rank_jobs import launch
from run_records import logged


def _fsdp_model(layers: int, *overrides: str) -> nn.Module:
    """A tiny model of ``layers`` blocks, sharded by FSDP on a 1-rank mesh (on meta)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*TINY, *QUIET, "parallel.strategy=fsdp", f"model.n_layers={layers}",
                             *overrides])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    return parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "fp32",
                       seed=0).model


def _prefetch_lists(prefetch: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per block of 4, the indices of the blocks it prefetches in forward and in backward."""
    model = _fsdp_model(4, f"parallel.fsdp_prefetch={prefetch}")
    states = [block._get_fsdp_state() for block in model.layers]
    index = {id(state): i for i, state in enumerate(states)}
    forward = [[index[id(s)] for s in state._states_to_forward_prefetch] for state in states]
    backward = [[index[id(s)] for s in state._states_to_backward_prefetch] for state in states]
    return forward, backward


def _units(group: int, prefetch: int) -> tuple[list[int], list[list[int]]]:
    """Per block of 5, the index of its FSDP unit; per unit, the units it prefetches in
    forward."""
    model = _fsdp_model(5, f"parallel.fsdp_group_blocks={group}",
                        f"parallel.fsdp_prefetch={prefetch}")
    states = [block._get_fsdp_state() for block in model.layers]
    distinct = list({id(s): s for s in states}.values())
    index = {id(s): i for i, s in enumerate(distinct)}
    assert model._get_fsdp_state() not in distinct  # the root is a unit of its own
    return ([index[id(s)] for s in states],
            [[index[id(p)] for p in s._states_to_forward_prefetch] for s in distinct])


@pytest.mark.parametrize(("prefetch", "forward", "backward"), [
    (0, [[], [], [], []], [[], [], [], []]),
    (1, [[1], [2], [3], []], [[], [0], [1], [2]]),
    (2, [[1, 2], [2, 3], [3], []], [[], [0], [1, 0], [2, 1]]),
])
def test_each_block_prefetches_its_neighbours(pg: None, prefetch: int, forward: list,
                                              backward: list) -> None:
    assert _prefetch_lists(prefetch) == (forward, backward)


@pytest.mark.parametrize(("group", "unit_of_block"), [
    (1, [0, 1, 2, 3, 4]), (2, [0, 0, 1, 1, 2]), (3, [0, 0, 0, 1, 1]), (9, [0, 0, 0, 0, 0]),
])
def test_consecutive_blocks_share_a_unit(pg: None, group: int, unit_of_block: list) -> None:
    assert _units(group, 0)[0] == unit_of_block


def test_prefetch_counts_units(pg: None) -> None:
    assert _units(2, 1)[1] == [[1], [2], []]


@pytest.mark.parametrize(("key", "value", "below", "minimum"), [
    ("fsdp_prefetch", 1, -1, "fsdp_prefetch = -1 must be >= 0"),
    ("fsdp_group_blocks", 2, 0, "fsdp_group_blocks = 0 must be >= 1"),
])
def test_refused_without_fsdp_or_below_its_minimum(key: str, value: int, below: int,
                                                   minimum: str) -> None:
    with pytest.raises(ConfigError, match=f"{key} = {value} with strategy 'ddp'") as e:
        load_config(DEMO, ["parallel.strategy=ddp", f"parallel.{key}={value}"])
    assert "parallel.strategy=fsdp" in e.value.hint
    with pytest.raises(ConfigError, match=minimum):
        load_config(DEMO, ["parallel.strategy=fsdp", f"parallel.{key}={below}"])


def test_training_with_either_option_is_bit_identical(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    common = [*TINY, *QUIET, "parallel.strategy=fsdp", "train.micro_batch=2", "train.steps=4",
              "model.n_layers=5", "checkpoint.interval=none", "checkpoint.save_at_end=false"]
    zero2_ac = ["parallel.reshard_after_forward=false", "parallel.activation_checkpointing=full"]
    spec = {"config": DEMO, "common": common, "out": str(runs), "jobs": [
        {"name": "default", "overrides": []},
        {"name": "prefetch", "overrides": ["parallel.fsdp_prefetch=2"]},
        {"name": "units", "overrides": ["parallel.fsdp_group_blocks=2"]},
        {"name": "zero2-ac", "overrides": zero2_ac},
        {"name": "zero2-ac-units", "overrides": [*zero2_ac, "parallel.fsdp_group_blocks=2"]},
    ]}
    launch(2, spec, tmp_path / "launch", 400)
    for base, changed in (("default", "prefetch"), ("default", "units"),
                          ("zero2-ac", "zero2-ac-units")):
        for key in ("loss", "grad_norm"):
            expected = logged(runs, base, key)
            assert sorted(expected) == [1, 2, 3, 4]
            assert logged(runs, changed, key) == expected, (changed, key)
