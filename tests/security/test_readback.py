"""Values read back from our own files are checked, not trusted (issue 28).

A checkpoint manifest, ``exit_info.json``, the goodput ledgers and account, and the pipeline's
records may be damaged or planted by anyone who can write the folder. Wrong types, NaN/inf,
``10**30``, negative counts, missing keys and a JSON list instead of an object are refused as
damage: ``resume auto`` falls back past such a checkpoint, ``--resume PATH`` exits 2, and
``runs``/``report``/``pipeline status`` say what is damaged and go on.

One real run (6 steps, saves at 2, 4, 6) gives the manifest every case edits; two copies of it
run again, with a damaged newest checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import DEMO, QUIET, REPO, TINY, RunResult, run_cli
from hpctrain.checkpoint.manifest import MANIFEST, DamagedCheckpoint, read_manifest
from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.observe.goodput import LEDGER_DIR, GoodputClock, compute_goodput
from hpctrain.train.checkpointing import TrainState, check_meta

BASE = [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4", "data.source=stdlib",
        "checkpoint.every=2", "checkpoint.keep_last=5"]
NEWEST = "step-00000006"


def _load(path: Path, key: str):
    """Import a helper module of another test folder by path (the folders are no packages)."""
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _train(out: Path, name: str, steps: int, *flags: str) -> RunResult:
    args = ["train", DEMO, *BASE, f"train.steps={steps}", f"run.out_dir={out}",
            f"run.name={name}", *flags]
    done = run_cli(args)
    return RunResult(args, done.returncode, done.stdout, done.stderr, out / name)


def _edit_manifest(ckpt: Path, change) -> None:
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))  # NaN and Infinity as Python's json writes them


def _nan_lr(m: dict) -> None:
    m["scheduler"]["base_lrs"][0] = math.nan


def _absurd_position(m: dict) -> None:
    m["loader"]["step"] = 10**30


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         run_pool: ThreadPoolExecutor) -> dict[str, Future]:
    """The reference run, then a rerun of a copy with a NaN learning rate in its newest
    checkpoint (resume auto), and one naming a copy's checkpoint with an absurd data position
    (--resume PATH), side by side."""
    out = tmp_path_factory.mktemp("readback")
    reference = run_pool.submit(_train, out, "reference", 6)

    def copy_of(ref: RunResult, name: str, change) -> Path:
        run_dir = out / name
        shutil.copytree(ref.ok().run_dir, run_dir)
        _edit_manifest(run_dir / "checkpoints" / NEWEST, change)
        return run_dir

    def auto(ref: RunResult) -> RunResult:
        copy_of(ref, "auto", _nan_lr)
        return _train(out, "auto", 8)

    def explicit(ref: RunResult) -> RunResult:
        run_dir = copy_of(ref, "explicit", _absurd_position)
        return _train(out, "explicit-new", 8, "--resume", str(run_dir / "checkpoints" / NEWEST))

    futures = {"reference": reference}
    for name, fn in (("auto", auto), ("explicit", explicit)):
        chained: Future = Future()

        def start(done: Future, fn=fn, chained=chained) -> None:
            def job() -> None:
                try:
                    chained.set_result(fn(done.result()))
                except BaseException as e:  # delivered to the test that waits for it
                    chained.set_exception(e)
            run_pool.submit(job)

        reference.add_done_callback(start)
        futures[name] = chained
    return futures


# -- checkpoint manifests: every value checked before anything acts on it --------------------

def _train_state(groups: int) -> TrainState:
    """The objects check_meta consults: an optimizer with the run's number of groups."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}][:groups])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainState(model, optimizer, scheduler, loader=None, scaler=None)


def _set(path: str, value: Any):
    def change(m: dict) -> None:
        *parents, last = path.split(".")
        node = m
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()

