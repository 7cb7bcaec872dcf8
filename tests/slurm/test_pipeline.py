"""``hpctrain pipeline`` end to end on the test Slurm: prepare (a 2-task array) -> merge -> train
-> evaluate, chained with afterok; a rerun submits nothing while every stage verifies, and
only the stage whose output changed once one has; ``pipeline status`` shows each stage.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from hpctrain.cli import main

from .conftest import SlurmCluster
from .jobs import REPO, TINY

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

EVALUATE = ("import json, os; info = json.load(open('runs/tiny-train/exit_info.json')); "
            "os.makedirs('eval', exist_ok=True); "
            "json.dump({'loss': info['extra']['final_loss']}, open('eval/result.json', 'w'))")


def _pipeline(project: Path) -> Path:
    overrides = [o for o in TINY if not o.startswith("data.")] + [
        "data.source=shards", "data.path=data/corpus", "data.seq_len=64", "model.vocab_size=257",
        "train.steps=3", "parallel.strategy=none", "run.name=tiny-train"]
    path = project / "pipeline.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: tiny
        resources: {{time: "00:10:00"}}
        stages:
          - name: prepare
            kind: prepare
            inputs: [corpus/]
            out: data/corpus
            tasks: 2
            args: [--shard-mb, "0.05", --workers, "1"]
          - name: merge
            kind: merge
            out: data/corpus
          - name: train
            kind: train
            config: configs/demo.yaml
            overrides: {json.dumps(overrides)}
          - name: evaluate
            kind: command
            command: [python, -c, {json.dumps(EVALUATE)}]
            outputs: [eval/result.json]
        """))
    return path


def _run(capsys: pytest.CaptureFixture, *args: str) -> str:
    main(["pipeline", *args])
    return capsys.readouterr().out


def _jobs(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(\S+)\s+submitted job (\d+)", out, re.M))


def test_chain_rerun_and_status(slurm_cluster: SlurmCluster, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    project = tmp_path / "proj"
    (project / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", project / "configs")
    corpus = project / "corpus"
    corpus.mkdir()
    for name in ("json/encoder.py", "csv.py", "textwrap.py", "shlex.py"):
        src = Path(json.__file__).parents[1] / name
        shutil.copy(src, corpus / f"{src.stem}.txt")
    monkeypatch.chdir(project)
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm_cluster.env[key])
    path = _pipeline(project)

    jobs = _jobs(_run(capsys, str(path)))
    assert list(jobs) == ["prepare", "merge", "train", "evaluate"], jobs
    logs = project / "runs" / "pipelines" / "tiny" / "logs"
    for stage, job in jobs.items():
        ids = [f"{job}_0", f"{job}_1"] if stage == "prepare" else [job]
        for jid in ids:
            state = slurm_cluster.wait(jid, timeout=240)
            log = logs / f"tiny-{stage}-{jid}.out"
            assert state == "COMPLETED", f"{stage}: {log.read_text()[-3000:]}"
    # afterok: each stage started after the one before it ended.
    ends = {s: max(r["EndTime"] for r in slurm_cluster.jobs(j)) for s, j in jobs.items()}
    starts = {s: min(r["StartTime"] for r in slurm_cluster.jobs(j)) for s, j in jobs.items()}
    assert ends["prepare"] <= starts["merge"] and ends["merge"] <= starts["train"]
    assert ends["train"] <= starts["evaluate"]
    result = json.loads((project / "eval" / "result.json").read_text())
    info = json.loads((project / "runs" / "tiny-train" / "exit_info.json").read_text())
    assert result["loss"] == info["extra"]["final_loss"]

    status = _run(capsys, "status", str(path))
    for stage, job in jobs.items():
        line = next(ln for ln in status.splitlines() if ln.startswith(stage + " "))
        assert job in line and "COMPLETED" in line and "  done: " in line, status

    out = _run(capsys, str(path))
    assert _jobs(out) == {} and "nothing to submit" in out, out

    # An output changed after its job wrote it: only that stage runs again.
    with (project / "eval" / "result.json").open("a") as f:
        f.write("\n")
    again = _jobs(_run(capsys, str(path)))
    assert list(again) == ["evaluate"], again
    assert slurm_cluster.wait(again["evaluate"], timeout=120) == "COMPLETED"
    assert "nothing to submit" in _run(capsys, str(path))
