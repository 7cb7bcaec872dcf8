"""Hostile checkpoints: nothing a checkpoint folder holds may run code when hpctrain reads it.

For every file the loader reads (``.metadata``, the ``.distcp`` shards' tensor and value items,
``rng-rank-*.pt``, ``manifest.json``, ``latest``) a real payload is planted in the newest of two
checkpoints and the manifest resealed (sizes and xxh3 updated, as an attacker can). Each payload
would create a marker file; the tests assert it never appears, that the error names the file and
the refused global, and that resuming falls back to the older checkpoint. Each payload is also
run through a trusting unpickler once, to prove it is live (a test that cannot fail is useless).

One process, a 1-rank gloo group, the manager directly: no training run is needed.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import pickle
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import CheckpointError, DamagedCheckpoint, describe
from hpctrain.checkpoint.safe_io import SafeFileSystemReader

_CKPT_TESTS = Path(__file__).resolve().parents[1] / "checkpoint"


def _load(name: str):
    """Import ``tests/checkpoint/<name>.py`` by path (the test folders are not packages)."""
    key = f"_ckpt_test_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, _CKPT_TESTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


hostile = _load("hostile")
helpers = _load("helpers")

NEWEST, OLDER = "step-00000002", "step-00000001"


@pytest.fixture()
def run(pg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CheckpointManager, Path]:
    """Two genuine checkpoints (steps 1 and 2) of a tiny model; returns (manager, root)."""
    monkeypatch.delenv("HPCTRAIN_FAULTS", raising=False)
    model = helpers.make_model(0)
    opt = helpers.make_optimizer(model)
    root = tmp_path / "checkpoints"
    m = helpers.manager(root, keep_last=5)
    for step in (1, 2):
        helpers.train_steps(model, opt, 1, seed=step)
        m.save(step, helpers.state_of(model, opt), {"step": step, "world_size": 1},
               blocking=True)
    return m, root


def _fresh_state() -> dict:
    model = helpers.make_model(5)
    return helpers.state_of(model, helpers.make_optimizer(model))


def _resume(m: CheckpointManager, caplog: pytest.LogCaptureFixture) -> tuple[str, list[str]]:
    """Resume as training does (newest loadable); returns (checkpoint used, warnings)."""
    state = _fresh_state()
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        found = m.restore_newest(lambda path, manifest: m.load(path, state))
    assert found is not None
    return found[0].name, [r.getMessage() for r in caplog.records
                           if r.name.startswith("hpctrain")]


def _assert_refused(m: CheckpointManager, root: Path, caplog: pytest.LogCaptureFixture,
                    file: str, refused: str, marker: Path) -> None:
    """Explicit load fails naming file and global; resume falls back; nothing ran."""
    newest = root / NEWEST
    m.verify(newest)  # the attacker resealed the manifest: the checksums agree
    with pytest.raises(DamagedCheckpoint) as e:
        m.load(newest, _fresh_state())
    assert file in e.value.what and refused in e.value.what, e.value.what
    assert e.value.exit_code == 2
    used, warnings = _resume(m, caplog)
    assert used == OLDER, warnings
    skipped = [w for w in warnings if NEWEST in w]
    assert skipped and file in skipped[0] and refused in skipped[0], warnings
    assert (root / "damaged" / NEWEST).is_dir(), "the hostile checkpoint was not set aside"
    hostile.settle()
    assert not marker.exists(), "loading the checkpoint ran code"


def _prove_live(data: bytes, marker: Path, *, torch_format: bool = False) -> None:
    """A trusting reader would have run the payload."""
    try:
        if torch_format:
            torch.load(io.BytesIO(data), weights_only=False)
        else:
            pickle.loads(data)
    except Exception:  # noqa: BLE001 - only the side effect matters
        pass
    assert hostile.wait_for(marker), "the payload is not live: the test proves nothing"


# -- .metadata ---------------------------------------------------------------------------------

DOTTED = [
    # A module on the old allow-list that imports os: protocol 4 resolves the dotted name.
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    # The old rule let any attribute of torch through if it was a dtype: dots reach further.
    ("torch", "serialization.os.system"),
]


@pytest.mark.parametrize("module,qualname", DOTTED, ids=[f"{m}:{q}" for m, q in DOTTED])
def test_metadata_dotted_name_is_refused(run, tmp_path: Path, caplog, module: str,
                                         qualname: str) -> None:
    m, root = run
    marker = tmp_path / "pwned"
    data = hostile.dotted_global_pickle(module, qualname, f"touch {marker}")
    hostile.write_resealed(root / NEWEST, ".metadata", data)
    with pytest.raises(CheckpointError) as e:
        SafeFileSystemReader(root / NEWEST).read_metadata()
    assert ".metadata" in e.value.what and f"{module}.{qualname}" in e.value.what
    _assert_refused(m, root, caplog, ".metadata", f"{module}.{qualname}", marker)
    live = tmp_path / "live"  # a plain unpickler resolves the dotted name
    _prove_live(hostile.dotted_global_pickle(module, qualname, f"touch {live}"), live)


@pytest.mark.parametrize("kind", sorted(hostile.PAYLOADS))
def test_metadata_reduce_payload_is_refused(run, tmp_path: Path, caplog, kind: str) -> None:
    m, root = run
    cls = hostile.PAYLOADS[kind]
    marker = tmp_path / "pwned"
    hostile.write_resealed(root / NEWEST, ".metadata", pickle.dumps(cls(marker)))
    _assert_refused(m, root, caplog, ".metadata", hostile.refused_name(cls), marker)
    _prove_live(pickle.dumps(cls(tmp_path / "live")), tmp_path / "live")


@pytest.mark.parametrize("kind", sorted(hostile.PAYLOADS))
def test_metadata_nested_payload_is_refused(run, tmp_path: Path, caplog, kind: str) -> None:
    """A valid index with the payload hidden inside (``planner_data``)."""
    m, root = run
    cls = hostile.PAYLOADS[kind]
    marker = tmp_path / "pwned"
    data = hostile.nested_metadata_pickle(root / NEWEST, cls(marker))
    hostile.write_resealed(root / NEWEST, ".metadata", data)
    _assert_refused(m, root, caplog, ".metadata", hostile.refused_name(cls), marker)
    _prove_live(hostile.nested_metadata_pickle(root / OLDER, cls(tmp_path / "live")),
                tmp_path / "live")


def test_metadata_may_not_point_outside_the_checkpoint(run, tmp_path: Path, caplog) -> None:
    """An index whose storage points at a file the manifest does not hold is refused."""
    m, root = run
    metadata = hostile.read_index(root / NEWEST)
    metadata.storage_meta.load_id = None
    for info in metadata.storage_data.values():
        info.relative_path = "../" + OLDER + "/" + info.relative_path
    hostile.write_resealed(root / NEWEST, ".metadata", pickle.dumps(metadata))
    _assert_refused(m, root, caplog, ".metadata", "../" + OLDER, tmp_path / "none")


def test_genuine_metadata_still_loads(run) -> None:
    """The allow-list is exact, not empty: DCP's own index of every dtype still reads."""
    m, root = run
    reader = SafeFileSystemReader(root / NEWEST)
    metadata = reader.read_metadata()
    assert metadata.state_dict_metadata
    state = {f"t_{dt}".replace(".", "_"): torch.ones(3, dtype=dt)
             for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                        torch.uint8, torch.float8_e4m3fn, torch.complex64)}
    state["cl"] = torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last)
    m.save(3, state, {"step": 3, "world_size": 1}, blocking=True)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    m.load(root / "step-00000003", loaded)
    for k, v in state.items():
        assert torch.equal(loaded[k].float(), v.float()), k


