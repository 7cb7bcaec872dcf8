"""Training throughput of the built-in model: tokens/s per GPU, MFU and peak memory.

Each variant is measured by `hpctrain.bench.model` (the code behind ``hpctrain bench model``): a
real ``hpctrain train`` run, the numbers read back from its per-rank metrics after the warm-up
windows (compilation, allocator growth), GPU energy per token through NVML.

    python benchmarks/train_throughput.py                      # every variant that fits the GPUs
    python benchmarks/train_throughput.py --only 1gpu-compile fsdp4-compile --steps 60

It prints a Markdown table (paste it into benchmarks/RESULTS.md with the card and the date) and
writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from hpctrain.bench.model import run_model_bench
from hpctrain.errors import HpctrainError
from hpctrain.plan.gpu import gpu_name
from hpctrain.runtime.env import MULTICAST_OFF

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: as_measured
from as_measured import pin  # noqa: E402

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
for _config, _, _overrides in VARIANTS.values():
    pin(_config, _overrides)  # the shapes the names and benchmarks/RESULTS.md describe



def run_variant(name: str, steps: int, out_dir: Path, timeout: float) -> dict:
    """Train one variant for ``steps`` steps with `hpctrain.bench.model` and return its row."""
    config, ranks, overrides = VARIANTS[name]
    from hpctrain.observe.power import sampler_factory

    factory, note = sampler_factory()
    if factory is None:
        print(note, flush=True)
    try:
        row, _ = run_model_bench(REPO / config, overrides, nproc=ranks,
                                 out=out_dir / f"bench-{name}", steps=steps, log_every=5,
                                 timeout=timeout, env={**os.environ, **MULTICAST_OFF},
                                 sampler_factory=factory)
    except HpctrainError as e:
        return {"variant": name, "error": str(e).splitlines()[0], "log_tail": str(e)[-3000:]}
    return {"variant": name, **row}


def markdown(rows: list[dict], device: str) -> str:
    """The rows as a Markdown table, with the device and date in the caption."""
    lines = [f"Device: {device}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}", "",
             "| variant | GPUs | tokens/s/GPU | MFU | HFU | peak mem GB | step s | data/step "
             "| J/token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | | {r['error']} | | | | | | |")
            continue
        jpt = "n/a" if r["joules_per_token"] is None else f"{r['joules_per_token']:.3g}"
        lines.append(f"| {r['variant']} | {r['ranks']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{pct(r['mfu_pct'])} | {pct(r['hfu_pct'])} | {r['peak_mem_gb']:.1f} | "
                     f"{r['step_time_s']:.3f} | {r['data_time_pct']:.2f}% | {jpt} |")
    return "\n".join(lines)


def pct(value: float | None) -> str:
    """'41.2%' or 'n/a'."""
    return "n/a" if value is None else f"{value:.1f}%"


def main() -> None:
    """Run the selected variants and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    # Counted and named through NVML: a CUDA context in this process would hold ~0.5 GB of
    # GPU 0 for every run it measures (and shift their numbers).
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("train_throughput needs CUDA GPUs; on CPU use `make demo` for a functional run")
    names = args.only or [n for n, (_, ranks, _) in VARIANTS.items() if ranks <= gpus]
    rows = []
    for name in names:
        print(f"== {name}", flush=True)
        row = run_variant(name, args.steps, args.out.resolve(), args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(rows, indent=1))
    print(markdown(rows, gpu_name(0)))


if __name__ == "__main__":
    main()