META_CASES = {
    "NaN learning rate": ("scheduler.base_lrs", [math.nan, 0.002]),
    "infinite last LR": ("scheduler._last_lr", [math.inf, 0.0002]),
    "negative learning rate": ("scheduler.base_lrs", [-0.1, 0.002]),
    "learning rates as text": ("scheduler.base_lrs", ["0.002", "0.002"]),
    "absurd data position": ("loader.step", 10**30),
    "absurd position, tokens to match": ("loader.step", 10**30),
    "negative token count": ("tokens_seen", -1),
    "token count as text": ("tokens_seen", "768"),
    "no seed": ("loader.seed", _DELETE),
    "seed beyond 64 bits": ("loader.seed", 2**70),
    "global batch 0": ("loader.global_batch", 0),
    "scheduler is a list": ("scheduler", []),
    "last_epoch a bool": ("scheduler.last_epoch", True),
    "world_size 0": ("world_size", 0),
    "a planted lr_lambda state": ("scheduler.lr_lambdas", [{"__class__": "x"}, None]),
    "lr_lambdas as text": ("scheduler.lr_lambdas", "xy"),
    "a NaN loss scale": ("scaler", {"scale": math.nan}),
    "data position behind the step": ("loader.step", 2),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_a_damaged_manifest_value_is_refused_naming_it(runs: dict[str, Future],
                                                       case: str) -> None:
    ref = runs["reference"].result().ok()
    ckpt = ref.run_dir / "checkpoints" / NEWEST
    manifest = read_manifest(ckpt)
    cfg = load_config(ref.run_dir / "config" / "config.yaml")
    state = _train_state(len(manifest["scheduler"]["base_lrs"]))
    check_meta(state, ckpt, copy.deepcopy(manifest), cfg)  # the real one passes
    path, value = META_CASES[case]
    bad = copy.deepcopy(manifest)
    _set(path, value)(bad)
    if case == "absurd position, tokens to match":
        bad["tokens_seen"] = 10**30 * 4 * 32
    with pytest.raises(DamagedCheckpoint) as e:
        check_meta(state, ckpt, bad, cfg)
    assert str(ckpt / MANIFEST) in e.value.what
    assert path.split(".")[-1] in e.value.render() or "data position" in e.value.what


@pytest.mark.parametrize("content", [
    "[1, 2, 3]",
    '{"format_version": 1, "files": [], "step": 6}',
    '{"format_version": 1, "files": {"a": {"size": "5", "xxh3": "0123456789abcdef"}}, '
    '"step": 6}',
    '{"format_version": 1, "files": {"a": {"size": NaN, "xxh3": "0123456789abcdef"}}, '
    '"step": 6}',
    '{"format_version": 1, "files": {}, "step": 1e400}',
    '{"format_version": 1, "files": {}, "step": -6}',
    '{"format_version": true, "files": {}, "step": 6}',
])
def test_a_damaged_manifest_is_a_damaged_checkpoint(tmp_path: Path, content: str) -> None:
    ckpt = tmp_path / NEWEST
    ckpt.mkdir()
    (ckpt / MANIFEST).write_text(content)
    with pytest.raises(DamagedCheckpoint) as e:
        read_manifest(ckpt)
    assert str(ckpt / MANIFEST) in e.value.what


def test_resume_auto_falls_back_past_a_nan_learning_rate(runs: dict[str, Future]) -> None:
    run = runs["auto"].result().ok()
    log = (run.run_dir / "logs" / "rank-000.log").read_text()
    skipped = [line for line in log.splitlines() if f"skipping checkpoint {NEWEST}" in line]
    assert skipped and "base_lrs[0] = nan" in skipped[0], log[-3000:]
    assert "resumed from step-00000004" in log
    assert (run.run_dir / "checkpoints" / "damaged" / NEWEST).is_dir()
    assert all(math.isfinite(r["lr"]) for r in run.metrics())


def test_resume_path_with_an_absurd_data_position_is_exit_2(runs: dict[str, Future]) -> None:
    run = runs["explicit"].result()
    assert run.returncode == 2, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    assert "loader.step = 1000000000000000000000000000000" in run.stderr, run.describe()


# -- exit_info.json and goodput.json: runs and report say "damaged" and go on ---------------

synthetic = _load(REPO / "tests" / "observe" / "synthetic_runs.py", "_readback_synthetic_runs")

EXIT_INFOS = {
    "a list": "[0]",
    "not JSON": '{"exit_code": 0,',
    "exit code as text": '{"exit_code": "0", "reason": "completed", "timestamp": 1}',
    "NaN time": '{"exit_code": 0, "reason": "completed", "timestamp": NaN}',
    "infinite time": '{"exit_code": 0, "reason": "completed", "timestamp": 1e400}',
    "no exit code": '{"reason": "completed", "timestamp": 1}',
    "extra is text": '{"exit_code": 124, "reason": "hung", "timestamp": 1, "extra": "x"}',
    "reason a number": '{"exit_code": 1, "reason": 12, "timestamp": 1}',
}


@pytest.mark.parametrize("case", sorted(EXIT_INFOS))
def test_runs_and_report_survive_a_damaged_exit_info(tmp_path: Path, capsys, case: str) -> None:
    run = synthetic.write_run(tmp_path / "r", ranks=1, steps=4)
    (run / "exit_info.json").write_text(EXIT_INFOS[case])
    main(["runs", str(tmp_path), "--json"])
    out = capsys.readouterr()
    row = json.loads(out.out)
    assert row["state"] == "unknown" and row["damaged"], row
    assert "exit_info.json" in out.err and "damaged" in out.err
    main(["report", str(run), "-o", str(tmp_path / "report.html")])
    assert "exit_info.json" in capsys.readouterr().err
    assert (tmp_path / "report.html").is_file()


@pytest.mark.parametrize("account", [
    '{"version": 1, "wall_s": 10, "parts": {}, "goodput": NaN, "attempts": []}',
    "[]",
    '{"version": 1, "wall_s": -5, "parts": {"productive": 1}, "goodput": 2, "attempts": "x"}',
])
def test_a_damaged_goodput_account_is_not_shown(tmp_path: Path, capsys, account: str) -> None:
    run = synthetic.write_run(tmp_path / "r", ranks=1, steps=4)
    (run / "goodput.json").write_text(account)
    main(["runs", str(tmp_path), "--json"])
    out = capsys.readouterr()
    assert json.loads(out.out)["goodput"] is None
    assert "goodput.json" in out.err
    main(["report", str(run), "-o", str(tmp_path / "report.html")])
    assert "nan%" not in (tmp_path / "report.html").read_text()


# -- goodput ledgers: a damaged one is kept aside and a new one started ----------------------

def _ledger(run_dir: Path, **fields: Any) -> Path:
    """A killed attempt's ledger as GoodputClock writes it, with ``fields`` changed."""
    clock = GoodputClock.open(run_dir)
    clock.started(None)
    clock.step_done(1, writing=False)
    path = run_dir / LEDGER_DIR / "attempt-0001.json"
    state = json.loads(path.read_text())
    state.update(fields)
    path.write_text(json.dumps(state))
    return path


@pytest.mark.parametrize("fields", [
    {"start": "yesterday"},
    {"buckets": {"startup": math.nan}},
    {"updated": math.inf},
    {"attempt": -1},
    {"rollbacks": "x"},
])
def test_a_damaged_ledger_is_set_aside_and_a_new_one_started(tmp_path: Path,
                                                             fields: dict) -> None:
    damaged = _ledger(tmp_path, **fields)
    text = damaged.read_text()
    account = compute_goodput(tmp_path)  # the damaged attempt is left out, nothing raises
    assert account["attempts"] == []
    clock = GoodputClock.open(tmp_path)
    clock.started(None)
    clock.step_done(1, writing=False)
    account = clock.finish(exit_code=0)
    assert [a["attempt"] for a in account["attempts"]] == [1]
    kept = damaged.with_name(damaged.name + ".damaged")
    assert kept.read_text() == text
    assert json.loads((tmp_path / "goodput.json").read_text())["goodput"] >= 0


def test_a_ledger_that_is_a_json_list_is_left_out(tmp_path: Path) -> None:
    (tmp_path / LEDGER_DIR).mkdir()
    (tmp_path / LEDGER_DIR / "attempt-0001.json").write_text("[1, 2]")
    assert compute_goodput(tmp_path)["attempts"] == []


# -- pipeline status and submission ----------------------------------------------------------

PIPELINE = """\
name: rb
stages:
  - name: prep
    kind: prepare
    inputs: [corpus/]
    out: data/corpus
  - name: train
    kind: train
    config: configs/demo.yaml
    overrides: [run.out_dir=runs, run.name=rb, data.source=stdlib]
    after: []
  - name: report
    kind: command
    command: [hpctrain, runs, runs]
    outputs: [runs/rb]
    after: []
"""


@pytest.fixture
def pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project with a pipeline file and a fake sbatch that records being called."""
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / DEMO, tmp_path / DEMO)
    (tmp_path / "pipeline.yaml").write_text(PIPELINE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\necho 100\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _status(capsys) -> str:
    main(["pipeline", "status", "pipeline.yaml"])
    return capsys.readouterr().out


def test_status_of_a_train_stage_that_never_ran_says_so(pipeline: Path, capsys) -> None:
    out = _status(capsys)
    line = next(ln for ln in out.splitlines() if ln.startswith("train"))
    assert "has not started" in line and "None" not in line


@pytest.mark.parametrize("info", [
    "[]", '{"exit_code": "0"}', '{"exit_code": 0, "timestamp": 1, "extra": "x"}',
    '{"exit_code": 0, "timestamp": NaN, "extra": {"steps": 300}}',
])
def test_status_survives_a_damaged_exit_info(pipeline: Path, capsys, info: str) -> None:
    run = pipeline / "runs" / "rb"
    run.mkdir(parents=True)
    (run / "exit_info.json").write_text(info)
    line = next(ln for ln in _status(capsys).splitlines() if ln.startswith("train"))
    assert "not done: damaged" in line and "exit_info.json" in line


def test_status_of_a_failed_run_says_it_ended_before_its_steps(pipeline: Path, capsys) -> None:
    run = pipeline / "runs" / "rb"
    run.mkdir(parents=True)
    (run / "exit_info.json").write_text(json.dumps(
        {"exit_code": 2, "reason": "config error\nsecond line", "timestamp": 1.0, "extra": {}}))
    line = next(ln for ln in _status(capsys).splitlines() if ln.startswith("train"))
    assert "ended with exit 2 before its" in line and "None" not in line
    assert "second line" not in line


@pytest.mark.parametrize("marker", ["[]", '{"job_id": 5, "outputs": {}}',
                                    '{"job_id": "5", "outputs": []}', "{"])
def test_status_survives_a_damaged_done_marker(pipeline: Path, capsys, marker: str) -> None:
    done = pipeline / "runs" / "pipelines" / "rb" / "done"
    done.mkdir(parents=True)
    (done / "report.json").write_text(marker)
    line = next(ln for ln in _status(capsys).splitlines() if ln.startswith("report"))
    assert "not done: damaged" in line


@pytest.mark.parametrize("jobs", ["[1]", '{"train": "100"}', '{"train": {"job_id": "1; rm"}}'])
def test_a_damaged_jobs_file_is_a_clear_error(pipeline: Path, capsys, jobs: str) -> None:
    state = pipeline / "runs" / "pipelines" / "rb"
    state.mkdir(parents=True)
    (state / "jobs.json").write_text(jobs)
    with pytest.raises(SystemExit) as e:
        main(["pipeline", "status", "pipeline.yaml"])
    assert e.value.code == 2
    assert "jobs.json is damaged" in capsys.readouterr().err


def test_a_missing_prepare_input_is_refused_before_anything_is_submitted(
        pipeline: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["pipeline", "pipeline.yaml"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "input 'corpus/' does not exist" in err and "nothing was submitted" in err
    assert not (pipeline / "sbatch-called").exists()


# -- numeric options: finite and in range, or argparse says which (exit 2) -------------------

BAD_NUMBERS = [
    ["plan", "interval", "--save-min", "nan", "--mttf-h", "24"],
    ["plan", "interval", "--save-min", "5", "--mttf-h", "inf"],
    ["plan", "interval", "--save-min", "-5", "--mttf-h", "24"],
    ["plan", "budget", "--tokens", "1e400", "--tokens-per-s", "1000", "--gpus", "8"],
    ["plan", "budget", "--tokens", "1T", "--tokens-per-s", "nan", "--gpus", "8"],
    ["plan", "budget", "--tokens", "1T", "--tokens-per-s", "1000", "--gpus", "-8"],
    ["plan", "budget", "--tokens", "1T", "--tokens-per-s", "1000", "--gpus", "8", "--pue", "0"],
    ["plan", "goodput", "--save-s", "1e309", "--restart-s", "1", "--mttf-h", "24"],
    ["plan", "memory", "--model", "1b", "--gpus", "0"],
    ["plan", "parallel", "model.size=1b", "--gpu", "h100", "--gpus-per-node", "0"],
    ["plan", "parallel", "--model", "1b", "--gpu", "h100", "--nodes", "-1"],
    ["bench", "collective", "-f", "nan"],
    ["bench", "gemm", "-n", "0"],
    ["bench", "node", "--tolerance", "inf"],
    ["tune", "configs/demo.yaml", "--gpus", "0"],
    ["tune", "configs/demo.yaml", "--gpus", "1", "--timeout", "nan"],
    ["data", "prepare", "x", "--out", "y", "--shard-mb", "-1"],
    ["data", "prepare", "x", "--out", "y", "--workers", "0"],
    ["sbatch", "configs/demo.yaml", "--signal-lead-s", "-5"],
    ["sbatch", "configs/demo.yaml", "--nodes", "1e30"],
    ["generate", "hf:x", "--prompt", "a", "--temperature", "inf"],
    ["generate", "hf:x", "--prompt", "a", "--top-p", "nan"],
    ["export", "hf", "r", "--out", "o", "--max-shard-gb", "nan"],
]


@pytest.mark.parametrize("argv", BAD_NUMBERS, ids=[" ".join(a[:2] + a[-2:]) for a in BAD_NUMBERS])
def test_a_non_finite_or_out_of_range_number_is_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    option = next(a for a in reversed(argv) if a.startswith("-"))
    assert option in err and ("out of range" in err or "not a" in err), err


# -- a config path that is not a regular file ------------------------------------------------

def test_a_fifo_config_is_named_and_not_opened(tmp_path: Path) -> None:
    import os

    from hpctrain.errors import ConfigError

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # opening it would block until a writer came
    with pytest.raises(ConfigError, match=r"is a named pipe \(FIFO\), not a regular file"):
        load_config(fifo)
    with pytest.raises(ConfigError, match="is a character device, not a regular file"):
        load_config(Path("/dev/null"))
    link = tmp_path / "gone.yaml"
    link.symlink_to(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="symbolic link to a file that does not exist"):
        load_config(link)


# -- chat templates: bounded time and size ---------------------------------------------------

BOMBS = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}",
    "string multiplication": "{{ 'x' * 10000000000 }}",
    "list multiplication": "{{ (['x'] * 10000000000)|length }}",
    "doubling by ~": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "a macro calling itself twice": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}"
                                    "{% endif %}{% endmacro %}{{ f(64) }}",
    "replace": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "center filter": "{{ 'x'|center(10000000000) }}",
    "format width": "{{ '{:>9999999999}'.format(1) }}",
    "percent width": "{{ '%9999999999d' % 1 }}",
    "big power": "{{ 10 ** 100000000 }}",
    "endless recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_a_chat_template_work_bomb_is_stopped(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from hpctrain.data import bounded_jinja
    from hpctrain.data.chat import ChatTemplate
    from hpctrain.errors import DataError

    monkeypatch.setattr(bounded_jinja, "MAX_SECONDS", 0.3)
    template = ChatTemplate(BOMBS[case], {}, "the chat template of bomb/tokenizer_config.json")
    start = time.monotonic()
    with pytest.raises(DataError, match="the chat template of bomb/tokenizer_config.json"):
        template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert time.monotonic() - start < 10


def test_a_real_chat_template_still_renders() -> None:
    from hpctrain.data.chat import ChatTemplate

    hf = _load(REPO / "tests" / "hf_models.py", "_readback_hf_models")
    template = ChatTemplate(hf.CHAT_TEMPLATE + "{{ messages|tojson }}{{ '%03d' % 7 }}",
                            {"bos_token": "<s>"})
    text = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.startswith("<s><|user|>\nhi<|end|>\n<|assistant|>\n") and text.endswith("007")


# -- import hf: config.json checked against the weights before anything is built --------------

@pytest.mark.parametrize("change", [{"num_hidden_layers": 10**9},
                                    {"hidden_size": 2**20, "intermediate_size": 2**22},
                                    {"vocab_size": 10**9}])
def test_import_hf_checks_the_config_against_the_weights_first(tmp_path: Path,
                                                                change: dict) -> None:
    import time

    from hpctrain.errors import ConfigError
    from hpctrain.pretrained.import_hf import import_hf

    pytest.importorskip("safetensors")
    inputs = _load(REPO / "tests" / "security" / "test_pretrained_inputs.py",
                   "_readback_pretrained_inputs")
    folder = inputs._folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    if "hidden_size" in change:
        config["head_dim"] = change["hidden_size"] // config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    with pytest.raises(ConfigError, match="config.json"):
        import_hf(folder, tmp_path / "out")
    assert time.monotonic() - start < 10
    assert not (tmp_path / "out").exists()


# -- generate: the model's own eos_token_id, and a hint that names real options ----------------

def _tokenizer_without_eos_names(folder: Path) -> None:
    """tokenizer.json whose only special token is <|stop|> (no name EOS_CANDIDATES has)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|pad|>", "<|stop|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world " * 50], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))


def test_generate_takes_the_models_eos_token_id(tmp_path: Path) -> None:
    from hpctrain.pretrained.source import model_tokenizer, resolve_source

    pytest.importorskip("safetensors")
    inputs = _load(REPO / "tests" / "security" / "test_pretrained_inputs.py",
                   "_readback_pretrained_inputs")
    folder = inputs._folder(tmp_path / "m")
    _tokenizer_without_eos_names(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 1}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    tok = model_tokenizer(resolve_source(f"hf:{folder}"))
    assert (tok.tokenizer.eos_token, tok.tokenizer.eos_id) == ("<|stop|>", 1)
    assert tok.stop_ids == {0, 1}


def test_generate_missing_eos_hint_names_real_options(tmp_path: Path, capsys) -> None:
    from hpctrain.data.tokenizer import NoEosToken
    from hpctrain.pretrained.source import model_tokenizer, resolve_source

    pytest.importorskip("safetensors")
    inputs = _load(REPO / "tests" / "security" / "test_pretrained_inputs.py",
                   "_readback_pretrained_inputs")
    folder = inputs._folder(tmp_path / "m")
    _tokenizer_without_eos_names(folder)
    with pytest.raises(NoEosToken) as e:
        model_tokenizer(resolve_source(f"hf:{folder}"))
    with contextlib.suppress(SystemExit):  # argparse's exit after --help
        main(["generate", "--help"])
    usage = capsys.readouterr().out
    named = {w.strip(",.;:") for w in e.value.hint.split() if w.startswith("--")}
    assert named and all(f"{option} " in usage for option in named), (named, usage)
    tok = model_tokenizer(resolve_source(f"hf:{folder}"), eos_token="<|stop|>")
    assert tok.tokenizer.eos_id == 1


# -- audit: more numbers that crashed or ran without end -------------------------------------

@pytest.mark.parametrize("argv", [
    # micro-batch suggestions searched every smaller micro-batch one by one (minutes)
    ["plan", "memory", "model.size=1b", "model.max_seq_len=16777216", "data.seq_len=16777216",
     "train.micro_batch=1048576", "parallel.strategy=fsdp", "--gpus", "16777216", "--gpu",
     "h100"],
    # Daly's formula overflowed math.exp (OverflowError traceback)
    ["plan", "goodput", "--save-s", "1", "--restart-s", "1", "checkpoint.mttf_gpu_hours=1e-300",
     "--gpus", "16777216"],
    ["plan", "goodput", "--save-s", "1e9", "--restart-s", "1e9", "--mttf-h", "1e-300",
     "--interval-min", "1e9"],
])
def test_extreme_but_valid_plans_answer_promptly(argv: list[str], capsys) -> None:
    import time

    start = time.monotonic()
    main(argv)
    assert time.monotonic() - start < 20
    out = capsys.readouterr().out
    assert "does NOT fit" in out or "expected goodput 0.0%" in out, out


def test_a_budget_longer_than_any_allocation_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:  # int(inf) in the duration: OverflowError before
        main(["plan", "budget", "--tokens", "1e18", "--tokens-per-s", "1e-300", "--gpus", "1"])
    assert e.value.code == 2
    assert "longer than any allocation" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["[]", '{"rows": [1]}', '{"rows": [{"tokens_per_s_per_gpu":'
                                     ' NaN}]}', '{"rows": []}', "{"])
