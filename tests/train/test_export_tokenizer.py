"""``hpctrain export hf`` writes the tokenizer files its model knows, and says so when it knows
none: a model trained on byte-level tokens has no Hugging Face tokenizer file, and a data
tokenizer that came from a model folder brings that folder's special-tokens map and generation
config along.

    .venv/bin/pytest tests/train/test_export_tokenizer.py -q
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from conftest import train
from hf_models import VOCAB, chat_tokenizer
from hpctrain.cli import main


def _prepared(root: Path, *tokenizer: str) -> Path:
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "a.txt").write_text("what is 2 plus 3? 5.\n" * 400)
    data = root / "data"
    main(["data", "prepare", str(root / "corpus"), "--out", str(data), "--no-progress",
          *tokenizer])
    return data


def _export(run: Path, out: Path) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["export", "hf", str(run), "--out", str(out), "--dtype", "fp32"])
    return buf.getvalue()


def test_byte_level_model_exports_without_tokenizer_and_says_why(tmp_path: Path) -> None:
    data = _prepared(tmp_path)
    run = train(tmp_path / "runs", "bytes", "data.source=shards", f"data.path={data}",
                "model.vocab_size=257", steps=2).ok()
    text = _export(run.run_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert "note: no tokenizer files: the model was trained on byte-level tokens" in text, text


def test_data_tokenizer_folder_brings_its_special_tokens_and_generation_config(
        tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    folder = chat_tokenizer(tmp_path / "tok")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    data = _prepared(tmp_path, "--tokenizer", str(folder))
    run = train(tmp_path / "runs", "bpe", "data.source=shards", f"data.path={data}",
                f"model.vocab_size={VOCAB}", steps=2).ok()
    text = _export(run.run_dir, tmp_path / "out")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= names, names
    assert "note:" not in text
