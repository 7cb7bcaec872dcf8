"""The embedded corpus: the standard library's .py sources as bytes, capped and deterministic."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpctrain.data.stdlib_corpus import read_stdlib_bytes, stdlib_root
from hpctrain.errors import ConfigError

# Each read lists the whole stdlib (~1800 files), so the module reads it few times.
N = 300_000


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return read_stdlib_bytes(max_bytes=N)


def test_cap_is_exact_and_deterministic(corpus: np.ndarray) -> None:
    assert corpus.dtype == np.uint8
    assert corpus.shape == (N,)
    np.testing.assert_array_equal(read_stdlib_bytes(max_bytes=N), corpus)


def test_shorter_cap_is_exact_prefix(corpus: np.ndarray) -> None:
    # The cap cuts mid-file, and the result is the prefix of any longer read.
    short = read_stdlib_bytes(max_bytes=1001)
    assert short.shape == (1001,)
    np.testing.assert_array_equal(short, corpus[:1001])


def test_looks_like_python_source(corpus: np.ndarray) -> None:
    data = corpus.tobytes()
    assert b"def " in data
    assert b"import " in data
    assert b"\n\n" in data
    assert np.mean(corpus < 128) > 0.98


def test_stdlib_root_holds_os_module() -> None:
    assert (stdlib_root() / "os.py").is_file()


def test_custom_root_sorted_and_joined(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(b"B")
    (tmp_path / "a.py").write_bytes(b"A")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_bytes(b"C")
    (tmp_path / "notes.txt").write_bytes(b"ignored")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_bytes(b"X")
    assert read_stdlib_bytes(root=tmp_path).tobytes() == b"A\n\nB\n\nC\n\n"
    assert read_stdlib_bytes(max_bytes=4, root=tmp_path).tobytes() == b"A\n\nB"
    # A cap beyond the corpus returns the whole corpus.
    assert read_stdlib_bytes(max_bytes=100, root=tmp_path).tobytes() == b"A\n\nB\n\nC\n\n"


def test_empty_root_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        read_stdlib_bytes(root=tmp_path)
    assert str(tmp_path) in info.value.what
    assert info.value.hint is not None


def test_site_packages_is_never_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed packages under the stdlib (often ten times its size) are not listed at all:
    every run reads the corpus on every rank, and listing them only to drop them cost ~0.6 s."""
    (tmp_path / "a.py").write_bytes(b"A")
    deep = tmp_path / "site-packages" / "pkg"
    deep.mkdir(parents=True)
    (deep / "x.py").write_bytes(b"X")
    listed: list[str] = []
    scandir = os.scandir

    def spy(path: Any = ".") -> Any:
        listed.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", spy)
    assert read_stdlib_bytes(root=tmp_path).tobytes() == b"A\n\n"
    assert listed and not [p for p in listed if "site-packages" in Path(p).parts], listed
