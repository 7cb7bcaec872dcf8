"""A 3-D checkpoint resumed on fewer GPUs (issue 15 item 5): a 4-GPU PP2 x TP2 run's step-K
checkpoint resumed on 2 GPUs (FSDP) and on 1 GPU, step K+1's loss compared with the 4-GPU run's
own continuation.

Per source layout (``--layouts``, default ``pp2_tp2``; also ``pp2_fsdp2``, ``tp2_fsdp2``), real
``hpctrain train`` runs, one after another:

1. ``original``: the layout on N GPUs, steps 1..K+1, a checkpoint at step K (kept);
2. ``same``: that checkpoint resumed on the same layout, step K+1 (the exact-resume control,
   ``--no-control`` skips it; the CPU smoke skips it unless ``--control``);
3. ``fsdp2``: resumed with FSDP on 2 GPUs, step K+1;
4. ``1gpu``: resumed on 1 GPU without parallelism, step K+1.

Every run trains the same global batch of G samples (micro-batch x grad_accum x data-parallel
ranks, as tests/parallel/test_layouts.py does on CPU). Compared at step K+1 (the first step after
the resume: model, AdamW moments, LR schedule and data position all come from the checkpoint):
the loss and the global gradient norm, relative to the original's. bf16 runs differ by how the
layouts split and order their sums; fp32 (``--precision fp32``) shows the protocol's own error.

    python3 benchmarks/resume_layouts_gpu.py --out runs/resume-layouts            # 4 GPUs, 1b
    python3 benchmarks/resume_layouts_gpu.py --layouts pp2_fsdp2 tp2_fsdp2 --out runs/resume-layouts
    python3 benchmarks/resume_layouts_gpu.py --cpu-smoke --out /tmp/rl   # the protocol, 4 CPU ranks

Prints a Markdown table and writes ``<out>/resume_layouts.json``. The 1b model, K = 10, eager:
about 1 minute per run on H100/H200 (start-up dominates), 4 runs per source layout. The CPU
smoke (3 runs) takes 2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from as_measured import AS_MEASURED  # benchmarks/: the llama configs' former values

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from hpctrain.bench.common import run_command  # noqa: E402
from hpctrain.observe.metrics import read_metrics  # noqa: E402
from hpctrain.runtime.env import MULTICAST_OFF  # noqa: E402

GLOBAL_BATCH = 8
# Source layouts on 4 ranks: (overrides, data-parallel degree). PP cuts the step's samples
# into pipeline micro-batches; with it, train.micro_batch x grad_accum is the rank's share.
SOURCES = {
    "pp2_tp2": (["parallel.strategy=none", "parallel.pp=2", "parallel.tp=2",
                 "parallel.pp_microbatches=4"], 1),
    "pp2_fsdp2": (["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_microbatches=2"], 2),
    "tp2_fsdp2": (["parallel.strategy=fsdp", "parallel.tp=2"], 2),
}
# Resume targets: name -> (ranks, overrides, data-parallel degree, grad_accum).
TARGETS = {
    "fsdp2": (2, ["parallel.strategy=fsdp"], 2, 1),
    "1gpu": (1, ["parallel.strategy=none"], 1, 2),  # accumulation keeps 1b's memory in bounds
}
BASE = ["metrics.log_every=1", "metrics.progress=false", "run.suffix=none",
        "optim.schedule=constant", "optim.warmup_steps=2", "checkpoint.async_save=false",
        "watchdog.timeout=1800", "parallel.compile=false"]
GPU = ["configs/llama-1b.yaml", *AS_MEASURED["configs/llama-1b.yaml"], "data.max_bytes=200000000"]
# The CPU smoke: tests/conftest.py's TINY shape with 4 layers (two pipeline stages of two).
CPU = ["configs/demo.yaml", "run.device=cpu", "model.dim=64", "model.n_layers=4",
       "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "data.seq_len=32",
       "data.max_bytes=200000", "train.deterministic=true"]


class Runner:
    """`hpctrain train` runs under one output folder (as benchmarks/checkpoint.py's Bench)."""

    def __init__(self, out: Path, cpu: bool, extra: list[str]):
        self.out, self.cpu, self.extra = out, cpu, extra

    def train(self, name: str, ranks: int, *overrides: str) -> Path:
        """Run `hpctrain train` afresh; return its run directory (raise with the log tail)."""
        run_dir = self.out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "hpctrain", "train", *(CPU if self.cpu else GPU), *BASE,
               *self.extra, f"run.out_dir={self.out}", f"run.name={name}", *overrides]
        if ranks > 1:
            cmd += ["--nproc", str(ranks)]
        print("$", " ".join(cmd[2:]), flush=True)
        env = {**os.environ, **MULTICAST_OFF}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
        code, tail, wall = run_command(cmd, timeout=1800, env=env, cwd=REPO)
        if code != 0:
            raise RuntimeError(f"{name} failed ({code}):\n{tail}")
        print(f"  {wall:.0f} s", flush=True)
        return run_dir


def batch(dp: int, accum: int = 1) -> list[str]:
    """Overrides that make `dp` data-parallel ranks train the global batch together."""
    micro, rest = divmod(GLOBAL_BATCH, dp * accum)
    if rest or micro < 1:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {dp} x {accum}")
    return [f"train.micro_batch={micro}", f"train.grad_accum={accum}"]


