"""Provenance: the keys a run records, and no secrets among them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.runtime.provenance import collect_provenance, write_provenance
from hpctrain.runtime.rundir import RunDir


def test_keys_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not a git repo
    info = collect_provenance(["gpu01", "gpu02"])
    for key in (
        "python",
        "platform",
        "torch",
        "cuda",
        "cudnn",
        "nccl",
        "gpus",
        "hpctrain",
        "packages",
        "hosts",
        "argv",
        "env",
        "git_sha",
        "git_dirty",
    ):
        assert key in info
    assert info["git_sha"] is None and info["git_dirty"] is None
    assert info["hosts"] == ["gpu01", "gpu02"]
    assert any(line.startswith("torch==") for line in info["packages"])
    json.dumps(info)  # JSON-ready


def test_no_secret_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "abc")
    monkeypatch.setenv("NCCL_SECRET_X", "1")
    monkeypatch.setenv("NCCL_IB_KEY", "2")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    info = collect_provenance([])
    assert "HF_TOKEN" not in info["env"]
    assert "NCCL_SECRET_X" not in info["env"]
    assert "NCCL_IB_KEY" not in info["env"]
    assert info["env"]["NCCL_DEBUG"] == "INFO"
    assert info["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    text = json.dumps(info)
    assert "HF_TOKEN" not in text and "NCCL_SECRET_X" not in text


def test_secret_options_in_argv_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train", "--hf-token=abc", "--api-key", "xyz", "--lr", "3"])
    argv = collect_provenance([])["argv"]
    assert argv == ["train", "--hf-token=<redacted>", "--api-key", "<redacted>", "--lr", "3"]


def test_secret_overrides_in_argv_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    # KEY=VALUE overrides are how every setting reaches a run: a token there is a secret too.
    monkeypatch.setattr(sys, "argv", ["train", "c.yaml", "tracking.api_token=abc",
                                      "run.name=x", "--resume", "auto"])
    argv = collect_provenance([])["argv"]
    assert argv == ["train", "c.yaml", "tracking.api_token=<redacted>", "run.name=x",
                    "--resume", "auto"]


def test_git_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=10)
        subprocess.run(
            [
                "git",
                "-C",
                str(tmp_path),
                "-c",
                "user.email=t@t",
                "-c",
                "user.name=t",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "x",
            ],
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git not usable here")
    monkeypatch.chdir(tmp_path)
    info = collect_provenance([])
    assert isinstance(info["git_sha"], str) and len(info["git_sha"]) == 40
    assert info["git_dirty"] is False
    (tmp_path / "new.txt").write_text("x")
    assert collect_provenance([])["git_dirty"] is True


def test_write_provenance(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    info = {"packages": ["a==1", "b==2"], "hosts": ["h"]}
    write_provenance(run, info)
    assert json.loads((run.provenance_dir / "provenance.json").read_text()) == info
    assert (run.provenance_dir / "packages.txt").read_text() == "a==1\nb==2\n"
