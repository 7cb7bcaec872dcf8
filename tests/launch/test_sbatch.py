"""``hpctrain sbatch``: the script text, pinned by golden files, and what the command checks and
creates so that the script runs as written (tests/slurm/test_sbatch_script.py submits it to a
real Slurm).

    .venv/bin/pytest tests/launch/test_sbatch.py -q
    HPCTRAIN_UPDATE_GOLDEN=1 .venv/bin/pytest tests/launch/test_sbatch.py   # intended changes
"""

from __future__ import annotations

import difflib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.launch.containers import Container
from hpctrain.launch.sbatch import SbatchParams, render_sbatch

# main() is wrapped by torch's @record, which cannot install its fault handler on pytest's
# captured stderr; that is noise here, not a finding.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
HOME = "/home/alice/hpctrain"

CASES = {
    "sbatch-single.sh": SbatchParams(
        config="configs/demo.yaml", workdir=HOME, python=f"{HOME}/.venv/bin/python",
        overrides=["train.steps=100", "run.name=first try", "data.path=data/web"]),
    "sbatch-gpu-array.sh": SbatchParams(
        config="configs/llama-1b.yaml", workdir=HOME, python="/opt/envs/train env/bin/python",
        overrides=["parallel.strategy=fsdp"], job_name="llama", nodes=2, tasks_per_node=4,
        gpus_per_node=4, cpus_per_task=16, time="04:00:00", signal_lead_s=180,
        partition="gpu", account="proj-42", array="0-3%2", log_dir="/scratch/alice/logs",
        dependency="afterok:4242:4243", preflight=True),
    "sbatch-apptainer.sh": SbatchParams(
        config="configs/llama-1b.yaml", workdir=HOME, python="python3",
        overrides=["data.source=shards", "data.path=/lustre/corpus"], job_name="llama", nodes=2,
        tasks_per_node=4, gpus_per_node=4, cpus_per_task=16, log_dir="/scratch/alice/logs",
        preflight=True, container=Container("/images/hpctrain 0.1.sif", "apptainer", [
            HOME, "/lustre/corpus", "/scratch/alice/logs"])),
    "sbatch-pyxis.sh": SbatchParams(
        config="configs/llama-1b.yaml", workdir=HOME, python="/opt/venv/bin/python",
        job_name="llama", nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=16,
        container=Container("nvcr.io#nvidia/pytorch:25.01-py3", "pyxis", [HOME])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_script_text_matches_golden_file(name: str) -> None:
    text = render_sbatch(CASES[name])
    path = GOLDEN / name
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                        str(path), "rendered"))
    assert text == expected, diff


def test_ranks_fill_a_node_before_the_next() -> None:
    """Block distribution: ranks 0..k-1 on the first node, so tp (innermost) stays in a node."""
    argv = _srun_argv(render_sbatch(CASES["sbatch-gpu-array.sh"]))
    assert "--distribution=block" in argv[:argv.index("-m")]


def test_a_dependency_never_leaves_the_job_pending_forever() -> None:
    lines = render_sbatch(CASES["sbatch-gpu-array.sh"]).splitlines()
    assert "#SBATCH --dependency=afterok:4242:4243" in lines
    assert "#SBATCH --kill-on-invalid-dep=yes" in lines
    assert "#SBATCH --kill-on-invalid-dep=yes" not in render_sbatch(CASES["sbatch-single.sh"])


def _srun_argv(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("srun ") and " doctor " not in ln]
    return shlex.split(line)


