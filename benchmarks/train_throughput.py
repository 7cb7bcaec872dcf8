"""Training throughput of the built-in model: tokens/s per GPU, MFU and peak memory.

Each variant is a real ``hpctrain train`` run (the same CLI a user types); the numbers are read
back from the run's per-rank metrics, skipping the warm-up steps (compilation, allocator growth).

    python benchmarks/train_throughput.py                      # every variant that fits the GPUs
    python benchmarks/train_throughput.py --only 1gpu-compile fsdp4-compile --steps 60

It prints a Markdown table (paste it into benchmarks/RESULTS.md with the card and the date) and
writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hpctrain.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]

# name -> (config, ranks, overrides)
VARIANTS: dict[str, tuple[str, int, list[str]]] = {
    "1gpu-eager": ("configs/llama-1b.yaml", 1, ["parallel.compile=false"]),
    "1gpu-compile": ("configs/llama-1b.yaml", 1, []),
    "1gpu-compile-mb8": ("configs/llama-1b.yaml", 1, ["train.micro_batch=8"]),
    "fsdp4-compile": ("configs/llama-1b.yaml", 4, ["parallel.strategy=fsdp"]),
    "fsdp4-compile-zero2": ("configs/llama-1b.yaml", 4,
                            ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false"]),
    "ddp4-compile": ("configs/llama-1b.yaml", 4, ["parallel.strategy=ddp"]),
    "8b-fsdp4-ac": ("configs/llama-8b-fsdp.yaml", 4, []),
}

# NVLink multicast stays off on shared machines (it can take a host's GPUs out of service).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def run_variant(name: str, steps: int, out_dir: Path, timeout: float) -> dict:
    """Train one variant for ``steps`` steps and summarise its metrics."""
    config, ranks, overrides = VARIANTS[name]
    run_name = f"bench-{name}"
    shutil.rmtree(out_dir / run_name, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpctrain", "train", config, *overrides,
           f"train.steps={steps}", "metrics.log_every=5", "metrics.progress=false",
           f"run.out_dir={out_dir}", f"run.name={run_name}", "run.suffix=none"]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **MULTICAST_OFF}, timeout=timeout,
                          capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"variant": name, "error": f"exit {proc.returncode}", "log_tail": tail}
    return summarise(name, out_dir / run_name, ranks, steps, wall, " ".join(cmd[2:]))


def summarise(name: str, run_dir: Path, ranks: int, steps: int, wall: float, cmd: str) -> dict:
    """Median over the windows after warm-up (the first 40% of steps), averaged over ranks."""
    warm = int(steps * 0.4)
    per_rank = []
    for rank in range(ranks):
        rows = [r for r in read_metrics(run_dir / "metrics" / f"rank-{rank:03d}.jsonl")
                if "tokens_per_s" in r and r["step"] > warm]  # skip event lines
        per_rank.append(rows)
    tok = statistics.mean(statistics.median(r["tokens_per_s"] for r in rows) for rows in per_rank)
    mfu_vals = [r["mfu"] for rows in per_rank for r in rows if r["mfu"] is not None]
    step_t = statistics.median(r["step_time_s"] for rows in per_rank for r in rows)
    data_t = statistics.median(r["data_time_s"] for rows in per_rank for r in rows)
    return {
        "variant": name,
        "ranks": ranks,
        "tokens_per_s_per_gpu": tok,
        "mfu": statistics.median(mfu_vals) if mfu_vals else None,
        "peak_mem_gb": max(r["mem_gb"] for rows in per_rank for r in rows),
        "step_time_s": step_t,
        "data_time_frac": data_t / step_t,
        "final_loss": per_rank[0][-1]["loss"],
        "wall_s": wall,
        "command": cmd,
    }


def markdown(rows: list[dict], device: str) -> str:
    """The rows as a Markdown table, with the device and date in the caption."""
    lines = [f"Device: {device}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}", "",
             "| variant | GPUs | tokens/s/GPU | MFU | peak mem GB | step s | data/step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | | {r['error']} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['variant']} | {r['ranks']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{mfu} | {r['peak_mem_gb']:.1f} | {r['step_time_s']:.3f} | "
                     f"{100 * r['data_time_frac']:.2f}% |")
    return "\n".join(lines)


def main() -> None:
    """Run the selected variants and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_throughput needs CUDA GPUs; on CPU use `make demo` for a functional run")
    gpus = torch.cuda.device_count()
    names = args.only or [n for n, (_, ranks, _) in VARIANTS.items() if ranks <= gpus]
    rows = []
    for name in names:
        print(f"== {name}", flush=True)
        row = run_variant(name, args.steps, args.out.resolve(), args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(rows, indent=1))
    print(markdown(rows, torch.cuda.get_device_name(0)))


if __name__ == "__main__":
    main()
