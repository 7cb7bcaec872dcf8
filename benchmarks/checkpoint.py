"""What checkpoints cost a training run, measured as a user pays it: the same run with and
without checkpoints, through real `hpctrain train` runs of the `1b` model.

For one layout per call (`1gpu`, or `fsdp2`: FSDP on 2 GPUs) it runs (`--variants`, in order):

1. `probe`: a short run with background saves (the writer process), for the background write
   time W and the undisturbed step time (the fastest logging window after warm-up: a save only
   adds time to the window it falls in), kept in `<out>/<layout>/probe.json` for the calls that
   follow;
2. the same N steps with: `none` (no checkpoints), `sync` (blocking saves), `process`
   (background saves by the writer process, the default on GPUs) and `thread` (background saves
   by a thread of the training process, as before issue 9). Saves come every K steps, K the
   smallest multiple of 10 with K steps >= 2 W (issue 9's condition), at steps K, 2K, 3K; the
   run ends at N = 4K, so each save has K steps of background write behind it inside the
   measured range.

Measured over steps 20..N from rank 0's step records (`ts`: wall clock, warm-up excluded):

- whole-run tokens/s per GPU with and without checkpoints, and their ratio (target >= 0.97);
- extra wall time per save: (T_with - T_without) / 3, for blocking and background saves, and
  the ratio background / blocking (target <= 1/20);
- first-save cost: the first save's `checkpoint_stall` (target <= 1 s; the writer's buffers are
  allocated and pinned after step 1, reported apart as `prepare_s`);
- the stall the metric reports (median `checkpoint_stall.stall_s`), the background write time
  and bytes (`checkpoint` events), and what goodput.json charges per save (`checkpoint_cost_s`:
  stall plus measured slowdown), to compare with the extra wall time measured here.

    B=benchmarks/checkpoint.py; O=--out=runs/bench-ckpt
    python $B --layout 1gpu  --variants probe,none,process $O     # 1 GPU
    python $B --layout 1gpu  --variants sync,thread $O
    python $B --layout fsdp2 --variants probe,none,process $O     # 2 GPUs, FSDP
    python $B --layout fsdp2 --variants sync,thread $O
    python $B --report $O                                          # the table
    python $B --layout 1gpu --cpu-smoke --out /tmp/ck              # checks the script (CPU)

On an H200 (eager 1b: 0.16 s a step; the writer process writes 13.2 GB in 21-27 s, bound by
its serialisation and checksums, not the disk) K comes out near 320 steps and a run near 4 min
(`--compile` adds ~1 min per run): each line above takes up to about 10 minutes.
Each variant's numbers go to `<out>/<layout>/<variant>.json`; `--report` derives the ratios
and targets from whatever is there and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from as_measured import AS_MEASURED  # the llama configs' values before auto
from ckpt_runs import CPU_TINY, events, run_train, step_records
from hpctrain.plan.gpu import gpu_name

# Steps 1..WARMUP hold compilation, the writer's buffer allocation and the first windows.
WARMUP = 20
BASE = ["metrics.log_every=10", "optim.schedule=constant", "optim.warmup_steps=2",
        "checkpoint.keep_last=1"]
CONFIG = {"gpu": ["configs/llama-1b.yaml", *AS_MEASURED["configs/llama-1b.yaml"],
                  "data.max_bytes=200000000"], "cpu": CPU_TINY}
LAYOUTS = {"1gpu": (1, ["parallel.strategy=none"]),
           "fsdp2": (2, ["parallel.strategy=fsdp"])}
VARIANTS = {
    "none": ["checkpoint.interval=none", "checkpoint.save_at_end=false"],
    "sync": ["checkpoint.async_save=false"],
    "process": ["checkpoint.async_save=true", "checkpoint.writer=process"],
    "thread": ["checkpoint.async_save=true", "checkpoint.writer=thread"],
}
TARGETS = {"throughput_ratio": 0.97, "first_save_s": 1.0, "extra_vs_sync": 1 / 20}


class Bench:
    """One layout's runs under ``out``."""

    def __init__(self, out: Path, mode: str, layout: str, compile_: bool):
        self.out = out
        self.mode = mode
        self.layout = layout
        self.ranks, self.extra = LAYOUTS[layout]
        self.extra = [*self.extra, f"parallel.compile={str(compile_).lower()}"]

    def train(self, name: str, *overrides: str) -> Path:
        """Run `hpctrain train` afresh; return its run directory (raise with the log tail)."""
        return run_train(self.out, name, [*CONFIG[self.mode], *BASE, *self.extra, *overrides],
                         ranks=self.ranks)

    def probe(self) -> tuple[float, float]:
        """(background write seconds, undisturbed step seconds) from a short run with saves by
        the writer process."""
        run = self.train(f"{self.layout}-probe", "train.steps=60", "checkpoint.every=20",
                         *VARIANTS["process"])
        saves = [e["write_s"] for e in events(run, "checkpoint")]
        # Not the median: with saves every 20 steps and windows of 10, half the windows hold a
        # save (or a wait for the previous one), which once read 1.35 s for a 0.16 s step and
        # set the interval 8x too short.
        steps = [r["step_time_s"] for r in step_records(run) if r["step"] > WARMUP]
        return max(saves), min(steps)

    def measure(self, name: str, every: int, steps: int) -> dict:
        """One variant's numbers over steps WARMUP..steps."""
        # A run without checkpoints takes no cadence (refused under interval=none).
        cadence = [] if name == "none" else [f"checkpoint.every={every}"]
        run = self.train(f"{self.layout}-{name}", f"train.steps={steps}", *cadence,
                         *VARIANTS[name])
        records = {r["step"]: r for r in step_records(run)}
        layout = events(run, "layout")[-1]
        seconds = records[steps]["ts"] - records[WARMUP]["ts"]
        result = {"variant": name, "seconds": seconds,
                  "tokens_per_s": (steps - WARMUP) * layout["tokens_per_step_per_gpu"] / seconds}
        stalls = [e for e in events(run, "checkpoint_stall") if e["step"] < steps]
        saves = [e for e in events(run, "checkpoint") if e["step"] < steps]
        if stalls:
            result.update(saves=len(stalls), first_save_s=stalls[0]["stall_s"],
                          stall_s=statistics.median(e["stall_s"] for e in stalls),
                          wait_s=max(e.get("wait_s", 0.0) for e in stalls))
        if saves:
            result.update(write_s=statistics.median(e["write_s"] for e in saves),
                          bytes=saves[-1]["bytes"], writer=saves[-1].get("writer"))
        prepared = events(run, "checkpoint_writer")
        if prepared:
            result["prepare_s"] = prepared[-1]["prepare_s"]
        account = json.loads((run / "goodput.json").read_text())
        result["goodput_checkpoint_cost_s"] = account.get("checkpoint_cost_s")
        return result


