"""The first commands after a finished run: a refused run writes nothing into the directory it was
refused from, a rerun of a finished run says it was complete, and the run's summaries agree.

One tiny run on prepared byte-level shards (vocabulary 257, taken from the manifest: the config
sets no model.vocab_size) is the "demo"; the commands a newcomer types next run against it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY, run_cli
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.observe.runs import runs_table

STEPS = 4


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A completed run on shards, with a bounded validation every 2 steps, and its command."""
    root = tmp_path_factory.mktemp("first-hour")
    text = root / "corpus.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i}: " + "abcdefgh" * (i % 7 + 3)})
                            + "\n" for i in range(400)))
    data = root / "data"
    prepare([text], data, PrepareSettings(TokenizerSpec(), shard_tokens=8000))
    argv = ["train", DEMO, *TINY, *QUIET, f"train.steps={STEPS}", f"run.out_dir={root / 'runs'}",
            "run.name=demo", "data.source=shards", f"data.path={data}",
            "data.val_fraction=0.2", "train.val_every=2", "train.val_max_samples=6"]
    done = run_cli(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"argv": argv, "run_dir": root / "runs" / "demo", "stderr": done.stderr}


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_the_vocabulary_follows_the_manifest(finished: dict) -> None:
    config = (finished["run_dir"] / "config" / "config.yaml").read_text()
    assert "vocab_size: 257" in config


@pytest.mark.parametrize(("extra", "words"), [
    # The README's next command after `make demo`: another vocabulary (stdlib bytes, 256).
    (["data.source=stdlib", "data.path=null"],
     ["saved for another model shape", "model.vocab_size 257 there, 256 here"]),
    (["data.source=stdlib", "data.path=null", "--nproc", "2"],
     ["saved for another model shape", "model.vocab_size 257 there, 256 here"]),
    # A layout this process cannot have (2 tensor-parallel ranks in a world of 1).
    (["parallel.strategy=none", "parallel.tp=2"], ["parallel.tp"]),
])
def test_a_refused_run_writes_nothing_into_the_run_it_was_refused_from(
        finished: dict, extra: list[str], words: list[str]) -> None:
    run_dir = finished["run_dir"]
    before = _snapshot(run_dir)
    refused = run_cli([*finished["argv"], *extra])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    for word in words:
        assert word in refused.stderr, refused.stderr[-3000:]
    if "another model shape" in words[0]:
        assert "--fresh" in refused.stderr and "run.name=" in refused.stderr
    assert _snapshot(run_dir) == before  # exit_info, goodput, config, logs, metrics, lock
    (row,) = runs_table(run_dir.parent, squeue="/nonexistent/squeue")
    assert row["state"] == "done" and row["goodput"] > 0


def test_a_rerun_of_a_finished_run_says_it_was_complete(finished: dict) -> None:
    run_dir = finished["run_dir"]
    info = json.loads((run_dir / "exit_info.json").read_text())
    goodput = (run_dir / "goodput.json").read_bytes()
    ledgers = sorted(p.name for p in (run_dir / "goodput").iterdir())
    again = run_cli(finished["argv"])
    assert again.returncode == 0, again.stderr[-3000:]
    err = again.stderr
    # The old summary: "final loss nan, 0 tokens/s" (a rate like 31070 tokens/s is fine).
    assert "loss nan" not in err and not re.search(r"(?<![\d,.])0 tokens/s", err), err[-3000:]
    expected = (f"already complete: demo finished step {STEPS} of train.steps={STEPS} before "
                f"(final loss {info['extra']['final_loss']:.4f}, "
                f"{info['extra']['tokens_per_s']:.0f} tokens/s per rank")
    assert expected in err, err[-3000:]
    assert "raise train.steps" in err and "--fresh" in err
    # Nothing trained, so nothing recorded: the run's account stays that of its one attempt.
    assert json.loads((run_dir / "exit_info.json").read_text()) == info
    assert (run_dir / "goodput.json").read_bytes() == goodput
    assert sorted(p.name for p in (run_dir / "goodput").iterdir()) == ledgers


def test_one_tokens_per_s_everywhere(finished: dict) -> None:
    """The `done:` line, exit_info.json and `hpctrain runs` show one number: the tokens of the
    windows after the first over their wall time (validation left out)."""
    run_dir = finished["run_dir"]
    rate = json.loads((run_dir / "exit_info.json").read_text())["extra"]["tokens_per_s"]
    windows = [json.loads(line) for line in
               (run_dir / "metrics" / "rank-000.jsonl").read_text().splitlines()]
    windows = [r for r in windows if "loss" in r and "event" not in r][1:]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in windows)
    assert rate == pytest.approx(tokens / sum(r["step_time_s"] for r in windows), rel=1e-6)
    done = re.search(r"done: \d+ steps, final loss [\d.]+, (\d+) tokens/s per rank",
                     finished["stderr"])
    assert done is not None, finished["stderr"][-3000:]
    assert int(done.group(1)) == round(rate)
    (row,) = runs_table(run_dir.parent, squeue="/nonexistent/squeue")
    assert row["tokens_per_s"] == rate


def test_validation_is_bounded_and_says_what_it_covered(finished: dict) -> None:
    records = [json.loads(line) for line in
               (finished["run_dir"] / "metrics" / "rank-000.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, STEPS]
    for r in val:
        assert r["val_samples"] == 6 < r["val_split_samples"]
        assert r["val_tokens"] == 6 * 32 and r["val_batches"] == 1  # micro_batch 8 holds 6
    assert (f"(6 of the {val[0]['val_split_samples']} held-out samples, 1 batches per rank; "
            "train.val_max_samples bounds it") in finished["stderr"]
