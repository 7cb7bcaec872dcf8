"""``hpctrain pipeline``: a chain of Slurm jobs from one YAML file, each stage with its own
resources and ``afterok`` on the stages before it; a rerun submits only what is not complete.

    hpctrain pipeline pipeline.yaml             # submit what is left, one line per stage
    hpctrain pipeline pipeline.yaml --dry-run   # say what would be submitted, submit nothing
    hpctrain pipeline status pipeline.yaml      # each stage: its job, Slurm's state, verified?

A pipeline file (relative paths mean what they mean where the command runs)::

    name: corpus-to-model
    resources: {partition: gpu, time: "02:00:00"}   # defaults of every stage
    container: /images/hpctrain.sif                  # optional: every stage runs in it
    stages:
      - name: prepare                    # an array: each task tokenizes a slice of the inputs
        kind: prepare
        inputs: [corpus/]
        out: data/corpus
        tasks: 16
        resources: {cpus_per_task: 16}
      - name: merge                      # waits for the stage before it (all array tasks)
        kind: merge
        out: data/corpus
      - name: train
        kind: train
        config: configs/llama-1b.yaml
        overrides: [data.source=shards, data.path=data/corpus]
        resources: {nodes: 2, tasks_per_node: 4, gpus_per_node: 4, time: "12:00:00"}
      - name: evaluate
        kind: command
        command: [python, eval.py, runs/llama-1b]   # hpctrain/python: the jobs' interpreter
        outputs: [eval/llama-1b.json]
        after: [train]                   # default: the stage before

When is a stage complete and verified (and skipped by a rerun)?

- prepare: the merged manifest of ``out`` verifies (every shard's size and checksum), or every
  array task's part does (merge has not run yet);
- merge: the manifest of ``out`` verifies;
- train: the run (``<run.out_dir>/<run.name>``; run.suffix=none is added so that a requeue or a
  rerun continues the same run) ended with exit 0 after train.steps, and its last checkpoint
  verifies;
- command: its job exited 0 and wrote a done-marker, and each declared output still has the
  size and modification time recorded then.

A stage runs again when a stage it depends on runs again (a train stage then starts its run over:
the old run directory is archived as ``<run>-archived-<time>``, never deleted). A stage whose
previous job is still queued or running is not submitted twice: its dependents wait for that
job; if a stage it depends on must run again first, the command stops and says which job to
wait for or cancel.

Files, under ``runs/pipelines/<name>/``::

    jobs.json                      stage -> the last job submitted for it (id, time, script)
    done/<stage>.json              command stages: the job's done-marker (outputs' fingerprint)
    logs/<name>-<stage>-<job>.out  each stage's Slurm log (array tasks: ..-<job>_<task>.out)
    logs/<name>-<stage>-<job>.sh   the script as submitted
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from hpctrain.errors import ConfigError, HpctrainError, LaunchError
from hpctrain.launch.containers import Container, default_runtime, job_binds
from hpctrain.launch.sbatch import SbatchParams, check_placement, resolve_python
from hpctrain.launch.submit import submit_script
from hpctrain.records import BadRecord, Int, Map, Record, Str, too_large
from hpctrain.runtime.exit_info import read_exit_info
from hpctrain.runtime.rundir import archive_run, write_json_atomic
from hpctrain.shown import quoted

STATE_ROOT = Path("runs") / "pipelines"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Slurm states of a job that has not ended: its stage is not submitted again.
ACTIVE = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                    "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "SIGNALING",
                    "STAGE_OUT"})
# Which keys each kind of stage takes (besides name, kind, after, resources).
_KEYS = {"prepare": {"inputs", "out", "tasks", "args"}, "merge": {"out", "args"},
         "train": {"config", "overrides"}, "command": {"command", "outputs"}}


class PipelineError(LaunchError):
    """The pipeline cannot be submitted as the queue stands."""


@dataclass
class Resources:
    """A stage's share of the cluster; unset values come from the pipeline's, then sbatch's."""

    nodes: int | None = None
    tasks_per_node: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None

    def over(self, base: Resources) -> Resources:
        """These values where set, else `base`'s."""
        mine = dataclasses.asdict(self)
        return Resources(**{k: getattr(base, k) if v is None else v for k, v in mine.items()})

    def sbatch(self) -> dict:
        """The set values as SbatchParams keywords."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class Stage:
    """One job of the pipeline (see the module docstring for the keys of each kind)."""

    name: str = ""
    kind: Literal["prepare", "merge", "train", "command"] = "command"
    # Stages this one waits for (afterok); None: the stage before it.
    after: list[str] | None = None
    resources: Resources = field(default_factory=Resources)
    inputs: list[str] = field(default_factory=list)
    out: str | None = None
    tasks: int = 1
    args: list[str] = field(default_factory=list)
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


@dataclass
class Pipeline:
    """A pipeline file: a name, default resources and the stages in order."""

    name: str = ""
    resources: Resources = field(default_factory=Resources)
    stages: list[Stage] = field(default_factory=list)
    # The jobs' interpreter, which must import hpctrain (default: the one running this command;
    # with a container: python3 of the image).
    python: str | None = None
    # Run every stage's program in this image (see launch/containers.py): Apptainer, or Pyxis
    # for .sqsh images; more host folders to bind besides those the stages name.
    container: str | None = None
    container_runtime: Literal["apptainer", "pyxis"] | None = None
    binds: list[str] = field(default_factory=list)

    def parents(self, stage: Stage) -> list[str]:
        """The stages `stage` waits for."""
        if stage.after is not None:
            return stage.after
        i = self.stages.index(stage)
        return [self.stages[i - 1].name] if i else []


def load_pipeline(path: Path) -> Pipeline:
    """Read and check a pipeline file (ConfigError naming the key and the fix)."""
    from hpctrain.config import from_dict

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"pipeline file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"pipeline file {str(path)!r} cannot be read: {e}") from None
    if too_large(raw, 100_000):  # YAML aliases nested to billions of values
        raise ConfigError(f"pipeline file {str(path)!r} expands to more than 100,000 values",
                          expected="a pipeline without YAML aliases that multiply its size")
    pl = from_dict(Pipeline, raw if raw is not None else {}, "pipeline")
    if not _NAME.fullmatch(pl.name):
        raise ConfigError(f"pipeline.name = {pl.name!r} is not a plain name",
                          expected="letters, digits, '.', '_', '-' (it names the job and folder)")
    if not pl.stages:
        raise ConfigError("the pipeline has no stages", hint="add a `stages:` list")
    seen: list[str] = []
    for i, st in enumerate(pl.stages):
        where = f"pipeline.stages[{i}]"
        if not _NAME.fullmatch(st.name) or st.name in seen:
            raise ConfigError(f"{where}.name = {st.name!r} is missing, repeated or not plain",
                              expected="a new name of letters, digits, '.', '_', '-'")
        for key in st.after or []:
            if key not in seen:
                raise ConfigError(f"{where}.after names {key!r}",
                                  expected=f"stages listed before it: {', '.join(seen) or '-'}")
        defaults = Stage()
        stray = [f.name for f in dataclasses.fields(Stage)
                 if f.name not in {"name", "kind", "after", "resources", *_KEYS[st.kind]}
                 and getattr(st, f.name) != getattr(defaults, f.name)]
        if stray:
            raise ConfigError(f"{where} ({st.name}, kind {st.kind}) sets {', '.join(stray)}",
                              expected=f"keys of a {st.kind} stage: "
                              f"{', '.join(sorted(_KEYS[st.kind]))}")
        missing = {"prepare": not st.inputs or not st.out or st.tasks < 1,
                   "merge": not st.out, "train": not st.config,
                   "command": not st.command}[st.kind]
        if missing:
            raise ConfigError(f"{where} ({st.name}) lacks what a {st.kind} stage needs",
                              expected={"prepare": "inputs, out and tasks >= 1", "merge": "out",
                                        "train": "config", "command": "command"}[st.kind])
        seen.append(st.name)
    return pl


# -- when a stage is done --------------------------------------------------------------------


def fingerprint(path: Path) -> dict:
    """Size and modification time of a file, or of every file under a folder (one digest)."""
    if path.is_file():
        st = path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if not path.is_dir():
        raise FileNotFoundError(path)
    digest = hashlib.sha256()
    count = total = 0
    for item in sorted(p for p in path.rglob("*") if p.is_file()):
        st = item.stat()
        digest.update(f"{item.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        count, total = count + 1, total + st.st_size
    return {"files": count, "size": total, "listing": digest.hexdigest()}


# The files this module writes and reads back, checked before use (records.py).
_JOB_ID = Str(64, pattern=r"[0-9]+(?:_[0-9]+)?(?:;[A-Za-z0-9_.-]+)?", what="a Slurm job id")
_JOBS = Map(Str(255), Record({"job_id": _JOB_ID, "script": Str(optional=True),
                              "submitted": Str(64, optional=True)}))
_MARKER = Record({"job_id": Str(64, pattern=r"[A-Za-z0-9_.;-]+", what="a job id"),
                  "time": Str(64, optional=True),
                  "outputs": Map(Str(), Record({}))})
_PART = Record({"task_count": Int(1), "task_index": Int(), "tokens_checksum": Str(64)})


def _read_record(path: Path, schema: Record | Map) -> dict:
    """The JSON object at ``path`` checked against ``schema``; BadRecord when damaged."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise BadRecord(f"{path} is unreadable ({quoted(str(e))})") from None
    return schema.check(data, path)