def step_record(run_dir: Path, step: int) -> dict:
    """Rank 0's record of one training step."""
    rows = [r for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl")
            if r.get("step") == step and "loss" in r]
    if not rows:
        raise RuntimeError(f"{run_dir} logged no step {step}")
    return rows[-1]


def measure(runner: Runner, source: str, ranks: int, k: int, control: bool) -> dict:
    """Original run, its step-K checkpoint resumed on each target; the step-K+1 records."""
    overrides, dp = SOURCES[source]
    original = runner.train(f"{source}-original", ranks, *overrides, *batch(dp),
                            f"train.steps={k + 1}", "checkpoint.interval=steps",
                            f"checkpoint.every={k}", f"checkpoint.keep_every={k}",
                            "checkpoint.save_at_end=false")
    ckpt = original / "checkpoints" / f"step-{k:08d}"
    resume = [f"checkpoint.resume={ckpt}", f"train.steps={k + 1}", "checkpoint.interval=none",
              "checkpoint.save_at_end=false"]
    runs = {"original": (ranks, original)}
    if control:
        runs["same"] = (ranks, runner.train(f"{source}-same", ranks, *overrides, *batch(dp),
                                            *resume))
    for name, (n, target, tdp, accum) in TARGETS.items():
        runs[name] = (n, runner.train(f"{source}-{name}", n, *target, *batch(tdp, accum),
                                      *resume))
    ref = step_record(original, k + 1)
    result = {"source": source, "k": k, "runs": {}}
    for name, (n, run_dir) in runs.items():
        rec = step_record(run_dir, k + 1)
        result["runs"][name] = {
            "gpus": n, "loss": rec["loss"], "grad_norm": rec.get("grad_norm"),
            "loss_rel": abs(rec["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_norm_rel": (abs(rec["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
                              if rec.get("grad_norm") and ref.get("grad_norm") else None),
        }
    return result


def report(results: list[dict], rtol: float) -> bool:
    """Print the Markdown table; True when every resumed loss is within rtol."""
    print(f"\n| source layout | resumed on | GPUs | loss at K+1 | rel. to original | "
          f"grad norm | rel. | within {rtol:g} |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for res in results:
        for name, r in res["runs"].items():
            within = r["loss_rel"] <= rtol
            ok &= within or name == "original"
            norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.4f}"
            nrel = "-" if r["grad_norm_rel"] is None else f"{r['grad_norm_rel']:.1e}"
            label = {"original": "(original, continued)", "same": "same layout"}.get(name, name)
            print(f"| {res['source']} | {label} | {r['gpus']} | {r['loss']:.6f} | "
                  f"{r['loss_rel']:.1e} | {norm} | {nrel} | "
                  f"{'-' if name == 'original' else 'yes' if within else '**no**'} |")
    return ok


def main() -> None:
    """Run the protocol for each source layout; print and write the comparison."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/resume-layouts"))
    p.add_argument("--layouts", nargs="+", default=["pp2_tp2"], choices=sorted(SOURCES))
    p.add_argument("--nproc", type=int, default=4, help="GPUs of the source layout")
    p.add_argument("--size", default=None, help="model size preset (default: the config's 1b)")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="training precision (default bf16; fp32 in the CPU smoke)")
    p.add_argument("-k", "--steps", type=int, default=None,
                   help="checkpoint step K (default 10 on GPU, 2 in the CPU smoke)")
    p.add_argument("--rtol", type=float, default=None,
                   help="allowed relative loss difference (default 1e-2 bf16, 1e-5 fp32)")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                   help="also resume on the source layout itself (default: on GPU only)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same protocol with a tiny model on CPU gloo ranks")
    args = p.parse_args()
    if args.nproc != 4:
        p.error("the source layouts are 2 x 2: --nproc 4")
    cpu = args.cpu_smoke
    precision = args.precision or ("fp32" if cpu else "bf16")
    k = args.steps or (2 if cpu else 10)
    rtol = args.rtol or (1e-5 if precision == "fp32" else 1e-2)
    if not cpu:
        import torch

        if torch.cuda.device_count() < args.nproc:
            sys.exit(f"needs {args.nproc} CUDA GPUs, sees {torch.cuda.device_count()} "
                     "(or --cpu-smoke)")
    extra = [f"train.precision={precision}"] + ([f"model.size={args.size}"] if args.size else [])
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, cpu, extra)
    control = not cpu if args.control is None else args.control
    results = [measure(runner, source, args.nproc, k, control) for source in args.layouts]
    ok = report(results, rtol)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu_smoke": cpu, "precision": precision,
            "global_batch": GLOBAL_BATCH, "k": k, "rtol": rtol, "size": args.size or
            ("tiny" if cpu else "1b")}
    (out / "resume_layouts.json").write_text(json.dumps({"meta": meta, "results": results},
                                                        indent=1) + "\n")
    print(f"\nresults: {out / 'resume_layouts.json'}")
    if not ok:
        sys.exit(f"a resumed loss is off by more than {rtol:g}")


if __name__ == "__main__":
    main()
