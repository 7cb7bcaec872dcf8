"""A config's ``auto`` values against `hpctrain tune`'s best, measured in the same call.

The README's commands leave the micro-batch, checkpointing and data-parallel strategy to
``auto`` (hpctrain.plan.auto); issue 31's target is that each reaches >= 95% of tune's best
tokens/s per GPU for the same model and GPUs. This script runs, one after the other, on the
GPUs of this node:

1. ``hpctrain tune CONFIG --gpus N`` into ``OUT/tune`` (its first candidate, "as configured",
   is auto's own pick: tune resolves a config's auto values as training does);
2. the config as the README trains it (auto, no tune results) through ``hpctrain bench model``
   into ``OUT/auto``;
3. with ``--also-tuned``, the config again with ``parallel.tune_results=OUT/tune`` (auto then
   takes tune's fastest measured setting) into ``OUT/tuned``.

It prints auto's resolved values, tune's winner and the ratios, and writes them as JSON to
``OUT/auto_vs_tune.json``.

    python benchmarks/auto_vs_tune.py --config configs/llama-8b-fsdp.yaml --gpus 4 \
        --max-candidates 4 --steps 20
    python benchmarks/auto_vs_tune.py --config configs/llama-1b.yaml --gpus 1 --also-tuned
    python benchmarks/auto_vs_tune.py --cpu-smoke        # 2 CPU ranks, a tiny model (~minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from hpctrain.bench.model import run_model_bench
from hpctrain.errors import HpctrainError
from hpctrain.runtime.env import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.95
# --cpu-smoke: a ~50k-parameter decoder, every value left to auto, 2 gloo ranks.
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_dim=128", "data.seq_len=32", "data.max_bytes=200000",
         "train.global_batch_tokens=512", "train.micro_batch=auto", "parallel.strategy=auto",
         "parallel.activation_checkpointing=auto", "parallel.reshard_after_forward=auto",
         "parallel.fsdp_group_blocks=auto", "metrics.progress=false"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "llama-1b.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=30, help="steps per run (tune's and ours)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--max-candidates", type=int, default=6, help="tune's --max-candidates")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--with-fp8", action="store_true",
                   help="let tune try fp8 too (auto keeps the config's precision)")
    p.add_argument("--also-tuned", action="store_true",
                   help="also train with parallel.tune_results=OUT/tune")
    p.add_argument("--resume", action="store_true",
                   help="keep the tune candidates an earlier call measured into OUT/tune (a call "
                   "split to fit a time limit)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="2 CPU ranks, a tiny model, 4 steps, --also-tuned: checks the script, "
                   "measures nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default runs/auto_vs_tune/<config stem>-<gpus>)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.config = REPO / "configs" / "demo.yaml"
        args.overrides = [*SMOKE, *args.overrides]
        args.gpus, args.steps, args.log_every, args.max_candidates = 2, 4, 2, 2
        args.also_tuned = True  # the tune_results path too, on a real tune folder
    args.out = (args.out or Path("runs") / "auto_vs_tune" / f"{args.config.stem}-{args.gpus}"
                ).resolve()
    return args


def tune(args: argparse.Namespace) -> dict:
    """Run `hpctrain tune` into OUT/tune; its results.json."""
    from hpctrain.cli import main

    out = args.out / "tune"
    argv = ["tune", str(args.config), *args.overrides, "--gpus", str(args.gpus), "--steps",
            str(args.steps), "--log-every", str(args.log_every), "--max-candidates",
            str(args.max_candidates), "--timeout", str(args.timeout), "--out", str(out),
            # auto never changes the precision: tune's best is compared in the config's own.
            *([] if args.with_fp8 else ["--no-fp8"]), *(["--resume"] if args.resume else [])]
    try:
        main(argv)
    except SystemExit as e:  # tune exits 1 when every candidate failed: reported below
        if e.code not in (0, None, 1):
            raise
    return json.loads((out / "results.json").read_text())


def train(args: argparse.Namespace, name: str, extra: list[str]) -> dict:
    """One `bench model` run of the config (its auto values resolved as training does)."""
    out = args.out / name
    row, _ = run_model_bench(args.config, [*args.overrides, *extra], nproc=args.gpus, out=out,
                             steps=args.steps, log_every=args.log_every, timeout=args.timeout)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    keys = {"train": ("micro_batch", "grad_accum"),
            "parallel": ("strategy", "reshard_after_forward", "activation_checkpointing",
                         "fsdp_group_blocks")}
    row["resolved"] = {f"{s}.{k}": resolved[s][k] for s, ks in keys.items() for k in ks}
    return row


def main(argv: list[str] | None = None) -> int:
    """Tune, train with auto, compare; 0 when auto reached the target (or --cpu-smoke ran)."""
    args = parse(argv)
    os.environ.update(MULTICAST_OFF)  # tune's runs and ours inherit it (benchmarks/peers)
    args.out.mkdir(parents=True, exist_ok=True)
    results = tune(args)
    ok = [c for c in results["candidates"] if c["status"] == "ok"]
    best = max(ok, key=lambda c: c["measured"]["tokens_per_s_per_gpu"]) if ok else None
    baseline = next((c for c in ok if c["source"] == "config"), None)
    rows = {"auto": train(args, "auto", [])}
    if args.also_tuned:
        rows["tuned"] = train(args, "tuned", [f"parallel.tune_results={args.out / 'tune'}"])
    meta = results["meta"]
    print(f"\n{args.config.name} on {args.gpus} x {meta['device_name']}, global batch "
          f"{meta['global_batch']} samples, {args.steps} steps per run")
    best_tps = best["measured"]["tokens_per_s_per_gpu"] if best else None
    if best:
        print(f"tune's best: {best['label']}: {best_tps:,.0f} tokens/s per GPU")
    if baseline:
        print(f"auto's pick inside tune: {baseline['label']}: "
              f"{baseline['measured']['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")
    summary = {"config": str(args.config), "gpus": args.gpus, "device": meta["device_name"],
               "tune_best": best and {"label": best["label"], "tokens_per_s_per_gpu": best_tps},
               "runs": {}}
    reached = True
    for name, row in rows.items():
        tps = row["tokens_per_s_per_gpu"]
        ratio = tps / best_tps if best_tps else None
        reached &= ratio is not None and ratio >= TARGET
        print(f"{name}: {tps:,.0f} tokens/s per GPU"
              + (f", {ratio:.3f} x tune's best" if ratio else "")
              + f"; {', '.join(f'{k}={v}' for k, v in row['resolved'].items())}")
        summary["runs"][name] = {"tokens_per_s_per_gpu": tps, "ratio": ratio,
                                 "mfu_pct": row.get("mfu_pct"),
                                 "peak_mem_gb": row.get("peak_mem_gb"),
                                 "resolved": row["resolved"]}
    (args.out / "auto_vs_tune.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"written: {args.out / 'auto_vs_tune.json'}")
    if args.cpu_smoke:
        print("--cpu-smoke: CPU ranks, the ratio says nothing")
        return 0
    print(f"target >= {TARGET:.0%} of tune's best: {'met' if reached else 'NOT met'}")
    return 0 if reached else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HpctrainError as e:
        sys.exit(f"auto_vs_tune: error: {e}")
