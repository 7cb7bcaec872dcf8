"""The ``hpctrain data`` subcommands: prepare, merge, pack (files, images), synth-images,
train-tokenizer and verify shards.

    hpctrain data prepare corpus/ more/*.jsonl.zst --out data/corpus --workers 8
    hpctrain data prepare --stdlib --out runs/data/stdlib
    hpctrain data prepare chats.jsonl --format chat --tokenizer /models/Llama-3.2-1B --out data/chat
    hpctrain data prepare corpus/ --out data/corpus --task-count 16   # in a Slurm array task
    hpctrain data merge data/corpus                                   # after all 16 finished
    hpctrain data pack images/ --out data/images --shard-mb 256
    hpctrain data pack-images photos/ --out data/photos --val-fraction 0.02
    hpctrain data synth-images --out /tmp/synth --count 20000 --classes 100
    hpctrain data train-tokenizer corpus/ --vocab 32000 --out data/tokenizer.json
    hpctrain data verify data/corpus
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from hpctrain.data.chat import FORMATS
from hpctrain.errors import ConfigError
from hpctrain.numeric_args import count, real

FOLLOW_HELP = ("also read symbolic links that lead out of the inputs (by default they are "
               "skipped with a warning, so a link to /etc/shadow never ends up in shards)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``data`` and its subcommands on the top-level parser's ``sub``."""
    d = sub.add_parser("data", help="prepare and check token shards",
                       description="Prepare text into token shards (with a manifest and "
                       "checksums) once, offline; merge the parts of a Slurm array; pack "
                       "files into tar shards; train a tokenizer; verify shards.")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

    p = dsub.add_parser("prepare", help="tokenize text files into token shards",
                        description="Tokenize .txt, .jsonl, .jsonl.zst, .json.gz, .parquet and "
                        "plain files into shards with a manifest. Rerun the same command to "
                        "resume an interrupted run.")
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or globs")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--stdlib", action="store_true",
                   help="add this Python's standard-library .py files (the demo corpus)")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (byte-level, vocab 257), a HuggingFace tokenizer.json, or a "
                   "model folder holding one (its tokenizer_config.json gives the EOS token "
                   "and the chat template)")
    p.add_argument("--eos-token", default=None, help="EOS token of a tokenizer.json")
    p.add_argument("--text-field", default="text",
                   help="JSON field / Parquet column holding the text (default: text)")
    p.add_argument("--format", default="text", choices=FORMATS,
                   help="text: documents; chat ({messages: [{role, content}, ...]}) or "
                   "prompt-response ({prompt, response}): fine-tuning examples, with a loss "
                   "mask so only the responses are trained")
    p.add_argument("--messages-field", default="messages", help="--format chat: the field")
    p.add_argument("--prompt-field", default="prompt", help="--format prompt-response")
    p.add_argument("--response-field", default="response", help="--format prompt-response")
    p.add_argument("--system-field", default="system",
                   help="--format prompt-response: an optional system prompt field")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--shard-tokens", type=count(0, 1 << 40), default=0, help="tokens per shard")
    size.add_argument("--shard-mb", type=real(0, 1 << 20, open_min=True), default=256.0,
                      help="shard size in MiB of tokens (default 256)")
    p.add_argument("--workers", type=count(1, 4096), default=None,
                   help="tokenizer processes (default: the CPUs available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--follow-symlinks", action="store_true", help=FOLLOW_HELP)
    p.add_argument("--task-count", type=count(1, 1 << 20), default=None,
                   help="Slurm array mode: number of tasks; this task tokenizes its slice into "
                   "OUT/parts/, then `hpctrain data merge OUT` writes the shards")
    p.add_argument("--task-index", type=count(0, 1 << 20), default=None,
                   help="this task's index (default: $SLURM_ARRAY_TASK_ID - "
                   "$SLURM_ARRAY_TASK_MIN)")
    p.set_defaults(handler=_prepare)

    g = dsub.add_parser("merge", help="cut the parts of an array-mode prepare into shards",
                        description="After every `prepare --task-index I --task-count N` task "
                        "has finished: write the shards and manifest.json (byte-identical to a "
                        "single prepare over all inputs) and delete OUT/parts/.")
    g.add_argument("out", type=Path, metavar="OUT", help="the --out of the array tasks")
    g.add_argument("--keep-parts", action="store_true", help="keep OUT/parts/")
    g.set_defaults(handler=_merge)

    k = dsub.add_parser("pack", help="pack files grouped by basename into WebDataset tar shards",
                        description="Pack a directory's files, grouped by key (x.jpg + x.json = "
                        "sample x), into tar shards readable by WebDataset, with a manifest.")
    k.add_argument("src", type=Path, metavar="DIR", help="directory of files to pack")
    k.add_argument("--out", type=Path, required=True, help="output directory")
    k.add_argument("--shard-mb", type=real(0, 1 << 20, open_min=True), default=256.0,
                   help="target shard size in MiB (default 256)")
    k.add_argument("--follow-symlinks", action="store_true", help=FOLLOW_HELP)
    k.set_defaults(handler=_pack)

    i = dsub.add_parser("pack-images", help="pack an image folder or path,label table into "
                        "tar shards per split",
                        description="Pack images (ImageFolder CLASS/FILE, train/ and val/ "
                        "folders, or a .csv/.parquet/.jsonl table of path,label[,split]) into "
                        "WebDataset tar shards under OUT/train and OUT/val, with manifests "
                        "(classes, counts, checksums). Non-images and unreadable files are "
                        "skipped and named. Rerun the same command to resume.")
    i.add_argument("src", type=Path, metavar="SRC", help="image folder or table")
    i.add_argument("--out", type=Path, required=True, help="output directory")
    i.add_argument("--shard-mb", type=real(0, 1 << 20, open_min=True), default=1024.0,
                   help="target shard size in MiB (default 1024)")
    i.add_argument("--val-fraction", type=real(0, 1), default=0.0,
                   help="move this fraction of each class to the val split (default 0; "
                   "train/ and val/ folders or a split column give the splits instead)")
    i.add_argument("--seed", type=count(0, 1 << 62), default=0,
                   help="the shuffle of samples into shards and the val pick (default 0)")
    i.add_argument("--readers", type=count(1, 1024), default=8,
                   help="threads reading input files ahead (default 8; the output does not "
                   "depend on it)")
    i.add_argument("--no-progress", action="store_true", help="no progress bar")
    i.add_argument("--follow-symlinks", action="store_true", help=FOLLOW_HELP)
    i.set_defaults(handler=_pack_images)

    y = dsub.add_parser("synth-images", help="write synthetic JPEGs (ImageFolder layout)",
                        description="Write synthetic JPEGs of ImageNet-like size and quality "
                        "(500x375, quality 90, ~90 kB) for throughput measurements.")
    y.add_argument("--out", type=Path, required=True, help="output directory")
    y.add_argument("--count", type=count(1, 1 << 32), required=True, help="number of images")
    y.add_argument("--classes", type=count(1, 1 << 20), default=10,
                   help="class folders (default 10)")
    y.add_argument("--width", type=count(8, 1 << 15), default=500,
                   help="image width (default 500)")
    y.add_argument("--height", type=count(8, 1 << 15), default=375,
                   help="image height (default 375)")
    y.add_argument("--quality", type=count(1, 100), default=90, help="JPEG quality (default 90)")
    y.add_argument("--seed", type=count(0, 1 << 62), default=0,
                   help="image i depends on (seed, i) only (default 0)")
    y.add_argument("--workers", type=count(1, 4096), default=None,
                   help="processes (default: the CPUs available)")
    y.set_defaults(handler=_synth_images)

    t = dsub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json",
                        description="Train a byte-level BPE tokenizer (HuggingFace tokenizers) "
                        "on the same inputs prepare reads; use it with prepare --tokenizer.")
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    t.add_argument("--vocab", type=count(2, 1 << 31), required=True,
                   help="vocabulary size (EOS included)")
    t.add_argument("--out", type=Path, required=True, help="tokenizer.json to write")
    t.add_argument("--text-field", default="text", help="JSON field / Parquet column")
    t.add_argument("--eos-token", default="<|endoftext|>", help="special token ending documents")
    t.add_argument("--follow-symlinks", action="store_true", help=FOLLOW_HELP)
    t.set_defaults(handler=_train_tokenizer)

    v = dsub.add_parser("verify", help="check every shard's checksum against the manifest")
    v.add_argument("path", type=Path, help="a prepared or packed directory")
    v.set_defaults(handler=_verify)


