"""Judging flight-recorder dumps: which collective did which ranks not join."""

from __future__ import annotations

import os

import pytest

from hpctrain.runtime.watchdog import (
    WatchdogConfig,
    describe_collective,
    enable_flight_recorder,
    unjoined_collective,
)


def _entry(pg: str, seq: int, op: str = "nccl:all_reduce", *, t: int = 0, retired: bool = False,
           p2p: bool = False) -> dict:
    return {"process_group": [pg, "desc"], "collective_seq_id": seq, "profiling_name": op,
            "time_created_ns": t, "retired": retired, "is_p2p": p2p, "state": "scheduled"}


def test_the_rank_behind_in_a_group_is_missing() -> None:
    dumps = {0: [_entry("0", 1, retired=True), _entry("0", 2, t=20)],
             1: [_entry("0", 1, retired=True)],
             2: [_entry("0", 1, retired=True), _entry("0", 2, t=21)]}
    found = unjoined_collective(dumps, 3)
    assert (found["process_group"], found["seq"], found["joined"], found["missing"]) == (
        "0", 2, [0, 2], [1])
    assert describe_collective(found) == ("collective nccl:all_reduce #2 of process group 0 was "
                                          "entered by rank(s) 0, 2 but not by rank(s) 1")


def test_the_group_entered_last_is_where_ranks_wait() -> None:
    # Group 5 (a TP pair) is behind too, but its collective is older: the hang is in group 0.
    dumps = {0: [_entry("5", 7, t=10), _entry("0", 3, t=50)],
             1: [_entry("5", 6, t=5, retired=True), _entry("0", 2, t=4, retired=True)]}
    assert unjoined_collective(dumps, 2)["process_group"] == "0"


def test_a_rank_without_a_dump_is_missing_from_the_open_collective() -> None:
    dumps = {0: [_entry("0", 4, t=9)], 1: [_entry("0", 4, t=9)]}
    found = unjoined_collective(dumps, 3)
    assert found["missing"] == [2] and found["no_dump"] == [2] and found["joined"] == [0, 1]
    # Everyone level and finished: nothing to name.
    done = {0: [_entry("0", 4, retired=True)], 1: [_entry("0", 4, retired=True)]}
    assert unjoined_collective(done, 3) is None
    assert unjoined_collective({0: [], 1: []}, 2) is None


def test_point_to_point_entries_are_left_out() -> None:
    dumps = {0: [_entry("0", 0, "nccl:send", p2p=True), _entry("0", 3)],
             1: [_entry("0", 3)]}
    assert unjoined_collective(dumps, 2) is None


@pytest.mark.parametrize("preset, expect", [(None, "2000"), ("50", "50")])
def test_flight_recorder_size_is_set_unless_the_user_did(monkeypatch, preset, expect) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if preset:
        monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", preset)
    enable_flight_recorder(WatchdogConfig())
    assert (os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get(
        "TORCH_NCCL_TRACE_BUFFER_SIZE")) == expect
    if preset:
        assert "TORCH_FR_BUFFER_SIZE" not in os.environ


def test_flight_recorder_off(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    enable_flight_recorder(WatchdogConfig(flight_recorder=0))
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
