"""Hostile and broken config input: non-finite numbers, undecodable files, wrong kinds of path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import run_cli
from hpctrain.config import JobConfig, load_config
from hpctrain.errors import ConfigError


def _float_keys() -> list[str]:
    """Every float (or optional float) field of the job config, as a dotted key."""
    keys = []
    for section in dataclasses.fields(JobConfig):
        value = getattr(JobConfig(), section.name)
        if not dataclasses.is_dataclass(value):  # a top-level key (task:), not a section
            continue
        for f in dataclasses.fields(type(value)):
            if "float" in str(f.type):
                keys.append(f"{section.name}.{f.name}")
    return keys


FLOAT_KEYS = _float_keys()


def test_the_float_keys_are_found() -> None:
    # The parametrisation below must cover the fields the issue names.
    assert {"optim.lr", "train.grad_clip", "run.timeout_s", "guard.spike_sigma"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf", "-Infinity", "1e999"])
def test_non_finite_float_is_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}={value}"])
    err = info.value
    assert key in err.what and "finite" in err.what
    assert err.expected


def test_non_finite_float_in_a_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  grad_clip: .nan\n")
    with pytest.raises(ConfigError, match=r"train\.grad_clip"):
        load_config(p)


def test_non_finite_inside_a_list_of_sections_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.mix\[0\]\.weight"):
        load_config(None, ["data.source=mix", "data.mix=[{path: a, weight: .inf}]"])


def test_finite_values_still_load() -> None:
    cfg = load_config(None, ["optim.lr=1e-4", "train.grad_clip=0", "run.timeout_s=30"])
    assert cfg.optim.lr == 1e-4 and cfg.train.grad_clip == 0.0


def test_non_utf8_yaml_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert "UTF-8" in info.value.what and str(p) in info.value.what


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "model.pt"
    p.write_bytes(b"\x80\x02\x00\xff\xfe" * 10)
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(p)


def test_directory_as_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "is a directory" in info.value.what
    assert info.value.hint and "configs/" in info.value.hint


@pytest.mark.parametrize("make", ["dir", "latin1", "nan"])
def test_cli_exits_2_without_traceback(tmp_path: Path, make: str) -> None:
    args = ["configs/demo.yaml", "optim.lr=.nan"] if make == "nan" else [str(tmp_path)]
    if make == "latin1":
        p = tmp_path / "c.yaml"
        p.write_bytes(b"run:\n  name: \xe9\n")
        args = [str(p)]
    proc = run_cli(["config", *args], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("hpctrain: error:")
