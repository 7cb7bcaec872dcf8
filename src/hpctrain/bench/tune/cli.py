"""The ``hpctrain tune`` command: its parser, the run from plan to files, and its tables.

What the command does, and the files and exit codes it promises, are in the package docstring;
the parser's description says it in brief.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from hpctrain.bench.tune.candidates import MAX_CANDIDATES, TunePlan, plan_tuning
from hpctrain.bench.tune.measure import (
    measure,
    rate_unit,
    resume_from,
    winner,
    write_results,
)
from hpctrain.bench.tune.task_candidates import plan_task_tuning
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.numeric_args import count, real
from hpctrain.plan.auto import CPU
from hpctrain.runtime.config import TooLargeForCPU


class TuneFailed(HpctrainError):
    """Every candidate failed to run; the message lists each one's reason."""

    exit_code = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tune`` on the top-level sub-parser set."""
    p = sub.add_parser("tune", help="measure a short list of configurations, keep the fastest",
                       description="Measure the configurations of CONFIG that the memory model "
                       "lets fit --gpus GPUs of this node (layout, DDP or FSDP ZeRO-2/3, "
                       "activation checkpointing, micro-batch, fp8), keep the fastest in "
                       "best.yaml and best.overrides. For a task of your own (my_task.py): "
                       "DDP or FSDP ZeRO-2/3 at micro-batches around its own, smallest first. "
                       "The global batch stays the config's. "
                       "--dry-run prints the short list and runs nothing.")
    p.add_argument("config", type=Path, help="YAML config of a built-in model family, e.g. "
                   "configs/llama-8b-fsdp.yaml, or a task file (my_task.py, as train takes it)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides applied before tuning (kept in best.overrides)")
    p.add_argument("--gpus", type=count(1, 4096), required=True,
                   help="GPUs of this node to tune for (CPU ranks without a GPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None,
                   help="run.device for every candidate (kept in best.overrides)")
    p.add_argument("--gpu-mem-gb", type=real(0, 1e6, open_min=True), default=None,
                   help="memory per GPU the model sizes against (default: the GPU's; "
                   f"{CPU.bytes / 1e9:g} per rank on a CPU)")
    p.add_argument("--max-candidates", type=count(1, 10_000), default=MAX_CANDIDATES,
                   help="how many configurations to measure")
    p.add_argument("--steps", type=count(1, 10_000_000), default=None,
                   help="steps per candidate (default 30 on a GPU, 8 on a CPU)")
    p.add_argument("--log-every", type=count(1, 10_000_000), default=None,
                   help="logging window (default 5 on a GPU, 2 on a CPU)")
    p.add_argument("--timeout", type=real(0, 1e7, open_min=True), default=900.0,
                   help="seconds per candidate")
    p.add_argument("--no-fp8", action="store_true", help="never try train.precision=fp8")
    p.add_argument("--resume", action="store_true",
                   help="keep the candidates an earlier, interrupted call measured into --out "
                   "and run the rest")
    p.add_argument("--dry-run", action="store_true",
                   help="print the short list and its predictions, run nothing")
    p.add_argument("--gpu", default=None,
                   help="with --dry-run: the short list for GPUs of this type (h100, h200, "
                   "a100, ...), made where none is visible, e.g. on a login node")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default runs/tune/<config stem>)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain tune``: plan, measure, report, write."""
    import torch

    if args.gpu is not None and not args.dry_run:
        raise ConfigError(f"--gpu {args.gpu} without --dry-run",
                          expected="--gpu only with --dry-run (measuring needs the GPUs "
                          "themselves)", hint="add --dry-run, or run on a node with the GPUs")
    if args.device is not None:
        args.overrides = [*args.overrides, f"run.device={args.device}"]
    try:
        if _names_task(args.config, args.overrides, args.gpus):
            plan = plan_task_tuning(args.config, args.overrides, args.gpus,
                                    gpu_mem_gb=args.gpu_mem_gb,
                                    max_candidates=args.max_candidates, gpu=args.gpu)
        else:
            plan = plan_tuning(args.config, args.overrides, args.gpus,
                               gpu_mem_gb=args.gpu_mem_gb, max_candidates=args.max_candidates,
                               allow_fp8=not args.no_fp8, gpu=args.gpu)
    except TooLargeForCPU as e:
        if not args.dry_run:
            raise
        # A dry run measures nothing: what the user wants is the short list for the GPUs the
        # job will get, which --gpu gives without one here.
        raise ConfigError(e.what, expected=e.expected,
                          hint="add --gpu TYPE (h100, h200, a100, ...) to make the short list "
                          "for GPUs of that type on this machine; run.device=cpu would tune "
                          "it for CPU ranks instead") from None
    on_gpu = plan.device == "cuda"
    steps = args.steps or (30 if on_gpu else 8)
    # A short --steps keeps two windows (the first is warm-up) unless --log-every says otherwise.
    log_every = args.log_every or max(1, min(5 if on_gpu else 2, steps // 2))
    if log_every < 1 or steps < 2 * log_every:
        raise ConfigError(f"--steps {steps} with --log-every {log_every}",
                          expected="steps >= 2 x log_every >= 2 (the first window is warm-up)",
                          hint="e.g. --steps 30 --log-every 5")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}", expected="seconds, > 0")
    print_shortlist(plan, args.gpus)
    if args.dry_run:
        return
    out = (args.out or Path("runs") / "tune" / args.config.stem).resolve()
    same = {"config": str(args.config.resolve()), "overrides": args.overrides,
            "gpus": args.gpus, "device_name": plan.device_name, "steps": steps,
            "log_every": log_every}
    if args.resume and (out / "results.json").exists():
        taken = resume_from(plan, out / "results.json", same)
        print(f"--resume: {taken} candidate(s) measured by an earlier call are kept")
    print(f"measuring {len(plan.candidates)} candidates, {steps} steps each, into {out}",
          flush=True)
    interrupted = measure(plan, args.config, args.overrides, args.gpus, out, steps=steps,
                          log_every=log_every, timeout=args.timeout,
                          echo=lambda line: print(line, flush=True))
    best = winner(plan.candidates)
    meta = {**same, "device": plan.device, "gpu_mem_gb": plan.gpu_bytes / 1e9,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": _command(args), "global_batch": plan.global_batch, "fp8": plan.fp8,
            "notes": plan.notes, "interrupted": interrupted}
    print_results(plan, best)
    paths = write_results(plan, out, meta, best, args.config, args.overrides)
    if best is not None:
        _announce(plan, best, args.config, out, args.gpus)
    elif not interrupted and (out / "best.overrides").exists():
        print(f"note: {out / 'best.overrides'} and best.yaml are from an earlier tuning, "
              "left as they were")
    print(f"results: {', '.join(str(p) for p in paths)}")
    if interrupted:
        raise KeyboardInterrupt
    if best is None:
        raise TuneFailed("every candidate failed:",
                         lines=[f"  [{i}] {c.label}: {c.reason}"
                                for i, c in enumerate(plan.candidates, 1)],
                         hint=f"the runs' logs are under {out}/cNN/train/logs")


def print_shortlist(plan: TunePlan, gpus: int) -> None:
    """The candidates and their predictions, before anything runs."""
    from rich.console import Console
    from rich.table import Table

    on_gpu = plan.device == "cuda"
    unit = "GPU" if on_gpu else "rank"
    fit = "that training accepts on" if plan.task else "that fit"
    table = Table(title=f"{len(plan.candidates)} of {plan.considered} settings {fit} "
                  f"{gpus} {unit}(s) of {plan.gpu_bytes / 1e9:.0f} GB ({plan.device_name}), "
                  f"global batch {plan.global_batch}")
    # A task's candidates have no predicted speed, and a peak only where a step was measured
    # (task_candidates: on a GPU).
    speed, sized = not plan.task, _sized(plan)
    for col in ("#", "candidate", *(["predicted tokens/s per GPU"] if speed else []),
                *(["predicted peak GB"] if sized else [])):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for i, c in enumerate(plan.candidates, 1):
        table.add_row(str(i), c.label,
                      *([f"{c.predicted_tokens_per_s:,.0f}" if on_gpu else "-"] if speed else []),
                      *([_num(c.predicted_peak / 1e9 or None, ".2f")] if sized else []))
    Console(width=160).print(table)
    if not on_gpu and not plan.task:
        print("note: on the CPU the step-time model (made for GPUs) only orders the candidates")
    for note in plan.notes:
        print(f"note: {note}")


def print_results(plan: TunePlan, best: int | None) -> None:
    """Measured against predicted, per candidate."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tune results")
    sized = _sized(plan)
    predicted = ("predicted GB", "measured/predicted") if sized else ()
    for col in ("#", "candidate", f"{rate_unit(plan)} per GPU", "MFU %", "peak GB", *predicted,
                "status"):
        table.add_column(col, justify="left" if col in ("candidate", "status") else "right")
    for i, c in enumerate(plan.candidates):
        m = c.measured or {}
        status = c.status + (f": {c.reason}" if c.reason and c.status == "failed" else "")
        table.add_row(str(i + 1) + (" *" if i == best else ""), c.label,
                      _num(m.get("tokens_per_s_per_gpu"), ",.0f"), _num(m.get("mfu_pct"), ".1f"),
                      _num(m.get("peak_mem_gb"), ".2f"),
                      *([_num(c.predicted_peak / 1e9 or None, ".2f"),
                         _num(c.mem_ratio, ".2f")] if sized else []), status)
    Console(width=200).print(table)
    if plan.device == "cpu" and not plan.task:
        print("note: on the CPU the measured peak is the process's RSS; the model predicts GPU "
              "memory, so the ratio says little here")


def _sized(plan: TunePlan) -> bool:
    """Whether the candidates have a predicted peak: a family's always, a task's where its
    step was measured (on a GPU: task_candidates)."""
    return not plan.task or any(c.predicted_peak for c in plan.candidates)


def _names_task(config: Path, overrides: list[str], gpus: int) -> bool:
    """Whether ``config`` (a task file, or a YAML with ``task:``) trains a task of one's own."""
    from hpctrain.bench.model import run_config

    return bool(run_config(config, overrides, gpus).task)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _announce(plan: TunePlan, best: int, config: Path, out: Path, gpus: int) -> None:
    c = plan.candidates[best]
    tok = c.measured["tokens_per_s_per_gpu"]
    line = f"winner: [{best + 1}] {c.label}: {tok:,.0f} {rate_unit(plan)} per GPU"
    base = next((b for b in plan.candidates if b.source == "config" and b.status == "ok"), None)
    if base is not None and base is not c:
        gain = tok / base.measured["tokens_per_s_per_gpu"] - 1
        line += f" ({gain:+.1%} over the config as given)"
    print(line)
    nproc = f" --nproc {gpus}" if gpus > 1 else ""
    print(f"train it: hpctrain train {config} $(cat {out / 'best.overrides'}){nproc}")


def _command(args: argparse.Namespace) -> str:
    argv = ["hpctrain", "tune", str(args.config), *args.overrides, "--gpus", str(args.gpus)]
    for flag, value in (("--gpu", args.gpu), ("--gpu-mem-gb", args.gpu_mem_gb),
                        ("--steps", args.steps),
                        ("--log-every", args.log_every), ("--out", args.out)):
        if value is not None:
            argv += [flag, str(value)]
    if args.max_candidates != MAX_CANDIDATES:
        argv += ["--max-candidates", str(args.max_candidates)]
    argv += [flag for flag, on in (("--no-fp8", args.no_fp8), ("--resume", args.resume),
                                   ("--dry-run", args.dry_run)) if on]
    return shlex.join(argv)
