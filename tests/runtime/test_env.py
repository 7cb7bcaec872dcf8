"""Launcher detection: local, torchrun and Slurm variables."""

from __future__ import annotations

import pytest

from hpctrain.errors import RuntimeEnvError
from hpctrain.runtime.env import (
    detect_env,
    export_torch_env,
    parse_tasks_per_node,
    slurm_master_port,
)


def slurm_vars(**overrides: str) -> dict[str, str]:
    """Variables srun sets for task 5 of 8 (two nodes, four tasks each), with overrides."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    env.update(overrides)
    return env


def torchrun_vars(**overrides: str) -> dict[str, str]:
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "abc",
    }
    env.update(overrides)
    return env


def test_nothing_set_is_one_local_process() -> None:
    env = detect_env({})
    assert env.launcher == "local"
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (0, 1, 0, 0)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)
    assert env.job_id is None
    assert env.is_rank0 and not env.is_distributed


def test_slurm_task_ranks_and_master() -> None:
    env = detect_env(slurm_vars())
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size) == (5, 1, 8)
    assert (env.local_world_size, env.node_rank) == (4, 1)
    assert env.master_addr == "gpu07"
    assert env.job_id == "123456"
    assert env.is_distributed and not env.is_rank0


def test_slurm_port_is_deterministic_per_job() -> None:
    port = detect_env(slurm_vars()).master_port
    assert port == detect_env(slurm_vars(SLURM_PROCID="0", SLURM_LOCALID="0")).master_port
    assert port == slurm_master_port("123456")
    assert port != detect_env(slurm_vars(SLURM_JOB_ID="123457")).master_port
    assert 20000 <= port < 30000


def test_slurm_respects_explicit_master() -> None:
    env = detect_env(slurm_vars(MASTER_ADDR="head", MASTER_PORT="4242"))
    assert (env.master_addr, env.master_port) == ("head", 4242)


def test_slurm_step_nodelist_preferred() -> None:
    env = detect_env(slurm_vars(SLURM_STEP_NODELIST="gpu08"))
    assert env.master_addr == "gpu08"


def test_slurm_uneven_tasks_per_node() -> None:
    env = detect_env(
        slurm_vars(
            SLURM_NTASKS="11",
            SLURM_TASKS_PER_NODE="4(x2),3",
            SLURM_NODEID="2",
            SLURM_PROCID="10",
            SLURM_LOCALID="2",
        )
    )
    assert env.local_world_size == 3


def test_slurm_ntasks_per_node_fallback() -> None:
    variables = slurm_vars(SLURM_NTASKS_PER_NODE="4")
    del variables["SLURM_TASKS_PER_NODE"]
    assert detect_env(variables).local_world_size == 4


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_tasks_per_node("8") == [8]
    assert parse_tasks_per_node("2,1(x3)") == [2, 1, 1, 1]
    with pytest.raises(RuntimeEnvError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("4(2)")


def test_slurm_array_ids_recorded() -> None:
    env = detect_env(slurm_vars(SLURM_ARRAY_JOB_ID="1000", SLURM_ARRAY_TASK_ID="7"))
    assert (env.array_job_id, env.array_task_id) == ("1000", "7")


def test_batch_script_without_task_is_local_but_keeps_job_id() -> None:
    env = detect_env({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-2]"})
    assert env.launcher == "local"
    assert env.world_size == 1
    assert env.job_id == "42"


def test_torchrun() -> None:
    env = detect_env(torchrun_vars())
    assert env.launcher == "torchrun"
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 4)
    assert (env.local_world_size, env.node_rank) == (2, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29400)


def test_torchrun_wins_inside_slurm_and_keeps_job_id() -> None:
    variables = {**slurm_vars(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="1(x2)"), **torchrun_vars()}
    env = detect_env(variables)
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.master_addr) == (3, 4, "10.0.0.1")
    assert env.job_id == "123456"


@pytest.mark.parametrize(
    ("variables", "name"),
    [
        (slurm_vars(SLURM_PROCID="8"), "SLURM_PROCID"),
        (slurm_vars(SLURM_PROCID="two"), "SLURM_PROCID"),
        (slurm_vars(SLURM_LOCALID="4"), "SLURM_LOCALID"),
        (slurm_vars(SLURM_NTASKS="9"), "SLURM_TASKS_PER_NODE"),
        (slurm_vars(SLURM_NODEID="2"), "SLURM_NODEID"),
        (slurm_vars(SLURM_JOB_ID="abc"), "SLURM_JOB_ID"),
        (slurm_vars(MASTER_PORT="70000"), "MASTER_PORT"),
        ({k: v for k, v in slurm_vars().items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS"),
        (
            {k: v for k, v in slurm_vars().items() if k != "SLURM_JOB_NODELIST"},
            "SLURM_JOB_NODELIST",
        ),
        (torchrun_vars(RANK="4"), "RANK"),
        (torchrun_vars(LOCAL_RANK="-1"), "LOCAL_RANK"),
        (torchrun_vars(WORLD_SIZE="4.0"), "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ],
)
def test_inconsistent_values_name_the_variable(variables: dict[str, str], name: str) -> None:
    with pytest.raises(RuntimeEnvError) as info:
        detect_env(variables)
    assert name in str(info.value)
    assert "HINT" in str(info.value)


def test_export_torch_env() -> None:
    exported = export_torch_env(detect_env(slurm_vars()))
    assert exported["RANK"] == "5"
    assert exported["WORLD_SIZE"] == "8"
    assert exported["LOCAL_RANK"] == "1"
    assert exported["MASTER_ADDR"] == "gpu07"
    assert exported["MASTER_PORT"] == str(slurm_master_port("123456"))
    assert all(isinstance(value, str) for value in exported.values())


def test_default_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert detect_env().job_id == "77"


def test_batch_shell_is_not_a_rank() -> None:
    """The batch script itself has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id:
    it is one local process, not rank 0 of a group whose other ranks never start."""
    batch = slurm_vars(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    del batch["SLURM_STEP_ID"]
    env = detect_env(batch)
    assert (env.launcher, env.rank, env.world_size) == ("local", 0, 1)
    assert env.job_id == "123456"
