"""Issue 11 on GPUs: what observing a run costs, the OOM snapshot, and NCCL hang forensics.

    python benchmarks/observe_gpu.py --out runs/observe-gpu                  # every check
    python benchmarks/observe_gpu.py --only overhead --steps 60 --repeat 2   # ABBA pairs

Three checks, each a real ``hpctrain train`` run:

- ``overhead`` (1 GPU, the 1b model as configs/llama-1b.yaml trains it): the same run with
  observing on (TensorBoard and MLflow tracking, the straggler exchange) and off (both trackers
  off, ``metrics.straggler_windows=0``), in ABBA order so drift of the machine falls on both.
  Both log every 10 steps (the logging window itself is not optional). Reported: tokens/s over
  the whole measured span (steps after warm-up, from the metrics' timestamps) and the median
  window, and the cost = 1 - on/off. Target: at most 1%.
- ``oom`` (1 GPU): micro-batch 64 of the 1b model; the run must fail with a CUDA OOM and leave
  ``profiles/oom-rank-000.pickle`` (PyTorch's memory snapshot, with allocation history) and an
  exit_info.json that says so.
- ``hang`` (2 GPUs, NCCL): rank 1 is held before step 3 (``HPCTRAIN_FAULTS``); the watchdog
  fires, every rank dumps NCCL's flight recorder, and exit_info.json names the collective rank 0
  entered and rank 1 did not.

Prints one JSON line per run and a summary; everything goes to ``--out``/observe_gpu.json.

The GPU machines have neither tensorboard nor mlflow-skinny: download them with their
dependencies here (Python 3.12 wheels; numpy and pillow are there already) and install them
there from that folder, which fills in only what is missing:

    pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whltrack \
        tensorboard mlflow-skinny && rm .whltrack/numpy-* .whltrack/pillow-*
    # there:
    pip install --no-index --find-links .whltrack tensorboard mlflow-skinny
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

from as_measured import AS_MEASURED  # benchmarks/: the llama configs' former values
from hpctrain.bench.common import run_command
from hpctrain.bench.model import run_model_bench, summarise
from hpctrain.plan.gpu import gpu_name
from hpctrain.runtime.env import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[1]
OBSERVE = {
    "on": ["track.tensorboard=true", "track.mlflow=true", "metrics.straggler_windows=3"],
    "off": ["track.tensorboard=false", "track.mlflow=false", "metrics.straggler_windows=0"],
}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **MULTICAST_OFF, "PYTHONPATH": _pythonpath(), **extra}


def _pythonpath() -> str:
    parts = [str(REPO / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    return ":".join(dict.fromkeys(parts))


def overhead(out: Path, steps: int, repeat: int) -> dict:
    """ABBA pairs of the 1b run with observing on and off; the cost of turning it on."""
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    order = [v for i in range(repeat) for v in (("off", "on") if i % 2 == 0 else ("on", "off"))]
    for i, variant in enumerate(order):
        run_out = out / f"overhead-{i}-{variant}"
        row, cfg = run_model_bench(REPO / "configs/llama-1b.yaml",
                                   [*AS_MEASURED["configs/llama-1b.yaml"], *OBSERVE[variant]],
                                   nproc=1, out=run_out, steps=steps, log_every=10, env=_env())
        res = summarise(run_out / "train", 1)
        (first, last), (t0, t1) = res.measured_steps, res.measured_span_s
        tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.data.seq_len
        row.update(variant=variant, span_tokens_per_s=(last - first) * tokens / (t1 - t0))
        rows[variant].append(row)
        print(json.dumps({"check": "overhead", **row}), flush=True)
    span = {v: statistics.mean(r["span_tokens_per_s"] for r in rs) for v, rs in rows.items()}
    window = {v: statistics.mean(r["tokens_per_s_per_gpu"] for r in rs) for v, rs in rows.items()}
    return {"runs": rows, "span_tokens_per_s": span, "window_tokens_per_s": window,
            "cost_span_pct": 100 * (1 - span["on"] / span["off"]),
            "cost_window_pct": 100 * (1 - window["on"] / window["off"])}


def oom(out: Path) -> dict:
    """A 1b run far past the GPU's memory: the OOM snapshot and the exit account."""
    run_dir = out / "oom"
    argv = [sys.executable, "-m", "hpctrain", "train", str(REPO / "configs/llama-1b.yaml"),
            *AS_MEASURED["configs/llama-1b.yaml"], "train.micro_batch=64", "train.steps=3",
            "parallel.compile=false",
            "data.source=stdlib", "checkpoint.interval=none", "checkpoint.save_at_end=false",
            "checkpoint.resume=never", f"run.out_dir={out}", "run.name=oom", "run.suffix=none",
            "metrics.progress=false"]
    code, tail, wall = run_command(argv, timeout=300, env=_env())
    snap = run_dir / "profiles" / "oom-rank-000.pickle"
    info = _json(run_dir / "exit_info.json")
    result = {"exit_code": code, "wall_s": wall, "snapshot": snap.exists(),
              "snapshot_mb": snap.stat().st_size / 1e6 if snap.exists() else None,
              "reason": info.get("reason"), "tail": tail[-800:]}
    if snap.exists():
        with snap.open("rb") as f:  # our own run's file, written a moment ago
            data = pickle.load(f)
        result["snapshot_segments"] = len(data.get("segments", []))
        result["snapshot_traces"] = sum(len(t) for t in data.get("device_traces", []))
    print(json.dumps({"check": "oom", **result}), flush=True)
    return result


