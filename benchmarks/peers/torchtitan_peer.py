"""torchtitan 0.2.2, the peer, trained offline on the shapes and layouts of hpctrain's benchmarks.

    python benchmarks/peers/torchtitan_peer.py --size 1b --gpus 2 --dp-shard 2 --steps 60
    python benchmarks/peers/torchtitan_peer.py --size 8b --gpus 2 --ac full --local-batch 2
    python benchmarks/peers/torchtitan_peer.py --size 1b --gpus 2 --tp 2 --dtype bfloat16

torchtitan and what it needs beyond the GPU image (datasets, torchdata, tyro, ...) travel as
wheels: `benchmarks/peers/README.md` says which and how. This script builds what an offline
torchtitan run needs in a work folder (a small byte-level BPE `tokenizer.json`, a JSON-lines
dataset of random words, the datasets cache built once before the ranks start, and a module that
registers the `1b` flavor), starts `torchrun -m torchtitan.train`, and reads its log:
tokens/s per GPU (torchtitan's `tps` is already per GPU: tokens over time x non-data-parallel
degree), memory, and MFU recomputed with hpctrain's convention, so both sides are compared on one
definition (6·(N − V·D) + 12·L·D·T FLOPs per token against the datasheet peak).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpctrain.runtime.env import MULTICAST_OFF

# torchtitan's flavors for our sizes; `1b` is registered by the module written below.
FLAVORS = {"1b": "1b", "8b": "8B"}
# torchtitan's names for hpctrain's pipeline schedules (parallel.pp_schedule).
PEER_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                  "interleaved_zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
# The 1b shape of hpctrain's `models/sizes.py` (TinyLlama), in torchtitan's argument names.
_FLAVOR_MODULE = '''\
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

llama3_args["1b"] = TransformerModelArgs(
    dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, multiple_of=256,
    ffn_dim_multiplier=None, rope_theta=10000)
'''
_LINE = re.compile(r"step:\s*(\d+).*?loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?"
                   r"tps:\s*([\d,]+).*?tflops:\s*([\d,.]+).*?mfu:\s*([\d.]+)%")


@dataclass
class PeerRun:
    """One torchtitan run's settings; `argv` turns them into its command line."""

    size: str = "1b"
    gpus: int = 1
    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    local_batch: int = 4
    seq_len: int = 2048
    steps: int = 60
    log_freq: int = 5
    compile: bool = True
    ac: str = "none"
    dtype: str = "float32"
    extra: list[str] = field(default_factory=list)

    def argv(self, work: Path) -> list[str]:
        """The torchrun command line of this run."""
        a = [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={self.gpus}", "-m", "torchtitan.train",
             "--model.name", "llama3", "--model.flavor", FLAVORS[self.size],
             "--model.hf_assets_path", str(work / "assets"),
             "--experimental.custom_import", "hpctrain_peer_flavors",
             "--training.dataset", "c4_test", "--training.dataset_path", str(work / "data"),
             "--training.local_batch_size", str(self.local_batch),
             "--training.seq_len", str(self.seq_len), "--training.steps", str(self.steps),
             "--training.dtype", self.dtype,
             "--metrics.log_freq", str(self.log_freq),
             "--activation_checkpoint.mode", self.ac,
             "--compile.enable" if self.compile else "--compile.no-enable",
             "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
             "--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
             "--parallelism.tensor_parallel_degree", str(self.tp),
             "--parallelism.pipeline_parallel_degree", str(self.pp),
             "--checkpoint.no-enable", "--validation.no-enable",
             "--job.dump_folder", str(work / "outputs")]
        if self.pp > 1:
            a += ["--parallelism.pipeline_parallel_schedule", self.pp_schedule,
                  "--parallelism.pipeline_parallel_microbatch_size", str(self.pp_microbatch_size)]
        return a + self.extra