def _prepare(args: argparse.Namespace) -> None:
    from hpctrain.data.chat import ExampleFields
    from hpctrain.data.prepare import PrepareSettings, default_workers, prepare
    from hpctrain.data.shards import load_manifest
    from hpctrain.data.stdlib_corpus import stdlib_files
    from hpctrain.data.tokenizer import TokenizerSpec, load_tokenizer, token_dtype

    inputs = [str(f) for f in stdlib_files()] if args.stdlib else []
    inputs += args.inputs
    if not inputs:
        raise ConfigError("no inputs: name files, directories or globs, or pass --stdlib",
                          hint="hpctrain data prepare corpus/*.jsonl --out data/corpus")
    tokenizer = args.tokenizer.removeprefix("hf:")
    spec = (TokenizerSpec() if tokenizer == "bytes"
            else TokenizerSpec("hf", tokenizer, args.eos_token))
    shard_tokens = args.shard_tokens
    if shard_tokens < 0 or args.shard_mb <= 0:
        raise ConfigError("--shard-tokens and --shard-mb must be positive")
    if not shard_tokens:
        itemsize = token_dtype(load_tokenizer(spec).vocab_size).itemsize
        shard_tokens = max(1, int(args.shard_mb * (1 << 20)) // itemsize)
    workers = args.workers or default_workers()
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be >= 1")
    t0 = time.perf_counter()
    settings = PrepareSettings(spec, args.text_field, shard_tokens, args.format,
                               ExampleFields(args.messages_field, args.prompt_field,
                                             args.response_field, args.system_field))
    if args.task_count is not None or args.task_index is not None:
        from hpctrain.data.prepare import prepare_task

        count, index = args.task_count, args.task_index
        if index is None and "SLURM_ARRAY_TASK_ID" in os.environ:
            index = int(os.environ["SLURM_ARRAY_TASK_ID"]) - int(
                os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        if count is None or index is None:
            raise ConfigError("array mode needs --task-count and --task-index (or "
                              "$SLURM_ARRAY_TASK_ID)",
                              hint="sbatch --array=0-15 ... hpctrain data prepare ... "
                              "--task-count 16")
        meta = prepare_task(inputs, args.out, settings, index, count, workers=workers,
                            progress=not args.no_progress, follow_symlinks=args.follow_symlinks)
        print(f"{meta}: task {index} of {count} done, {time.perf_counter() - t0:.1f}s; "
              f"when all are done: hpctrain data merge {args.out}")
        return
    path = prepare(inputs, args.out, settings, workers=workers, progress=not args.no_progress,
                   follow_symlinks=args.follow_symlinks)
    m = load_manifest(path.parent)
    m.verify()
    trained = (f", {sum(s['loss_tokens'] for s in m.shards):,} of them trained (responses)"
               if m.has_masks else "")
    print(f"{path.parent}: {len(m.shards)} shards, {m.num_tokens:,} tokens{trained} "
          f"({m.raw['dtype']}, vocab {m.vocab_size}), {sum(s['docs'] for s in m.shards):,} "
          f"documents, {time.perf_counter() - t0:.1f}s")


def _merge(args: argparse.Namespace) -> None:
    from hpctrain.data.prepare import merge
    from hpctrain.data.shards import load_manifest

    path = merge(args.out, keep_parts=args.keep_parts)
    m = load_manifest(path.parent)
    m.verify()
    print(f"{path.parent}: {len(m.shards)} shards, {m.num_tokens:,} tokens")


def _train_tokenizer(args: argparse.Namespace) -> None:
    from hpctrain.data.tokenizer import HFTokenizer, train_bpe

    t0 = time.perf_counter()
    path = train_bpe(args.inputs, args.out, args.vocab, text_field=args.text_field,
                     eos_token=args.eos_token, follow_symlinks=args.follow_symlinks)
    tok = HFTokenizer(str(path), args.eos_token)
    print(f"{path}: byte-level BPE, vocab {tok.vocab_size}, EOS {tok.eos_token!r} = {tok.eos_id}, "
          f"{time.perf_counter() - t0:.1f}s")


def _pack(args: argparse.Namespace) -> None:
    from hpctrain.data.tar_samples import pack, verify_tar

    if args.shard_mb <= 0:
        raise ConfigError(f"--shard-mb {args.shard_mb} must be positive")
    t0 = time.perf_counter()
    path = pack(args.src, args.out, max(1, int(args.shard_mb * (1 << 20))),
                follow_symlinks=args.follow_symlinks)
    raw = verify_tar(path.parent)
    print(f"{path.parent}: {len(raw['shards'])} tar shards, {raw['samples']:,} samples, "
          f"{sum(s['bytes'] for s in raw['shards']) / 1e6:,.1f} MB, "
          f"{time.perf_counter() - t0:.1f}s")


def _pack_images(args: argparse.Namespace) -> None:
    from hpctrain.data.images.pack import PackSettings, pack_images, verify_images

    t0 = time.perf_counter()
    settings = PackSettings(max(1, int(args.shard_mb * (1 << 20))), args.val_fraction, args.seed,
                            args.follow_symlinks)
    path = pack_images(args.src, args.out, settings, progress=not args.no_progress,
                       readers=args.readers)
    raw = verify_images(path.parent)
    splits = ", ".join(f"{name} {s['samples']:,} images in {s['shards']} shards "
                       f"({s['bytes'] / 1e6:,.1f} MB)" for name, s in raw["splits"].items())
    skipped = f", {len(raw['skipped'])} files skipped" if raw["skipped"] else ""
    print(f"{path.parent}: {len(raw['classes'])} classes, {splits}{skipped}, "
          f"{time.perf_counter() - t0:.1f}s")


def _synth_images(args: argparse.Namespace) -> None:
    from hpctrain.data.images.synthetic import write_synthetic_jpegs

    t0 = time.perf_counter()
    total = write_synthetic_jpegs(args.out, args.count, args.classes, seed=args.seed,
                                  size=(args.width, args.height), quality=args.quality,
                                  workers=args.workers)
    print(f"{args.out}: {args.count:,} JPEGs in {min(args.classes, args.count)} classes, "
          f"{total / args.count / 1e3:.1f} kB each, {time.perf_counter() - t0:.1f}s")


def _verify(args: argparse.Namespace) -> None:
    import json

    from hpctrain.data.images.reader import IMAGES_FORMAT
    from hpctrain.data.shards import load_manifest
    from hpctrain.data.tar_samples import TAR_FORMAT, verify_tar

    try:
        fmt = json.loads((args.path / "manifest.json").read_text()).get("format")
    except (OSError, ValueError):
        fmt = None
    if fmt == IMAGES_FORMAT:
        from hpctrain.data.images.pack import verify_images

        raw = verify_images(args.path)
        splits = ", ".join(f"{name} {s['samples']:,} images in {s['shards']} shards"
                           for name, s in raw["splits"].items())
        print(f"{args.path}: {len(raw['classes'])} classes, {splits}, checksums OK")
        return
    if fmt == TAR_FORMAT:
        raw = verify_tar(args.path)
        print(f"{args.path}: {len(raw['shards'])} tar shards, {raw['samples']:,} samples, "
              "checksums OK")
        return
    m = load_manifest(args.path)
    m.verify()
    print(f"{args.path}: {len(m.shards)} shards, {m.num_tokens:,} tokens, checksums OK")
