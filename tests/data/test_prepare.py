"""``hpctrain data prepare`` and the shard format: layout, determinism, resume, formats, errors."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import forked
from conftest import cli_env, run_cli
from hpctrain.data.prepare import (
    PrepareSettings,
    merge,
    prepare,
    prepare_task,
    read_documents,
    task_slice,
)
from hpctrain.data.shards import HEADER_BYTES, MAGIC, load_manifest
from hpctrain.data.tokenizer import BYTE_EOS, TokenizerSpec
from hpctrain.errors import DataError

BYTES = PrepareSettings(TokenizerSpec(), shard_tokens=1000)


def _corpus(root: Path, n_files: int = 7, docs_per_file: int = 5) -> list[Path]:
    """A few JSONL files and text files of varied, deterministic documents."""
    rng = np.random.default_rng(0)
    files = []
    for f in range(n_files):
        if f % 3 == 2:
            path = root / f"part-{f}.txt"
            path.write_text(f"plain file {f}\n" * int(rng.integers(5, 60)))
        else:
            path = root / f"part-{f}.jsonl"
            lines = [json.dumps({"text": f"doc {f}.{d} " + "é" * int(rng.integers(0, 5))
                                 + "x" * int(rng.integers(1, 700)), "id": d})
                     for d in range(docs_per_file)]
            path.write_text("\n".join(lines) + "\n")
        files.append(path)
    return files


def _stream(out: Path) -> tuple[np.ndarray, list[int]]:
    """All tokens of a prepared directory, concatenated, and the global doc start offsets."""
    m = load_manifest(out)
    tokens, starts, base = [], [], 0
    for i in range(len(m.shards)):
        t = np.asarray(m.tokens(i))
        tokens.append(t)
        starts += (m.doc_starts(i) + base).tolist()
        base += len(t)
    return np.concatenate(tokens), starts


def _tree_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _expected_stream(docs: list[bytes]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(d, np.uint8).astype(np.uint16), BYTE_EOS)
                           for d in docs if d])


def _docs_of(files: list[Path]) -> list[bytes]:
    docs = []
    for f in files:
        for d in read_documents(f):
            docs.append(d if isinstance(d, bytes) else d.encode())
    return docs


def test_shard_layout_header_memmap_and_index(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    prepare(files, tmp_path / "out", BYTES)
    m = load_manifest(tmp_path / "out")
    assert m.raw["dtype"] == "uint16" and m.vocab_size == 257 and m.eos_id == BYTE_EOS
    assert m.raw["tokenizer"]["name"] == "bytes"
    assert m.raw["tokenizer"]["hash"].startswith("sha256:")
    assert len(m.shards) > 3
    assert all(s["tokens"] == 1000 for s in m.shards[:-1]) and 0 < m.shards[-1]["tokens"] <= 1000
    first = tmp_path / "out" / "shard-000000.bin"
    raw = first.read_bytes()
    assert raw[:8] == MAGIC and len(raw) == HEADER_BYTES + 2 * 1000
    direct = np.memmap(first, dtype="<u2", mode="r", offset=HEADER_BYTES)
    np.testing.assert_array_equal(direct, m.tokens(0))
    # The stream is the documents in input order, each followed by EOS; .idx marks their starts.
    docs = _docs_of(files)
    tokens, starts = _stream(tmp_path / "out")
    np.testing.assert_array_equal(tokens, _expected_stream(docs))
    lengths = [len(d) + 1 for d in docs if d]
    assert starts == np.cumsum([0, *lengths[:-1]]).tolist()
    assert sum(s["docs"] for s in m.shards) == len(lengths)
    m.verify()


def test_byte_identical_across_worker_counts(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    prepare(files, tmp_path / "w1", BYTES, workers=1)
    prepare(files, tmp_path / "w3", BYTES, workers=3)
    assert _tree_bytes(tmp_path / "w1") == _tree_bytes(tmp_path / "w3")


@pytest.mark.parametrize("stop_after", [1, 4])
def test_interrupted_run_resumes_byte_identical(tmp_path: Path, stop_after: int) -> None:
    files = _corpus(tmp_path)
    prepare(files, tmp_path / "ref", BYTES)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(files, out, BYTES, stop_after_shards=stop_after)
    assert not (out / "manifest.json").exists() and (out / "manifest.partial.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert len(kept) == 2 * stop_after
    (out / "shard-999999.bin.tmp").write_bytes(b"half-written")  # a crash mid-write
    prepare(files, out, BYTES, workers=2)
    assert _tree_bytes(out) == _tree_bytes(tmp_path / "ref")
    # Finished shards were kept, not rewritten.
    assert all((out / n).stat().st_mtime_ns == t for n, t in kept.items())


def test_rerun_after_losing_last_shard_and_manifest(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    out = tmp_path / "out"
    prepare(files, out, BYTES)
    ref = _tree_bytes(out)
    last = sorted(out.glob("shard-*.bin"))[-1]
    last.unlink()
    (out / "manifest.json").unlink()
    prepare(files, out, BYTES)
    assert _tree_bytes(out) == ref
    # A complete directory is left alone; other inputs into it are refused.
    prepare(files, out, BYTES)
    with pytest.raises(DataError, match="different preparation"):
        prepare(files[:2], out, BYTES)


def test_corrupted_shard_names_file_and_checksums(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    prepare(files, tmp_path / "out", BYTES)
    victim = tmp_path / "out" / "shard-000002.bin"
    data = bytearray(victim.read_bytes())
    data[HEADER_BYTES + 10] ^= 0xFF
    victim.write_bytes(bytes(data))
    m = load_manifest(tmp_path / "out")
    with pytest.raises(DataError) as info:
        m.verify()
    msg = info.value.what
    assert "shard-000002.bin" in msg and m.shards[2]["bin_checksum"] in msg
    assert "checksum mismatch" in msg


def test_truncated_shard_fails_on_open(tmp_path: Path) -> None:
    prepare(_corpus(tmp_path), tmp_path / "out", BYTES)
    victim = tmp_path / "out" / "shard-000001.bin"
    victim.write_bytes(victim.read_bytes()[:-6])
    with pytest.raises(DataError, match="shard-000001.bin.*truncated"):
        load_manifest(tmp_path / "out").tokens(1)


# -- input formats -----------------------------------------------------------------------------

DOCS = ["first document", "second — with ünïcode", "", "third\nline two"]


def _write_format(path: Path, docs: list[str]) -> None:
    lines = "".join(json.dumps({"body": d}) + "\n" for d in docs).encode()
    name = path.name
    if name.endswith(".jsonl.zst"):
        zstd = pytest.importorskip("zstandard")
        path.write_bytes(zstd.ZstdCompressor().compress(lines))
    elif name.endswith(".json.gz"):
        path.write_bytes(gzip.compress(lines))
    elif name.endswith(".jsonl"):
        path.write_bytes(lines)
    elif name.endswith(".parquet"):
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), path,
                       row_group_size=2)


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.zst", "a.json.gz", "a.parquet"])
def test_record_formats_round_trip(tmp_path: Path, name: str) -> None:
    _write_format(tmp_path / name, DOCS)
    prepare([tmp_path / name], tmp_path / "out",
            PrepareSettings(TokenizerSpec(), text_field="body", shard_tokens=16))
    tokens, starts = _stream(tmp_path / "out")
    want = [d.encode() for d in DOCS]
    np.testing.assert_array_equal(tokens, _expected_stream(want))
    assert len(starts) == 3  # the empty document is skipped
    pieces = np.split(tokens, starts[1:])
    assert [p[:-1].astype(np.uint8).tobytes().decode() for p in pieces] == [d for d in DOCS if d]


def test_plain_files_directories_and_globs(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "sub" / "a.txt").write_text("ay")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\0\1")
    (tmp_path / "notes.rst").write_text("rst")
    prepare([tmp_path / "d", str(tmp_path / "*.rst")], tmp_path / "out", BYTES)
    tokens, _ = _stream(tmp_path / "out")
    np.testing.assert_array_equal(tokens, _expected_stream([b"bee", b"ay", b"rst"]))


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    tk = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS * 3, trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    _write_format(tmp_path / "a.jsonl", DOCS)
    spec = TokenizerSpec("hf", str(tmp_path / "tokenizer.json"))
    prepare([tmp_path / "a.jsonl"], tmp_path / "out", PrepareSettings(spec, "body", 8))
    m = load_manifest(tmp_path / "out")
    eos = tok.token_to_id("<|endoftext|>")
    assert m.eos_id == eos and m.vocab_size == tok.get_vocab_size() and m.raw["dtype"] == "uint16"
    tokens, starts = _stream(tmp_path / "out")
    pieces = np.split(tokens, starts[1:])
    assert all(p[-1] == eos for p in pieces)
    assert [tok.decode(p[:-1].tolist()) for p in pieces][0] == "first document"


# -- errors ------------------------------------------------------------------------------------


def test_empty_inputs_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no text"):
        prepare([tmp_path / "empty.txt"], tmp_path / "out", BYTES)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        prepare([tmp_path / "emptydir"], tmp_path / "out", BYTES)
    with pytest.raises(DataError, match="matches no files"):
        prepare([str(tmp_path / "*.nothing")], tmp_path / "out", BYTES)


def test_bad_records_name_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: record has no field 'text'"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "out", BYTES)
    (tmp_path / "b.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot read input .*b.json.gz"):
        prepare([tmp_path / "b.json.gz"], tmp_path / "out2", BYTES, workers=2)


def _cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """Run ``hpctrain data ARGS`` in this process: (exit code, stdout, stderr)."""
    from hpctrain.cli import main

    try:
        main(["data", *args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_subprocess_missing_input_exit_2(tmp_path: Path) -> None:
    done = run_cli(["data", "prepare", str(tmp_path / "missing.txt"), "--out",
                    str(tmp_path / "out")], timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("hpctrain: error: input ") and "Traceback" not in done.stderr


def test_module_entry_point_prepares_with_a_pool(tmp_path: Path) -> None:
    """`python -m hpctrain` records SIGTERM until the trainer's handlers take over; the pool's
    workers, forked from it, must still die on Pool.terminate's SIGTERM, or the command hangs
    once every file is tokenized (it did: a fresh `python -m hpctrain data prepare corpus/`
    too, with OMP_NUM_THREADS unset; here with it set, as the suite's runs have it)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # the README's test corpus: files large enough for a pool of workers
        (corpus / f"notes-{i}.txt").write_text(f"notes {i}: the quick brown fox\n" * 2000)
    (corpus / "pages.jsonl").write_text("".join(
        f'{{"text": "page {i} of a small corpus"}}\n' for i in range(500)))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    with forked.command() as env:
        done = subprocess.run(["bash", "-c", "hpctrain data prepare corpus/ --out out"],
                              cwd=tmp_path, env={**cli_env(), **env, "PATH": path},
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert load_manifest(tmp_path / "out").num_tokens > 0


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl.zst").write_bytes(b"garbage")
    for args, words in (([str(tmp_path / "empty.txt")], "no text"),
                        ([str(tmp_path / "bad.jsonl.zst")], "bad.jsonl.zst"),
                        ([], "no inputs")):
        code, _, err = _cli(capsys, "prepare", *args, "--out", str(tmp_path / "out"),
                            "--workers", "1")
        assert code == 2, (args, err)
        assert err.startswith("hpctrain: error: ") and words in err


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_cli_prepare_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = _corpus(tmp_path, n_files=3)
    code, out, err = _cli(capsys, "prepare", *map(str, files), "--out", str(tmp_path / "out"),
                          "--shard-tokens", "500", "--workers", "2", "--no-progress")
    assert code == 0, err
    assert "shards" in out
    assert _cli(capsys, "verify", str(tmp_path / "out"))[0] == 0
    victim = tmp_path / "out" / "shard-000000.idx"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\7")
    code, _, err = _cli(capsys, "verify", str(tmp_path / "out"))
    assert code == 2 and "shard-000000.idx" in err and "checksum mismatch" in err


# -- Slurm array mode: task slices + merge == one prepare, byte for byte ----------------------

ARRAY = PrepareSettings(TokenizerSpec(), shard_tokens=500)


def test_task_slices_cover_the_inputs_in_order() -> None:
    sizes = [5, 1, 1, 9, 3, 3, 100, 2]
    for count in (1, 2, 3, 5, 8, 11):
        got = [task_slice(sizes, i, count) for i in range(count)]
        assert got[0][0] == 0 and got[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
    with pytest.raises(DataError, match="not a valid array task"):
        task_slice(sizes, 3, 3)


@pytest.mark.parametrize("count", [1, 3, 10])
def test_array_then_merge_is_byte_identical(tmp_path: Path, count: int) -> None:
    files = _corpus(tmp_path, n_files=7)
    prepare(files, tmp_path / "ref", ARRAY)
    out = tmp_path / "out"
    for i in reversed(range(count)):  # any order of task completion
        prepare_task(files, out, ARRAY, i, count)
    merge(out)
    assert _tree_bytes(out) == _tree_bytes(tmp_path / "ref")


def test_merge_refuses_missing_tasks_and_rerun_keeps_parts(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    out = tmp_path / "out"
    first = prepare_task(files, out, ARRAY, 0, 3)
    prepare_task(files, out, ARRAY, 2, 3)
    with pytest.raises(DataError, match=r"1 of 3 array tasks .*\[1\]"):
        merge(out)
    mtime = first.stat().st_mtime_ns
    assert prepare_task(files, out, ARRAY, 0, 3).stat().st_mtime_ns == mtime  # kept
    with pytest.raises(DataError, match="holds no parts"):
        merge(tmp_path / "nothing")


def test_cli_array_tasks_from_slurm_env_then_merge(tmp_path: Path) -> None:
    files = _corpus(tmp_path, n_files=4)
    prepare(files, tmp_path / "ref", ARRAY)
    for i in range(2):
        env = {"SLURM_ARRAY_TASK_ID": str(10 + i), "SLURM_ARRAY_TASK_MIN": "10"}
        r = run_cli(["data", "prepare", *map(str, files), "--out", str(tmp_path / "o"),
                     "--shard-tokens", "500", "--task-count", "2", "--workers", "1"], env=env)
        assert r.returncode == 0, r.stderr
    r = run_cli(["data", "merge", str(tmp_path / "o")])
    assert r.returncode == 0, r.stderr
    assert _tree_bytes(tmp_path / "o") == _tree_bytes(tmp_path / "ref")
