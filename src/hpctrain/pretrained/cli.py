"""The ``import``, ``export``, ``generate`` and ``eval`` subcommands.

    hpctrain import hf /models/Llama-3.2-1B --out ckpt/llama-3.2-1b
    hpctrain export hf runs/finetune [--step N] --out exported/llama-ft [--dtype bf16]
    hpctrain generate runs/finetune --prompt "Hello" [--chat] [--temperature 0.8 --top-p 0.95]
    hpctrain eval runs/finetune [--data data/chat --val-fraction 0.05]

A model is named as `hpctrain.pretrained.source` says: a run directory, a checkpoint
directory, or hf:DIR. All four work in one process, on the CPU or one GPU (``--device``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpctrain.errors import ConfigError
from hpctrain.numeric_args import count, real

_SOURCE_HELP = ("a run directory (its latest checkpoint, or --step), a checkpoint directory, "
                "or hf:DIR (a Hugging Face model folder)")
_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``import hf``."""
    p = sub.add_parser("import", help="convert a Hugging Face model into an hpctrain checkpoint",
                       description="Convert once; then model.init_from: CKPT loads it into any "
                       "layout (model.init_from: hf:DIR reads the folder directly instead).")
    fmt = p.add_subparsers(dest="import_format", required=True, metavar="FORMAT")
    h = fmt.add_parser("hf", help="a Hugging Face folder: config.json + *.safetensors")
    h.add_argument("folder", type=lambda text: Path(text.removeprefix("hf:")), metavar="DIR",
                   help="the model folder (an hf: prefix is allowed)")
    h.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    h.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto",
                   help="weights' dtype in the checkpoint (auto: the folder's own)")
    h.add_argument("--family", default=None, metavar="NAME",
                   help="the model family to import into (default: the one its architecture "
                   "names; e.g. qwen for a Qwen2 folder, which otherwise becomes a llama)")
    h.set_defaults(handler=_import)


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export hf``."""
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder")
    fmt = p.add_subparsers(dest="export_format", required=True, metavar="FORMAT")
    h = fmt.add_parser("hf", help="config.json, safetensors shards (+ index), and the tokenizer "
                       "files the model knows",
                       description="Any training layout exports: tensors are read one at a "
                       "time from the DCP shards and streamed into the safetensors files.")
    h.add_argument("source", metavar="RUN", help=_SOURCE_HELP)
    h.add_argument("--step", type=count(0), default=None, help="a run's checkpoint at this step")
    h.add_argument("--out", type=Path, required=True, help="folder to create")
    h.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16",
                   help="dtype of the exported weights")
    h.add_argument("--max-shard-gb", type=real(0, 1e6, open_min=True), default=5.0,
                   help="largest safetensors file (default 5 GB, as Hugging Face writes)")
    h.set_defaults(handler=_export)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``generate``."""
    p = sub.add_parser("generate", help="continue a prompt with a model (greedy or sampled)",
                       description="Sample from a model with a KV cache, on the CPU or one GPU.")
    p.add_argument("source", metavar="RUN|hf:DIR", help=_SOURCE_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--step", type=count(0), default=None, help="a run's checkpoint at this step")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the model's chat template")
    p.add_argument("--max-new-tokens", type=count(1, 1 << 20), default=64,
                   help="stop after this many new tokens (or at an end-of-reply token)")
    p.add_argument("--temperature", type=real(0, 1e3), default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=count(0, 1 << 31), default=0,
                   help="keep the k most likely (0: all)")
    p.add_argument("--top-p", type=real(0, 1, open_min=True), default=1.0,
                   help="nucleus sampling threshold")
    p.add_argument("--seed", type=count(0, 2**63 - 1), default=0, help="of the sampling")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json or model folder, if the model knows none")
    p.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="the token that ends a reply, if neither the tokenizer nor the model "
                   "(eos_token_id in generation_config.json / config.json) names it")
    _device_args(p)
    p.set_defaults(handler=_generate)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``eval``."""
    p = sub.add_parser("eval", help="perplexity of a model on a prepared split",
                       description="Mean loss and perplexity over the targets that count "
                       "(only responses, for fine-tuning data). A run's own data settings are "
                       "the defaults.")
    p.add_argument("source", metavar="RUN", help=_SOURCE_HELP)
    p.add_argument("--step", type=count(0), default=None, help="a run's checkpoint at this step")
    p.add_argument("--data", default=None, help="a prepared directory (default: the run's)")
    p.add_argument("--split", choices=("val", "train", "all"), default="val",
                   help="which part of the data to evaluate")
    p.add_argument("--val-fraction", type=real(0, 1), default=None,
                   help="held-out share of each shard's windows (default: the run's)")
    p.add_argument("--seq-len", type=count(1, 1 << 24), default=None,
                   help="default: the run's data.seq_len")
    p.add_argument("--micro-batch", type=count(1, 1 << 20), default=8,
                   help="samples per forward pass")
    p.add_argument("--max-samples", type=count(1), default=None,
                   help="evaluate at most this many samples (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _device_args(p)
    p.set_defaults(handler=_eval)


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype of the weights")


def run(args: argparse.Namespace) -> None:
    """Dispatch to the subcommand's handler."""
    args.handler(args)


