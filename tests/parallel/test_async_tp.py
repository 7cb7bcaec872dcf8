"""``parallel.async_tp``: the settings it needs are checked when the config loads, and a CPU
run (two gloo ranks through ``parallelize``) is refused before anything compiles.

What it does to speed (and that the loss stays that of plain TP) is measured on GPUs
(``benchmarks/peers/compare.py --set parallel.async_tp=true``, benchmarks/RESULTS.md): its fused
collectives need CUDA and symmetric memory, which no CPU test can run.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from conftest import DEMO, QUIET, TINY, fork_spawn, free_port
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.models import Transformer
from hpctrain.parallel.layout import ParallelLayout
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.tensor import async_tp_obstacle, enable_async_tp
from hpctrain.runtime.dist import MESH_AXES

BASE = [*TINY, *QUIET, "parallel.strategy=none", "parallel.async_tp=true"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.compile=true"], "tp = 1 and compile = true"),
    (["parallel.tp=2", "parallel.compile=false"], "tp = 2 and compile = false"),
])
def test_async_tp_without_tp_or_compile_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(DEMO, [*BASE, *overrides])
    assert "tp > 1 and compile true" in info.value.expected
    assert "drop parallel.async_tp" in info.value.hint


def test_async_tp_with_tp_and_compile_loads() -> None:
    cfg = load_config(DEMO, [*BASE, "parallel.tp=2", "parallel.compile=true"])
    assert cfg.parallel.async_tp


def test_async_tp_is_off_by_default() -> None:
    assert not load_config(DEMO, [*TINY, *QUIET]).parallel.async_tp


def test_async_tp_on_cpu_is_refused_before_the_compiler_is_touched() -> None:
    with pytest.raises(ConfigError, match="async_tp = true on cpu") as info:
        enable_async_tp(None, torch.device("cpu"))  # the device is checked before the mesh
    assert "CUDA" in info.value.expected
    assert not torch._inductor.config._micro_pipeline_tp


def _parallelize_tp2(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = load_config(DEMO, [*BASE, "parallel.tp=2", "parallel.compile=true"])
        mesh = init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=MESH_AXES)
        with torch.device("meta"):
            model = Transformer(cfg.model.resolve())
        try:
            parallelize(model, cfg.parallel, ParallelLayout(tp=2), mesh, torch.device("cpu"),
                        "fp32", seed=0)
            out[rank] = "parallelized"
        except ConfigError as e:
            out[rank] = (str(e), torch._inductor.config._micro_pipeline_tp)
    finally:
        # Refused before any collective, rank 0 could tear down the group (and the store it
        # hosts) while rank 1 still made the mesh's groups through that store: CI saw rank 1
        # fail with "Broken pipe" or "connectFullMesh ... closed by peer", rank 0 exit 0.
        dist.barrier()
        dist.destroy_process_group()


def test_parallelize_refuses_async_tp_on_cpu_ranks() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        fork_spawn(_parallelize_tp2, (free_port(), out), 2)
        results = dict(out)
    for rank in (0, 1):
        message, flag = results[rank]
        assert "async_tp = true on cpu" in message
        assert not flag


NVLINK = {(0, 1), (1, 0), (2, 3), (3, 2)}  # two NVLink pairs on one host


def _peers(i: int, j: int) -> bool:
    return (i, j) in NVLINK


@pytest.mark.parametrize(("members", "obstacle"), [
    ([("n1", 0), ("n1", 1)], None),
    ([("n1", 2), ("n1", 3)], None),
    ([("n1", 1), ("n1", 2)], "GPU 1 cannot access GPU 2 peer to peer on n1"),
    ([("n1", 0), ("n2", 0)], "spans 2 hosts (n1, n2)"),
    # One GPU visible per task: the indices name no GPU, so no peer question is asked.
    ([("n1", 0), ("n1", 0)], None),
])
def test_an_async_tp_group_must_share_a_host_and_peer_access(
        members: list[tuple[str, int]], obstacle: str | None) -> None:
    found = async_tp_obstacle(members, _peers)
    if obstacle is None:
        assert found is None
    else:
        assert obstacle in found
