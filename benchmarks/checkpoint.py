"""Checkpoint cost and cross-layout resume for the `1b` model, through real `hpctrain train` runs.

Measures, per layout (1 GPU, FSDP on 4 GPUs): synchronous save time, async stall (how long the
loop is blocked), background write time, bytes written, write bandwidth and load time; then saves
with FSDP on 4 GPUs and resumes with FSDP on 2 GPUs and on 1 GPU (same global batch through
gradient accumulation) and compares the first loss after the resume with the uninterrupted run.

    python benchmarks/checkpoint.py --out runs/bench-ckpt          # needs 4 GPUs for all parts

Numbers come from the runs' metrics events (`checkpoint`, `checkpoint_stall`,
`checkpoint_load`); results go to `<out>/checkpoint.json` and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from hpctrain.bench.common import run_command
from hpctrain.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
# Short runs: compile off (it does not change what is saved), stdlib data, log every step.
BASE = ["parallel.compile=false", "metrics.log_every=1", "metrics.progress=false",
        "run.suffix=none", "data.source=stdlib", "data.max_bytes=20000000",
        "optim.schedule=constant", "optim.warmup_steps=2"]
# --cpu-smoke: the same protocol with the tiny model on CPU ranks, to check the script itself.
CONFIG = {"gpu": ["configs/llama-1b.yaml"],
          "cpu": ["configs/demo.yaml", "run.device=cpu", "train.precision=fp32",
                  "data.seq_len=64", "train.micro_batch=2"]}
MODE = "gpu"


def train(out: Path, name: str, ranks: int, *overrides: str, fresh: bool = True) -> Path:
    """Run `hpctrain train` and return its run directory; raise with the log tail on failure."""
    run_dir = out / name
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpctrain", "train", *CONFIG[MODE], *BASE, f"run.out_dir={out}",
           f"run.name={name}", *overrides]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    print("$", " ".join(cmd[2:]), flush=True)
    # run_command kills the launcher and its ranks on timeout (they live in their own sessions).
    code, tail, _ = run_command(cmd, timeout=900, env={**os.environ, **MULTICAST_OFF}, cwd=REPO)
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}):\n{tail}")
    return run_dir


def events(run_dir: Path, kind: str) -> list[dict]:
    """Metrics event lines of one kind from rank 0."""
    return [r for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl")
            if r.get("event") == kind]


def loss_at(run_dir: Path, step: int) -> float:
    """The global loss logged at ``step`` (the last line for that step: after any resume)."""
    rows = [r for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl")
            if "loss" in r and r["step"] == step]
    return rows[-1]["loss"]


def cost(out: Path, label: str, ranks: int, extra: list[str]) -> dict:
    """Sync and async save cost and load time for one layout."""
    steps = ["train.steps=12", "checkpoint.every=4", "checkpoint.keep_last=1", *extra]
    sync = train(out, f"ckpt-sync-{label}", ranks, *steps, "checkpoint.async_save=false")
    asyn = train(out, f"ckpt-async-{label}", ranks, *steps, "checkpoint.async_save=true")
    # Resume the sync run for one more step to time the load.
    train(out, f"ckpt-sync-{label}", ranks, "train.steps=13", "checkpoint.interval=none",
          "checkpoint.save_at_end=false", *extra, fresh=False)
    sync_saves = events(sync, "checkpoint")
    stalls = [e["stall_s"] for e in events(asyn, "checkpoint_stall")]
    writes = events(asyn, "checkpoint")
    return {
        "layout": label,
        "ranks": ranks,
        "sync_save_s": statistics.median(e["write_s"] for e in sync_saves),
        "async_stall_s": statistics.median(stalls),
        "async_write_s": statistics.median(e["write_s"] for e in writes),
        "bytes": sync_saves[-1]["bytes"],
        "write_gb_per_s": statistics.median(e["gb_per_s"] for e in sync_saves),
        "load_s": events(sync, "checkpoint_load")[-1]["load_s"],
    }


def reshard(out: Path) -> dict:
    """Save with FSDP on 4 ranks at step 6; resume on 4 (FSDP), 2 (FSDP) and 1 GPU."""
    first = ["train.steps=6", "checkpoint.interval=none", "parallel.strategy=fsdp",
             "train.micro_batch=2"]
    src = train(out, "reshard-src", 4, *first)
    ckpt = src / "checkpoints" / "step-00000006"
    layouts = {
        "fsdp4": (4, ["parallel.strategy=fsdp", "train.micro_batch=2"]),
        "fsdp2": (2, ["parallel.strategy=fsdp", "train.micro_batch=2", "train.grad_accum=2"]),
        "1gpu": (1, ["parallel.strategy=none", "train.micro_batch=2", "train.grad_accum=4"]),
    }
    losses = {}
    for name, (ranks, extra) in layouts.items():
        run = train(out, f"reshard-{name}", ranks, "train.steps=7", "checkpoint.interval=none",
                    "checkpoint.save_at_end=false", f"checkpoint.resume={ckpt}", *extra)
        losses[name] = loss_at(run, 7)
    ref = losses["fsdp4"]
    return {"step7_loss": losses,
            "max_rel_diff": max(abs(v - ref) / abs(ref) for v in losses.values())}


def main() -> None:
    """Run the parts that fit the visible GPUs and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-ckpt"))
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the protocol on CPU ranks with the tiny model (checks the script)")
    args = p.parse_args()
    global MODE
    MODE = "cpu" if args.cpu_smoke else "gpu"
    if MODE == "gpu" and not torch.cuda.is_available():
        sys.exit("benchmarks/checkpoint.py needs CUDA GPUs (or --cpu-smoke)")
    out = args.out.resolve()
    gpus = torch.cuda.device_count() if MODE == "gpu" else 4
    rows = [cost(out, "1gpu", 1, [])]
    if gpus >= 4:
        rows.append(cost(out, "fsdp4", 4, ["parallel.strategy=fsdp"]))
    device = torch.cuda.get_device_name(0) if MODE == "gpu" else "cpu (smoke)"
    result = {"device": device, "date": time.strftime("%Y-%m-%d"),
              "cost": rows, "reshard": reshard(out) if gpus >= 4 else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.json").write_text(json.dumps(result, indent=1))
    print(f"Device: {result['device']}; torch {torch.__version__}; {result['date']}\n")
    print("| layout | bytes | sync save s | write GB/s | async stall s | async write s | "
          "stall/sync | load s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['bytes'] / 1e9:.2f} GB | {r['sync_save_s']:.2f} | "
              f"{r['write_gb_per_s']:.2f} | {r['async_stall_s']:.3f} | {r['async_write_s']:.2f} "
              f"| {r['async_stall_s'] / r['sync_save_s']:.3f} | {r['load_s']:.2f} |")
    if result["reshard"]:
        print("\nresume of an FSDP-4 checkpoint, loss at the next step:",
              json.dumps(result["reshard"]))


if __name__ == "__main__":
    main()
