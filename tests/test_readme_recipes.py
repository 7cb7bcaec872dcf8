"""Every command block of README.md runs as written, or says what it needs that a CPU lacks.

Each fenced block carries a marker on the line above it:

    <!-- recipe: ID -->     run here, as written, by bash, in README order (test_recipe_runs)
    <!-- file: NAME -->     a file the reader saves (e.g. a task): written as NAME, in README
                            order, before the recipes after it run
    <!-- needs: WHAT -->    needs a GPU, a Slurm cluster, Kubernetes or a Hugging Face model
                            folder (NEEDS); the code behind it is tested elsewhere
    <!-- output -->         not commands: what a command prints
    <!-- quickstart -->     `make demo` / `make test` themselves (what CI runs)

A block without a marker fails test_every_block_is_marked, so a recipe added later is either
run or says why not. The recipes run one after another in one working folder, as a reader
following the README would: a copy of configs/, the checkout's .venv (linked), a small corpus
in corpus/ ("your text files") and a finished short demo run in runs/demo (what `make demo`
leaves). The README's text is read at test time: what the test runs is what the page says.

    .venv/bin/pytest tests/test_readme_recipes.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import forked
from conftest import REPO, cli_env, kill_group

README = REPO / "README.md"
MARKER = re.compile(r"<!--\s*(recipe|file|needs|output|quickstart)\s*(?::\s*([\w.-]+)\s*)?-->")
NEEDS = {"gpu", "slurm", "kubernetes", "hf-model"}
FENCE = re.compile(r"^```")
RECIPE_TIMEOUT_S = 300


@dataclass
class Block:
    """One fenced block of a Markdown file and the marker above it."""

    line: int  # 1-based line of the opening fence
    kind: str | None  # recipe, needs, output, quickstart; None when unmarked
    value: str | None  # the recipe id or what it needs
    text: str


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of `path` in order, each with the marker on the line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        m = MARKER.fullmatch(above.strip())
        found.append(Block(start + 1, m.group(1) if m else None, m.group(2) if m else None,
                           "\n".join(lines[start + 1:end]) + "\n"))
        i = end + 1
    return found


def recipes() -> list[Block]:
    """The README's recipe blocks, in README order."""
    return [b for b in blocks(README) if b.kind == "recipe"]


def test_every_block_is_marked() -> None:
    wrong = []
    for b in blocks(README):
        if b.kind is None:
            wrong.append(f"README.md:{b.line}: no <!-- recipe: ID --> / <!-- needs: ... --> "
                         "marker above this block")
        elif b.kind == "needs" and b.value not in NEEDS:
            wrong.append(f"README.md:{b.line}: needs {b.value!r}, expected one of {NEEDS}")
        elif b.kind in ("recipe", "file") and not b.value:
            wrong.append(f"README.md:{b.line}: a {b.kind} needs a name")
        elif b.kind == "file" and Path(b.value).name != b.value:
            wrong.append(f"README.md:{b.line}: a file's name is a plain name, not a path")
    assert not wrong, "\n".join(wrong)
    ids = [b.value for b in recipes()]
    assert len(ids) == len(set(ids)), f"recipe ids repeat: {ids}"


