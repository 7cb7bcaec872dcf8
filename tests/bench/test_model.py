"""`bench model`: warm-up and event lines skipped, HFU factors, a real 2-rank CPU run, and a
user's task file measured as train runs it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli
from hpctrain.bench import model
from hpctrain.bench.model import add_energy, hfu_factor, kept_windows, summarise
from hpctrain.cli import main
from hpctrain.errors import ConfigError

# The conftest TINY model: ~50k parameters, 32-token samples, a 200 kB corpus.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "data.seq_len=32", "data.max_bytes=200000"]


def test_hfu_factor() -> None:
    assert hfu_factor("none", 22) == 1.0
    assert hfu_factor("full", 22) == pytest.approx(4 / 3)
    # every_k with k = 2 on 4 blocks recomputes blocks 0 and 2: 1 + (1/3)(2/4).
    assert hfu_factor("every_k", 4, 2) == pytest.approx(1 + 1 / 6)
    # k = 3 on 22 blocks: 0, 3, ..., 21 -> 8 blocks.
    assert hfu_factor("every_k", 22, 3) == pytest.approx(1 + 8 / 22 / 3)
    assert hfu_factor("every_k", 22, 1) == pytest.approx(hfu_factor("full", 22))
    with pytest.raises(ConfigError):
        hfu_factor("some", 4)


def _write_metrics(run_dir: Path, rank: int, rows: list[dict]) -> None:
    path = run_dir / "metrics" / f"rank-{rank:03d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(step: int, tok: float, mfu: float | None, ts: float, wait: float = 0.07) -> dict:
    return {"ts": ts, "step": step, "loss": 10.0 / step, "tokens_per_s": tok,
            "step_time_s": 0.5, "data_time_s": 0.005, "mfu": mfu, "mem_gb": 10.0 + step / 100,
            "host_wait_s": wait}


def test_summarise_skips_warmup_and_event_lines(tmp_path: Path) -> None:
    # 2 ranks, windows of 5 steps up to 40; the first window (compilation) is 10x slower and
    # event lines carry no tokens_per_s.
    for rank in range(2):
        rows = [_step(5, 100.0, 0.01, 1000.0)]
        rows.append({"ts": 1001.0, "event": "checkpoint_stall", "step": 5, "stall_s": 1.0})
        # Rank 1's host is the one that falls behind: its device barely waits for it.
        rows += [_step(s, 1000.0 + rank * 100 + s, 0.40, 1000.0 + s, 0.001 * s if rank else 0.07)
                 for s in range(10, 45, 5)]
        rows.append({"ts": 1050.0, "event": "checkpoint", "step": 40})
        _write_metrics(tmp_path, rank, rows)
    res = summarise(tmp_path, 2, hfu_mult=4 / 3, warmup_frac=0.3)
    # 0.3 * 40 = 12: windows ending at 5 and 10 are warm-up; 15..40 kept (median step 27.5).
    assert res.measured_steps == (10, 40)
    assert res.measured_span_s == (1010.0, 1040.0)
    assert res.tokens_per_s_per_gpu == pytest.approx((1027.5 + 1127.5) / 2)
    assert res.mfu == pytest.approx(0.40)
    assert res.hfu == pytest.approx(0.40 * 4 / 3)
    assert res.peak_mem_gb == pytest.approx(10.4)
    assert res.data_time_frac == pytest.approx(0.01)
    assert res.host_wait_s == [pytest.approx(0.07), pytest.approx(0.0275)]
    # 30 s at 1,400 W for 30 steps x 8,192 tokens x 2 ranks.
    add_energy(res, joules=42_000.0, tokens_per_step_per_rank=8192)
    assert res.gpu_watts == pytest.approx(1400.0)
    assert res.joules_per_token == pytest.approx(42_000 / (30 * 8192 * 2))
    assert res.tokens_per_joule == pytest.approx(30 * 8192 * 2 / 42_000)


def test_unknown_mfu_stays_unknown(tmp_path: Path) -> None:
    rows = [_step(s, 500.0, None, float(s)) for s in (2, 4, 6)]
    for row in rows:  # metrics written before host_wait_s existed
        del row["host_wait_s"]
    _write_metrics(tmp_path, 0, rows)
    res = summarise(tmp_path, 1, hfu_mult=4 / 3)
    assert res.mfu is None and res.hfu is None
    assert res.host_wait_s == [None]
    assert res.measured_steps == (2, 6)


def test_too_few_windows_is_a_user_error() -> None:
    with pytest.raises(ConfigError, match="logging window"):
        kept_windows([_step(5, 1.0, None, 0.0)])


def test_bench_model_two_cpu_ranks_end_to_end(tmp_path: Path, capsys) -> None:
    """A real `hpctrain train --nproc 2` run with every_k checkpointing, read back."""
    out = tmp_path / "model"
    main(["bench", "model", "--device", "cpu", "--nproc", "2", "--ac", "every_k",
          "--ac-every", "2", "--steps", "8", "--log-every", "2", "--out", str(out),
          "--set", *TINY, "train.micro_batch=4"])
    text = capsys.readouterr().out
    assert "MFU %" in text and "unknown" in text and "tokens/s per rank" in text
    data = json.loads((out / "model.json").read_text())
    row = data["rows"][0]
    assert row["ranks"] == 2 and row["strategy"] == "ddp" and row["ac"] == "every_k/2"
    assert row["tokens_per_s_per_gpu"] > 0 and row["mfu_pct"] is None and row["hfu_pct"] is None
    assert row["measured_steps"] == [2, 8]
    assert row["joules_per_token"] is None  # no GPU, no NVML
    assert (out / "config.yaml").exists()
    assert (out / "train" / "metrics" / "rank-001.jsonl").exists()


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2", "--strategy", "none"], "strategy=none"),
    (["--steps", "4", "--log-every", "5"], "steps >= 2 x log_every"),
    (["--set", "model.size=huge"], "model"),
    (["--device", "tpu"], "unknown device"),
])
def test_bench_model_user_errors(argv: list[str], message: str, tmp_path: Path,
                                 capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "model", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


TASK = """\
import torch
from torch import nn
from hpctrain.task import Task

