"""``hpctrain data prepare``: tokenize text files into token shards (see `hpctrain.data.shards`).

    hpctrain data prepare corpus/*.jsonl.zst --out data/corpus --workers 8
    hpctrain data prepare --stdlib --out runs/data/stdlib          # the demo's corpus

Inputs are files, directories (searched recursively for the known suffixes, sorted) and globs,
in the order given; links out of the inputs, FIFOs and devices are skipped with a warning (see
`hpctrain.data.inputs`). Each input file is one task: worker processes tokenize files in
parallel and the main process appends their documents, in input order, to a token stream that
it cuts into shards of ``shard_tokens``. So the output is byte-identical whatever the number of
workers.
Resume: after each shard, ``manifest.partial.json`` lists the finished shards and the input
files they cover; a rerun with the same inputs and settings keeps those shards and skips the
files they contain. ``manifest.json`` is written last and marks the directory as complete.

Fine-tuning data (``--format chat`` or ``prompt-response``, JSON records): each example becomes
one document with a loss mask (`hpctrain.data.chat`), written beside each shard (manifest
version 2, `hpctrain.data.shards`):

    hpctrain data prepare chats.jsonl --format chat --tokenizer /models/Llama-3.2-1B --out data/chat
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hpctrain.data.chat import FORMATS, ExampleEncoder, ExampleFields, load_template
from hpctrain.data.inputs import InputFile, expand_inputs, read_documents
from hpctrain.data.progress import BytesProgress
from hpctrain.data.shards import (
    DTYPES,
    FORMAT_VERSION,
    MANIFEST,
    MASK_VERSION,
    PARTIAL_MANIFEST,
    atomic_write_json,
    dtype_name,
    file_checksum,
    make_out_dir,
    write_shard,
)
from hpctrain.data.tokenizer import TokenizerSpec, load_tokenizer, token_dtype
from hpctrain.errors import DataError
from hpctrain.runtime import early_signals
from hpctrain.runtime.rundir import fsync_dir

DEFAULT_SHARD_BYTES = 256 << 20


@dataclass(frozen=True)
class PrepareSettings:
    """Everything that determines the output bytes besides the inputs themselves."""

    tokenizer: TokenizerSpec
    text_field: str = "text"
    shard_tokens: int = 0  # 0: DEFAULT_SHARD_BYTES worth of tokens
    # "text": documents; "chat" / "prompt-response": fine-tuning examples with loss masks.
    format: str = "text"
    fields: ExampleFields = ExampleFields()


# -- tokenizing (worker side) ------------------------------------------------------------------

_worker_tok = None
_worker_examples: ExampleEncoder | None = None


def _init_worker(settings: PrepareSettings) -> None:
    global _worker_tok, _worker_examples
    # `python -m hpctrain` records SIGTERM until a trainer takes over (early_signals): a pool
    # worker forked with that handler ignores Pool.terminate's SIGTERM and the command hangs
    # after the last file. Preparing data is no training to checkpoint: SIGTERM ends it.
    early_signals.uninstall()
    _worker_tok = load_tokenizer(settings.tokenizer)
    _worker_examples = None
    if settings.format != "text":
        template = load_template(_worker_tok, settings.tokenizer.path)
        _worker_examples = ExampleEncoder(_worker_tok, settings.format, settings.fields,
                                          template)


Tokenized = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def tokenize_file(job: tuple[InputFile, str, int]) -> Tokenized | DataError:
    """(tokens with EOS after each document, document start offsets, loss mask or None for
    plain text) of one file."""
    file, field, skip = job
    path = str(file.path)
    tok = _worker_tok
    dtype = token_dtype(tok.vocab_size)
    if _worker_examples is not None:
        return _tokenize_examples(file, skip, dtype)
    eos = np.array([tok.eos_id], dtype=dtype)
    parts, lengths = [], []
    try:
        for doc in read_documents(file, field):
            if not isinstance(doc, (str, bytes)):
                raise DataError(f"{path}: a document is a {type(doc).__name__}, not text")
            ids = tok.encode(doc)
            if len(ids) == 0:
                continue  # an empty document adds nothing, not even EOS
            if int(ids.max()) >= tok.vocab_size:  # would wrap around in a narrower dtype
                raise DataError(f"{path}: the tokenizer produced id {int(ids.max())}, outside "
                                f"its vocabulary of {tok.vocab_size}",
                                hint="check the tokenizer.json")
            parts += [ids.astype(dtype, copy=False), eos]
            lengths.append(len(ids) + 1)
    except DataError as e:
        return e
    except (OSError, EOFError, UnicodeDecodeError) as e:
        return DataError(f"cannot read input {path!r}: {e}")
    except Exception as e:  # noqa: BLE001 - tokenizer errors: report the file, not a traceback
        return DataError(f"cannot read input {path!r}: {type(e).__name__}: {e}")
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64) if lengths else np.zeros(0, np.int64)
    if skip:  # resume: drop what finished shards already hold
        tokens = tokens[skip:]
        starts = starts[starts >= skip] - skip
    return tokens, starts, None


def _tokenize_examples(file: InputFile, skip: int, dtype: np.dtype) -> Tokenized | DataError:
    """`tokenize_file` for fine-tuning examples: one document and its mask per record."""
    path = str(file.path)
    tok, encoder = _worker_tok, _worker_examples
    parts, masks, lengths = [], [], []
    try:
        for i, record in enumerate(read_documents(file, None)):
            ids, mask = encoder.encode(record, f"{path}, record {i + 1}")
            if int(ids.max()) >= tok.vocab_size:
                raise DataError(f"{path}, record {i + 1}: the tokenizer produced id "
                                f"{int(ids.max())}, outside its vocabulary of {tok.vocab_size}",
                                hint="check the tokenizer.json")
            parts.append(ids.astype(dtype))
            masks.append(mask)
            lengths.append(len(ids))
    except DataError as e:
        return e
    except Exception as e:  # noqa: BLE001 - tokenizer errors: report the file, not a traceback
        return DataError(f"cannot read input {path!r}: {type(e).__name__}: {e}")
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64) if lengths else np.zeros(0, np.int64)
    if skip:
        tokens, mask = tokens[skip:], mask[skip:]
        starts = starts[starts >= skip] - skip
    return tokens, starts, mask


# -- writing (main process) --------------------------------------------------------------------


class _ShardWriter:
    """Appends documents to a token stream and cuts it into shards of ``shard_tokens``."""

    def __init__(self, out: Path, shard_tokens: int, dtype: np.dtype, shards: list[dict],
                 on_shard: Callable[[], None]):
        self.out, self.shard_tokens, self.dtype = out, shard_tokens, dtype
        self.shards = shards
        self.on_shard = on_shard
        self.buf: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.n = 0

    @property
    def written(self) -> int:
        """Tokens in finished shards."""
        return sum(s["tokens"] for s in self.shards)

    def add(self, tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray | None = None) -> None:
        pos = 0
        while pos < len(tokens):
            take = min(self.shard_tokens - self.n, len(tokens) - pos)
            sel = starts[(starts >= pos) & (starts < pos + take)]
            self.buf.append(tokens[pos : pos + take])
            if mask is not None:
                self.masks.append(mask[pos : pos + take])
            self.starts.append(sel - pos + self.n)
            self.n += take
            pos += take
            if self.n == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self.n == 0:
            return
        tokens = np.concatenate(self.buf).astype(self.dtype, copy=False)
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        mask = np.concatenate(self.masks) if self.masks else None
        self.shards.append(write_shard(self.out, len(self.shards), tokens, starts, mask))
        self.buf, self.starts, self.masks, self.n = [], [], [], 0
        self.on_shard()


def _input_record(file: InputFile) -> dict:
    return {"path": str(file.path), "bytes": file.size}


def prepare(inputs: list[str] | list[Path], out: str | Path, settings: PrepareSettings,
            workers: int = 1, progress: bool = False, stop_after_shards: int | None = None,
            follow_symlinks: bool = False) -> Path:
    """Tokenize ``inputs`` into shards under ``out``; return the manifest path.

    ``stop_after_shards`` stops (raising KeyboardInterrupt) once that many shards are finished
    in this call: the seam the tests use to interrupt a run. ``follow_symlinks``: also read
    links that lead out of the inputs (see `hpctrain.data.inputs`).
    """
    files = expand_inputs([str(i) for i in inputs], follow_symlinks=follow_symlinks)
    records = [_input_record(f) for f in files]
    head, dtype, shard_tokens = _job_head(settings)
    out = make_out_dir(Path(out))
    final, partial = out / MANIFEST, out / PARTIAL_MANIFEST
    if final.is_file():
        done = json.loads(final.read_text())
        if _same_job(done, head, records):
            return final  # already prepared
        raise DataError(f"{str(out)!r} already holds a different preparation",
                        hint="prepare into a new directory or delete this one")

    # Resume: keep the shards a partial manifest lists if it describes this same job.
    shards: list[dict] = []
    done_files = 0
    if partial.is_file():
        old = json.loads(partial.read_text())
        if not _same_job(old, head, records):
            raise DataError(f"{str(out)!r} holds an interrupted preparation of other inputs or "
                            "settings", hint="prepare into a new directory or delete this one")
        shards = [s for s in old["shards"] if (out / s["bin"]).is_file()
                  and file_checksum(out / s["bin"]) == s["bin_checksum"]
                  and (out / s["idx"]).is_file()
                  and file_checksum(out / s["idx"]) == s["idx_checksum"]]
        shards = shards[: next((i for i, (a, b) in enumerate(zip(shards, old["shards"],
                                                                 strict=False)) if a is not b),
                               len(shards))]
    for stale in out.glob("shard-*"):
        if stale.name not in {s[k] for s in shards for k in ("bin", "idx")}:
            stale.unlink()

    # Which files finished shards already cover, from the per-file token counts they recorded.
    file_tokens: list[int] = []
    if shards:
        file_tokens = list(json.loads(partial.read_text()).get("file_tokens", []))
    kept = sum(s["tokens"] for s in shards)
    pos = 0
    while done_files < len(file_tokens) and pos + file_tokens[done_files] <= kept:
        pos += file_tokens[done_files]
        done_files += 1
    file_tokens = file_tokens[:done_files]
    skip_first = kept - pos

    stop = {"n": 0}

    def checkpoint() -> None:
        atomic_write_json(partial, {**head, "inputs": records, "shards": shards,
                                    "file_tokens": file_tokens})
        fsync_dir(out)
        stop["n"] += 1
        if stop_after_shards is not None and stop["n"] >= stop_after_shards:
            raise KeyboardInterrupt(f"stopped after {stop['n']} shards (test seam)")

    writer = _ShardWriter(out, shard_tokens, dtype, shards, checkpoint)
    jobs = [(f, settings.text_field, skip_first if i == done_files else 0)
            for i, f in enumerate(files)][done_files:]
    with _map(workers, settings, jobs) as results, \
            BytesProgress(progress, sum(r["bytes"] for r in records[done_files:])) as bar:
        for i, result in enumerate(results, start=done_files):
            if isinstance(result, DataError):
                raise result
            tokens, starts, mask = result
            # Record the file's full token count before its tokens may complete a shard.
            file_tokens.append(len(tokens) + (skip_first if i == done_files else 0))
            writer.add(tokens, starts, mask)
            bar.advance(records[i]["bytes"])
    writer.flush()
    if not shards or sum(s["tokens"] for s in shards) == 0:
        partial.unlink(missing_ok=True)
        raise DataError("the inputs hold no text: every document is empty",
                        hint="check the inputs and --text-field")
    atomic_write_json(final, {**head, "inputs": records, "shards": shards})
    partial.unlink(missing_ok=True)
    fsync_dir(out)
    return final


def _job_head(settings: PrepareSettings) -> tuple[dict, np.dtype, int]:
    """(manifest fields fixed by the settings, token dtype, tokens per shard)."""
    tok = load_tokenizer(settings.tokenizer)
    dtype = token_dtype(tok.vocab_size)
    shard_tokens = settings.shard_tokens or DEFAULT_SHARD_BYTES // dtype.itemsize
    head = {
        "format": "hpctrain-tokens", "version": FORMAT_VERSION, "dtype": dtype_name(dtype),
        "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id),
        "tokenizer": {"name": tok.name, "hash": tok.hash, **asdict(settings.tokenizer)},
        "text_field": settings.text_field, "shard_tokens": int(shard_tokens),
    }
    if settings.format not in FORMATS:
        raise DataError(f"--format {settings.format!r} is not one of {', '.join(FORMATS)}")
    if settings.format != "text":
        # Plain text keeps writing version 1 (its output bytes unchanged); examples carry masks.
        template = load_template(tok, settings.tokenizer.path)
        head.update(version=MASK_VERSION, example_format={
            "format": settings.format, **asdict(settings.fields),
            "chat_template": (None if template is None else "sha256:" + hashlib.sha256(
                template.source.encode()).hexdigest())})
        del head["text_field"]
    return head, dtype, shard_tokens


# -- Slurm array mode: task i tokenizes its slice into a part, `merge` cuts the shards ---------

PARTS = "parts"


def task_slice(sizes: list[int], task_index: int, task_count: int) -> tuple[int, int]:
    """Files ``[lo, hi)`` of task ``task_index``: contiguous slices of about equal bytes."""
    if task_count < 1 or not 0 <= task_index < task_count:
        raise DataError(f"task {task_index} of {task_count} is not a valid array task",
                        expected="0 <= --task-index < --task-count")
    cum = np.cumsum([0, *sizes], dtype=np.float64)
    bounds = np.searchsorted(cum, cum[-1] * np.arange(task_count + 1) / task_count, side="left")
    bounds[0], bounds[-1] = 0, len(sizes)
    bounds = np.maximum.accumulate(bounds)
    return int(bounds[task_index]), int(bounds[task_index + 1])


def _part_stem(task_index: int, task_count: int) -> str:
    return f"part-{task_index:05d}-of-{task_count:05d}"


def prepare_task(inputs: list[str] | list[Path], out: str | Path, settings: PrepareSettings,
                 task_index: int, task_count: int, workers: int = 1,
                 progress: bool = False, follow_symlinks: bool = False) -> Path:
    """Array task ``task_index``: tokenize its slice of the inputs into ``out/parts/``.

    The part is the task's token stream (documents with EOS, no shard cuts) and its document
    starts; `merge` concatenates the parts in task order and cuts the shards, so the result is
    byte-identical to one `prepare` over all inputs. A finished part is kept on a rerun.
    """
    if settings.format != "text":
        raise DataError(f"--format {settings.format} is not supported in array mode",
                        hint="prepare fine-tuning examples in one task (drop --task-count)")
    files = expand_inputs([str(i) for i in inputs], follow_symlinks=follow_symlinks)
    records = [_input_record(f) for f in files]
    head, dtype, _ = _job_head(settings)
    lo, hi = task_slice([r["bytes"] for r in records], task_index, task_count)
    parts = make_out_dir(make_out_dir(Path(out)) / PARTS)
    stem = _part_stem(task_index, task_count)
    meta_path = parts / f"{stem}.json"
    meta = {**head, "task_index": task_index, "task_count": task_count, "all_inputs": records,
            "inputs": records[lo:hi]}
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta} == meta:
            return meta_path  # finished earlier
    tok_tmp, starts_tmp = parts / f"{stem}.tokens.tmp", parts / f"{stem}.starts.tmp"
    n_tok = n_docs = 0
    jobs = [(f, settings.text_field, 0) for f in files[lo:hi]]
    with open(tok_tmp, "wb") as ft, open(starts_tmp, "wb") as fs, \
            _map(workers, settings, jobs) as results, \
            BytesProgress(progress, sum(r["bytes"] for r in records[lo:hi])) as bar:
        for i, result in enumerate(results, start=lo):
            if isinstance(result, DataError):
                raise result
            tokens, starts, _ = result
            ft.write(np.ascontiguousarray(tokens, dtype=dtype.newbyteorder("<")).tobytes())
            fs.write(np.ascontiguousarray(starts + n_tok, dtype="<u8").tobytes())
            n_tok += len(tokens)
            n_docs += len(starts)
            bar.advance(records[i]["bytes"])
        for f in (ft, fs):
            f.flush()
            os.fsync(f.fileno())
    os.replace(tok_tmp, parts / f"{stem}.tokens")
    os.replace(starts_tmp, parts / f"{stem}.starts")
    atomic_write_json(meta_path, {**meta, "tokens": n_tok, "docs": n_docs,
                                  "tokens_checksum": file_checksum(parts / f"{stem}.tokens")})
    fsync_dir(parts)
    return meta_path


def merge(out: str | Path, keep_parts: bool = False) -> Path:
    """Cut the parts of a finished array preparation into shards; write ``manifest.json``."""
    out = Path(out)
    parts = out / PARTS
    metas = [json.loads(p.read_text()) for p in sorted(parts.glob("part-*-of-*.json"))]
    if not metas:
        raise DataError(f"{str(parts)!r} holds no parts",
                        hint="run `hpctrain data prepare ... --task-index I --task-count N` "
                        "for every I first")
    count = metas[0]["task_count"]
    head_keys = [k for k in metas[0] if k not in ("task_index", "inputs", "tokens", "docs",
                                                   "tokens_checksum")]
    missing = sorted(set(range(count)) - {m["task_index"] for m in metas
                                          if m["task_count"] == count})
    if missing:
        raise DataError(f"{len(missing)} of {count} array tasks have not finished: "
                        f"{missing[:10]}{' ...' if len(missing) > 10 else ''}",
                        hint="rerun those task indices, then merge again")
    metas = sorted((m for m in metas if m["task_count"] == count), key=lambda m: m["task_index"])
    if any({k: m.get(k) for k in head_keys} != {k: metas[0][k] for k in head_keys}
           for m in metas):
        raise DataError(f"the parts in {str(parts)!r} come from different inputs or settings",
                        hint="delete the directory and run the array again")
    head = {k: metas[0][k] for k in head_keys if k not in ("task_count", "all_inputs")}
    dtype = DTYPES[head["dtype"]]
    for stale in out.glob("shard-*"):
        stale.unlink()
    shards: list[dict] = []
    writer = _ShardWriter(out, int(head["shard_tokens"]), dtype, shards, lambda: None)
    chunk = max(int(head["shard_tokens"]), 1 << 24)
    for m in metas:
        stem = _part_stem(m["task_index"], count)
        if file_checksum(parts / f"{stem}.tokens") != m["tokens_checksum"]:
            raise DataError(f"part {str(parts / stem)!r}.tokens does not match its checksum",
                            hint=f"rerun array task {m['task_index']}, then merge again")
        tokens = (np.memmap(parts / f"{stem}.tokens", dtype=dtype, mode="r") if m["tokens"]
                  else np.zeros(0, dtype))
        starts = np.fromfile(parts / f"{stem}.starts", dtype="<u8").astype(np.int64)
        for a in range(0, len(tokens), chunk):
            b = min(a + chunk, len(tokens))
            sel = starts[np.searchsorted(starts, a):np.searchsorted(starts, b)] - a
            writer.add(tokens[a:b], sel)
    writer.flush()
    if not shards:
        raise DataError("the inputs hold no text: every document is empty",
                        hint="check the inputs and --text-field")
    atomic_write_json(out / MANIFEST, {**head, "inputs": metas[0]["all_inputs"], "shards": shards})
    fsync_dir(out)
    if not keep_parts:
        shutil.rmtree(parts)
    return out / MANIFEST


def _same_job(manifest: dict, head: dict, records: list[dict]) -> bool:
    return all(manifest.get(k) == v for k, v in head.items()) and manifest.get("inputs") == records


class _map:
    """Ordered results of `tokenize_file` over ``jobs``: inline for 1 worker, else a pool."""

    def __init__(self, workers: int, settings: PrepareSettings, jobs: list):
        # No more workers than files: one file is tokenized inline, without a pool to start.
        self.workers, self.settings, self.jobs = min(workers, len(jobs)), settings, jobs
        self.pool = None

    def __enter__(self):
        if self.workers <= 1:
            _init_worker(self.settings)
            return map(tokenize_file, self.jobs)
        # fork while this process has a single thread (the CLI: no torch work has run, the
        # progress bar starts after the pool): workers start at once, without re-importing the
        # `hpctrain` entry point (and torch) as spawn would. With other threads, spawn is safe.
        single = threading.active_count() == 1 and sys.platform == "linux"
        ctx = multiprocessing.get_context("fork" if single else "spawn")
        self.pool = ctx.Pool(self.workers, initializer=_init_worker,
                             initargs=(self.settings,))
        # imap keeps input order; a small chunk keeps memory bounded to a few files per worker.
        return self.pool.imap(tokenize_file, self.jobs, chunksize=1)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def default_workers() -> int:
    """Worker processes when not given: the CPUs this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)