def _run_bash(text: str, tmp: Path, tools: dict[str, str], env: dict[str, str]) -> str:
    """Run a generated script with fake tools first on PATH (they echo their argv)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = tmp / "job.sh"
    script.write_text(text.replace(f"cd -- {HOME} ", f"cd -- {tmp} "))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7",
                               "SLURM_JOB_NODELIST": "n1", **env})
    assert done.returncode == 0, done.stderr
    return "\n".join(ln for ln in done.stdout.splitlines() if ln.startswith("<"))


ECHO_ARGV = 'for a in "$@"; do printf "<%s>" "$a"; done; echo'


def test_apptainer_gets_the_binds_and_slurm_tmpdir(tmp_path: Path) -> None:
    """The srun lines, run by bash: apptainer exec --nv --bind <folders,$SLURM_TMPDIR> IMAGE."""
    text = render_sbatch(CASES["sbatch-apptainer.sh"])
    out = _run_bash(text, tmp_path, {"srun": ECHO_ARGV}, {"SLURM_TMPDIR": "/local/job 7"})
    doctor, train = out.splitlines()
    binds = f"{HOME},/lustre/corpus,/scratch/alice/logs,/local/job 7"
    assert train.startswith("<--kill-on-bad-exit=1><--distribution=block><apptainer><exec>"
                            f"<--nv><--bind><{binds}><") and "<python3><-m><hpctrain><train>" in \
        train, train
    assert "<hpctrain 0.1.sif>" not in train and "</images/hpctrain 0.1.sif>" in train
    assert "<doctor>" in doctor and f"<{binds}>" in doctor


def test_pyxis_mounts_without_slurm_tmpdir(tmp_path: Path) -> None:
    out = _run_bash(render_sbatch(CASES["sbatch-pyxis.sh"]), tmp_path, {"srun": ECHO_ARGV}, {})
    assert out.startswith("<--kill-on-bad-exit=1><--distribution=block>"
                          "<--container-image=nvcr.io#nvidia/pytorch:25.01-py3>"
                          f"<--container-mounts={HOME}:{HOME}><--container-workdir={HOME}>"
                          "</opt/venv/bin/python><-m><hpctrain><train>"), out


def test_preflight_runs_doctor_on_every_task_before_training() -> None:
    lines = render_sbatch(CASES["sbatch-gpu-array.sh"]).splitlines()
    srun = [shlex.split(ln) for ln in lines if ln.startswith("srun ")]
    assert [argv[argv.index("-m") + 2] for argv in srun] == ["doctor", "train"]
    doctor, train = srun
    assert doctor[:doctor.index("-m")] == train[:train.index("-m")]  # same tasks, same layout
    assert doctor[doctor.index("doctor") + 1:] == ["configs/llama-1b.yaml",
                                                   "parallel.strategy=fsdp", "||", "exit", "1"]
    assert "doctor" not in render_sbatch(CASES["sbatch-single.sh"])


def _program(text: str) -> list[str]:
    """What srun starts: the interpreter and its arguments (srun's own options dropped)."""
    argv = _srun_argv(text)
    return argv[argv.index("-m") - 1:]


def test_every_body_path_is_shell_quoted() -> None:
    """Paths with spaces survive as single words: the interpreter, the config, the workdir."""
    p = SbatchParams(config="my configs/demo.yaml", workdir="/home/a b/proj",
                     python="/opt/my env/bin/python", overrides=["run.name=x y"],
                     log_dir="/scratch/logs")
    text = render_sbatch(p)
    assert _program(text) == ["/opt/my env/bin/python", "-m", "hpctrain", "train",
                                    "my configs/demo.yaml", "run.name=x y"]
    (cd,) = [ln for ln in text.splitlines() if ln.startswith("cd ")]
    assert shlex.split(cd) == ["cd", "--", "/home/a b/proj", "||", "exit", "1"]


@pytest.mark.parametrize("change, message", [
    (dict(log_dir="logs of mine"), "log folder"),            # relative: joined to the workdir
    (dict(workdir="/home/a b/proj"), "log folder"),          # the default log dir lies below it
    (dict(log_dir="/scratch/%u/logs"), "log folder"),        # '%' is a Slurm filename pattern
    (dict(workdir="proj"), "absolute"),
    (dict(python="python3"), "absolute"),
    (dict(job_name="a\n#SBATCH --x"), "--job-name"),
    (dict(partition="gpu --exclusive"), "--partition"),
    (dict(account="a\nb"), "--account"),
    (dict(array="0-3\n#SBATCH --x"), "--array"),
    (dict(signal="USR2\n"), "--signal"),
    (dict(dependency="afterok:1\n#SBATCH --x"), "--dependency"),
    (dict(dependency="after-ok:12"), "--dependency"),
    (dict(dependency="afterok"), "--dependency"),
])
def test_values_sbatch_lines_cannot_carry_are_refused(change: dict, message: str) -> None:
    base = dict(config="c.yaml", workdir="/home/alice/p", python="/usr/bin/python3")
    with pytest.raises(ConfigError, match=message):
        render_sbatch(SbatchParams(**{**base, **change}))


# -- the command --------------------------------------------------------------------------------


def _sbatch(*args: str) -> None:
    main(["sbatch", *args])


def test_defaults_run_as_written_from_anywhere(project: Path) -> None:
    """This interpreter, a cd to the generating folder, an absolute log folder that exists."""
    assert not (project / "runs").exists()
    _sbatch("configs/demo.yaml", "train.steps=3", "-o", "train.sh")
    text = (project / "train.sh").read_text()
    assert (project / "runs" / "slurm-logs").is_dir()  # created now: Slurm would not
    assert _program(text) == [sys.executable, "-m", "hpctrain", "train",
                                    "configs/demo.yaml", "train.steps=3"]
    assert f"cd -- {project} || exit 1" in text.splitlines()
    assert f"#SBATCH --output={project}/runs/slurm-logs/hpctrain-%j.out" in text.splitlines()


def test_stdout_without_output_file(project: Path, capsys: pytest.CaptureFixture) -> None:
    _sbatch("configs/demo.yaml", "--log-dir", "logs")
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and f"--output={project}/logs/" in out
    assert (project / "logs").is_dir()


def test_output_into_a_missing_folder_creates_it(project: Path) -> None:
    _sbatch("configs/demo.yaml", "-o", "runs/slurm/demo.sh")
    assert (project / "runs" / "slurm" / "demo.sh").read_text().startswith("#!/bin/bash\n")


def test_output_that_cannot_be_written_is_a_user_error(project: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    (project / "taken").write_text("a file, not a folder")
    err = _fails(capsys, "configs/demo.yaml", "-o", "taken/demo.sh")
    assert "-o 'taken/demo.sh' cannot be written" in err and "HINT" in err, err
    err = _fails(capsys, "configs/demo.yaml", "-o", "configs")
    assert "is a directory" in err, err


def test_venv_picks_its_interpreter(project: Path) -> None:
    _sbatch("configs/demo.yaml", "--venv", sys.prefix, "-o", "train.sh")
    argv = _program((project / "train.sh").read_text())
    assert argv[0] == str(Path(sys.prefix) / "bin" / "python")


def _fails(capsys: pytest.CaptureFixture, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _sbatch(*args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_an_interpreter_without_hpctrain_is_refused(project: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    # -S: no site-packages, so neither hpctrain nor torch; exactly a bare system python3.
    bare = project / "bare-python"
    bare.write_text(f'#!/bin/sh\nunset PYTHONPATH\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    bare.chmod(0o755)
    err = _fails(capsys, "configs/demo.yaml", "--python", str(bare), "-o", "train.sh")
    assert "cannot import hpctrain" in err and "--venv" in err, err
    assert not (project / "train.sh").exists()


@pytest.mark.parametrize("args, message", [
    (["--python", "no/such/python"], "not an executable file"),
    (["--python", "no-such-python-on-path"], "not found on PATH"),
    (["--venv", "no-such-venv"], "no such directory"),
    (["--venv", "."], "bin/python does not exist"),
    (["--log-dir", "my logs"], "log folder"),
])
def test_bad_interpreters_and_paths_are_user_errors(project: Path, capsys: pytest.CaptureFixture,
                                                   args: list[str], message: str) -> None:
    err = _fails(capsys, "configs/demo.yaml", *args, "-o", "train.sh")
    assert message in err, err
    assert not (project / "train.sh").exists()
    assert not (project / "my logs").exists()


@pytest.mark.parametrize("args, message", [
    # 3 ranks per node with tp 2: ranks 2 and 3 form a group across two nodes.
    (["parallel.strategy=fsdp", "parallel.tp=2", "--nodes", "2", "--tasks-per-node", "3"],
     "tensor-parallel groups would span nodes"),
    (["parallel.strategy=fsdp", "parallel.tp=4", "--nodes", "2", "--tasks-per-node", "2"],
     "tensor-parallel groups would span nodes"),
    # The layout rules of training apply before anything is written: 6 ranks, tp 4.
    (["parallel.strategy=fsdp", "parallel.tp=4", "--nodes", "1", "--tasks-per-node", "6"],
     "cannot be split"),
])
def test_layouts_that_place_tp_across_nodes_are_refused(project: Path, capsys, args: list[str],
                                                        message: str) -> None:
    err = _fails(capsys, "configs/demo.yaml", *args, "-o", "train.sh")
    assert message in err and "HINT" in err, err
    assert not (project / "train.sh").exists()


def test_array_tasks_never_share_a_run_directory(project: Path, capsys) -> None:
    err = _fails(capsys, "configs/demo.yaml", "run.suffix=none", "--array", "0-3", "-o", "x.sh")
    assert "would all write runs/demo" in err and "run.suffix" in err, err


def test_tp_inside_each_node_is_accepted(project: Path) -> None:
    _sbatch("configs/demo.yaml", "parallel.strategy=fsdp", "parallel.tp=2", "--nodes", "2",
            "--tasks-per-node", "4", "-o", "train.sh")
    assert "--distribution=block" in _srun_argv((project / "train.sh").read_text())


def test_container_binds_what_the_job_uses(project: Path, tmp_path: Path) -> None:
    _sbatch("configs/demo.yaml", "run.out_dir=runs/x", f"data.stage_to={tmp_path}/local",
            "--container", "img.sif", "--bind", "/opt/models", "-o", "train.sh")
    text = (project / "train.sh").read_text()
    # The working folder holds the logs and runs/x; node-local staging and --bind come on top.
    assert f"binds={project},{tmp_path}/local,/opt/models" in text.splitlines(), text
    assert "apptainer exec --bind \"$binds\" img.sif python3 -m hpctrain train" in text


def test_an_enroot_image_runs_under_pyxis(project: Path) -> None:
    _sbatch("configs/demo.yaml", "--container", "/images/pt.sqsh", "--python", "/opt/py/bin/python",
            "-o", "train.sh")
    argv = _srun_argv((project / "train.sh").read_text())
    assert "--container-image=/images/pt.sqsh" in argv and "apptainer" not in argv
    assert argv[argv.index("-m") - 1] == "/opt/py/bin/python"


@pytest.mark.parametrize("args, message", [
    (["--container", "x.sif", "--venv", "."], "--venv with --container"),
    (["--bind", "/data"], "--bind without --container"),
    (["--container", "x.sif", "--bind", "/a:b"], "cannot be passed to the container"),
    (["--container", "x.sif", "--bind", "/a,b"], "cannot be passed to the container"),
])
def test_container_options_that_cannot_work(project: Path, capsys, args, message) -> None:
    err = _fails(capsys, "configs/demo.yaml", *args, "-o", "train.sh")
    assert message in err, err


def test_python_and_venv_exclude_each_other(project: Path, capsys: pytest.CaptureFixture) -> None:
    err = _fails(capsys, "configs/demo.yaml", "--python", sys.executable, "--venv", sys.prefix)
    assert "not allowed with" in err, err


def test_a_folder_with_spaces_needs_an_explicit_log_dir(tmp_path: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "my project"
    (root / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", root / "configs" / "demo.yaml")
    monkeypatch.chdir(root)
    err = _fails(capsys, "configs/demo.yaml", "-o", "train.sh")
    assert "--log-dir" in err, err
    logs = tmp_path / "logs"
    _sbatch("configs/demo.yaml", "--log-dir", str(logs), "-o", "train.sh")
    lines = (root / "train.sh").read_text().splitlines()
    assert f"cd -- '{root}' || exit 1" in lines
    assert logs.is_dir()


@pytest.mark.parametrize("overrides, nodes, tasks, message", [
    # 8 samples a step cannot be shared by 16 ranks: refused now, not after the job queued.
    (["train.global_batch_tokens=16384"], "2", "8", "cannot be split over 16 data-parallel"),
    # auto resolved first: the pipeline's rules see numbers, not 'auto' (was a bare TypeError).
    (["parallel.pp=2", "parallel.pp_microbatches=3"], "1", "2", "pp_microbatches = 3"),
])
def test_auto_is_resolved_for_the_jobs_ranks_before_the_script_is_written(
        project: Path, capsys, overrides: list[str], nodes: str, tasks: str,
        message: str) -> None:
    config = str(REPO / "configs" / "llama-1b.yaml")
    err = _fails(capsys, config, *overrides, "--nodes", nodes, "--tasks-per-node", tasks,
                 "-o", "train.sh")
    assert message in err and "HINT" in err, err
    assert not (project / "train.sh").exists()
    # The shipped batch splits over the common GPU counts (up to 64 data-parallel ranks).
    _sbatch(config, "parallel.pp=2", "--nodes", "1", "--tasks-per-node", "2", "-o", "train.sh")
    for name in ("llama-1b.yaml", "llama-8b-fsdp.yaml"):
        _sbatch(str(REPO / "configs" / name), "--nodes", "8", "--tasks-per-node", "8",
                "-o", "train.sh")


def test_check_layout_refuses_values_left_to_auto() -> None:
    from hpctrain.config import load_config
    from hpctrain.parallel.layout import check_layout

    with pytest.raises(ConfigError, match="auto") as e:
        check_layout(load_config(REPO / "configs" / "llama-1b.yaml"), 2)
    assert "resolve_auto" in e.value.hint