def _verify_data(out: Path) -> str:
    from hpctrain.data.shards import load_manifest

    m = load_manifest(out)
    m.verify()
    return f"{out}: {len(m.shards)} shards verified"


def _verify_parts(out: Path, tasks: int) -> str:
    from hpctrain.data.prepare import PARTS
    from hpctrain.data.shards import file_checksum

    found = set()
    for meta_path in (out / PARTS).glob("part-*.json"):
        meta = _read_record(meta_path, _PART)
        tokens = meta_path.with_suffix(".tokens")
        if meta["task_count"] == tasks and file_checksum(tokens) == meta["tokens_checksum"]:
            found.add(meta["task_index"])
    if len(found) != tasks:
        raise ValueError(f"{len(found)} of {tasks} parts in {out / PARTS} verified")
    return f"{out / PARTS}: {tasks} parts verified"


# Stand-in data for checking a train stage whose shards an earlier stage has yet to write.
_NO_DATA = ["data.source=stdlib", "data.path=null", "data.mix=null"]


def _train_config(stage: Stage, pl: Pipeline):
    """(the stage's config, the overrides its job gets); checked as training would check it.

    When an earlier stage prepares data, the shards may not exist yet: the config is then
    checked with stand-in data (everything but the data), and the data when the job starts.
    """
    from hpctrain.config import load_config

    overrides = list(stage.overrides)
    if not any(o.startswith("run.suffix=") for o in overrides):
        overrides.append("run.suffix=none")  # requeues and reruns continue the same run
    try:
        cfg = load_config(stage.config, overrides)
    except ConfigError:
        earlier = pl.stages[:pl.stages.index(stage)]
        if not any(s.kind in ("prepare", "merge") for s in earlier):
            raise
        cfg = load_config(stage.config, overrides + _NO_DATA)
    return cfg, overrides