def _import(args: argparse.Namespace) -> None:
    from hpctrain.models.hf_weights import read_hf_config
    from hpctrain.pretrained.import_hf import import_hf

    dtype = args.dtype
    if dtype == "auto":
        raw = read_hf_config(args.folder)
        dtype = _DTYPE_NAMES.get(raw.get("dtype") or raw.get("torch_dtype"), "bf16")
    t0 = time.perf_counter()
    out = import_hf(args.folder, args.out, dtype, family=args.family)
    print(f"{out}: checkpoint of {args.folder} ({dtype}), {time.perf_counter() - t0:.1f}s; "
          f"train from it with model.init_from={out}")


def _export(args: argparse.Namespace) -> None:
    from hpctrain.data.tokenizer import TOKENIZER_JSON
    from hpctrain.pretrained.export_hf import export_hf, missing_tokenizer
    from hpctrain.pretrained.source import resolve_source

    if not args.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb {args.max_shard_gb} must be positive")
    source = resolve_source(args.source, args.step)
    t0 = time.perf_counter()
    out = export_hf(source, args.out, args.dtype, int(args.max_shard_gb * 1e9))
    files = sorted(p.name for p in out.iterdir())
    print(f"{out}: {source.label} as a Hugging Face model ({args.dtype}), "
          f"{time.perf_counter() - t0:.1f}s: {', '.join(files)}")
    if TOKENIZER_JSON not in files and "tokenizer.model" not in files:
        print(f"note: no tokenizer files: {missing_tokenizer(source)}")


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no GPU is visible", hint="use --device cpu")
    return torch.device(name)


def _load(args: argparse.Namespace):
    import torch

    from hpctrain.pretrained.source import resolve_source
    from hpctrain.pretrained.weights import load_model

    source = resolve_source(args.source, args.step)
    model = load_model(source.weights, _device(args.device), source.origin.args)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    return source, model


def _generate(args: argparse.Namespace) -> None:
    import torch

    from hpctrain.data.chat import chat_prompt
    from hpctrain.models.generate import generate
    from hpctrain.pretrained.source import model_tokenizer

    for flag, value, ok in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens > 0),
                            ("--temperature", args.temperature, args.temperature >= 0),
                            ("--top-k", args.top_k, args.top_k >= 0),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1)):
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range")
    source, model = _load(args)
    tok = model_tokenizer(source, args.tokenizer, args.eos_token)
    prompt = (chat_prompt(tok.tokenizer, tok.template, args.prompt) if args.chat
              else tok.tokenizer.encode_prompt(args.prompt))
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(args.seed)
    ids = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, stop_ids=tok.stop_ids,
                   generator=generator)
    sys.stdout.write(tok.tokenizer.decode(ids) + "\n")


def _eval(args: argparse.Namespace) -> None:
    from hpctrain.data.shard_dataset import ShardTokens
    from hpctrain.data.shards import check_token_ids, load_manifest
    from hpctrain.pretrained.evaluate import perplexity
    from hpctrain.pretrained.source import resolve_source, run_data_section

    source = resolve_source(args.source, args.step)
    data = run_data_section(source.run) if source.run is not None else {}
    path = args.data or (data.get("path") if data.get("source") == "shards" else None)
    if not path:
        raise ConfigError("no prepared data to evaluate on",
                          hint="name a directory written by `hpctrain data prepare` with --data")
    fraction = args.val_fraction if args.val_fraction is not None else float(
        data.get("val_fraction") or 0.0)
    seq_len = args.seq_len or int(data.get("seq_len") or min(source.origin.args.max_seq_len,
                                                             2048))
    if args.split == "val" and fraction <= 0:
        raise ConfigError("--split val needs a held-out share (--val-fraction > 0)",
                          hint="set --val-fraction, or evaluate --split all")
    if not 0 <= fraction < 1 or args.micro_batch < 1 or seq_len < 2:
        raise ConfigError("--val-fraction must be in [0, 1), --micro-batch >= 1, "
                          "--seq-len >= 2")
    manifest = load_manifest(path)
    check_token_ids(manifest, source.origin.args.vocab_size)
    split = "train" if args.split == "all" else args.split
    dataset = ShardTokens(manifest, seq_len, split=split,
                          val_fraction=0.0 if args.split == "all" else fraction,
                          vocab_size=source.origin.args.vocab_size)
    if len(dataset) == 0:
        raise ConfigError(f"the {args.split} split of {path} holds no windows of {seq_len} "
                          "tokens", hint="shorten --seq-len or raise --val-fraction")
    _, model = _load(args)
    result = perplexity(model, dataset, args.micro_batch, args.max_samples)
    result.update(source=source.label, data=str(path), split=args.split, seq_len=seq_len)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{source.label} on {path} ({args.split}, {result['samples']} samples of "
              f"{seq_len}): loss {result['loss']:.4f}, perplexity {result['ppl']:.2f} over "
              f"{result['tokens']:,} tokens")