# -- .distcp items (tensors and pickled values) ---------------------------------------------------

@pytest.mark.parametrize("fqn", ["model.inp.weight", "optim.param_groups.0.lr"],
                         ids=["tensor-item", "value-item"])
@pytest.mark.parametrize("kind", sorted(hostile.PAYLOADS))
def test_shard_item_payload_is_refused(run, tmp_path: Path, caplog, fqn: str,
                                       kind: str) -> None:
    m, root = run
    cls = hostile.PAYLOADS[kind]
    marker = tmp_path / "pwned"
    shard = hostile.replace_item(root / NEWEST, fqn, hostile.torch_pickle(cls(marker)))
    _assert_refused(m, root, caplog, shard, hostile.refused_name(cls), marker)
    _prove_live(hostile.torch_pickle(cls(tmp_path / "live")), tmp_path / "live",
                torch_format=True)


# -- rng-rank-*.pt ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(hostile.PAYLOADS))
def test_rng_file_payload_is_refused(run, tmp_path: Path, caplog, kind: str) -> None:
    m, root = run
    cls = hostile.PAYLOADS[kind]
    marker = tmp_path / "pwned"
    hostile.write_resealed(root / NEWEST, "rng-rank-00000.pt", hostile.torch_pickle(cls(marker)))
    _assert_refused(m, root, caplog, "rng-rank-00000.pt", hostile.refused_name(cls), marker)


def test_rng_file_of_the_wrong_shape_is_damage(run, tmp_path: Path, caplog) -> None:
    """Safe to unpickle but not RNG states: damage, not a crash in set_rng_state."""
    m, root = run
    hostile.write_resealed(root / NEWEST, "rng-rank-00000.pt", hostile.torch_pickle({"cpu": 3}))
    used, warnings = _resume(m, caplog)
    assert used == OLDER
    assert any("rng-rank-00000.pt" in w for w in warnings), warnings


# -- manifest.json and latest -----------------------------------------------------------------

def test_manifest_holding_a_pickle_is_damage(run, tmp_path: Path, caplog) -> None:
    m, root = run
    marker = tmp_path / "pwned"
    (root / NEWEST / "manifest.json").write_bytes(pickle.dumps(hostile.ShellPayload(marker)))
    used, warnings = _resume(m, caplog)
    assert used == OLDER
    assert any(NEWEST in w and "manifest.json" in w for w in warnings), warnings
    hostile.settle()
    assert not marker.exists()


def test_manifest_may_not_name_files_outside(run, tmp_path: Path, caplog) -> None:
    """A manifest listing ``../x`` would make verification read outside the checkpoint."""
    m, root = run
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    manifest = (root / NEWEST / "manifest.json").read_text()
    (root / NEWEST / "manifest.json").write_text(
        manifest.replace('"files": {', '"files": {"../../outside.txt": '
                         + json.dumps(describe(outside)) + ", ", 1))
    used, warnings = _resume(m, caplog)
    assert used == OLDER
    assert any(NEWEST in w and "../../outside.txt" in w for w in warnings), warnings


@pytest.mark.parametrize("content", [b"\x80\x04\x95", b"../../../etc\n", b"step-1; rm -rf /\n"],
                         ids=["pickle", "traversal", "shell"])
def test_hostile_latest_is_ignored(run, tmp_path: Path, caplog, content: bytes) -> None:
    """``latest`` is only a name: anything else is ignored with a warning, never followed."""
    m, root = run
    (root / "latest").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        assert m.latest_name() is None
    assert any("latest" in r.getMessage() for r in caplog.records if r.name.startswith("hpctrain"))
    used, _ = _resume(m, caplog)
    assert used == NEWEST
    # The resume points ``latest`` at the checkpoint it committed to again.
    assert (root / "latest").read_text().strip() == NEWEST