def prepare_work_dir(work: Path, *, seed: int = 0, megabytes: float = 8) -> None:
    """Tokenizer, dataset, datasets cache and flavor module: what an offline run needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    work.mkdir(parents=True, exist_ok=True)
    (work / "hpctrain_peer_flavors.py").write_text(_FLAVOR_MODULE)
    data = work / "data"
    data.mkdir(exist_ok=True)
    text_file = data / "data.json"
    if not text_file.exists():
        # Random words: throughput does not depend on the text, only on the shapes.
        rng = random.Random(seed)
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(5000)]
        lines, size = [], 0
        while size < megabytes * 1e6:
            doc = " ".join(rng.choice(words) for _ in range(400))
            lines.append(json.dumps({"text": doc}))
            size += len(doc)
        text_file.write_text("\n".join(lines) + "\n")
    assets = work / "assets"
    assets.mkdir(exist_ok=True)
    if not (assets / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|begin_of_text|>",
                                                                       "<|end_of_text|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        sample = [json.loads(line)["text"] for line in text_file.read_text().splitlines()[:200]]
        tok.train_from_iterator(sample, trainer)
        tok.save(str(assets / "tokenizer.json"))
        (assets / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
            "add_bos_token": True, "add_eos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast"}))
    # Built once here: ranks that each build the cache race on it.
    from datasets import load_dataset

    load_dataset(str(data), split="train")


def run_peer(run: PeerRun, work: Path, *, timeout: float = 900, warmup_steps: int = 20
             ) -> dict:
    """Train with torchtitan and return its row (median over windows after ``warmup_steps``)."""
    prepare_work_dir(work)
    env = {**os.environ, **MULTICAST_OFF, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf-cache"),
           "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(run.argv(work), env=env, capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout + proc.stderr
    (work / f"log-{run.size}-{run.gpus}-tp{run.tp}-pp{run.pp}.txt").write_text(log)
    windows = parse_windows(log)
    row = {"peer": "torchtitan 0.2.2", **asdict(run), "returncode": proc.returncode}
    kept = [w for w in windows if w["step"] > warmup_steps]
    if proc.returncode != 0 or not kept:
        return {**row, "error": f"exit {proc.returncode}, {len(windows)} windows",
                "log_tail": log[-3000:]}
    tps = statistics.median(w["tps"] for w in kept)
    return {**row, "tokens_per_s_per_gpu": tps, "windows_tps": [w["tps"] for w in kept],
            "peak_mem_gib": max(w["mem_gib"] for w in kept),
            "final_loss": kept[-1]["loss"], "torchtitan_mfu_pct": statistics.median(
                w["mfu"] for w in kept),
            "mfu_pct": hpctrain_mfu(run.size, run.seq_len, tps)}


def parse_windows(log: str) -> list[dict]:
    """torchtitan's per-window lines (colour codes removed), one dict per logged step."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    rows = []
    for m in _LINE.finditer(plain):
        rows.append({"step": int(m[1]), "loss": float(m[2]), "mem_gib": float(m[3]),
                     "tps": float(m[4].replace(",", "")), "mfu": float(m[6])})
    return rows


def hpctrain_mfu(size: str, seq_len: int, tokens_per_s: float) -> float | None:
    """MFU (%) of a torchtitan rate by hpctrain's convention, on this machine's GPU 0 (named
    through NVML: compare.py's process, which runs both sides, must hold no CUDA context)."""
    import torch

    from hpctrain.models import flops_per_token
    from hpctrain.models.config import ModelConfig
    from hpctrain.observe.peaks import peak_tflops
    from hpctrain.plan.gpu import gpu_name

    if torch.cuda.device_count() == 0:
        return None
    peak = peak_tflops(gpu_name(0), "bf16")
    if peak is None:
        return None
    args = ModelConfig(size=size).resolve()
    return 100 * tokens_per_s * flops_per_token(args, seq_len) / (peak * 1e12)


def main() -> None:
    """Run one torchtitan configuration and print its row as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(FLAVORS), default="1b")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--pp-schedule", default="1F1B")
    p.add_argument("--pp-microbatch-size", type=int, default=1)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32: fp32 master weights (torchtitan's default); bfloat16: pure bf16")
    p.add_argument("--work", type=Path, default=Path("runs/peers/torchtitan"))
    args = p.parse_args()
    run = PeerRun(size=args.size, gpus=args.gpus, dp_shard=args.dp_shard,
                  dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp,
                  pp_schedule=args.pp_schedule, pp_microbatch_size=args.pp_microbatch_size,
                  local_batch=args.local_batch, seq_len=args.seq_len, steps=args.steps,
                  compile=not args.no_compile, ac=args.ac, dtype=args.dtype)
    row = run_peer(run, args.work.resolve())
    print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}))
    if "error" in row:
        print(row["log_tail"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
