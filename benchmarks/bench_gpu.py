"""Issue 5's numbers on the device machine: GEMM vs plain torch.matmul, all_reduce busbw on 2 and
4 GPUs, `bench model` (tokens/s, MFU, HFU, J/token) of real training runs with `plan memory`
against their measured peak, the roofline of the GEMM/copy results, and `bench node`.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python3 benchmarks/bench_gpu.py --out runs/bench-gpu
    python3 benchmarks/bench_gpu.py --dry-run          # print the commands and the estimates

Every step is the CLI a user runs (``python -m hpctrain bench ...``), started with NVLink
multicast off. GPU power (J/token) is read through NVML; where NVML cannot start those columns
say n/a and the rest runs. Prints Markdown for benchmarks/RESULTS.md and writes summary.json.
269 s on 4 H200 (torch 2.11); ``--skip model`` leaves out the five training runs (about 3 of
those minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from as_measured import pin  # noqa: E402  (benchmarks/, the script's own folder)
from hpctrain.runtime.env import MULTICAST_OFF  # noqa: E402

# name -> (config, ranks, train overrides, plan memory options)
MEMORY_VARIANTS: dict[str, tuple[str, int, list[str], dict]] = {
    "1b-1gpu": ("configs/llama-1b.yaml", 1, [],
                dict(model="1b", strategy="none", gpus=1, micro_batch=4)),
    "1b-fsdp4": ("configs/llama-1b.yaml", 4, ["parallel.strategy=fsdp"],
                 dict(model="1b", strategy="fsdp", gpus=4, micro_batch=4)),
    "1b-fsdp4-ac": ("configs/llama-1b.yaml", 4,
                    ["parallel.strategy=fsdp", "parallel.activation_checkpointing=full"],
                    dict(model="1b", strategy="fsdp", gpus=4, micro_batch=4, ac="full")),
    "1b-ddp4": ("configs/llama-1b.yaml", 4, ["parallel.strategy=ddp"],
                dict(model="1b", strategy="ddp", gpus=4, micro_batch=4)),
    "8b-fsdp4-ac": ("configs/llama-8b-fsdp.yaml", 4, [],
                    dict(model="8b", strategy="fsdp", gpus=4, micro_batch=2, ac="full")),
}
for _config, _, _overrides, _ in MEMORY_VARIANTS.values():
    pin(_config, _overrides)  # the shapes the names and the plan memory options describe


def env() -> dict[str, str]:
    """The environment of every child: multicast off, this checkout importable."""
    out = {**os.environ, **MULTICAST_OFF}
    out["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{out.get('PYTHONPATH', '')}"
    return out


def run(cmd: list[str], dry: bool, timeout: float = 300) -> subprocess.CompletedProcess | None:
    """Run `cmd` in the repository root (or only print it with --dry-run)."""
    print("$", " ".join(cmd), flush=True)
    if dry:
        return None
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
    return proc


def plain_matmul_tflops(size: int = 8192, reps: int = 50, trials: int = 5) -> float:
    """Best of `trials` loops of `reps` bf16 torch.matmul calls timed with one event pair."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        torch.matmul(a, b)
    best = 0.0
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * size**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12)
    return best


def plain_matmul_in_child() -> float:
    """plain_matmul_tflops() in a spawned child process: its CUDA context (~0.5 GB of GPU 0)
    ends with it, where in this process, which starts every run that follows, it would stay."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(plain_matmul_tflops).result()


def estimate_gb(opts: dict) -> float:
    """`plan memory`'s peak for one variant, in GB."""
    from hpctrain.models import PRESETS
    from hpctrain.plan.memory import estimate_memory
    from hpctrain.plan.memory_options import MemoryOptions

    kw = {k: v for k, v in opts.items() if k != "model"}
    return estimate_memory(PRESETS[opts["model"]], MemoryOptions(seq_len=2048, **kw)).peak / 1e9


MODEL_KEYS = ("tokens_per_s_per_gpu", "mfu_pct", "hfu_pct", "gpu_watts", "joules_per_token",
              "tokens_per_joule", "step_time_s")


def read_rows(path: Path) -> list[dict] | None:
    """The rows of a bench results JSON, or None when the step left none."""
    return json.loads(path.read_text())["rows"] if path.exists() else None