def _verify_train(stage: Stage, pl: Pipeline, workdir: Path) -> str:
    from hpctrain.checkpoint.manifest import read_manifest, verify_files

    cfg, _ = _train_config(stage, pl)
    run = workdir / cfg.run.out_dir / cfg.run.name
    info = read_exit_info(run / "exit_info.json")
    if info is None:
        raise ValueError(f"{run} has not started" if not run.exists() else
                         f"{run} has not ended (no exit_info.json yet)")
    steps = (info.get("extra") or {}).get("steps")
    if info["exit_code"] != 0 or steps != cfg.train.steps:
        where = (f"at step {steps} of {cfg.train.steps}" if steps is not None
                 else f"before its {cfg.train.steps} steps were done")
        reason = quoted((info.get("reason") or "").partition("\n")[0])
        raise ValueError(f"{run} ended with exit {info['exit_code']} {where} ({reason})")
    last = info.get("last_checkpoint")
    if last:
        ckpt = run / "checkpoints" / last
        manifest = read_manifest(ckpt)
        verify_files(ckpt, manifest["files"], sorted(manifest["files"]))
        return f"{run}: {steps} steps, checkpoint {last} verified"
    return f"{run}: {steps} steps (no checkpoint kept)"


def _verify_command(stage: Stage, state: Path) -> str:
    marker = _read_record(state / "done" / f"{stage.name}.json", _MARKER)
    for out in stage.outputs:
        if marker["outputs"].get(out) != fingerprint(Path(out)):
            raise ValueError(f"{out} changed since job {marker['job_id']} wrote it")
    return f"job {marker['job_id']} done, {len(stage.outputs)} outputs unchanged"


