"""Measuring the short list of ``hpctrain tune``: run each candidate, keep the fastest, write it.

Each candidate is a real training run through :func:`hpctrain.bench.model.run_model_bench`; a
failure is recorded with a one-line reason and the next one runs, Ctrl-C keeps what was
measured, and ``--resume`` takes the finished candidates of an earlier call. The files written
into ``--out`` (results.json, best.overrides, best.yaml) are described in the package docstring.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.bench.tune.candidates import Candidate, TunePlan
from hpctrain.errors import ConfigError, HpctrainError


def failure_reason(err: BaseException) -> str:
    """One line saying why a candidate failed, from the error or the run's output tail."""
    text = "\n".join([err.what, *err.lines]) if isinstance(err, HpctrainError) else str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    oom = [line for line in lines if "out of memory" in line.lower()]
    ours = [line for line in lines if line.startswith("hpctrain: error:")]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    if oom:
        line = oom[0] if oom[0].lower().startswith("out of memory") else f"out of memory: {oom[0]}"
    else:
        line = (ours or errors or lines or ["failed"])[-1]
    return line if len(line) <= 200 else line[:197] + "..."


def rate_unit(plan: TunePlan) -> str:
    """What the candidates are ranked by: samples/s for a task whose samples are not tokens
    (its tokens/s are its samples/s, hpctrain.task), else tokens/s."""
    if plan.task and all((c.measured or {}).get("tokens_per_sample") in (None, 1)
                         for c in plan.candidates):
        return "samples/s"
    return "tokens/s"


def measure(plan: TunePlan, config: Path | None, overrides: list[str], gpus: int, out: Path, *,
            steps: int, log_every: int, timeout: float,
            echo: Callable[[str], None] = print) -> bool:
    """Run each candidate in turn and record its result; True if Ctrl-C stopped it."""
    from hpctrain.bench.model import run_model_bench

    n = len(plan.candidates)
    for i, c in enumerate(plan.candidates, 1):
        if c.status in ("ok", "failed"):  # --resume: measured by an earlier call
            echo(f"[{i}/{n}] {c.label}: {c.status} in the earlier call, kept")
            continue
        echo(f"[{i}/{n}] {c.label}: {' '.join(c.overrides)}")
        c.run_dir = str(out / f"c{i:02d}")
        try:
            row, _ = run_model_bench(config, [*overrides, *c.overrides], nproc=gpus,
                                     out=Path(c.run_dir), steps=steps, log_every=log_every,
                                     timeout=timeout)
        except KeyboardInterrupt:
            c.status, c.reason = "interrupted", "Ctrl-C"
            for rest in plan.candidates[i:]:
                rest.status = "not_run"
            echo(f"[{i}/{n}] interrupted: keeping the {i - 1} measured before")
            return True
        except HpctrainError as e:
            c.status, c.reason = "failed", failure_reason(e)
            echo(f"[{i}/{n}] failed: {c.reason}")
            if plan.task and c.reason.startswith("out of memory"):
                _skip_larger(plan.candidates[i:], c, echo)
            continue
        c.status = "ok"
        c.measured = {key: row.get(key) for key in (
            "tokens_per_s_per_gpu", "tokens_per_sample", "mfu_pct", "hfu_pct", "peak_mem_gb",
            "step_time_s", "final_loss", "measured_steps", "wall_s")}
        if plan.task:  # a task's trainer counts tokens_per_sample tokens per sample
            c.measured["samples_per_s_per_gpu"] = (row["tokens_per_s_per_gpu"]
                                                   / (row.get("tokens_per_sample") or 1))
        mfu = "unknown" if row["mfu_pct"] is None else f"{row['mfu_pct']:.1f}%"
        unit = "tokens/s" if not plan.task or (row.get("tokens_per_sample") or 1) > 1 \
            else "samples/s"
        predicted = f" (predicted {c.predicted_peak / 1e9:.2f})" if c.predicted_peak else ""
        echo(f"[{i}/{n}] {row['tokens_per_s_per_gpu']:,.0f} {unit} per GPU, MFU {mfu}, "
             f"peak {row['peak_mem_gb']:.2f} GB{predicted}")
    return False


def _skip_larger(rest: list[Candidate], oom: Candidate, echo: Callable[[str], None]) -> None:
    """Record the candidates of ``oom``'s setting at a larger micro-batch as failed, unrun: a
    task's candidates run smallest first (task_candidates), and more samples need more memory."""
    s = oom.setting
    for c in rest:
        if (c.status == "pending" and (c.setting.strategy, c.setting.zero) == (s.strategy, s.zero)
                and c.setting.micro_batch > s.micro_batch):
            c.status = "failed"
            c.reason = f"not run: micro-batch {s.micro_batch} of this setting ran out of memory"
            echo(f"skipping {c.label}: {c.reason}")


def resume_from(plan: TunePlan, path: Path, same: dict[str, Any]) -> int:
    """Take the finished candidates of an earlier call of the same tuning; return how many."""
    try:
        doc = json.loads(path.read_text())
        earlier = doc["candidates"]
        differs = [k for k, v in same.items() if doc["meta"].get(k) != v]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume: {path} cannot be read ({e})",
                          hint="drop --resume, or pass another --out") from None
    if differs or [c["overrides"] for c in earlier] != [c.overrides for c in plan.candidates]:
        raise ConfigError(
            f"--resume: {path} is from another tuning ("
            + (f"its {', '.join(differs)} differ" if differs else "other candidates") + ")",
            expected="the same config, overrides, GPUs, device and steps as the earlier call",
            hint="drop --resume to start over (it overwrites results.json), or pass another "
            "--out")
    taken = 0
    for c, e in zip(plan.candidates, earlier, strict=True):
        if e["status"] in ("ok", "failed"):
            c.status, c.reason, c.measured, c.run_dir = (e["status"], e["reason"], e["measured"],
                                                        e["run_dir"])
            taken += 1
    return taken


def winner(candidates: list[Candidate]) -> int | None:
    """Index of the fastest measured candidate (tokens/s per GPU), None if none ran."""
    ok = [i for i, c in enumerate(candidates) if c.status == "ok"]
    if not ok:
        return None
    return max(ok, key=lambda i: candidates[i].measured["tokens_per_s_per_gpu"])


def write_results(plan: TunePlan, out: Path, meta: dict[str, Any], best: int | None,
                  config: Path | None, overrides: list[str]) -> list[Path]:
    """Write results.json and, with a winner, best.overrides and best.yaml; return the paths."""
    from hpctrain.bench.model import run_config
    from hpctrain.config import dump_yaml
    from hpctrain.data.shards import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "winner": best,
           "candidates": [c.to_json(i) for i, c in enumerate(plan.candidates)]}
    paths = [out / "results.json"]
    atomic_write(paths[0], [(json.dumps(doc, indent=2) + "\n").encode()])
    if best is None:
        return paths
    c = plan.candidates[best]
    lines = [*overrides, *c.overrides]
    atomic_write(out / "best.overrides", ["".join(f"{x}\n" for x in lines).encode()])
    tok = c.measured["tokens_per_s_per_gpu"]
    header = (f"# hpctrain tune: {c.label}, {tok:,.0f} {rate_unit(plan)} per GPU on "
              f"{meta['gpus']} x {plan.device_name} ({out / 'results.json'})\n")
    text = header + dump_yaml(run_config(config, lines, meta["gpus"]))
    atomic_write(out / "best.yaml", [text.encode()])
    return [*paths, out / "best.overrides", out / "best.yaml"]

