"""runtime/dist._agent_store: the per-attempt prefix on the elastic agent's store is used only
where one agent runs the whole group (restart counts are per agent)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from hpctrain.runtime import dist as rdist
from hpctrain.runtime.env import ProcessEnv


def _env() -> ProcessEnv:
    return ProcessEnv(launcher="torchrun", rank=1, local_rank=0, world_size=2,
                      local_world_size=1, node_rank=1, master_addr="127.0.0.1", master_port=1,
                      hostname="n2")


@pytest.mark.parametrize(("agents", "prefixed"), [("2", False), ("1", True)])
def test_the_attempt_prefix_only_under_a_single_agent(monkeypatch, agents: str,
                                                      prefixed: bool) -> None:
    """Two agents (two nodes) whose restart counts differ would otherwise meet under two
    prefixes and wait for each other until the timeout: there the env:// rendezvous is kept."""
    made = []

    class Store:
        def __init__(self, *args, **kwargs):
            made.append(args)

    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: ("prefixed", prefix))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", agents)
    got = rdist._agent_store(_env(), datetime.timedelta(seconds=1))
    if prefixed:
        assert got == ("prefixed", "hpctrain/attempt-1") and len(made) == 1
    else:
        assert got is None and not made