def verify(stage: Stage, pl: Pipeline, workdir: Path, state: Path) -> tuple[bool, str]:
    """(complete and verified?, why) for one stage."""
    try:
        if stage.kind == "prepare":
            try:
                return True, _verify_data(workdir / stage.out)
            except (HpctrainError, OSError, ValueError):
                return True, _verify_parts(workdir / stage.out, stage.tasks)
        if stage.kind == "merge":
            return True, _verify_data(workdir / stage.out)
        if stage.kind == "train":
            return True, _verify_train(stage, pl, workdir)
        return True, _verify_command(stage, state)
    except FileNotFoundError as e:
        return False, f"{e.filename or e} is missing"
    except BadRecord as e:
        return False, f"damaged: {e.what} (expected {e.expected})"
    except (HpctrainError, OSError, ValueError, KeyError) as e:
        return False, str(e).splitlines()[0]


# -- Slurm ------------------------------------------------------------------------------------


def job_states(job_id: str) -> list[tuple[str, str]]:
    """(state, reason) of a job or each array task from scontrol, else sacct; [] if unknown."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                              text=True, timeout=60)
        if done.returncode == 0:
            return [(m.group(1), r.group(1) if (r := re.search(r"\bReason=(\S+)", line))
                     else "None")
                    for line in done.stdout.splitlines()
                    if (m := re.search(r"\bJobState=(\S+)", line))]
        # Slurm forgets ended jobs after MinJobAge; accounting (where there is one) remembers.
        done = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [(line.split()[0], "None") for line in done.stdout.splitlines() if line.strip()]


def describe_states(states: list[tuple[str, str]]) -> str:
    """One cell of the status table: ``RUNNING``, ``PENDING (Dependency)``, ``COMPLETED x4``."""
    if not states:
        return "unknown to Slurm"
    counts: dict[str, int] = {}
    for state, reason in states:
        key = f"{state} ({reason})" if state == "PENDING" and reason != "None" else state
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in counts.items())


# -- submitting ------------------------------------------------------------------------------


@dataclass
class Plan:
    """What a run of ``hpctrain pipeline`` does with one stage."""

    stage: Stage
    action: Literal["skip", "keep", "submit"]
    detail: str
    job_id: str | None = None
    # A train stage after a stage that is submitted again: its old run is archived first.
    fresh: bool = False


def _program(argv: list[str], python: str) -> list[str]:
    """A command line with ``hpctrain``/``python`` as the jobs' interpreter."""
    head, *rest = argv
    if head == "hpctrain":
        return [python, "-m", "hpctrain", *rest]
    if head in ("python", "python3"):
        return [python, *rest]
    return argv


def _container(pl: Pipeline, stage: Stage, workdir: Path, logs: Path) -> Container | None:
    """The stage's container, binding the folders it reads and writes."""
    if pl.container is None:
        return None
    from hpctrain.config import JobConfig

    cfg = _train_config(stage, pl)[0] if stage.kind == "train" else JobConfig()
    paths = [*pl.binds, *([stage.out] if stage.out else []),
             *(i for i in stage.inputs if Path(i).is_absolute())]
    return Container(pl.container, pl.container_runtime or default_runtime(pl.container),
                     job_binds(cfg, workdir, str(logs), paths))


def _check_inputs(pl: Pipeline, stage: Stage, workdir: Path) -> None:
    """Refuse a prepare stage whose inputs do not exist (and no earlier stage writes them)."""
    if stage.kind != "prepare":
        return
    earlier = pl.stages[:pl.stages.index(stage)]
    made = {os.path.normpath(workdir / p) for st in earlier
            for p in [*st.outputs, *([st.out] if st.out else [])]}
    for item in stage.inputs:
        path = workdir / item
        if os.path.normpath(path) in made:
            continue
        found = glob.glob(str(path), recursive=True) if glob.has_magic(item) else \
            [str(path)] if os.path.lexists(path) else []
        if not found:
            raise ConfigError(
                f"stage {stage.name}: input {quoted(item)} "
                f"{'matches nothing' if glob.has_magic(item) else 'does not exist'} "
                f"(in {workdir})", expected="files, folders or glob patterns that exist, or "
                "the out/outputs of an earlier stage",
                hint="fix the stage's inputs: list; nothing was submitted")


