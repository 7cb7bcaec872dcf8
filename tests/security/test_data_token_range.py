"""Token ids outside the model's vocabulary are refused before training, with the shard named.

An id >= the embedding's rows is an IndexError mid-run on the CPU and a device-side assert on a
GPU. Shards record their largest id (prepare, merge), manifests that contradict themselves are
refused, and the dataset is checked against the model when training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import train
from hpctrain.data.config import DataConfig, MixSource
from hpctrain.data.loader import build_dataset, gather_windows
from hpctrain.data.prepare import PrepareSettings, merge, prepare, prepare_task
from hpctrain.data.shards import MANIFEST, load_manifest, write_shard
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import DataError, HpctrainError

BYTES = PrepareSettings(TokenizerSpec(), shard_tokens=1000)
SEQ = 32


def _prepared(root: Path, name: str = "data") -> Path:
    """26 documents of 99 letters: three shards of up to 1000 tokens, each holding EOS ids."""
    rng = np.random.default_rng(len(name))
    docs = [bytes(rng.integers(97, 123, 99, dtype=np.uint8)).decode() for _ in range(26)]
    (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([root / f"{name}.jsonl"], root / name, BYTES)
    return root / name


def _poison(out: Path, shard: int, bad_id: int, *, legacy: bool = False,
            record: int | None = None) -> Path:
    """Rewrite ``shard`` with ``bad_id`` every 16 tokens, checksums updated (a consistent lie).

    ``legacy`` drops the recorded maxima (a manifest written before they existed); ``record``
    writes that value as the shard's maximum instead of the true one.
    """
    raw = json.loads((out / MANIFEST).read_text())
    m = load_manifest(out)
    tokens = np.asarray(m.tokens(shard)).astype(np.uint16)
    tokens[::16] = bad_id
    entry = write_shard(out, shard, tokens, m.doc_starts(shard))
    raw["shards"][shard] = entry
    if record is not None:
        entry["max_token_id"] = record
    if legacy:
        for s in raw["shards"]:
            s.pop("max_token_id", None)
    (out / MANIFEST).write_text(json.dumps(raw))
    return out / entry["bin"]


def _shards_cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(source="shards", path=str(path), seq_len=SEQ, **kw)


def test_prepare_and_merge_record_the_largest_id(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    m = load_manifest(out)
    assert len(m.shards) == 3
    for i, s in enumerate(m.shards):
        assert s["max_token_id"] == int(np.asarray(m.tokens(i)).max())
    assert m.shards[0]["max_token_id"] == 256  # EOS
    for k in range(2):
        prepare_task([tmp_path / "data.jsonl"], tmp_path / "array", BYTES, k, 2)
    merge(tmp_path / "array")
    assert load_manifest(tmp_path / "array").shards == m.shards


def test_a_sparse_tokenizer_id_is_kept_not_wrapped(tmp_path: Path) -> None:
    """tokenizer.json may number tokens sparsely: its token count is then not its id range."""
    tk = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world"] * 3, trainers.BpeTrainer(
        vocab_size=40, special_tokens=["<unk>", "<|endoftext|>"]))
    raw = json.loads(tok.to_str())
    raw["model"]["vocab"]["world"] = 70000  # beyond uint16, with 17 tokens in all
    (tmp_path / "tok.json").write_text(json.dumps(raw))
    (tmp_path / "a.txt").write_text("hello world")
    prepare([tmp_path / "a.txt"], tmp_path / "out",
            PrepareSettings(TokenizerSpec("hf", str(tmp_path / "tok.json")), shard_tokens=100))
    m = load_manifest(tmp_path / "out")
    assert m.vocab_size == 70001 and m.raw["dtype"] == "uint32"
    assert 70000 in np.asarray(m.tokens(0)).tolist() and m.shards[0]["max_token_id"] == 70000


def test_build_dataset_checks_every_source_against_the_model(tmp_path: Path) -> None:
    a, b = _prepared(tmp_path, "a"), _prepared(tmp_path, "b")
    mix = DataConfig(source="mix", mix=[MixSource(str(a)), MixSource(str(b))], seq_len=SEQ,
                     val_fraction=0.2)
    for cfg in (_shards_cfg(a), _shards_cfg(a, val_fraction=0.2), mix):
        for split in ("train", "val") if cfg.val_fraction else ("train",):
            assert len(build_dataset(cfg, split, vocab_size=257)) > 0
            # The model's vocabulary is one short of the EOS id every shard holds.
            with pytest.raises(DataError, match=r"shard-000000\.bin.*256.*256"):
                build_dataset(cfg, split, vocab_size=256)
    stdlib = DataConfig(seq_len=SEQ, max_bytes=100_000)
    assert len(build_dataset(stdlib, vocab_size=256)) > 0
    with pytest.raises(DataError, match=r"stdlib.*token id 1\d\d .*100 ids"):
        build_dataset(stdlib, vocab_size=100)  # 'z' is 122


def test_manifests_that_contradict_themselves_are_refused(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    raw = json.loads((out / MANIFEST).read_text())
    for field, value, words in (("eos_id", 257, "EOS id 257"), ("vocab_size", 200, "EOS id 256"),
                                ("vocab_size", "many", "vocab_size")):
        (out / MANIFEST).write_text(json.dumps({**raw, field: value}))
        with pytest.raises(DataError, match=words):
            load_manifest(out)
    (out / MANIFEST).write_text(json.dumps(raw))
    _poison(out, 1, 300)
    with pytest.raises(DataError, match=r"shard-000001\.bin.*300"):
        load_manifest(out)


def test_a_legacy_manifest_is_scanned(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    raw = json.loads((out / MANIFEST).read_text())
    for s in raw["shards"]:
        del s["max_token_id"]
    (out / MANIFEST).write_text(json.dumps(raw))
    assert len(build_dataset(_shards_cfg(out), vocab_size=257)) > 0
    _poison(out, 2, 300, legacy=True)
    with pytest.raises(DataError, match=r"shard-000002\.bin.*300"):
        build_dataset(_shards_cfg(out), vocab_size=257)


def test_a_shard_changed_after_its_manifest_fails_at_the_batch(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    _poison(out, 1, 300, record=200)  # the recorded maximum lies
    ds = build_dataset(_shards_cfg(out), vocab_size=257)
    with pytest.raises(DataError, match=r"shard-000001\.bin.*300"):
        gather_windows(ds, np.arange(len(ds)))


def test_verify_checks_the_recorded_maximum(tmp_path: Path) -> None:
    from hpctrain.cli import main

    out = _prepared(tmp_path)
    raw = json.loads((out / MANIFEST).read_text())
    raw["shards"][1]["max_token_id"] = 120  # the shard holds EOS = 256
    (out / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as e:
        main(["data", "verify", str(out)])
    assert e.value.code == 2
    with pytest.raises(HpctrainError, match=r"shard-000001\.bin.*120.*256"):
        load_manifest(out).verify()


def test_training_refuses_before_the_first_step(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    bad = _poison(out, 1, 300, legacy=True)
    run = train(tmp_path / "runs", "poisoned", "parallel.strategy=none", "train.micro_batch=4",
                "data.source=shards", f"data.path={out}", "model.vocab_size=257")
    assert run.returncode == 2, run.describe()
    assert str(bad) in run.stderr and "300" in run.stderr, run.describe()
    assert "Traceback" not in run.stderr and "IndexError" not in run.stderr, run.describe()
    metrics = run.run_dir / "metrics" / "rank-000.jsonl"
    assert not metrics.exists() or run.metrics() == []
