"""`hpctrain data train-tokenizer`: a BPE tokenizer.json that prepare can use, deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from conftest import run_cli
from hpctrain.data.prepare import PrepareSettings, prepare  # noqa: E402
from hpctrain.data.shards import load_manifest  # noqa: E402
from hpctrain.data.tokenizer import HFTokenizer, TokenizerSpec, train_bpe  # noqa: E402
from hpctrain.errors import DataError  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "über", "日本", "training", "cluster"]
    lines = [" ".join(rng.choice(words, 12)) for _ in range(300)]
    (root / "a.jsonl").write_text("".join(f'{{"text": "{x}"}}\n' for x in lines[:150]))
    (root / "b.txt").write_text("\n".join(lines[150:]))
    return root


def test_trained_tokenizer_round_trips_and_prepares(corpus: Path, tmp_path: Path) -> None:
    out = train_bpe([str(corpus)], tmp_path / "tok.json", 300)
    tok = HFTokenizer(str(out))
    assert 258 <= tok.vocab_size <= 300 and tok.eos_token == "<|endoftext|>"
    text = "gamma über 日本 cluster"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges learned
    assert tok._tok.decode(ids.tolist()) == text
    prepare([corpus], tmp_path / "data", PrepareSettings(TokenizerSpec("hf", str(out))))
    m = load_manifest(tmp_path / "data")
    assert m.vocab_size == tok.vocab_size and m.eos_id == tok.eos_id
    # Same inputs, same file: training is deterministic.
    again = train_bpe([str(corpus)], tmp_path / "tok2.json", 300)
    assert again.read_bytes() == out.read_bytes()


def test_cli_and_errors(corpus: Path, tmp_path: Path) -> None:
    r = run_cli(["data", "train-tokenizer", str(corpus / "b.txt"), "--vocab", "280", "--out",
                 str(tmp_path / "t.json")])
    assert r.returncode == 0, r.stderr
    assert "vocab" in r.stdout and (tmp_path / "t.json").is_file()
    with pytest.raises(DataError, match="too small"):
        train_bpe([str(corpus)], tmp_path / "x.json", 100)
    r = run_cli(["data", "train-tokenizer", str(tmp_path / "missing.txt"), "--vocab", "300",
                 "--out", str(tmp_path / "y.json")])
    assert r.returncode != 0 and "Traceback" not in r.stderr