def stage_params(pl: Pipeline, stage: Stage, workdir: Path, python: str, state: Path,
                 dependency: str | None, host_python: str) -> SbatchParams:
    """The batch script's parameters for one stage (`host_python` writes the done-marker)."""
    res = stage.resources.over(pl.resources).sbatch()
    common = dict(workdir=str(workdir), python=python, job_name=f"{pl.name}-{stage.name}",
                  log_dir=str(state / "logs"), dependency=dependency, config="",
                  container=_container(pl, stage, workdir, state / "logs"), **res)
    hpctrain = [python, "-m", "hpctrain"]
    if stage.kind == "prepare":
        return SbatchParams(**common, array=f"0-{stage.tasks - 1}", command=[
            *hpctrain, "data", "prepare", *stage.inputs, "--out", stage.out, "--task-count",
            str(stage.tasks), "--no-progress", *stage.args])
    if stage.kind == "merge":
        return SbatchParams(**common, command=[*hpctrain, "data", "merge", stage.out,
                                               *stage.args])
    if stage.kind == "train":
        cfg, overrides = _train_config(stage, pl)
        check_placement(cfg, res.get("nodes", 1), res.get("tasks_per_node", 1))
        return SbatchParams(**{**common, "config": stage.config}, overrides=overrides)
    # The marker is written by the batch shell, on the host (where `hpctrain pipeline` ran).
    mark = [host_python, "-m", "hpctrain", "pipeline", "mark", str(state), stage.name,
            *stage.outputs]
    return SbatchParams(**common, command=_program(stage.command, python), after_success=[mark])


class Runner:
    """Plans and submits one pipeline from one working directory."""

    def __init__(self, path: Path, workdir: Path | None = None):
        self.path = path
        self.pl = load_pipeline(path)
        self.workdir = (workdir or Path.cwd()).absolute()
        self.state = self.workdir / STATE_ROOT / self.pl.name
        self.jobs_file = self.state / "jobs.json"

    def recorded_jobs(self) -> dict[str, dict]:
        """Stage -> the last job submitted for it."""
        if not self.jobs_file.exists():
            return {}
        try:
            return _read_record(self.jobs_file, _JOBS)
        except BadRecord as e:
            raise ConfigError(f"{self.jobs_file} is damaged: {e.what}", expected=e.expected,
                              hint="move it aside; the stages' outputs still say what is done"
                              ) from None

    def plan(self) -> list[Plan]:
        """Skip what is verified, keep jobs still in Slurm, submit the rest."""
        recorded = self.recorded_jobs()
        plans: dict[str, Plan] = {}
        for stage in self.pl.stages:
            upstream = [plans[p] for p in self.pl.parents(stage)]
            rerun = any(p.action != "skip" for p in upstream)
            done, why = verify(stage, self.pl, self.workdir, self.state)
            old = recorded.get(stage.name, {}).get("job_id")
            states = job_states(old) if old else []
            active = bool(states) and all(s in ACTIVE for s, _ in states)
            if done and not rerun:
                plans[stage.name] = Plan(stage, "skip", f"done: {why}")
            elif active and any(p.action == "submit" for p in upstream):
                # It would run beside (or before) the new job of a stage it depends on.
                first = next(p.stage.name for p in upstream if p.action == "submit")
                raise PipelineError(
                    f"stage {stage.name}: job {old} is still {describe_states(states)}, but "
                    f"{first}, which it depends on, must run again first",
                    hint=f"wait for job {old} to end, or cancel it (scancel {old}), then "
                    "rerun this command")
            elif active:
                plans[stage.name] = Plan(stage, "keep", f"job {old} still "
                                         f"{describe_states(states)}", old)
            else:
                reason = f"a stage it depends on runs again ({why})" if done else why
                fresh = stage.kind == "train" and any(p.action == "submit" for p in upstream)
                plans[stage.name] = Plan(stage, "submit", reason, fresh=fresh)
        return list(plans.values())

    def submit(self, plans: list[Plan], *, dry_run: bool = False) -> None:
        """Submit the stages planned for it, in order, each after its parents' jobs."""
        host_python = resolve_python(None if self.pl.container else self.pl.python, None,
                                     self.workdir)
        python = (self.pl.python or "python3") if self.pl.container else host_python
        recorded = self.recorded_jobs()
        by_name = {p.stage.name: p for p in plans}
        todo = [p for p in plans if p.action == "submit"]

        def params(plan: Plan, dependency: str | None) -> SbatchParams:
            built = stage_params(self.pl, plan.stage, self.workdir, python, self.state,
                                 dependency, host_python)
            built.validate()
            return built

        for plan in todo:  # every stage checked before the first is submitted
            _check_inputs(self.pl, plan.stage, self.workdir)
            params(plan, None)
        if dry_run:
            return
        for plan in todo:
            after = [j for n in self.pl.parents(plan.stage) if (j := by_name[n].job_id)]
            built = params(plan, "afterok:" + ":".join(after) if after else None)
            self._retire_marker(plan.stage)
            if plan.stage.kind == "train":
                cfg = _train_config(plan.stage, self.pl)[0]
                (self.workdir / cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
                if plan.fresh:
                    # Its data is made again: a rerun must not continue the old run. Set
                    # aside now (renamed, never deleted), as `hpctrain train --fresh` would.
                    archived = archive_run(self.workdir / cfg.run.out_dir / cfg.run.name)
                    if archived is not None:
                        plan.detail += f"; the previous run is archived as {archived}"
            plan.job_id, script = submit_script(built)
            recorded[plan.stage.name] = {"job_id": plan.job_id, "script": str(script),
                                         "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            write_json_atomic(self.jobs_file, recorded)

    def _retire_marker(self, stage: Stage) -> None:
        """A stage submitted again is not done until its new job says so (old marker kept)."""
        marker = self.state / "done" / f"{stage.name}.json"
        if marker.is_file():
            try:
                job = _read_record(marker, _MARKER)["job_id"]
            except BadRecord:
                job = "damaged"  # kept aside all the same: it no longer says the stage is done
            os.replace(marker, marker.with_name(f"{stage.name}.{job}.json"))


def mark_done(state: Path, stage: str, outputs: list[str]) -> Path:
    """Record a command stage's success and its outputs' fingerprint (run by the stage's job)."""
    missing = [o for o in outputs if not Path(o).exists()]
    if missing:
        raise ConfigError(f"stage {stage} exited 0 but did not write {', '.join(missing)}",
                          expected="every path in its outputs: list",
                          hint="fix the command or the outputs list; the stage stays not done")
    path = state / "done" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"job_id": os.environ.get("SLURM_JOB_ID", "local"),
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "outputs": {o: fingerprint(Path(o)) for o in outputs}})
    return path


