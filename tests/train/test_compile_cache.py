"""The compile cache in the run directory: saved owner-only with a record, loaded only when the
record, the torch version, the key and the owner all check out; anything else is ignored with
a warning and never reaches torch (whose loader unpickles and runs what it is given).

A real inductor compile costs ~20 CPU-s on the 2-core test machine, over this file's budget:
torch's own save/load functions are replaced by recorders here, and the real round trip
(compile, save, load in a process with an empty inductor cache, cache hits) is recorded in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hpctrain.train.compile_cache import CompileCache

PAYLOAD = b"\x80\x04compiled-artifacts" * 100


@pytest.fixture
def torch_cache(monkeypatch, tmp_path_factory):
    """torch.compiler's save/load, recorded: what was handed to the loader; this user's cache
    key in a config folder of the test's own (outside the run directory)."""
    handed: list[bytes] = []
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))

    def load(data: bytes):
        handed.append(data)
        return torch.compiler.CacheInfo()

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: (PAYLOAD, torch.compiler.CacheInfo()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return handed


def _saved(tmp_path: Path) -> CompileCache:
    cache = CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0)
    assert cache.save()
    return cache


def test_saved_owner_only_and_loaded_by_the_next_attempt(tmp_path: Path, torch_cache) -> None:
    before = os.umask(0o002)  # a group-writable umask, common on clusters
    try:
        cache = _saved(tmp_path)
    finally:
        os.umask(before)
    for path in (cache.data, cache.record):
        assert path.stat().st_mode & 0o777 == 0o600
    assert cache.data.name == f"compile-{torch.__version__}-{cache.key}-rank00000.bin"
    again = CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0)
    assert again.load() and torch_cache == [PAYLOAD]
    assert not again.save()  # loaded: nothing new to write


def test_the_cache_is_never_writable_by_the_group_even_while_written(tmp_path: Path,
                                                                    torch_cache,
                                                                    monkeypatch) -> None:
    """The temp file is created 0600 (not 0666 less a umask of 002, chmod'ed after the rename):
    a group member cannot open it for writing in that window and keep the handle."""
    modes: dict[str, int] = {}
    replace = os.replace

    def recording_replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        modes[dst] = os.stat(src, dir_fd=src_dir_fd).st_mode & 0o777
        return replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "replace", recording_replace)
    before = os.umask(0o002)
    try:
        cache = _saved(tmp_path)
    finally:
        os.umask(before)
    assert modes == {cache.data.name: 0o600, cache.record.name: 0o600}


def test_a_cache_copied_from_another_user_is_refused(tmp_path: Path, torch_cache,
                                                     monkeypatch, caplog) -> None:
    """Owning the files is not enough: a colleague's run directory copied here is owned by
    us, but its cache was authenticated with the colleague's key, not ours."""
    _saved(tmp_path)  # under "the colleague's" key
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path.parent / f"{tmp_path.name}-mine"))
    cache = CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0)
    with caplog.at_level(logging.WARNING, logger="hpctrain.compile_cache"):
        assert not cache.load()
    assert torch_cache == []
    assert "HMAC" in caplog.text and "compiling from scratch" in caplog.text


def test_a_key_others_can_read_is_refused(tmp_path: Path, torch_cache, caplog) -> None:
    cache = _saved(tmp_path)
    key = Path(os.environ["XDG_CONFIG_HOME"]) / "hpctrain" / "compile-cache.key"
    assert key.stat().st_mode & 0o777 == 0o600
    key.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="hpctrain.compile_cache"):
        assert not CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0).load()
    assert torch_cache == [] and "readable or writable by others" in caplog.text
    assert not cache.save()  # nor is anything authenticated with it


def _damage_payload(cache: CompileCache) -> None:
    data = bytearray(cache.data.read_bytes())
    data[10] ^= 0xFF
    cache.data.write_bytes(bytes(data))


def _truncate(cache: CompileCache) -> None:
    cache.data.write_bytes(cache.data.read_bytes()[:-7])


def _other_torch(cache: CompileCache) -> None:
    record = json.loads(cache.record.read_text())
    cache.record.write_text(json.dumps({**record, "torch": "2.0.0"}))


def _writable_by_group(cache: CompileCache) -> None:
    cache.data.chmod(0o620)


def _no_record(cache: CompileCache) -> None:
    cache.record.unlink()


@pytest.mark.parametrize(("damage", "why"), [
    (_damage_payload, "does not match its record"),
    (_truncate, "does not match its record"),
    (_other_torch, "written by torch '2.0.0'"),
    (_writable_by_group, "writable by others"),
    (_no_record, "FileNotFoundError"),
])
def test_a_damaged_or_foreign_cache_is_ignored_with_a_warning(tmp_path: Path, torch_cache,
                                                              caplog, damage, why) -> None:
    damage(_saved(tmp_path))
    cache = CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0)
    with caplog.at_level(logging.WARNING, logger="hpctrain.compile_cache"):
        assert not cache.load()
    assert torch_cache == []  # never handed to torch
    assert why in caplog.text and "compiling from scratch" in caplog.text


def test_another_shape_uses_another_file(tmp_path: Path, torch_cache) -> None:
    _saved(tmp_path)
    other = CompileCache(tmp_path, {"model": "tiny", "world_size": 2}, rank=0)
    assert not other.load() and torch_cache == []


def test_a_link_planted_at_the_cache_is_not_followed(tmp_path: Path, torch_cache) -> None:
    cache = _saved(tmp_path)
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(cache.data.read_bytes())
    elsewhere.chmod(0o600)
    cache.data.unlink()
    cache.data.symlink_to(elsewhere)
    assert not CompileCache(tmp_path, {"model": "tiny", "world_size": 1}, rank=0).load()
    assert torch_cache == []


def test_goodput_splits_the_start_up_into_its_parts(reference_run) -> None:
    """The session's reference run (one process, no compile, nothing to resume)."""
    from hpctrain.observe.goodput import STARTUP_PARTS

    run = reference_run.result()
    assert run.returncode == 0, run.describe()
    account = json.loads((run.run_dir / "goodput.json").read_text())
    parts = account["attempts"][0]["startup_parts"]
    assert list(parts) == ["start", "process_group", "model_build", "checkpoint_load", "other",
                           "first_step"]
    assert set(parts) <= set(STARTUP_PARTS) and all(v >= 0 for v in parts.values())
    before_loop = sum(v for k, v in parts.items() if k != "first_step")
    assert before_loop <= account["parts"]["startup"] + 0.01


def test_a_run_keys_its_cache_by_the_shape_of_what_it_compiles(tmp_path: Path) -> None:
    from conftest import DEMO, REPO
    from hpctrain.config import load_config
    from hpctrain.train.compile_cache import run_compile_cache

    def cache(*overrides: str, world_size: int = 1, rank: int = 0):
        cfg = load_config(REPO / DEMO, list(overrides))
        return run_compile_cache(cfg, tmp_path, world_size, rank, torch.device("cpu"))

    assert cache("parallel.compile=false") is None
    base = cache("parallel.compile=true")
    assert base.key == cache("parallel.compile=true").key
    assert base.key != cache("parallel.compile=true", "model.n_layers=3").key
    assert base.key != cache("parallel.compile=true", "data.seq_len=64").key
    assert base.key != cache("parallel.compile=true", world_size=2).key
    assert cache("parallel.compile=true", rank=1).data.name.endswith("-rank00001.bin")
