"""``parallel.fsdp_prefetch``: each FSDP block issues its neighbours' all-gathers ahead of use.

In process (1-rank gloo): the blocks FSDP2 is told to prefetch, in forward the next ones and in
backward the previous ones, nearest first, and none where the setting is 0 (FSDP2's implicit
prefetch). On 2 real gloo ranks: training with prefetch gives the default run's losses and
gradient norms bit for bit, since only the order of issuing changes. Refused without FSDP.
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

LAYERS = 4


def _prefetch_lists(prefetch: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per block, the indices of the blocks it prefetches in forward and in backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.runtime.dist import MESH_AXES

    cfg = load_config(DEMO, [*TINY, *QUIET, "parallel.strategy=fsdp", f"model.n_layers={LAYERS}",
                             f"parallel.fsdp_prefetch={prefetch}"])
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_AXES)
    with torch.device("meta"):
        model = Transformer(cfg.model.resolve())
    model = parallelize(model, cfg.parallel, ParallelLayout(), mesh, torch.device("cpu"), "fp32",
                        seed=0).model
    blocks = list(model.layers)
    states = [block._get_fsdp_state() for block in blocks]
    index = {id(state): i for i, state in enumerate(states)}
    forward = [[index[id(s)] for s in state._states_to_forward_prefetch] for state in states]
    backward = [[index[id(s)] for s in state._states_to_backward_prefetch] for state in states]
    return forward, backward


@pytest.mark.parametrize(("prefetch", "forward", "backward"), [
    (0, [[], [], [], []], [[], [], [], []]),
    (1, [[1], [2], [3], []], [[], [0], [1], [2]]),
    (2, [[1, 2], [2, 3], [3], []], [[], [0], [1, 0], [2, 1]]),
])
def test_each_block_prefetches_its_neighbours(pg: None, prefetch: int, forward: list,
                                              backward: list) -> None:
    assert _prefetch_lists(prefetch) == (forward, backward)


def test_refused_without_fsdp() -> None:
    with pytest.raises(ConfigError, match="fsdp_prefetch = 1 with strategy 'ddp'") as e:
        load_config(DEMO, ["parallel.strategy=ddp", "parallel.fsdp_prefetch=1"])
    assert "parallel.strategy=fsdp" in e.value.hint
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(DEMO, ["parallel.strategy=fsdp", "parallel.fsdp_prefetch=-1"])


def test_training_with_prefetch_is_bit_identical(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    common = [*TINY, *QUIET, "parallel.strategy=fsdp", "train.micro_batch=2", "train.steps=4",
              f"model.n_layers={LAYERS}", "checkpoint.interval=none",
              "checkpoint.save_at_end=false"]
    spec = {"config": DEMO, "common": common, "out": str(runs), "jobs": [
        {"name": "default", "overrides": []},
        {"name": "prefetch", "overrides": ["parallel.fsdp_prefetch=2"]},
    ]}
    launch(2, spec, tmp_path / "launch", 300)
    for key in ("loss", "grad_norm"):
        default, prefetch = logged(runs, "default", key), logged(runs, "prefetch", key)
        assert sorted(default) == [1, 2, 3, 4]
        assert prefetch == default, key
