"""fp8 against bf16 on the loss, with bf16's own run-to-run spread beside the gap.

    python benchmarks/fp8_loss.py --config configs/llama-1b.yaml --steps 200 --repeats 2
    python benchmarks/fp8_loss.py --config configs/llama-8b-fsdp.yaml --nproc 2 --steps 200 \
        --repeats 2 --set parallel.activation_checkpointing=none train.micro_batch=4

Issue 14 asks that fp8 training end within 1% of bf16's loss after 200 steps. One run of each
cannot show that: two bf16 runs of the same config (same seed, same data order) already end
apart, since GPU kernels sum in no fixed order, and one lease's fp8 run ended 2.3% above bf16
while the next ended 2.7% below. So this runs each precision ``--repeats`` times, in ABBA order
(bf16, fp8, fp8, bf16, ...: drift of the machine falls on both), scores each run by its mean loss
over the last ``--tail`` steps (rank 0's logged windows), and prints:

- every run's score and tokens/s per GPU;
- bf16's spread: (largest - smallest) / mean over its repeats;
- fp8's gap: (mean fp8 score - mean bf16 score) / mean bf16 score;
- the verdict: within the bound (``--bound``, 1%) or not, and whether bf16's spread is itself
  under the bound (if not, no comparison at this length can resolve it).

Each run is a real ``hpctrain train`` (``hpctrain.bench.model.run_model_bench``); everything goes
to ``--out`` (one folder per run, and ``fp8_loss.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from hpctrain.bench.model import run_model_bench, step_records
from hpctrain.errors import HpctrainError
from hpctrain.runtime.env import MULTICAST_OFF

PRECISIONS = ("bf16", "fp8")


@dataclass
class Verdict:
    """What the repeats say: bf16's spread, fp8's gap, and whether each is under the bound."""

    bf16_spread: float | None  # None with one bf16 run
    fp8_gap: float
    bound: float

    @property
    def within(self) -> bool:
        """fp8's mean score is within the bound of bf16's."""
        return abs(self.fp8_gap) <= self.bound

    @property
    def resolvable(self) -> bool:
        """bf16's own runs agree to within the bound (else the gap says little)."""
        return self.bf16_spread is not None and self.bf16_spread <= self.bound

    def text(self) -> str:
        """One paragraph for the terminal and the results."""
        spread = "n/a (one run)" if self.bf16_spread is None else f"{self.bf16_spread:.2%}"
        lines = [f"bf16 spread over its repeats: {spread}",
                 f"fp8 against bf16 (mean scores): {self.fp8_gap:+.2%}",
                 f"verdict: fp8 {'within' if self.within else 'NOT within'} "
                 f"{self.bound:.0%} of bf16"]
        if self.bf16_spread is None:
            lines.append("note: one run of each says nothing of bf16's own spread; use "
                         "--repeats 2 or more")
        elif not self.resolvable:
            lines.append(f"note: bf16's own runs differ by more than {self.bound:.0%}; "
                         "more steps or repeats are needed to resolve the bound")
        return "\n".join(lines)


def order(repeats: int) -> list[str]:
    """ABBA: bf16, fp8, fp8, bf16, bf16, fp8, ... (``repeats`` runs of each)."""
    runs = []
    for i in range(repeats):
        runs += list(PRECISIONS if i % 2 == 0 else PRECISIONS[::-1])
    return runs


def tail_score(run_dir: Path, tail: int) -> float:
    """Mean loss of rank 0's logged windows that end in the last ``tail`` steps of the run."""
    windows = [w for w in step_records(run_dir, 1)[0] if "loss" in w]
    if not windows:
        raise HpctrainError(f"{run_dir} logged no loss windows",
                            expected="a finished training run's metrics")
    last = windows[-1]["step"]
    kept = [w["loss"] for w in windows if w["step"] > last - tail]
    return statistics.fmean(kept)


def verdict(scores: dict[str, list[float]], bound: float) -> Verdict:
    """bf16's spread and fp8's gap from each precision's run scores."""
    bf16, fp8 = scores["bf16"], scores["fp8"]
    mean = statistics.fmean(bf16)
    spread = (max(bf16) - min(bf16)) / mean if len(bf16) > 1 else None
    return Verdict(spread, (statistics.fmean(fp8) - mean) / mean, bound)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("configs/llama-1b.yaml"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides for both precisions' runs")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tail", type=int, default=50, help="steps at the end whose loss is scored")
    p.add_argument("--repeats", type=int, default=2, help="runs of each precision")
    p.add_argument("--bound", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=Path("runs/fp8-loss"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the repeats, print the runs and the verdict; 0 when every run finished."""
    p = parser()
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1 run of each precision")
    if not args.log_every <= args.tail <= args.steps:
        p.error(f"--tail {args.tail}: between one logging window ({args.log_every}) and "
                f"--steps ({args.steps})")
    out = args.out.resolve()
    runs, scores = [], {p: [] for p in PRECISIONS}
    for i, precision in enumerate(order(args.repeats)):
        folder = out / f"{i:02d}-{precision}"
        print(f"== run {i + 1}/{2 * args.repeats}: {precision}", flush=True)
        try:
            row, _ = run_model_bench(args.config, [*args.set, f"train.precision={precision}"],
                                     nproc=args.nproc, out=folder, steps=args.steps,
                                     log_every=args.log_every, timeout=args.timeout,
                                     env={**os.environ, **MULTICAST_OFF})
        except HpctrainError as e:
            print(f"run failed: {str(e)[-2000:]}", file=sys.stderr)
            return 1
        score = tail_score(folder / "train", args.tail)
        scores[precision].append(score)
        runs.append({"precision": precision, "score": score,
                     "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"], "folder": str(folder)})
        print(f"   loss over the last {args.tail} steps {score:.4f}, "
              f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU", flush=True)
    v = verdict(scores, args.bound)
    print(v.text())
    (out / "fp8_loss.json").write_text(json.dumps(
        {"runs": runs, "bf16_spread": v.bf16_spread, "fp8_gap": v.fp8_gap, "bound": v.bound,
         "within": v.within, "resolvable": v.resolvable, "steps": args.steps,
         "tail": args.tail}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
