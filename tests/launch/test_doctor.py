"""``hpctrain doctor``: each check on the facts it judges, with faults injected where this CPU
machine has none to show (GPUs, NUMA, InfiniBand, Lustre, a slow fabric, a sick GPU), and the
command itself on this machine (healthy: exit 0; an injected fault: exit 1, one line per problem
and its fix). tests/slurm/test_multinode.py runs it as the preflight of a real two-node job.

    .venv/bin/pytest tests/launch/test_doctor.py -q
"""

from __future__ import annotations

import functools
import json
import shutil
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import spawn_ranks
from hpctrain.bench.node import DeviceResult
from hpctrain.cli import main
from hpctrain.config import JobConfig, load_config
from hpctrain.errors import ConfigError
from hpctrain.launch import doctor as d
from hpctrain.launch.doctor import checks, facts
from hpctrain.launch.doctor.checks import Inputs
from hpctrain.launch.doctor.facts import Facts, format_cpus, parse_cpulist
from hpctrain.runtime.env import ProcessEnv

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128"]


def rank(i: int, host: str = "n1", **kw) -> Facts:
    """A healthy GPU rank: its own GPU, cores on that GPU's NUMA node, InfiniBand."""
    base = Facts(rank=i, local_rank=i % 4, host=host, python="3.11.7", torch="2.11.0+cu128",
                 cuda="12.8", nccl="2.27.5", hpctrain="0.1.0", gpus=4, gpu=i % 4,
                 gpu_pci=f"0000:{i % 4 + 0x18:02x}:00.0", gpu_numa=(i % 4) // 2,
                 numa_cpus=list(range(0, 32)) if (i % 4) < 2 else list(range(32, 64)),
                 affinity=list(range(16 * (i % 4), 16 * (i % 4) + 16)), omp_threads=16,
                 net_ifaces=["eth0", "ib0", "lo"], ib_devices=["mlx5_0", "mlx5_1"],
                 memlock=-1, nofile=65536)
    return replace(base, **kw)


def job(**kw) -> Inputs:
    """Two nodes of four GPUs; all healthy unless `kw` says otherwise."""
    facts = kw.pop("facts", [rank(i, "n1" if i < 4 else "n2") for i in range(8)])
    cfg = JobConfig()
    cfg.run.device = "cuda"
    return Inputs(facts=facts, cfg=cfg, **kw)


def problems(verdict) -> list[str]:
    return [p.line() for p in verdict.problems]


def test_a_healthy_job_has_no_problems() -> None:
    x = job(allreduce={"ranks": 8, "mb": 64, "backend": "nccl", "wrong": 0,
                       "busbw_gbps": 40.0}, expect_busbw=20.0)
    assert [p for v in checks.judge(x) for p in v.problems] == []


def test_versions_name_the_nodes_and_only_what_differs() -> None:
    facts = [rank(i, "n1" if i < 4 else "n2") for i in range(8)]
    facts[5] = replace(facts[5], torch="2.10.0+cu126", cuda="12.6")
    (line,) = problems(checks.check_versions(job(facts=facts)))
    assert "n1 (ranks 0-3); n2 (ranks 4,6-7): torch 2.11.0+cu128, cuda 12.8" in line, line
    assert "n2 (rank 5): torch 2.10.0+cu126, cuda 12.6" in line and "python" not in line
    assert "-- fix: run every node from one environment" in line


def test_gpus_missing_or_shared() -> None:
    facts = [rank(i) for i in range(4)]
    facts[1] = replace(facts[1], gpus=0, gpu=None, cuda_visible="")
    facts[3] = replace(facts[3], gpu_pci=facts[2].gpu_pci)
    lines = problems(checks.check_gpus(job(facts=facts)))
    assert len(lines) == 2, lines
    assert "rank 1 (local rank 1) on n1 has no GPU: 0 visible" in lines[0]
    assert "ranks 2-3 on n1 share GPU 0000:1a:00.0" in lines[1]
    none = [replace(f, gpus=0, gpu=None) for f in facts]
    assert "no task sees a GPU" in problems(checks.check_gpus(job(facts=none)))[0]
    cpu = job(facts=none)
    cpu.cfg.run.device = "auto"
    assert checks.check_gpus(cpu).problems == []  # a CPU run wants no GPU


