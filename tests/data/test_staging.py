"""Node-local staging: one verified copy per node, waiting ranks, low space, damaged copies."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import staging
from hpctrain.data.config import DataConfig
from hpctrain.data.loader import build_dataset
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shards import load_manifest
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import DataError


@pytest.fixture(autouse=True)
def _fresh_cache():
    staging.clear_cache()
    yield
    staging.clear_cache()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stage-src")
    (root / "a.txt").write_text("hello world " * 400)
    prepare([root / "a.txt"], root / "data", PrepareSettings(TokenizerSpec(), shard_tokens=1000))
    assert len(load_manifest(root / "data").shards) == 5
    return root / "data"


def _worker(src: str, stage_to: str, local_rank: int, tag: str, log_file: str) -> None:
    """One process of a (possibly different) job; records each copy it makes and its result."""
    real_copy = staging._copy_verified

    def counting_copy(*a, **kw):
        with open(log_file, "a") as f:
            f.write("copy\n")
        return real_copy(*a, **kw)

    staging._copy_verified = counting_copy
    out = staging.stage_dataset(src, stage_to, local_rank, tag=tag, timeout_s=60, poll_s=0.05)
    with open(log_file, "a") as f:
        f.write(f"path {out}\n")


def _run(procs: list[tuple], src: Path, stage_to: Path, log_file: Path) -> list[str]:
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_worker, args=(str(src), str(stage_to), lr, tag, str(log_file)))
          for lr, tag in procs]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    return log_file.read_text().splitlines()


def test_two_jobs_racing_on_one_node_make_one_verified_copy(prepared: Path,
                                                            tmp_path: Path) -> None:
    # Job A: local ranks 1 and 0 (rank 1 starts first and waits); job B: local rank 0 only.
    lines = _run([(1, "jobA"), (0, "jobA"), (0, "jobB")], prepared, tmp_path / "local",
                 tmp_path / "log")
    assert lines.count("copy") == 1
    paths = {line.split(" ", 1)[1] for line in lines if line.startswith("path ")}
    key = staging.stage_key(prepared)
    staged = tmp_path / "local" / staging.STAGE_SUBDIR / key
    assert paths == {str(staged)}
    load_manifest(staged).verify()
    leftovers = [p.name for p in staged.parent.iterdir() if ".tmp-" in p.name or ".bad-" in p.name]
    assert leftovers == []


def test_low_space_warns_and_reads_the_shared_path(prepared: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(staging.shutil, "disk_usage",
                        lambda p: usage._replace(free=1000))
    with caplog.at_level(logging.WARNING, logger="hpctrain.data"):
        out = staging.stage_dataset(prepared, str(tmp_path), 0, tag="t")
    assert out == prepared
    assert "not staging" in caplog.text and "GB free" in caplog.text
    assert not (tmp_path / staging.STAGE_SUBDIR / staging.stage_key(prepared)).exists()
    # The other local ranks get the same decision.
    staging.clear_cache()
    assert staging.stage_dataset(prepared, str(tmp_path), 1, tag="t", timeout_s=5) == prepared


def test_damaged_copy_is_detected_and_staged_again(prepared: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    first = staging.stage_dataset(prepared, str(tmp_path), 0, tag="t")
    assert first != prepared
    shard = first / load_manifest(first).shards[2]["bin"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum mismatch"):
        load_manifest(first).verify()
    staging.clear_cache()
    with caplog.at_level(logging.WARNING, logger="hpctrain.data"):
        again = staging.stage_dataset(prepared, str(tmp_path), 0, tag="t")
    assert again == first and "damaged" in caplog.text
    load_manifest(again).verify()


def test_env_vars_expand_and_unset_variable_falls_back(prepared: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FAKE_TMPDIR", str(tmp_path))
    out = staging.stage_dataset(prepared, "$FAKE_TMPDIR/x", 0, tag="t")
    assert out.parent == tmp_path / "x" / staging.STAGE_SUBDIR
    monkeypatch.delenv("FAKE_TMPDIR")
    staging.clear_cache()
    with caplog.at_level(logging.WARNING, logger="hpctrain.data"):
        assert staging.stage_dataset(prepared, "$FAKE_TMPDIR", 0) == prepared
    assert "unset variable" in caplog.text


def test_waiting_rank_times_out_with_a_clear_error(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="local rank 0"):
        staging.stage_dataset(prepared, str(tmp_path), 1, tag="nobody", timeout_s=0.3,
                              poll_s=0.05)


def test_build_dataset_reads_the_staged_copy(prepared: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    cfg = DataConfig(source="shards", path=str(prepared), seq_len=16, stage_to=str(tmp_path))
    cfg.validate()
    ds = build_dataset(cfg)
    assert ds.manifest.root.parent == tmp_path / staging.STAGE_SUBDIR
    plain = build_dataset(DataConfig(source="shards", path=str(prepared), seq_len=16))
    idx = np.arange(len(ds))
    np.testing.assert_array_equal(ds.windows(idx), plain.windows(idx))