# -- the command line ------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain pipeline`` on the top-level parser's ``sub``."""
    p = sub.add_parser("pipeline", help="submit a chain of Slurm jobs from a YAML file",
                       usage="hpctrain pipeline [status] PIPELINE.yaml [--dry-run]",
                       description="Submit the stages of PIPELINE.yaml that are not complete "
                       "and verified, each after the ones it depends on (afterok); `status` "
                       "shows each stage's job and whether its outputs verify.")
    p.add_argument("words", nargs="+", metavar="[status] PIPELINE.yaml",
                   help="the pipeline file, after `status` to show its stages' state")
    p.add_argument("--dry-run", action="store_true", help="plan, print, submit nothing")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain pipeline``."""
    words = args.words
    if words[0] == "mark" and len(words) >= 3:  # run by a command stage's job when it succeeds
        print(f"hpctrain: {mark_done(Path(words[1]), words[2], words[3:])}")
        return
    if words[0] == "status" and len(words) == 2:
        status(Runner(Path(words[1])))
        return
    if len(words) != 1:
        raise ConfigError(f"hpctrain pipeline {' '.join(words)}: unexpected words",
                          expected="hpctrain pipeline PIPELINE.yaml, or hpctrain pipeline "
                          "status PIPELINE.yaml")
    runner = Runner(Path(words[0]))
    plans = runner.plan()
    runner.submit(plans, dry_run=args.dry_run)
    width = max(len(p.stage.name) for p in plans)
    for p in plans:
        if p.action == "submit":
            verb = "would submit" if args.dry_run else f"submitted job {p.job_id}"
            line = f"{verb} ({p.detail})"
        else:
            line = p.detail if p.action == "keep" else f"skipped, {p.detail}"
        print(f"{p.stage.name:<{width}}  {line}")
    if not any(p.action == "submit" for p in plans):
        print("nothing to submit: every stage is done or still queued")
    print(f"follow it with: hpctrain pipeline status {words[0]}", file=sys.stderr)


def status(runner: Runner) -> None:
    """Print each stage's job, its Slurm state and whether its outputs verify."""
    recorded = runner.recorded_jobs()
    rows = [("STAGE", "JOB", "SLURM", "OUTPUTS")]
    for stage in runner.pl.stages:
        job = recorded.get(stage.name, {}).get("job_id")
        state = describe_states(job_states(job)) if job else "-"
        done, why = verify(stage, runner.pl, runner.workdir, runner.state)
        rows.append((stage.name, job or "-", state, f"{'done' if done else 'not done'}: {why}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"pipeline {runner.pl.name} ({runner.state})")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
