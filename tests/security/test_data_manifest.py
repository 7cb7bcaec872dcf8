"""A hostile token manifest: shard names that leave the directory are refused before any copy.

Staging copies each listed file from the shared directory to node-local disk under the name the
manifest gives, so ``"bin": "../../x"`` would read and write outside both directories.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.data import staging
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shards import MANIFEST, load_manifest
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import DataError


@pytest.mark.parametrize("name", ["../escaped.bin", "/tmp/escaped.bin", "sub/shard-000000.bin",
                                  "manifest.json"])
def test_shard_names_outside_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "shared" / "data"
    prepare([tmp_path / "a.txt"], out, PrepareSettings(TokenizerSpec(), shard_tokens=100))
    raw = json.loads((out / MANIFEST).read_text())
    # The escaping file exists, so only the name check stands between it and a copy.
    (out / raw["shards"][0]["bin"]).rename(out / "shard-000000.real")
    (tmp_path / "shared" / "escaped.bin").write_bytes(b"x")
    raw["shards"][0]["bin"] = name
    (out / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="malformed shard entry"):
        load_manifest(out)
    local = tmp_path / "local"
    staging.clear_cache()
    with pytest.raises(DataError):
        staging.stage_dataset(out, str(local), 0, tag="t")
    base = local / staging.STAGE_SUBDIR
    assert not (base / "escaped.bin").exists()
    assert not any(p.name == "escaped.bin" for p in local.rglob("*"))


@pytest.mark.parametrize("field", ["tar", "idx"])
@pytest.mark.parametrize("name", ["../escaped.tar", "/etc/hostname", "sub/shard-000000.tar",
                                  "manifest.json"])
def test_tar_manifest_names_outside_the_directory_are_refused(tmp_path: Path, field: str,
                                                              name: str) -> None:
    from hpctrain.data.tar_samples import TarSamples, load_tar_manifest, pack

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"s{i}.txt").write_text(f"sample {i}")
    out = tmp_path / "shared" / "packed"
    pack(src, out)
    raw = json.loads((out / MANIFEST).read_text())
    (tmp_path / "shared" / "escaped.tar").write_bytes(b"secret bytes")
    raw["shards"][0][field] = name
    (out / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="malformed shard entry"):
        load_tar_manifest(out)
    with pytest.raises(DataError, match="malformed shard entry"):
        TarSamples(out)