def hang(out: Path) -> dict:
    """Two NCCL ranks, rank 1 held before step 3: what the watchdog and flight recorder name."""
    run_dir = out / "hang"
    argv = [sys.executable, "-m", "hpctrain", "train", str(REPO / "configs/demo.yaml"),
            "run.device=cuda", "parallel.strategy=ddp", "train.precision=bf16",
            "train.steps=8", "watchdog.timeout=20", "checkpoint.interval=none",
            "checkpoint.save_at_end=false", "checkpoint.resume=never", "track.tensorboard=true",
            f"run.out_dir={out}", "run.name=hang", "run.suffix=none", "metrics.progress=false",
            "metrics.log_every=1", "--nproc", "2"]
    code, tail, wall = run_command(
        argv, timeout=300, env=_env(HPCTRAIN_FAULTS="hang@step=3,rank=1,seconds=600"))
    info = _json(run_dir / "exit_info.json")
    dumps = {r: _json(run_dir / "forensics" / f"fr-rank-{r:03d}.json") for r in (0, 1)}
    result = {"exit_code": code, "wall_s": wall, "reason": info.get("reason"),
              "collective": info.get("extra", {}).get("collective"),
              "suspect_rank": info.get("extra", {}).get("suspect_rank"),
              "flight_recorder_entries": {r: len(d.get("entries", [])) for r, d in dumps.items()},
              "tail": tail[-800:]}
    print(json.dumps({"check": "hang", **result}), flush=True)
    return result


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main() -> None:
    """Run the chosen checks and write their results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=["overhead", "oom", "hang"],
                   default=["overhead", "oom", "hang"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=2, help="ABBA pairs for the overhead")
    p.add_argument("--out", type=Path, default=Path("runs/observe-gpu"))
    args = p.parse_args()
    # Counted and named through NVML: a CUDA context in this process would hold ~0.5 GB of
    # GPU 0 for every run it measures (and shift their numbers).
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("observe_gpu needs CUDA GPUs")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": gpu_name(0), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "gpus": gpus}
    for check in args.only:
        if check == "hang" and gpus < 2:
            print("== hang: needs 2 GPUs, skipped", flush=True)
            continue
        print(f"== {check}", flush=True)
        results[check] = {"overhead": lambda: overhead(out, args.steps, args.repeat),
                          "oom": lambda: oom(out), "hang": lambda: hang(out)}[check]()
        (out / "observe_gpu.json").write_text(json.dumps(results, indent=2, default=str))
    if "overhead" in results:
        o = results["overhead"]
        print(f"observing costs {o['cost_span_pct']:+.2f}% of tokens/s over the whole span "
              f"({o['cost_window_pct']:+.2f}% by median window); target <= 1%")


if __name__ == "__main__":
    main()