def test_affinity_off_the_gpus_numa_node_and_oversubscribed() -> None:
    facts = [rank(i) for i in range(4)]
    facts[0] = replace(facts[0], affinity=list(range(40, 48)))
    facts[1] = replace(facts[1], omp_threads=64)
    lines = problems(checks.check_affinity(job(facts=facts)))
    assert "rank 0 on n1 holds cores 40-47, none on NUMA node 0 of its GPU 0000:18:00.0 " \
           "(cores 0-31)" in lines[0], lines
    assert "--gpu-bind=closest" in lines[0]
    assert "n1: 4 tasks x OMP_NUM_THREADS run 112 threads on 48 cores" in lines[1], lines


def test_network_names_that_do_not_exist() -> None:
    env = {"NCCL_SOCKET_IFNAME": "hsn", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_9:1"}
    facts = [rank(i, net_env=env) for i in range(4)]
    (line,) = problems(checks.check_network(job(facts=facts)))
    assert "NCCL_SOCKET_IFNAME=hsn on n1: no such interface (it has eth0, ib0, lo)" in line
    ok = {"NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_HCA": "mlx5"}
    assert checks.check_network(job(facts=[rank(i, net_env=ok) for i in range(4)])).problems == []
    # Two nodes of GPUs, no InfiniBand and no socket interface named: NCCL guesses.
    bare = [rank(i, "n1" if i < 2 else "n2", ib_devices=[]) for i in range(4)]
    lines = problems(checks.check_network(job(facts=bare)))
    assert len(lines) == 2 and "n2 has no InfiniBand HCA and NCCL_SOCKET_IFNAME is unset" in \
        lines[1], lines


@pytest.mark.parametrize("result, expect, message", [
    ({"wrong": 3, "busbw_gbps": 50.0}, None, "3 wrong elements"),
    ({"wrong": 0, "busbw_gbps": 3.5}, 20.0, "busbw 3.50 GB/s, below the expected 20"),
    ({"wrong": 0, "error": "DistBackendError: NCCL timeout"}, None, "failed: DistBackendError"),
])
def test_allreduce_wrong_slow_or_broken(result: dict, expect, message: str) -> None:
    r = {"ranks": 8, "mb": 64.0, "backend": "nccl", **result}
    (line,) = problems(checks.check_allreduce(job(allreduce=r, expect_busbw=expect)))
    assert message in line and "all_reduce of 64 MB over 8 ranks (nccl)" in line, line


def test_disk_too_small_for_the_checkpoints_kept(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "llama-1b.yaml",
                      [f"run.out_dir={tmp_path / 'runs'}", "checkpoint.keep_last=2"])
    s = facts.gather_storage(cfg, world_size=8)
    # Other processes write to this disk meanwhile: the same figure within a gigabyte.
    assert abs(s.free_bytes - shutil.disk_usage(tmp_path).free) < 1e9 and s.keep == 3
    assert s.ckpt_bytes == s.params * 12 and s.params > 1e9
    ok = checks.check_disk(job(storage=replace(s, free_bytes=10**15)))
    assert ok.problems == []
    (line,) = problems(checks.check_disk(job(storage=replace(s, free_bytes=20 * 10**9))))
    assert f"{tmp_path / 'runs'}: 20.0 GB free, the checkpoints need ~" in line, line
    assert "checkpoint.keep_last" in line


def _lustre(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stripes: str | None) -> Path:
    """`tmp_path` mounted as Lustre (a mounts file) and an `lfs` that reports `stripes`."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"10.0.0.1@o2ib:/scratch {tmp_path} lustre rw 0 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if stripes is not None:
        (bin_dir / "lfs").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/lfs-calls\n'
                                     f"echo {stripes}\n")
        (bin_dir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return mounts


def test_lustre_big_files_on_one_stripe(tmp_path: Path, monkeypatch) -> None:
    mounts = _lustre(tmp_path, monkeypatch, "1")
    cfg = load_config(REPO / "configs" / "llama-1b.yaml", [f"run.out_dir={tmp_path / 'ck'}"])
    s = facts.gather_storage(cfg, world_size=2, mounts=mounts)
    assert s.fs["checkpoints"]["stripes"] == 1
    assert f"getstripe -d -c {tmp_path}" in (tmp_path / "lfs-calls").read_text()
    (line,) = problems(checks.check_lustre(job(storage=s)))
    assert f"checkpoints folder {tmp_path / 'ck'}: stripe count 1 for files of ~" in line
    assert f"lfs setstripe -c 4 {tmp_path / 'ck'}" in line
    # Small checkpoints on one stripe are fine; so is a striped folder.
    tiny = load_config(REPO / "configs" / "demo.yaml", [f"run.out_dir={tmp_path / 'ck'}"])
    assert checks.check_lustre(job(storage=facts.gather_storage(tiny, 1, mounts))).problems == []


def test_lustre_without_lfs_says_so(tmp_path: Path, monkeypatch) -> None:
    mounts = _lustre(tmp_path, monkeypatch, None)
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"run.out_dir={tmp_path / 'ck'}"])
    (line,) = problems(checks.check_lustre(job(storage=facts.gather_storage(cfg, 1, mounts))))
    assert "on Lustre but its striping is unknown: lfs not found on PATH" in line, line


def test_small_files_in_the_data_path(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for i in range(12):
        (data / "sub" / f"{i}.txt").write_text("x")
    cfg = JobConfig()
    cfg.run.out_dir = str(tmp_path / "runs")
    cfg.data.source, cfg.data.path = "shards", str(data)  # unvalidated: no manifest needed
    s = facts.gather_storage(cfg, 1)
    assert s.small_files == 12
    assert checks.check_small_files(job(storage=s, max_small_files=12)).problems == []
    (line,) = problems(checks.check_small_files(job(storage=s, max_small_files=10)))
    assert f"{data} holds 12 files under 1 MiB" in line and "hpctrain data pack" in line


def test_ulimits(tmp_path: Path) -> None:
    facts = [rank(i, "n1" if i < 2 else "n2", memlock=65536, nofile=1024) for i in range(4)]
    lines = problems(checks.check_ulimits(job(facts=facts)))
    assert len(lines) == 4, lines  # per node: open files, locked memory
    assert "ulimit -n is 1024 on n1" in lines[0] and "ulimit -l is 64 KiB on n1" in lines[1]
    cpu = [replace(f, gpus=0, gpu=None, ib_devices=[]) for f in facts]
    x = job(facts=cpu)
    x.cfg.run.device = "cpu"
    assert len(checks.check_ulimits(x).problems) == 2  # locked memory matters for RDMA only


def test_gpu_health_flags_the_slow_gpu() -> None:
    gpus = [DeviceResult(f"n{n} GPU {g}", "H100", gemm_tflops=780.0, gemm_peak_tflops=989.0,
                         membw_gbps=3000.0) for n in (1, 2) for g in range(4)]
    gpus[6].gemm_tflops = 400.0
    lines = problems(checks.check_gpu_health(job(gpu_health=gpus)))
    assert any("n2 GPU 2 GEMM 49% below its siblings" in ln for ln in lines), lines
    assert all("--exclude=NODE" in ln for ln in lines)


def test_facts_of_this_machine(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    for name in ("eth0", "lo"):
        (sys_root / "class" / "net" / name).mkdir(parents=True)
    (sys_root / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    env = ProcessEnv("local", 0, 0, 1, 1, 0, "127.0.0.1", 29500, "h")
    f = facts.gather_facts(env, sys_root)
    assert f.net_ifaces == ["eth0", "lo"] and f.ib_devices == ["mlx5_0"]
    assert f.affinity and f.gpu is None and f.torch
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_injected_facts_replace_one_ranks() -> None:
    f = rank(1)
    assert d.inject(f, {d.INJECT_ENV: '{"1": {"torch": "9.9"}}'}).torch == "9.9"
    assert d.inject(f, {d.INJECT_ENV: '{"0": {"torch": "9.9"}}'}) == f
    with pytest.raises(ConfigError, match="cannot be applied"):
        d.inject(f, {d.INJECT_ENV: '{"1": {"no_such_fact": 1}}'})


def test_this_machine_passes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    main(["doctor", str(REPO / "configs" / "demo.yaml"), *TINY])
    out = capsys.readouterr().out
    assert out.count("\nok      ") == len(checks.CHECKS), out
    assert out.rstrip().endswith("doctor: 11 checks, no problems")


def test_a_problem_exits_1_with_its_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(d.INJECT_ENV, json.dumps({"0": {"nofile": 256}}))
    with pytest.raises(SystemExit) as exc:
        main(["doctor", str(REPO / "configs" / "demo.yaml"), *TINY])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and "Traceback" not in err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("PROBLEM")]
    assert line.startswith("PROBLEM ulimits: ulimit -n is 256 on ") and " -- fix: " in line
    assert "doctor found 1 problem" in err
    assert not (tmp_path / "runs").exists()  # a check writes nothing


def test_a_config_train_refuses_here_is_a_problem(tmp_path: Path, monkeypatch, capsys) -> None:
    """No GPU here: `train configs/llama-1b.yaml` refuses 1.1B parameters on the CPU; so must
    doctor."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as exc:
        main(["doctor", str(REPO / "configs" / "llama-1b.yaml"), "--no-gpu-health"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and "Traceback" not in err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("PROBLEM")]
    assert line.startswith("PROBLEM gpus: train would refuse this config here: ")
    assert "no GPU is visible" in line and "run.device=cpu" in line
    # The same config with the CPU forced is what train accepts, and so does doctor.
    main(["doctor", str(REPO / "configs" / "llama-1b.yaml"), "run.device=cpu",
          "--no-gpu-health"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no problems")
    # What the config's auto values resolve to here (hpctrain.plan.auto), as train would.
    assert "ok      auto: on 1 rank(s): parallel.strategy=none, " in out


# Threads a process group runs (gloo's I/O loop and workers, rank 0's TCPStore server): left
# alive past destroy_process_group, they are torn down at interpreter exit, which now and then
# aborts the process (SIGABRT) and with it a job's preflight.
GROUP_THREADS = ("gloo", "tcpstore")


def _doctor_rank(shown: Path, rank: int, port: int, queue) -> None:
    env = ProcessEnv(launcher="torchrun", rank=rank, local_rank=rank, world_size=2,
                     local_world_size=2, node_rank=0, master_addr="127.0.0.1",
                     master_port=port, hostname="localhost")
    # A short timeout: a rank left waiting at the closing barrier fails in seconds, not minutes.
    cfg = load_config(REPO / "configs" / "demo.yaml", [*TINY, "run.device=cpu",
                                                       "run.timeout_s=30"])
    got = {}

    def show(verdicts, who) -> None:  # shows, then fails as a broken terminal would
        got.update(verdicts=verdicts, who=who)
        shown.write_text(who)
        raise OSError("the terminal went away")

    try:
        got["verdicts"], got["who"] = d.run_doctor(cfg, env, allreduce_mb=0.01,
                                                   gpu_health=False, show=show)
    except OSError:
        assert rank == 0  # only rank 0 shows
    verdicts, who = got["verdicts"], got["who"]
    threads = [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]
    queue.put((rank, [v.check for v in verdicts if v.problems], who, shown.is_file(),
               [t for t in threads if any(g in t for g in GROUP_THREADS)]))


def test_two_ranks_agree_and_leave_no_group_running(tmp_path: Path) -> None:
    """The doctor on two real ranks: both get rank 0's verdicts, no rank returns before rank 0
    showed the report, rank 0's report failing still releases rank 1 from the closing barrier
    (it used to wait there until the timeout), and destroy_process_group leaves nothing of the
    group running (rank 0's `gpus` check imports training, which imports torch.distributed.nn
    while the group is up: that used to pin the group, whose threads then aborted the process
    at exit)."""
    results = sorted(spawn_ranks(functools.partial(_doctor_rank, tmp_path / "shown"), 2))
    who = f"2 ranks on 1 node: {socket.gethostname()}"
    assert [r[0] for r in results] == [0, 1] and results[0][1:] == results[1][1:], results
    assert results[0][2:] == (who, True, []), results
