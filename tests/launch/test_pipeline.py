"""``hpctrain pipeline`` without a cluster: the file's checks, the plan (skip what verifies, keep
what Slurm still runs, rerun what depends on a rerun), the scripts and done-markers, against a
fake ``sbatch`` and ``scontrol``. tests/slurm/test_pipeline.py runs a whole chain for real.

    .venv/bin/pytest tests/launch/test_pipeline.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.launch.pipeline import Runner, fingerprint, load_pipeline, mark_done

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
REPO = Path(__file__).resolve().parents[2]

CHAIN = """\
name: chain
resources: {time: "00:30:00", partition: cpu}
stages:
  - name: prepare
    kind: prepare
    inputs: [corpus/]
    out: data/corpus
    tasks: 3
    resources: {cpus_per_task: 4}
  - name: merge
    kind: merge
    out: data/corpus
  - name: train
    kind: train
    config: configs/demo.yaml
    overrides: [data.source=shards, data.path=data/corpus, model.vocab_size=257,
                train.steps=5, run.name=chain-train]
    resources: {nodes: 2, tasks_per_node: 2}
  - name: evaluate
    kind: command
    command: [hpctrain, data, verify, data/corpus]
    outputs: [eval.txt]
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder with configs/demo.yaml and pipeline.yaml; fake sbatch and scontrol."""
    root = tmp_path / "proj"
    (root / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", root / "configs" / "demo.yaml")
    (root / "pipeline.yaml").write_text(CHAIN)
    (root / "corpus").mkdir()  # the prepare stage's input: checked before submitting
    (root / "corpus" / "a.txt").write_text("some text\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # sbatch: job ids 100, 101, ...; each submitted script kept as sub-<id>.sh.
    (bin_dir / "sbatch").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        n=$(cat {tmp_path}/next 2>/dev/null || echo 100)
        echo $((n + 1)) > {tmp_path}/next
        cp "${{@: -1}}" {tmp_path}/sub-$n.sh
        echo $n
        """))
    # scontrol: the states listed in $FAKE_STATES ("id:STATE ..."), else an unknown job.
    (bin_dir / "scontrol").write_text(textwrap.dedent("""\
        #!/bin/bash
        for pair in ${FAKE_STATES:-}; do
            if [ "${pair%%:*}" = "$4" ]; then
                echo "JobId=$4 JobName=x JobState=${pair#*:} Reason=None"; exit 0
            fi
        done
        echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1
        """))
    for tool in ("sbatch", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.chdir(root)
    return root


def _run(capsys: pytest.CaptureFixture, *args: str) -> str:
    main(["pipeline", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return out


def _submitted(tmp: Path) -> dict[int, str]:
    return {int(p.stem.split("-")[1]): p.read_text() for p in tmp.glob("sub-*.sh")}


def test_first_run_submits_the_chain_with_afterok(project: Path, capsys) -> None:
    out = _run(capsys, "pipeline.yaml")
    assert [ln.split()[:3] for ln in out.splitlines()[:4]] == [
        ["prepare", "submitted", "job"], ["merge", "submitted", "job"],
        ["train", "submitted", "job"], ["evaluate", "submitted", "job"]], out
    scripts = _submitted(project.parent)
    prepare, merge, train, evaluate = (scripts[i].splitlines() for i in (100, 101, 102, 103))
    assert "#SBATCH --array=0-2" in prepare and "#SBATCH --cpus-per-task=4" in prepare
    assert "#SBATCH --partition=cpu" in prepare and "#SBATCH --time=00:30:00" in prepare
    assert "#SBATCH --dependency=afterok:100" in merge
    assert "#SBATCH --dependency=afterok:101" in train and "#SBATCH --nodes=2" in train
    assert "#SBATCH --requeue" in train and "#SBATCH --requeue" not in prepare
    assert any("run.suffix=none" in ln for ln in train)
    assert "#SBATCH --dependency=afterok:102" in evaluate
    # `hpctrain` in a command is the jobs' interpreter; success writes the done-marker.
    assert any(ln.startswith("srun ") and "-m hpctrain data verify data/corpus" in ln
               for ln in evaluate)
    assert any("pipeline mark" in ln and ln.strip().endswith("evaluate eval.txt || rc=$?")
               for ln in evaluate)
    jobs = json.loads((project / "runs/pipelines/chain/jobs.json").read_text())
    assert {k: v["job_id"] for k, v in jobs.items()} == {
        "prepare": "100", "merge": "101", "train": "102", "evaluate": "103"}
    assert (project / "runs/pipelines/chain/logs/chain-train-102.sh").is_file()


def test_queued_jobs_are_kept_and_waited_for(project: Path, capsys,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _run(capsys, "pipeline.yaml")
    monkeypatch.setenv("FAKE_STATES", "100:RUNNING 101:PENDING 102:PENDING 103:PENDING")
    out = _run(capsys, "pipeline.yaml")
    assert "nothing to submit" in out and "job 101 still PENDING" in out, out
    monkeypatch.setenv("FAKE_STATES", "100:RUNNING 101:PENDING 102:FAILED 103:CANCELLED")
    out = _run(capsys, "pipeline.yaml")
    assert "job 100 still RUNNING" in out and "job 101 still PENDING" in out, out
    scripts = _submitted(project.parent)
    assert "#SBATCH --dependency=afterok:101" in scripts[104].splitlines()  # train
    assert "#SBATCH --dependency=afterok:104" in scripts[105].splitlines()  # evaluate


def test_a_queued_job_after_a_stage_that_must_rerun_is_not_doubled(
        project: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(capsys, "pipeline.yaml")
    # prepare's job ended but its parts do not verify: it must run again, before merge.
    monkeypatch.setenv("FAKE_STATES", "100:COMPLETED 101:RUNNING 102:PENDING 103:PENDING")
    with pytest.raises(SystemExit) as exc:
        main(["pipeline", "pipeline.yaml"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "job 101 is still RUNNING" in err and "scancel 101" in err
    assert len(_submitted(project.parent)) == 4


def test_verified_stages_are_skipped_and_a_rerun_reaches_its_dependents(
        project: Path, capsys) -> None:
    from hpctrain.runtime.rundir import RunDir

    # train is complete (exit 0 after its 5 steps, no checkpoint kept); evaluate marked done.
    run = RunDir(project / "runs" / "chain-train")
    run.root.mkdir(parents=True)
    run.write_exit_info(exit_code=0, reason="done", last_checkpoint=None, extra={"steps": 5})
    (project / "eval.txt").write_text("ok\n")
    state = project / "runs/pipelines/chain"
    mark_done(state, "evaluate", ["eval.txt"])
    out = _run(capsys, "pipeline.yaml", "--dry-run")
    lines = dict(ln.split(None, 1) for ln in out.splitlines())
    # The data does not verify, so train and evaluate run again after it; the old run is
    # archived (renamed, never deleted), and the old marker is set aside, not trusted.
    assert lines["prepare"].startswith("would submit"), out
    assert "a stage it depends on runs again" in lines["train"], out
    assert not _submitted(project.parent)  # a dry run submits nothing, moves nothing
    assert not (state / "jobs.json").exists() and run.exit_info_path.is_file()
    out = _run(capsys, "pipeline.yaml")
    (archived,) = (project / "runs").glob("chain-train-archived-*")
    assert (archived / "exit_info.json").is_file() and not run.root.exists()
    assert f"previous run is archived as {archived}" in out, out
    assert not (state / "done" / "evaluate.json").exists()
    assert (state / "done" / "evaluate.local.json").is_file()


def test_command_marker_verifies_outputs(project: Path) -> None:
    out = project / "out"
    out.mkdir()
    (out / "a.txt").write_text("a")
    (project / "b.txt").write_text("b")
    state = project / "state"
    stage = load_pipeline(project / "pipeline.yaml")
    runner = Runner(project / "pipeline.yaml")
    evaluate = stage.stages[-1]
    evaluate.outputs = ["out", "b.txt"]
    from hpctrain.launch.pipeline import verify

    assert verify(evaluate, stage, project, state) == (False, f"{state}/done/evaluate.json "
                                                       "is missing")
    mark_done(state, "evaluate", ["out", "b.txt"])
    assert verify(evaluate, stage, project, state)[0]
    before = fingerprint(out)
    (out / "a.txt").write_text("changed")
    os.utime(out / "a.txt", ns=(1, 1))
    assert fingerprint(out) != before
    done, why = verify(evaluate, stage, project, state)
    assert not done and "out changed since job local wrote it" in why
    with pytest.raises(ConfigError, match="did not write missing.txt"):
        mark_done(state, "evaluate", ["missing.txt"])
    assert runner.state == project / "runs" / "pipelines" / "chain"


@pytest.mark.parametrize("edit, message", [
    (("    kind: merge\n", "    kind: merge\n    after: [train]\n"), "after names 'train'"),
    (("    kind: merge\n", "    kind: merge\n    config: x.yaml\n"), "sets config"),
    (("name: evaluate", "name: merge"), "repeated"),
    (("name: chain", "name: ../x"), "pipeline.name"),
    (("    outputs: [eval.txt]\n", "    outputs: [eval.txt]\n    output: x\n"),
     "did you mean 'outputs'"),
    (("    out: data/corpus\n    tasks: 3\n", "    tasks: 3\n"), "inputs, out and tasks"),
])
def test_a_bad_pipeline_file_is_refused_with_the_fix(project: Path, capsys, edit, message):
    text = CHAIN.replace(*edit)
    assert text != CHAIN
    (project / "pipeline.yaml").write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["pipeline", "pipeline.yaml"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err
    assert not _submitted(project.parent)


def test_a_train_stage_is_checked_before_anything_is_submitted(project: Path, capsys) -> None:
    # 2 nodes x 3 tasks with tp 2: a tensor-parallel group would straddle the nodes.
    (project / "pipeline.yaml").write_text(CHAIN.replace(
        "train.steps=5,", "train.steps=5, parallel.strategy=fsdp, parallel.tp=2,").replace(
        "model.vocab_size=257", "model.vocab_size=258").replace(
        "{nodes: 2, tasks_per_node: 2}", "{nodes: 2, tasks_per_node: 3}"))
    with pytest.raises(SystemExit):
        main(["pipeline", "pipeline.yaml"])
    assert "would span nodes" in capsys.readouterr().err
    assert not _submitted(project.parent)


def test_a_container_runs_every_stage_and_the_marker_on_the_host(project: Path, capsys) -> None:
    (project / "pipeline.yaml").write_text(CHAIN.replace(
        "name: chain\n", "name: chain\ncontainer: /images/hpctrain.sif\nbinds: [/models]\n"))
    _run(capsys, "pipeline.yaml")
    scripts = _submitted(project.parent)
    state = project / "runs/pipelines/chain"
    for text in scripts.values():
        assert f"binds={project},/models" in text, text
        (srun,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
        assert 'apptainer exec --bind "$binds" /images/hpctrain.sif python3 -m hpctrain' in srun
    (mark,) = [ln.strip() for ln in scripts[103].splitlines() if " pipeline mark " in ln]
    assert mark.startswith(f"{sys.executable} -m hpctrain pipeline mark {state} evaluate")
