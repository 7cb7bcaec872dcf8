"""The container recipes agree with each other and with the repository: the same CUDA base and
torch pin in containers/Containerfile and containers/hpctrain.def, a torch wheel built for the
base's CUDA, and every path they copy present. Building them is `make container-test` (opt-in,
podman needed), never part of `make test`; the tests below run its script against a stub podman.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

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
    (test_rule,) = re.findall(r"^test:(.*\n(?:\t.*\n)+)", makefile, re.M)
    assert "container-test" not in test_rule and "\ncontainer-test:" in makefile
    (rule,) = re.findall(r"^container-test:\n((?:\t.*\n)+)", makefile, re.M)
    assert "bash scripts/container-test.sh" in rule


# `make container-test` itself (scripts/container-test.sh) against a stub podman that records
# each call: which base, which torch and which podman settings it picks, without building.
STUB_PODMAN = """#!/bin/bash
echo "$*" >> "$STUB_LOG"
case "$1 $2" in
    "pull "*) exit "${STUB_PULL_RC:-0}" ;;
    "image exists") exit 0 ;;
esac
if [[ " $* " == *" run "* ]]; then
    if [ -n "${STUB_NEEDS:-}" ] && [[ " $* " != *" $STUB_NEEDS "* ]]; then
        echo "Error: crun: setrlimit RLIMIT_NOFILE: Operation not permitted" >&2; exit 126
    fi
    if [ -n "${STUB_FAIL:-}" ] && [[ " $* " == *" $STUB_FAIL "* ]]; then exit 3; fi
fi
exit 0
"""


def _container_test(
        tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run scripts/container-test.sh with a stub podman; its output and podman's calls."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "podman").write_text(STUB_PODMAN)
    (stubs / "podman").chmod(0o755)
    log = tmp_path / "podman.log"
    full_env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_LOG": str(log),
                "CONTAINER_TEST_LOG": str(tmp_path / "container-test.log"),
                "WHEEL_DIR": str(tmp_path / "no-wheels"), **env}
    done = subprocess.run(["bash", str(REPO / "scripts" / "container-test.sh")], env=full_env,
                          capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


def _only(calls: list[str], word: str) -> str:
    (call,) = [c for c in calls if f" {word} " in f" {c} "]
    return call


def test_container_test_without_a_registry_builds_a_local_base_and_uses_a_local_wheel(
        tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("2.9.0", "2.13.0+cpu", "2.10.0+cpu"):  # by version, not by name
        (wheels / f"torch-{version}-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    (wheels / "torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl").touch()  # not Debian 12's
    ca = tmp_path / "ca.crt"
    ca.touch()
    done, calls = _container_test(tmp_path, STUB_PULL_RC="125", WHEEL_DIR=str(wheels),
                                  PIP_CERT=str(ca))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hpctrain-base:bookworm already exists" in done.stdout
    build = _only(calls, "build")
    assert "--build-arg BASE=localhost/hpctrain-base:bookworm" in build
    assert f"-v {wheels}:/wheels:ro" in build
    assert "TORCH=/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl" in build
    assert "TORCH_INDEX=https://pypi.org/simple" in build
    assert f"-v {ca}:/etc/hpctrain-build-ca.crt:ro --build-arg PIP_CERT=" in build
    assert "doctor configs/demo.yaml" in calls[-2] and "--nproc 2" in calls[-1]
    assert "passed" in (tmp_path / "container-test.log").read_text()


def test_container_test_with_a_registry_keeps_the_pinned_cpu_torch(tmp_path: Path) -> None:
    done, calls = _container_test(tmp_path, TORCH="torch==2.13.0")
    assert done.returncode == 0, done.stdout + done.stderr
    build = _only(calls, "build")
    assert "BASE=docker.io/library/debian:12-slim" in build
    assert ("TORCH=torch==2.13.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu"
            in build)
    assert "/wheels" not in build and "--runtime" not in build and "--ulimit" not in build


def test_container_test_retries_with_this_shells_limits_and_runc(tmp_path: Path) -> None:
    runc = tmp_path / "bin" / "runc"
    runc.parent.mkdir()
    runc.write_text("#!/bin/sh\n")
    runc.chmod(0o755)
    done, calls = _container_test(tmp_path, STUB_NEEDS="--ulimit")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cannot start a container with its defaults" in done.stdout
    for call in [_only(calls, "build"), calls[-2], calls[-1]]:
        assert call.startswith("--runtime runc ") and "--ulimit nofile=" in call, call


def test_container_test_fails_when_training_in_the_image_fails(tmp_path: Path) -> None:
    done, calls = _container_test(tmp_path, STUB_FAIL="train")
    assert done.returncode != 0 and "doctor" in calls[-2] and "passed" not in done.stdout


def test_container_test_without_registry_or_wheel_says_what_to_set(tmp_path: Path) -> None:
    done, calls = _container_test(tmp_path, STUB_PULL_RC="125")
    assert done.returncode == 1 and "HINT: set TORCH_WHEEL=" in done.stdout  # stderr: in the log
    assert not [c for c in calls if " build " in f" {c} "]


@pytest.mark.skipif(os.geteuid() != 0, reason="make-base-image.sh refuses to run without root")
def test_base_image_from_the_first_bookworm_mirror(tmp_path: Path) -> None:
    # debootstrap and podman stubbed: the script picks the mirror, trims and imports.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "podman").write_text('#!/bin/bash\necho "$*" >> "$STUB_LOG"\n'
                                  '[ "$1" = import ] && cat > /dev/null\n'
                                  '[ "$1 $2" = "image exists" ] && exit 1\nexit 0\n')
    (stubs / "debootstrap").write_text('#!/bin/bash\necho "debootstrap $*" >> "$STUB_LOG"\n'
                                       'mkdir -p "$3/var/cache/apt/archives"\n'
                                       'touch "$3/var/cache/apt/archives/x.deb" "$3/ok"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n")
    log = tmp_path / "calls.log"
    done = subprocess.run(["bash", str(REPO / "scripts" / "make-base-image.sh"), "localhost/b:t"],
                          env={"PATH": f"{stubs}:/usr/bin:/bin", "APT_ETC": str(apt),
                               "STUB_LOG": str(log), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    (boot,) = [c for c in calls if c.startswith("debootstrap ")]
    assert re.fullmatch(r"debootstrap --variant=minbase bookworm \S+/rootfs "
                        r"http://mirror\.example/debian", boot)
    (imported,) = [c for c in calls if c.startswith("import ")]
    assert imported.endswith("- localhost/b:t") and "ENV PATH=" in imported
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hpctrain-base.")] == []
