"""End-to-end CPU runs of the Trainer: run-directory layout, precisions, activation
checkpointing and the non-finite-loss guard; through the real CLI where what it writes, prints
or exits with is checked, else through the ranks' real entry point, several runs in one process.

    .venv/bin/pytest tests/train/test_trainer_cpu.py -q
"""

from __future__ import annotations

import math
import platform
import re
import socket
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import yaml

from conftest import (
    DEMO,
    METRIC_FIELDS,
    QUIET,
    REFERENCE,
    REPO,
    STEPS,
    TINY,
    RunResult,
    one_of,
    run_cli,
    train,
    train_together,
)
from hpctrain.config import load_config, to_dict
from hpctrain.observe.metrics import read_metrics


@pytest.fixture(scope="module", autouse=True)
def runs(tmp_path_factory: pytest.TempPathFactory, run_pool: ThreadPoolExecutor,
         reference_run: Future[RunResult], ddp_run: Future[RunResult]
         ) -> dict[str, Future[RunResult]]:
    """Submit every run of this module up front (autouse); they overlap on the 2 cores.

    The runs checked by their numbers share one process (conftest's ``train_together``); those
    checked by what the CLI says and exits with run through it."""
    out = tmp_path_factory.mktemp("trainer")

    def submit(name: str, *overrides: str, steps: int = STEPS) -> Future[RunResult]:
        return run_pool.submit(train, out, name, *REFERENCE, *overrides, steps=steps)

    together = run_pool.submit(train_together, out, {
        "bf16": [*REFERENCE, "train.precision=bf16", "train.steps=2"],
        "fp16": [*REFERENCE, "train.precision=fp16", "train.steps=2"],
        "ac_full": [*REFERENCE, "parallel.activation_checkpointing=full"],
        "ac_every_k": [*REFERENCE, "parallel.activation_checkpointing=every_k",
                       "parallel.ac_every=2"],
    })
    return {
        **{name: one_of(together, name) for name in ("bf16", "fp16", "ac_full", "ac_every_k")},
        # AdamW moves every weight by ~lr per step whatever the gradient; 1e30 overflows the
        # forward within 3 steps. (Also checks that a dot-less exponent is read as a number.)
        # guard.action=stop: fail on a bad step instead of skipping it.
        "nan": submit("nan", "optim.lr=1e30", "guard.action=stop"),
        # The default guard (skip bad steps) with the same divergence.
        "nan_skip": submit("nan_skip", "optim.lr=1e30"),
    }


# -- run directory layout (2 DDP ranks) ---------------------------------------------------------


def test_run_directory_layout(ddp_run: Future[RunResult]) -> None:
    """config, provenance, per-rank logs and metrics, exit info: all there and consistent."""
    run = ddp_run.result().ok()
    root = run.run_dir
    for folder in ("config", "logs", "metrics", "checkpoints", "provenance"):
        assert (root / folder).is_dir(), f"missing {folder}/ in {sorted(root.iterdir())}"

    # The resolved config, overrides included, exactly as `load_config` builds it.
    saved = yaml.safe_load((root / "config" / "config.yaml").read_text())
    overrides = run.args[2:run.args.index("--nproc")]
    assert saved == to_dict(load_config(REPO / DEMO, overrides))
    assert saved["model"]["dim"] == 64 and saved["train"]["steps"] == STEPS
    assert saved["parallel"]["strategy"] == "ddp" and saved["train"]["micro_batch"] == 2
    assert saved["run"]["name"] == "ddp" and saved["run"]["suffix"] == "none"
    assert (root / "config" / "source.yaml").read_text() == (REPO / DEMO).read_text()

    prov = yaml.safe_load((root / "provenance" / "provenance.json").read_text())
    for key in ("git_sha", "git_dirty", "python", "torch", "hosts"):
        assert key in prov, f"provenance lacks {key!r}: {sorted(prov)}"
    assert prov["python"] == platform.python_version()
    assert prov["torch"] == torch.__version__
    assert prov["hosts"] == [socket.gethostname()]

    for rank in (0, 1):
        log = (root / "logs" / f"rank-{rank:03d}.log").read_text()
        assert re.search(rf"device binding: .*\brank {rank}/2\b.*\bdevice cpu\b", log), log
        # Every line of a rank's log says which rank wrote it.
        assert f"[rank {rank}/2 " in log.splitlines()[0]

        records = run.metrics(rank)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for r in records:
            missing = METRIC_FIELDS - r.keys()
            assert not missing, f"rank {rank} step {r['step']} lacks {sorted(missing)}"
            assert r["rank"] == rank and r["host"] == socket.gethostname()
            for key in ("loss", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb"):
                assert math.isfinite(r[key]) and r[key] > 0, (key, r)
            assert r["data_time_s"] >= 0
            assert 0 < r["lr"] <= 2e-3 * (1 + 1e-9)  # never above the demo's peak lr
            assert r["mfu"] is None  # no known CPU peak: MFU is not guessed
        stamps = [r["ts"] for r in records]
        assert stamps == sorted(stamps)

    info = run.exit_info()
    assert info["exit_code"] == 0 and info["reason"] == "completed", info
    assert info["extra"]["steps"] == STEPS
    assert info["extra"]["final_loss"] == run.losses()[-1]

    console = run.stdout + run.stderr
    assert "run directory" in console and str(root) in console, console
    assert "final loss" in console, console


# What a user sees on the console is hpctrain's own lines: warnings of the libraries under it
# (a deprecated DDP argument, a pytree registration, an optional package's kernels that do not
# load on this machine) are noise that teaches users to skim past real warnings.
WARNING_SIGNS = re.compile(r"Warning\b|warnings\.warn|deprecated|Failed to load", re.IGNORECASE)


def _warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if WARNING_SIGNS.search(line)]


