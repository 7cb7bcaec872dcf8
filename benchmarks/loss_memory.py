"""Peak memory and time of the loss: plain (whole logits) against chunked (``train.loss_chunks``).

Two measurements on one GPU, both for the `1b` shape (dim 2048, vocabulary 32,000):

- ``loss``: the output layer + cross entropy alone on 4 x 2048 tokens of bf16 hidden states,
  forward and backward, as FSDP computes it (bf16 weight): plain eager, plain with the loss
  compiled (what the trainer does under ``parallel.compile``), and chunked with 4, 8 and 16
  chunks. Peak = ``max_memory_allocated`` above what was allocated before, median time of 20.
- ``train``: whole training runs (``hpctrain.bench.model``, as ``benchmarks/train_throughput.py``)
  of ``configs/llama-1b.yaml`` with ``train.loss_chunks`` 0 and 8, compiled, micro-batch 4 and 8:
  tokens/s, step time and the run's peak memory.

    python benchmarks/loss_memory.py                 # both
    python benchmarks/loss_memory.py --only loss     # seconds
    python benchmarks/loss_memory.py --only train --steps 40

Prints Markdown tables (paste them into benchmarks/RESULTS.md with the card and date) and
writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from as_measured import AS_MEASURED  # benchmarks/: the llama configs' former values
from hpctrain.models.chunked_loss import chunked_linear_cross_entropy

REPO = Path(__file__).resolve().parents[1]
DIM, VOCAB, TOKENS = 2048, 32000, 4 * 2048


def _plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")


def _loss_variants() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                           torch.Tensor]]:
    variants = {"plain eager": _plain, "plain compiled": torch.compile(_plain)}
    for c in (4, 8, 16):
        variants[f"chunked {c}"] = (
            lambda h, w, t, c=c: chunked_linear_cross_entropy(h, w, t, c))
    return variants


def measure_loss(repeats: int = 20) -> list[dict]:
    """Peak extra memory (GB) and median forward+backward time (ms) of each loss variant."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, fn in _loss_variants().items():
        h = (torch.randn(TOKENS, DIM, device=dev, generator=g) * 0.02).bfloat16()
        w = (torch.randn(VOCAB, DIM, device=dev, generator=g) * 0.02).bfloat16()
        h.requires_grad_(True)
        w.requires_grad_(True)
        t = torch.randint(0, VOCAB, (TOKENS,), device=dev, generator=g)
        for _ in range(3):  # warm-up (compilation, allocator)
            fn(h, w, t).backward()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(h, w, t).backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            h.grad = w.grad = None
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
        rows.append({"variant": name, "peak_extra_gb": peak, "ms": statistics.median(times)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_train(steps: int, out: Path, timeout: float) -> list[dict]:
    """Whole 1b training runs with the plain and the chunked loss (one GPU, compiled)."""
    from hpctrain.bench.model import run_model_bench
    from hpctrain.errors import HpctrainError

    rows = []
    for mb in (4, 8):
        for chunks in (0, 8):
            name = f"1b mb{mb} loss_chunks={chunks}"
            overrides = [*AS_MEASURED["configs/llama-1b.yaml"], f"train.micro_batch={mb}",
                         f"train.loss_chunks={chunks}"]
            try:
                row, _ = run_model_bench(REPO / "configs/llama-1b.yaml", overrides, nproc=1,
                                         out=out / f"loss-mb{mb}-c{chunks}", steps=steps,
                                         log_every=5, timeout=timeout, env=dict(os.environ))
            except HpctrainError as e:
                row = {"error": str(e).splitlines()[0]}
            rows.append({"variant": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(loss_rows: list[dict], train_rows: list[dict]) -> str:
    """Both tables, captioned with the card, torch version and date."""
    lines = [f"Device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
             f"{time.strftime('%Y-%m-%d')}", ""]
    if loss_rows:
        lines += [f"Loss alone, {TOKENS} tokens x vocabulary {VOCAB}, dim {DIM}, bf16:", "",
                  "| loss | peak extra GB | fwd+bwd ms |", "|---|---|---|"]
        lines += [f"| {r['variant']} | {r['peak_extra_gb']:.2f} | {r['ms']:.2f} |"
                  for r in loss_rows]
        lines.append("")
    if train_rows:
        lines += ["| run | tokens/s | step s | peak mem GB |", "|---|---|---|---|"]
        for r in train_rows:
            if "error" in r:
                lines.append(f"| {r['variant']} | {r['error']} | | |")
            else:
                lines.append(f"| {r['variant']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                             f"{r['step_time_s']:.3f} | {r['peak_mem_gb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    """Run the selected measurements and print the tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["loss", "train"], help="one of the two measurements")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("loss_memory measures GPU memory: it needs a CUDA GPU")
    out = args.out.resolve()
    loss_rows = measure_loss() if args.only in (None, "loss") else []
    train_rows = measure_train(args.steps, out, args.timeout) if args.only in (None, "train") \
        else []
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_memory.json").write_text(json.dumps({"loss": loss_rows, "train": train_rows},
                                                     indent=1))
    print(markdown(loss_rows, train_rows))


if __name__ == "__main__":
    main()