def test_a_damaged_bench_result_is_refused(tmp_path: Path, capsys, content: str) -> None:
    (tmp_path / "model.json").write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["plan", "budget", "--tokens", "1T", "--from-bench", str(tmp_path), "--gpus", "8"])
    assert e.value.code == 2
    assert "model.json" in capsys.readouterr().err


def test_a_pilot_rate_that_is_not_finite_does_not_count(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics").mkdir()
    rows = [{"step": 1, "tokens_per_s": 1000.0}, {"step": 2, "tokens_per_s": math.nan},
            {"step": 3, "tokens_per_s": math.inf}, {"step": "4", "tokens_per_s": 10.0},
            {"step": 5, "tokens_per_s": -5.0}, {"tokens_per_s": 3.0}, {"step": 6, "loss": 1}]
    (tmp_path / "metrics" / "rank-000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    main(["plan", "budget", "--tokens", "1T", "--from-run", str(tmp_path), "--gpus", "8"])
    assert "1,000 tokens/s per GPU" in capsys.readouterr().out


def test_nproc_beyond_the_machine_is_refused_before_anything_starts(tmp_path: Path,
                                                                   capsys) -> None:
    with pytest.raises(SystemExit) as e:  # it started ranks until the machine gave out
        main(["train", DEMO, f"run.out_dir={tmp_path}", "--nproc", "100000"])
    assert e.value.code != 0
    assert "--nproc 100000 is more ranks than this machine can run" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _aliases(levels: int = 9) -> str:
    """A YAML flow list of ``levels`` nested aliases: 9**levels values in a few hundred bytes."""
    text = "&a0 [x, x, x, x, x, x, x, x, x]"
    for i in range(1, levels):
        text = f"&a{i} [{text}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    return f"[{text}]"


def test_a_config_of_nested_yaml_aliases_is_refused(tmp_path: Path) -> None:
    from hpctrain.errors import ConfigError

    config = tmp_path / "bomb.yaml"  # 9**9 values in nine lines: walking it never ended
    config.write_text(f"run:\n  name: {_aliases()}\n")
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        load_config(config)
    with pytest.raises(ConfigError, match="override run.name= expands"):
        load_config(REPO / DEMO, [f"run.name={_aliases()}"])


def test_a_pipeline_of_nested_yaml_aliases_is_refused(pipeline: Path) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.launch.pipeline import load_pipeline

    (pipeline / "bomb.yaml").write_text(f"name: {_aliases()}\n")
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        load_pipeline(pipeline / "bomb.yaml")