def _byte_tokenizer(folder) -> str:
    """A tokenizer.json of the 256 bytes and an EOS (a run on data.source=stdlib names none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_ddp_run_export_and_generate_print_no_warnings(ddp_run: Future[RunResult],
                                                       tmp_path) -> None:
    """A 2-rank DDP run, ``export hf`` and ``generate`` of its checkpoint: no library warnings."""
    run = ddp_run.result().ok()
    assert _warnings_in(run.stderr) == [], run.stderr[-4000:]
    exported = run_cli(["export", "hf", str(run.run_dir), "--out", str(tmp_path / "hf"),
                        "--dtype", "fp32"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert _warnings_in(exported.stderr) == [], exported.stderr[-4000:]
    sampled = run_cli(["generate", str(run.run_dir), "--prompt", "def ", "--max-new-tokens",
                       "4", "--device", "cpu", "--tokenizer", _byte_tokenizer(tmp_path)])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert _warnings_in(sampled.stderr) == [], sampled.stderr[-4000:]


def test_config_subcommand_prints_the_resolved_config() -> None:
    """`hpctrain config` shows the resolved config a run saves (defaults + file + overrides)."""
    overrides = [*TINY, *QUIET, "train.steps=3"]
    done = run_cli(["config", DEMO, *overrides], timeout=60)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == to_dict(load_config(REPO / DEMO, overrides))


# -- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains(runs: dict[str, Future[RunResult]],
                              reference_run: Future[RunResult], precision: str) -> None:
    """bf16 (autocast) and fp16 (autocast + GradScaler) run on the CPU with finite losses."""
    run = runs[precision].result().ok()
    losses = run.losses()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert all(math.isfinite(g) for g in run.grad_norms())
    fp32_first = reference_run.result().ok().losses()[0]
    # Same weights and batch as the fp32 reference, so step 1 is close to it...
    assert losses[0] == pytest.approx(fp32_first, rel=2e-2)
    # ...but not equal: the forward really ran in reduced precision.
    assert losses[0] != fp32_first
    assert run.exit_info()["reason"] == "completed"


# -- activation checkpointing -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ac_full", "ac_every_k"])
def test_activation_checkpointing_does_not_change_results(
        runs: dict[str, Future[RunResult]], reference_run: Future[RunResult], mode: str) -> None:
    """Recomputing activations in backward gives bit-identical losses and grad norms (fp32)."""
    ref = reference_run.result().ok()
    run = runs[mode].result().ok()
    assert run.losses() == ref.losses()
    assert run.grad_norms() == ref.grad_norms()


# -- non-finite loss ----------------------------------------------------------------------------


def test_non_finite_loss_stops_the_run(runs: dict[str, Future[RunResult]]) -> None:
    """A diverged loss ends the run with a user error (exit 2, no traceback) and exit info."""
    run = runs["nan"].result()
    assert run.returncode == 2, run.describe()  # a user error (HpctrainError), not a crash
    assert "NaN or infinite" in run.stderr, run.describe()
    assert "hpctrain: error:" in run.stderr and "HINT:" in run.stderr
    assert "Traceback" not in run.stderr, run.describe()
    info = run.exit_info()
    assert info["exit_code"] == 2
    assert "NonFiniteLossError" in info["reason"] and "NaN or infinite" in info["reason"]
    # Steps before the divergence were logged and finite; the run stopped well before the end.
    losses = run.losses()
    assert 1 <= len(losses) < STEPS and all(math.isfinite(x) for x in losses), losses


def test_skipping_guard_gives_up_with_a_user_error_when_nothing_recovers(
        runs: dict[str, Future[RunResult]]) -> None:
    """With guard.action=skip (the default) the diverged run skips each bad step, then, with no
    checkpoint to roll back to, stops with a user error: not a crash, never "completed"."""
    run = runs["nan_skip"].result()
    assert run.returncode == 2, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    assert "no checkpoint to roll back to" in run.stderr and "HINT:" in run.stderr
    info = run.exit_info()
    assert info["exit_code"] == 2 and "NonFiniteLossError" in info["reason"], info
    assert "final_loss" not in info["extra"], info
    # Every step after the first was bad and skipped, each reported once, up to the last.
    skipped = [r["step"] for r in read_metrics(run.run_dir / "metrics" / "rank-000.jsonl")
               if r.get("event") == "bad_steps"]
    assert skipped == list(range(2, STEPS + 1)), skipped