def fmt(value, spec: str) -> str:
    """format(value, spec), or n/a for None."""
    return "n/a" if value is None else format(value, spec)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-gpu"))
    p.add_argument("--dry-run", action="store_true", help="print commands and estimates only")
    p.add_argument("--skip", nargs="*", default=[],
                   help="gemm, allreduce, model (alias memory), roofline, node")
    p.add_argument("--memory-variants", nargs="*", default=list(MEMORY_VARIANTS))
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    out = (REPO / args.out).resolve()
    py = [sys.executable, "-m", "hpctrain"]
    summary: dict = {"time": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.time()
    gpus = 4 if args.dry_run else _gpu_count()

    if "gemm" not in args.skip:
        run([*py, "bench", "gemm", "--dtypes", "bf16", "fp8", "tf32", "--sizes", "1024", "4096",
             "8192", "-n", "50", "--out", str(out / "gemm")], args.dry_run)
        if not args.dry_run:
            rows = json.loads((out / "gemm" / "gemm.json").read_text())["rows"]
            ours = next(r["tflops"] for r in rows if r["dtype"] == "bf16" and r["m"] == 8192)
            plain = plain_matmul_in_child()
            summary["gemm_bf16_8192"] = {"bench_gemm": ours, "plain_matmul_best": plain,
                                         "ratio": ours / plain}
            print(f"gemm bf16 8192^3: bench {ours:.1f} TFLOP/s, plain torch.matmul {plain:.1f} "
                  f"({100 * ours / plain:.1f}%)")
        run([*py, "bench", "membw", "--out", str(out / "membw")], args.dry_run)

    if "allreduce" not in args.skip:
        for n in (n for n in (2, 4) if n <= gpus):
            run([*py, "bench", "collective", "--nproc", str(n), "--ops", "all_reduce",
                 "all_gather", "reduce_scatter", "-b", "64M", "-e", "1G", "-f", "2",
                 "-n", "20", "--out", str(out / f"collective-{n}")], args.dry_run)
            if not args.dry_run:
                path = out / f"collective-{n}" / "collective.json"
                if path.exists():
                    summary[f"collective_{n}"] = json.loads(path.read_text())["rows"]
        # Small messages, eager vs replayed from a CUDA graph (launch overhead stripped).
        n = min(gpus, 4)
        for tag, extra in (("eager", []), ("graph", ["--cuda-graph", "20"])):
            run([*py, "bench", "collective", "--nproc", str(n), "--ops", "all_reduce",
                 "-b", "8", "-e", "1M", "-f", "32", "-n", "20", "--no-plot", *extra,
                 "--out", str(out / f"small-{tag}")], args.dry_run)
            if not args.dry_run:
                summary[f"small_all_reduce_{tag}"] = read_rows(
                    out / f"small-{tag}" / "collective.json")

    if "model" not in args.skip and "memory" not in args.skip:
        rows = []
        for name in args.memory_variants:
            config, ranks, overrides, opts = MEMORY_VARIANTS[name]
            if ranks > gpus:
                continue
            est = estimate_gb(opts)
            cmd = [*py, "bench", "model", "--config", config, "--nproc", str(ranks),
                   "--steps", str(args.steps), "--log-every", "5", "--out",
                   str(out / f"model-{name}")]
            if overrides:
                cmd += ["--set", *overrides]
            run(cmd, args.dry_run, timeout=400)
            row = None if args.dry_run else read_rows(out / f"model-{name}" / "model.json")
            meas = row[0]["peak_mem_gb"] if row else None
            rows.append({"variant": name, "estimate_gb": est, "measured_gb": meas,
                         "error": None if meas is None else est / meas - 1,
                         **({k: row[0][k] for k in MODEL_KEYS} if row else {})})
        summary["model"] = rows
        print("\n| variant | GPUs | tokens/s/GPU | MFU | HFU | J/token | plan memory GB "
              "| measured peak GB | error |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            meas = "-" if r["measured_gb"] is None else f"{r['measured_gb']:.1f}"
            err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
            print(f"| {r['variant']} | {MEMORY_VARIANTS[r['variant']][1]} | "
                  f"{fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} | {fmt(r.get('mfu_pct'), '.1f')}"
                  f" | {fmt(r.get('hfu_pct'), '.1f')} | {fmt(r.get('joules_per_token'), '.3g')} | "
                  f"{r['estimate_gb']:.1f} | {meas} | {err} |")

    if "roofline" not in args.skip and "gemm" not in args.skip:
        run([*py, "bench", "roofline", "--from", str(out / "gemm"), str(out / "membw"),
             "--out", str(out / "roofline")], args.dry_run)
        if not args.dry_run:
            summary["roofline"] = read_rows(out / "roofline" / "roofline.json")

    if "node" not in args.skip:
        proc = run([*py, "bench", "node", "--out", str(out / "node")], args.dry_run)
        path = out / "node" / "node.json"
        if not args.dry_run and path.exists():
            summary["node"] = json.loads(path.read_text())
            print(f"bench node: exit {proc.returncode}, healthy={summary['node']['healthy']}")
            print(proc.stdout[-3000:])

    summary["wall_s"] = time.time() - t0
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary: {out / 'summary.json'} ({summary['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
