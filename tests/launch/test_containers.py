"""The container recipes agree with each other and with the repository: the same CUDA base and
torch pin in containers/Containerfile and containers/hpctrain.def, a torch wheel built for the
base's CUDA, and every path they copy present. Building them is `make container-test` (opt-in,
podman and a network needed), never part of `make test`.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = (REPO / "containers" / "Containerfile").read_text()
DEFINITION = (REPO / "containers" / "hpctrain.def").read_text()


def _arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", CONTAINERFILE, re.M)
    return value


def test_same_base_and_torch_in_both_recipes() -> None:
    (base,) = re.findall(r"^From: (\S+)$", DEFINITION, re.M)
    assert _arg("BASE") == f"docker.io/{base}"
    assert f"pip install --index-url {_arg('TORCH_INDEX')} {_arg('TORCH')}" in DEFINITION


def test_the_torch_wheel_matches_the_base_cuda() -> None:
    cuda = re.search(r"cuda:(\d+)\.(\d+)", _arg("BASE"))
    assert cuda is not None
    assert _arg("TORCH_INDEX").endswith(f"/cu{cuda.group(1)}{cuda.group(2)}")


def test_what_they_copy_exists() -> None:
    copied = re.findall(r"^COPY (.+) /opt/hpctrain/\S*$", CONTAINERFILE, re.M)
    paths = [p for line in copied for p in line.split()]
    paths += re.findall(r"^    (\S+) /opt/hpctrain/", DEFINITION, re.M)
    assert sorted(set(paths)) == ["README.md", "configs", "pyproject.toml", "src"]
    assert all((REPO / p).exists() for p in paths)


def test_building_is_opt_in() -> None:
    makefile = (REPO / "Makefile").read_text()
    (test_rule,) = re.findall(r"^test: (.*)$", makefile, re.M)
    assert "container-test" not in test_rule and "\ncontainer-test:" in makefile