def run_variants(bench: Bench, variants: list[str]) -> None:
    """Run the variants asked for, each saved as soon as it is measured."""
    folder = bench.out / bench.layout
    folder.mkdir(parents=True, exist_ok=True)
    probe_path = folder / "probe.json"
    if "probe" in variants:
        write_s, step_s = bench.probe()
        every = max(WARMUP + 10, math.ceil(2 * write_s / step_s / 10) * 10)
        probe = {"probe_background_write_s": write_s, "step_s": step_s, "every": every,
                 "steps": 4 * every, "ranks": bench.ranks, "date": time.strftime("%Y-%m-%d"),
                 "torch": torch.__version__,
                 # through NVML: no CUDA context in this process while the runs measure
                 "device": gpu_name(0) if bench.mode == "gpu" else "cpu (smoke)"}
        probe_path.write_text(json.dumps(probe, indent=1))
        print(f"{bench.layout}: background write {write_s:.2f} s, step {step_s:.3f} s -> a save "
              f"every {every} steps ({every * step_s:.1f} s), {4 * every} steps per run",
              flush=True)
    if not probe_path.is_file():
        sys.exit(f"no {probe_path}: run --variants probe first")
    probe = json.loads(probe_path.read_text())
    for name in variants:
        if name != "probe":
            result = bench.measure(name, probe["every"], probe["steps"])
            (folder / f"{name}.json").write_text(json.dumps(result, indent=1))