def test_the_marker_check_finds_an_unmarked_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- recipe: a -->\n```bash\ntrue\n```\n\ntext\n\n```bash\nfalse\n```\n")
    a, b = blocks(page)
    assert (a.kind, a.value, a.text) == ("recipe", "a", "true\n")
    assert b.kind is None and b.line == 8


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader's checkout after `make demo`: configs, .venv, a corpus, runs/demo."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO / "configs", root / "configs")
    (root / ".venv").symlink_to(Path(sys.prefix))
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"notes-{i}.txt").write_text(f"notes {i}: the quick brown fox\n" * 2000)
    (corpus / "pages.jsonl").write_text("".join(
        f'{{"text": "page {i} of a small corpus"}}\n' for i in range(500)))
    # What `make demo` leaves, only shorter (configs/demo.yaml runs 300 steps on 2 ranks).
    done = _bash(root, "hpctrain train configs/demo.yaml train.steps=2 metrics.log_every=1 "
                 "metrics.progress=false\n")
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def _bash(cwd: Path, text: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `text` with bash in `cwd`, stopping at the first failing command; ``env`` adds
    variables."""
    env = {**cli_env(), "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}",
           **(env or {})}
    argv = ["bash", "-e", "-o", "pipefail", "-c", text]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RECIPE_TIMEOUT_S)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        # Every process the recipe started goes; its test fails, the recipes after it run.
        kill_group(proc)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(argv, f"timeout after {RECIPE_TIMEOUT_S} s", out,
                                           err)


@pytest.fixture(scope="module")
def ran(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every recipe, run in README order in the one working folder (the files the README
    shows saved first where they come).

    Their ``hpctrain`` runs forked from the preloaded interpreter (tests/forked.py): ~2 CPU-s
    of imports less for each of some twenty commands. The fresh interpreter behind the
    ``hpctrain`` script is the one of the demo run above (and of the ranks `--nproc` starts)."""
    done = {}
    with forked.command() as env:
        for b in blocks(README):
            if b.kind == "file":
                (workdir / b.value).write_text(b.text)
            elif b.kind == "recipe":
                done[b.value] = _bash(workdir, b.text, env)
    return done


@pytest.mark.parametrize("recipe", [b.value for b in recipes()])
def test_recipe_runs(recipe: str, ran: dict, workdir: Path) -> None:
    done = ran[recipe]
    assert done.returncode == 0, (f"README recipe {recipe!r} failed (exit {done.returncode})"
                                  f"\nstdout:\n{done.stdout[-3000:]}\nstderr:\n"
                                  f"{done.stderr[-3000:]}")
    assert "Traceback" not in done.stderr, done.stderr
    check = CHECKS.get(recipe)
    if check is not None:
        check(workdir, done)


# What each recipe must leave behind, beyond exiting 0 (what the README says it does).


def _after_demo(root: Path, done) -> None:
    assert "demo" in done.stdout and (root / "runs" / "demo" / "report.html").is_file()


def _train(root: Path, done) -> None:
    for name in ("first", "pair"):
        assert (root / "runs" / name / "exit_info.json").is_file()
    assert "optim:" in done.stdout and "0.0001" in done.stdout  # the resolved config


def _data(root: Path, done) -> None:
    manifest = json.loads((root / "data" / "corpus" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 257  # bytes and EOS: the model follows it
    assert (root / "runs" / "corpus" / "exit_info.json").is_file()


def _watch(root: Path, done) -> None:
    assert (root / "runs" / "cmp.html").is_file()
    assert any((root / "runs" / "traced" / "profiles").iterdir())


def _resume(root: Path, done) -> None:
    assert list((root / "runs").glob("first-archived-*")), "--fresh keeps the old run"


def _plan(root: Path, done) -> None:
    assert "fits:" in done.stdout and "(as configured)" in done.stdout


def _slurm_script(root: Path, done) -> None:
    script = root / "runs" / "slurm" / "demo.sh"
    assert script.read_text().startswith("#!/bin/bash\n")
    assert "no problems" in done.stdout


def _k8s(root: Path, done) -> None:
    assert "kind: Job" in (root / "runs" / "k8s" / "llama.yaml").read_text()


def _bench(root: Path, done) -> None:
    assert "GEMM on CPU" in done.stdout


def _own_model(root: Path, done) -> None:
    info = json.loads((root / "runs" / "my_task" / "exit_info.json").read_text())
    assert info["exit_code"] == 0 and "my_task" in done.stdout


CHECKS = {"after-demo": _after_demo, "train": _train, "data": _data, "watch": _watch,
          "resume": _resume, "plan": _plan, "slurm-script": _slurm_script, "k8s": _k8s,
          "bench": _bench, "own-model": _own_model}


def test_links_between_the_pages_resolve() -> None:
    """Every relative link of README.md and docs/ names a file (and heading) that exists."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
