"""Data path throughput on this machine: the shard loader (tokens/s, one process) and prepare.

    .venv/bin/python benchmarks/data_throughput.py                 # both, default sizes
    .venv/bin/python benchmarks/data_throughput.py --tokens 200e6 --prepare-mb 200

Loader: random uint16 tokens written as shards of 2^24 tokens in a temporary directory on local
disk (a warm page cache, as on a node after its first epoch), read through `ShardTokens` +
`GlobalOrderSampler` (shuffle windows of 4 shards) + `TokenLoader` (prefetch 2, CPU device):
tokens/s = tokens handed out by ``next_step`` / wall time, median of 5 timed passes.
Prepare: synthetic JSONL (documents of 200-20,000 characters) tokenized by the byte-level
tokenizer; MB/s of input per worker = input MB / wall seconds / workers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hpctrain.data.loader import BatchLayout, GlobalOrderSampler, TokenLoader
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shard_dataset import ShardTokens
from hpctrain.data.shards import load_manifest, write_shard
from hpctrain.data.tokenizer import TokenizerSpec


def make_shards(root: Path, tokens: int, shard_tokens: int = 1 << 24) -> None:
    """Random byte-vocabulary shards and a manifest, without the tokenizer."""
    rng = np.random.default_rng(0)
    shards = []
    for i, start in enumerate(range(0, tokens, shard_tokens)):
        n = min(shard_tokens, tokens - start)
        toks = rng.integers(0, 257, n, dtype=np.uint16)
        shards.append(write_shard(root, i, toks, np.arange(0, n, 4096, dtype=np.uint64)))
    manifest = {"format": "hpctrain-tokens", "version": 1, "dtype": "uint16", "vocab_size": 257,
                "eos_id": 256, "tokenizer": {"name": "random"}, "shards": shards}
    (root / "manifest.json").write_text(json.dumps(manifest))


def bench_loader(root: Path, seq_len: int, micro: int, steps: int) -> float:
    """Tokens per second out of ``TokenLoader.next_step`` (median of 5 passes)."""
    ds = ShardTokens(load_manifest(root), seq_len)
    rates = []
    for rep in range(6):
        lay = BatchLayout(micro, 1, 1, 0)
        loader = TokenLoader(ds, GlobalOrderSampler(len(ds), lay, seed=rep), torch.device("cpu"), 2)
        loader.next_step()  # start the prefetch thread
        t0 = time.perf_counter()
        for _ in range(steps):
            loader.next_step()
        dt = time.perf_counter() - t0
        loader.close()
        if rep:  # the first pass warms the page cache
            rates.append(steps * micro * seq_len / dt)
    return statistics.median(rates)


def make_jsonl(root: Path, mb: float) -> list[Path]:
    """Synthetic JSONL files of about ``mb`` MB in total (8 files)."""
    rng = np.random.default_rng(1)
    words = [bytes(rng.integers(97, 123, rng.integers(2, 10), dtype=np.uint8)).decode()
             for _ in range(5000)]
    files, per_file = [], int(mb * 1e6 / 8)
    for f in range(8):
        lines, size = [], 0
        while size < per_file:
            n = int(rng.integers(30, 3000))
            text = " ".join(words[j] for j in rng.integers(0, len(words), n))
            line = json.dumps({"text": text})
            lines.append(line)
            size += len(line) + 1
        path = root / f"part-{f}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=100e6, help="loader dataset size")
    ap.add_argument("--prepare-mb", type=float, default=100.0, help="prepare input size")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        (root / "shards").mkdir()
        make_shards(root / "shards", int(args.tokens))
        print(f"loader, {int(args.tokens):,} uint16 tokens, one process, prefetch 2, CPU")
        for seq, micro in ((2048, 8), (2048, 32), (256, 64), (4096, 4)):
            steps = max(50, 4_000_000 // (seq * micro))
            rate = bench_loader(root / "shards", seq, micro, steps)
            print(f"  seq {seq:5d} x micro-batch {micro:3d}: {rate / 1e6:8.1f} M tokens/s")
        (root / "in").mkdir()
        files = make_jsonl(root / "in", args.prepare_mb)
        mb = sum(f.stat().st_size for f in files) / 1e6
        print(f"prepare, {mb:.0f} MB of JSONL in {len(files)} files, byte-level tokenizer")
        for w in args.workers:
            out = root / f"out-{w}"
            t0 = time.perf_counter()
            prepare(files, out, PrepareSettings(TokenizerSpec(), shard_tokens=1 << 24), workers=w)
            dt = time.perf_counter() - t0
            print(f"  {w} worker(s): {mb / dt:7.1f} MB/s total, {mb / dt / w:7.1f} MB/s per worker")


if __name__ == "__main__":
    main()