def task():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
                data=torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                loss=nn.functional.mse_loss, tokens_per_sample=4)
"""


def test_bench_model_measures_a_task_file_as_train_runs_it(tmp_path: Path, monkeypatch,
                                                          capsys) -> None:
    """``bench model --config my_task.py`` (was: 'is not valid YAML') trains the task as
    ``hpctrain train my_task.py`` does and reads its numbers back; the flags that shape the
    built-in model are refused for it, not ignored."""
    task = tmp_path / "reg_task.py"
    task.write_text(textwrap.dedent(TASK))

    def train_forked(argv: list[str], *, timeout: float, env=None, cwd=None):
        """The same `hpctrain train` command, forked from the preloaded interpreter."""
        assert argv[1:4] == ["-m", "hpctrain", "train"]
        done = run_cli(argv[3:], timeout)
        return done.returncode, done.stdout + done.stderr, 1.0

    monkeypatch.setattr(model, "run_command", train_forked)
    out = tmp_path / "bench"
    main(["bench", "model", "--config", str(task), "--device", "cpu", "--micro-batch", "8",
          "--steps", "4", "--log-every", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert f"bench model: task {task}, none on 1 rank(s)" in text
    row = json.loads((out / "model.json").read_text())["rows"][0]
    assert row["size"] == f"task {task}" and row["seq_len"] is None and row["micro_batch"] == 8
    assert row["tokens_per_s_per_gpu"] > 0 and row["measured_steps"] == [2, 4]
    layout = next(r for r in model.rank_metrics(out / "train", 1)[0] if r.get("event"))
    assert layout["tokens_per_step_per_gpu"] == 8 * 4  # the task's 4 tokens per sample
    for flag, message in ((["--size", "1b"], f"with task {task}"),
                          (["--seq-len", "64"], f"with task {task}"),
                          (["--set", "model.n_layers=4"], f"with task {task}"),
                          (["--ac", "full"], "with a task of your own")):  # training's words
        with pytest.raises(SystemExit) as exc:
            main(["bench", "model", "--config", str(task), "--device", "cpu", "--out",
                  str(out), *flag])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err