def derive(folder: Path) -> dict | None:
    """One layout's probe and variants, with ratios to the run without checkpoints and the
    issue's targets for the writer process (None where nothing was measured)."""
    probe_path = folder / "probe.json"
    if not probe_path.is_file():
        return None
    res = {**json.loads(probe_path.read_text()), "layout": folder.name, "runs": {}}
    for name in VARIANTS:
        path = folder / f"{name}.json"
        if path.is_file():
            res["runs"][name] = json.loads(path.read_text())
    runs = res["runs"]
    base = runs.get("none")
    if base is not None:  # the measured step time, rather than the probe's estimate
        res["step_s"] = base["seconds"] / (res["steps"] - WARMUP)
    for name in ("sync", "process", "thread"):
        r = runs.get(name)
        if r is not None and base is not None and r.get("saves"):
            r["extra_per_save_s"] = (r["seconds"] - base["seconds"]) / r["saves"]
            r["throughput_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
    sync = runs.get("sync", {}).get("extra_per_save_s")
    for name in ("process", "thread"):
        r = runs.get(name, {})
        if sync is not None and sync > 0 and "extra_per_save_s" in r:
            r["extra_vs_sync"] = r["extra_per_save_s"] / sync
    new = runs.get("process", {})
    checks = {
        "throughput_ratio": ("throughput_ratio", lambda v: v >= TARGETS["throughput_ratio"]),
        "first_save_s": ("first_save_s", lambda v: v <= TARGETS["first_save_s"]),
        "extra_vs_sync": ("extra_vs_sync", lambda v: v <= TARGETS["extra_vs_sync"]),
        "interval_2x_write": ("write_s", lambda v: res["every"] * res["step_s"] >= 2 * v),
    }
    res["targets"] = {name: ok(new[key]) if key in new else None
                      for name, (key, ok) in checks.items()}
    return res


def report(out: Path) -> None:
    """The Markdown table of every layout measured under ``out``."""
    results = [r for folder in sorted(out.iterdir()) if folder.is_dir()
               and (r := derive(folder)) is not None] if out.is_dir() else []
    if not results:
        sys.exit(f"no results under {out}: run with --layout first")
    for res in results:
        size = max((r.get("bytes", 0) for r in res["runs"].values()), default=0)
        print(f"\n{res['layout']} on {res['device']}, torch {res['torch']}, {res['date']}: "
              f"{size / 1e9:.1f} GB per checkpoint, a save every {res['every']} steps "
              f"({res['every'] * res['step_s']:.0f} s), {res['steps']} steps per run")
        print("\n| saves | tokens/s per GPU | vs none | extra wall per save s | vs blocking | "
              "first save s | stall s (metric) | write s | goodput cost per save s |")
        print("|---|---|---|---|---|---|---|---|---|")
        labels = {"none": "none", "sync": "blocking", "process": "background, writer process",
                  "thread": "background, thread"}
        for name, label in labels.items():
            r = res["runs"].get(name)
            if r is None:
                continue

            def num(key: str, fmt: str, r: dict = r) -> str:
                value = r.get(key)
                return format(value, fmt) if isinstance(value, int | float) else "-"

            print(f"| {label} | {num('tokens_per_s', ',.0f')} | {num('throughput_ratio', '.3f')} "
                  f"| {num('extra_per_save_s', '.2f')} | {num('extra_vs_sync', '.3f')} | "
                  f"{num('first_save_s', '.2f')} | {num('stall_s', '.2f')} | "
                  f"{num('write_s', '.1f')} | {num('goodput_checkpoint_cost_s', '.2f')} |")
        met = ", ".join(f"{k} {'-' if v is None else 'met' if v else 'MISSED'}"
                        for k, v in res["targets"].items())
        prepare = res["runs"].get("process", {}).get("prepare_s")
        print(f"\ntargets (writer process): {met}" + (
            f"; its buffers allocated once, after step 1, in {prepare:.1f} s"
            if prepare is not None else ""))


def main() -> None:
    """Measure one layout's variants (or print the table of those measured)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-ckpt"))
    p.add_argument("--layout", choices=sorted(LAYOUTS))
    p.add_argument("--variants", default="probe,none,sync,process,thread",
                   help="comma-separated, in order: probe (first), none, sync, process, thread")
    p.add_argument("--report", action="store_true", help="print the table of all layouts run")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slower start)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same protocol with the tiny model on CPU ranks (checks the script)")
    args = p.parse_args()
    out = args.out.resolve()
    if args.report:
        report(out)
        return
    if args.layout is None:
        p.error("give --layout (or --report)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"probe", *VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: probe, {', '.join(VARIANTS)}")
    mode = "cpu" if args.cpu_smoke else "gpu"
    ranks = LAYOUTS[args.layout][0]
    if mode == "gpu" and torch.cuda.device_count() < ranks:
        sys.exit(f"--layout {args.layout} needs {ranks} CUDA GPU(s) (or --cpu-smoke)")
    run_variants(Bench(out, mode, args.layout, args.compile), variants)
    report(out)


if __name__ == "__main__":
    main()
