"""What the commands of the README and docs/ write is ignored by git, so running them leaves the
checkout clean (provenance.json records ``git_dirty``); source folders of the same names are not
ignored.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# `--out PATH`, `-o PATH` and `> PATH` in the README's shell blocks.
_OUTPUT = re.compile(r"(?:--out|-o|>)\s+([\w./-]+)")


def readme_outputs() -> set[str]:
    """Paths the ```bash blocks of the README and docs/ write to (a folder gets a file inside
    it): the recipes moved from the README into docs/ are run in a checkout too."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```bash\n(.*?)```", page.read_text(),
                                                      re.S)]
    # Comments left out: "# x.jpg + x.json -> sample" is not a redirection.
    code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for b in blocks for line in b.splitlines())
    found = set()
    for path in _OUTPUT.findall(code):
        if path.startswith("/"):  # outside the checkout (/scratch/..., /tmp/...): not git's
            continue
        found.add(path if Path(path).suffix else f"{path}/manifest.json")
    return found


def _ignored(paths: list[str]) -> set[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    # --no-index: judge by the patterns alone, whether or not a path is tracked.
    done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO,
                          input="\n".join(paths), capture_output=True, text=True, timeout=30)
    assert done.returncode in (0, 1), done.stderr
    return set(done.stdout.split())


def test_readme_command_outputs_are_ignored() -> None:
    outputs = readme_outputs()
    # The parse must find what the issue named, or this test would pass on nothing.
    assert {"runs/train.sh", "data/web/manifest.json", "data/tok.json"} <= outputs, outputs
    # A script written with `> train.sh` at the root, as users do, is ignored too.
    expected = sorted(outputs | {"train.sh", "slurm-1234.out", "slurm-1234_5.out",
                                 "runs/slurm-logs/hpctrain-1.out", ".venv/bin/python"})
    assert _ignored(expected) == set(expected)


def test_source_of_the_same_names_is_not_ignored() -> None:
    source = ["src/hpctrain/data/loader.py", "tests/data/test_loader.py", "configs/demo.yaml",
              "scripts/install-slurm.sh", "tests/launch/golden/sbatch-single.sh"]
    assert _ignored(source) == set()
