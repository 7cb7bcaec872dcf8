"""hpctrain beside torchtitan 0.2.2: the same shapes and layouts, alternately, in one call.

    python benchmarks/peers/compare.py --layouts 1b-1gpu 1b-fsdp2 --steps 60
    python benchmarks/peers/compare.py --layouts 1b-tp2 1b-pp2 8b-fsdp2-ac --repeat 2

Each layout names both sides' settings (`LAYOUTS`); each side is a real training run (hpctrain
through `hpctrain.bench.model`, torchtitan through `torchtitan_peer.py` beside this file), the
warm-up windows skipped on both. With ``--repeat 2`` the pairs run hpctrain, torchtitan,
torchtitan, hpctrain, so drift of the machine falls on both. It prints a Markdown table (tokens/s
per GPU, MFU by hpctrain's convention for both, peak memory, ratio) and writes every row as JSON
to ``--out``/compare.json. Every speed claim in the README comes from this script.

    python benchmarks/peers/compare.py --layouts 8b-tp2 --set parallel.mixed_precision=autocast \
        --tag autocast --only hpctrain          # an A/B of one setting: rows 8b-tp2-autocast
    python benchmarks/peers/compare.py --layouts 8b-pp2 --profile   # + profile-8b-pp2.md
    python benchmarks/peers/compare.py --layouts 8b-tp2 --set parallel.async_tp=true \
        --tag asynctp            # both sides: the peer gets its async-TP flag (below)

    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 4 --out runs/tune/8b-4gpu
    python benchmarks/peers/compare.py --tuned runs/tune/8b-4gpu --steps 30   # layout "tuned"

``--tuned`` compares the configuration ``hpctrain tune`` picked: our side trains its best.yaml,
the peer the same layout, batch and precision in its flags (``tuned.py``). A ``--set`` that the peer
has a counterpart for (ZeRO-2, fp8, pure bf16, async TP, batch shape, checkpointing) changes the
peer's run as ``tuned.py`` maps a config, so an A/B of both sides stays like for like; what it
has none for (bf16 gradient reduction, the chunked loss, FSDP prefetch or units) is said in the
row's note. ``--peer-arg`` adds any other torchtitan flag.

``--profile`` adds, after each layout's pairs, a short run of our side with three steps profiled
and writes ``hpctrain profile``'s table of it (GPU time by kind, idle, exposed communication).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: as_measured
from torchtitan_peer import PEER_SCHEDULES, PeerRun, run_peer  # noqa: E402
from tuned import peer_run, read_tuned  # noqa: E402

from as_measured import pin  # noqa: E402
from hpctrain.bench.model import run_model_bench  # noqa: E402
from hpctrain.errors import HpctrainError  # noqa: E402
from hpctrain.plan.gpu import gpu_name  # noqa: E402
from hpctrain.runtime.env import MULTICAST_OFF  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Layout:
    """One comparison: hpctrain's config and overrides, torchtitan's run, the GPUs both use."""

    gpus: int
    config: str
    overrides: list[str] = field(default_factory=list)
    peer: PeerRun = field(default_factory=PeerRun)
    note: str = ""


_1B, _8B = "configs/llama-1b.yaml", "configs/llama-8b-fsdp.yaml"
LAYOUTS: dict[str, Layout] = {
    "1b-1gpu": Layout(1, _1B, [], PeerRun(size="1b", gpus=1)),
    "1b-fsdp2": Layout(2, _1B, ["parallel.strategy=fsdp"], PeerRun(size="1b", gpus=2)),
    "1b-fsdp4": Layout(4, _1B, ["parallel.strategy=fsdp"], PeerRun(size="1b", gpus=4)),
    # TP/PP with no FSDP dimension: torchtitan computes in fp32 unless its parameters are bf16
    # (FIELD_NOTES), so the peer runs pure bf16 there: its fastest setting.
    "1b-tp2": Layout(2, _1B, ["parallel.tp=2"],
                     PeerRun(size="1b", gpus=2, tp=2, dp_shard=1, dtype="bfloat16"),
                     "peer: pure bf16 (its fp32 default computes in fp32 with TP alone)"),
    "1b-pp2": Layout(2, _1B, ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                              "train.micro_batch=1", "train.grad_accum=8"],
                     PeerRun(size="1b", gpus=2, pp=2, dp_shard=1, local_batch=8,
                             pp_microbatch_size=1, dtype="bfloat16"),
                     "global batch 8 x 2048, 8 micro-batches of 1; peer: pure bf16"),
    # plan parallel's first choice for 1b on 2 GPUs (DDP; the peer replicates the same way).
    "1b-ddp2": Layout(2, _1B, ["parallel.strategy=ddp"],
                      PeerRun(size="1b", gpus=2, dp_shard=1, dp_replicate=2)),
    # ... and on 4 GPUs (issue 15: plan parallel ranks DDP4 and FSDP4 first, equal).
    "1b-ddp4": Layout(4, _1B, ["parallel.strategy=ddp"],
                      PeerRun(size="1b", gpus=4, dp_shard=1, dp_replicate=4)),
    "8b-fsdp2-ac": Layout(2, _8B, [], PeerRun(size="8b", gpus=2, ac="full", local_batch=2)),
    # 8b on 2 GPUs as plan parallel ranks it for 141 GB cards: FSDP without AC at micro-batch 4
    # first, then TP2 at micro-batch 8 and PP2 with 8 micro-batches of 1 (no FSDP dimension,
    # so the peer runs pure bf16 there, as for 1b).
    "8b-fsdp2": Layout(2, _8B, ["parallel.activation_checkpointing=none", "train.micro_batch=4"],
                       PeerRun(size="8b", gpus=2, local_batch=4), "no AC, micro-batch 4"),
    "8b-tp2": Layout(2, _8B, ["parallel.strategy=none", "parallel.tp=2", "train.micro_batch=8",
                              "parallel.activation_checkpointing=none"],
                     PeerRun(size="8b", gpus=2, tp=2, dp_shard=1, local_batch=8,
                             dtype="bfloat16"),
                     "no AC, batch 8 x 2048; peer: pure bf16"),
    "8b-pp2": Layout(2, _8B, ["parallel.strategy=none", "parallel.pp=2",
                              "parallel.pp_schedule=1f1b", "train.micro_batch=1",
                              "train.grad_accum=8", "parallel.activation_checkpointing=none"],
                     PeerRun(size="8b", gpus=2, pp=2, dp_shard=1, local_batch=8,
                             pp_microbatch_size=1, dtype="bfloat16"),
                     "no AC, 8 micro-batches of 1; peer: pure bf16"),
    "8b-fsdp4-ac": Layout(4, _8B, [], PeerRun(size="8b", gpus=4, ac="full", local_batch=2)),
    # 8b on 4 GPUs (issue 15) as plan parallel ranks it for 141 GB cards: FSDP without AC first,
    # then FSDP2 x TP2 and FSDP2 x PP2 (FSDP on both sides: fp32 masters on both).
    "8b-fsdp4": Layout(4, _8B, ["parallel.activation_checkpointing=none", "train.micro_batch=4"],
                       PeerRun(size="8b", gpus=4, local_batch=4), "no AC, micro-batch 4"),
    "8b-tp2fsdp2": Layout(4, _8B, ["parallel.tp=2", "train.micro_batch=8",
                                   "parallel.activation_checkpointing=none"],
                          PeerRun(size="8b", gpus=4, tp=2, dp_shard=2, local_batch=8),
                          "no AC, 8 x 2048 per data-parallel rank"),
    "8b-pp2fsdp2": Layout(4, _8B, ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                                   "train.micro_batch=1", "train.grad_accum=8",
                                   "parallel.activation_checkpointing=none"],
                          PeerRun(size="8b", gpus=4, pp=2, dp_shard=2, local_batch=8,
                                  pp_microbatch_size=1),
                          "no AC, 8 micro-batches of 1 per data-parallel rank"),
}
# TP4, PP2 x TP2 and PP4 under every schedule, for 1b and 8b (issue 15; no FSDP dimension, so
# the peer runs pure bf16).
for _size, _config in (("1b", _1B), ("8b", _8B)):
    _no_ac = ["parallel.strategy=none", "parallel.activation_checkpointing=none"]
    LAYOUTS[f"{_size}-tp4"] = Layout(
        4, _config, [*_no_ac, "parallel.tp=4", "train.micro_batch=8"],
        PeerRun(size=_size, gpus=4, tp=4, dp_shard=1, local_batch=8, dtype="bfloat16"),
        "no AC, batch 8 x 2048; peer: pure bf16")
    LAYOUTS[f"{_size}-pp2tp2"] = Layout(
        4, _config, [*_no_ac, "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1f1b",
                     "train.micro_batch=1", "train.grad_accum=8"],
        PeerRun(size=_size, gpus=4, pp=2, tp=2, dp_shard=1, local_batch=8,
                pp_microbatch_size=1, dtype="bfloat16"),
        "no AC, 8 micro-batches of 1; peer: pure bf16")
    for _ours, _theirs in PEER_SCHEDULES.items():
        # Zero-bubble schedules split backward into two passes, which we refuse to compile
        # (parallel/layout.py): both sides run them eager.
        _zb = _ours in ("interleaved_zb", "zbv")
        LAYOUTS[f"{_size}-pp4-{_ours}"] = Layout(
            4, _config, [*_no_ac, "parallel.pp=4", f"parallel.pp_schedule={_ours}",
                         "train.micro_batch=1", "train.grad_accum=8",
                         *(["parallel.compile=false"] if _zb else [])],
            PeerRun(size=_size, gpus=4, pp=4, dp_shard=1, pp_schedule=_theirs, local_batch=8,
                    pp_microbatch_size=1, dtype="bfloat16", compile=not _zb),
            "no AC, 8 micro-batches of 1; peer: pure bf16" + ("; eager" if _zb else ""))
# The configs leave the batch shape and strategy to `auto`; each layout keeps the values it was
# written and measured with, so both sides run the shapes named above.
for _layout in LAYOUTS.values():
    pin(_layout.config, _layout.overrides)


def run_ours(name: str, layout: Layout, steps: int, out: Path, timeout: float) -> dict:
    """hpctrain's row for one layout."""
    try:
        row, _ = run_model_bench(REPO / layout.config, layout.overrides, nproc=layout.gpus,
                                 out=out / f"hpctrain-{name}", steps=steps, log_every=5,
                                 timeout=timeout, env={**os.environ, **MULTICAST_OFF})
    except HpctrainError as e:
        return {"side": "hpctrain", "layout": name, "error": str(e).splitlines()[0],
                "log_tail": str(e)[-3000:]}
    return {"side": "hpctrain", "layout": name, **row}


def profile_ours(name: str, layout: Layout, out: Path, timeout: float) -> str:
    """A short run of our side with steps 21..23 profiled, apart from the measured runs (the
    profiler slows the steps it records); returns ``hpctrain profile``'s table of it."""
    from hpctrain.observe.trace_summary import find_traces, markdown, summarise_trace

    folder = out / f"profile-{name}"
    try:
        run_model_bench(REPO / layout.config,
                        [*layout.overrides, "profile.steps=[21,23]", "profile.memory=false"],
                        nproc=layout.gpus, out=folder, steps=25, log_every=5, timeout=timeout,
                        env={**os.environ, **MULTICAST_OFF})
        text = markdown([summarise_trace(path, steps)
                         for path, steps in find_traces(folder / "train")])
    except HpctrainError as e:
        text = f"profile failed: {str(e)[-2000:]}"
    (out / f"profile-{name}.md").write_text(text + "\n")
    return text


def run_theirs(name: str, layout: Layout, steps: int, out: Path, timeout: float) -> dict:
    """torchtitan's row for one layout."""
    row = run_peer(replace(layout.peer, steps=steps), out / "torchtitan", timeout=timeout)
    return {"side": "torchtitan", "layout": name, **row}


def table(rows: list[dict], device: str, notes: dict[str, str]) -> str:
    """Side-by-side Markdown: per layout, the median of each side's runs, and the ratio as the
    median of the same-call pairs' ratios (each of our runs over the peer's run of the same
    pair: the machine's drift between pairs cancels), each pair's ratio listed; the layout's
    note (``notes``, by layout name)."""
    lines = [f"Device: {device}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}", "",
             "| layout | hpctrain tok/s/GPU | MFU | mem GB | torchtitan tok/s/GPU | MFU | "
             "mem GiB | ratio (median of pairs) | pairs | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, tag in dict.fromkeys((r["layout"], r.get("tag", "")) for r in rows):
        ours = [r for r in rows if (r["layout"], r.get("tag", "")) == (name, tag)
                and r["side"] == "hpctrain"]
        theirs = [r for r in rows if (r["layout"], r.get("tag", "")) == (name, tag)
                  and r["side"] == "torchtitan"]
        a, b = _summary(ours, "peak_mem_gb"), _summary(theirs, "peak_mem_gib")
        pairs = pair_ratios(ours, theirs)
        ratio = f"{statistics.median(pairs):.2f}x" if pairs else "n/a"
        shown = " / ".join(f"{x:.3f}" for x in pairs)
        lines.append(f"| {name}{tag} | {a[3]} | {a[1]} | {a[2]} | {b[3]} | {b[1]} | {b[2]} | "
                     f"{ratio} | {shown} | {notes.get(name, '')} |")
    return "\n".join(lines)


def pair_ratios(ours: list[dict], theirs: list[dict]) -> list[float]:
    """Our tokens/s over the peer's, pair by pair (rows of the same ``pair`` index), for the
    pairs where both sides ran."""
    def rates(rows: list[dict]) -> dict[int, float]:
        return {r.get("pair", 0): r["tokens_per_s_per_gpu"] for r in rows
                if "error" not in r and r.get("tokens_per_s_per_gpu")}
    a, b = rates(ours), rates(theirs)
    return [a[i] / b[i] for i in sorted(a) if i in b]


def _summary(rows: list[dict], mem_key: str) -> tuple[float | None, str, str, str]:
    good = [r for r in rows if "error" not in r]
    if not good:
        return None, "", "", "error: " + (rows[0]["error"] if rows else "not run")
    rates = [r["tokens_per_s_per_gpu"] for r in good]
    mfu = [r["mfu_pct"] for r in good if r.get("mfu_pct") is not None]
    shown = " / ".join(f"{x:,.0f}" for x in rates)
    return (statistics.median(rates), f"{statistics.median(mfu):.1f}%" if mfu else "n/a",
            f"{max(r[mem_key] for r in good):.1f}", shown)


def _tag(text: str) -> str:
    # Taken without its hyphen: argparse reads "--tag -autocast" as an unknown option "-a...",
    # which once cost a GPU lease its A/B runs. argparse also passes the default ("") through
    # here: that is no tag, not an error (refusing it once cost a lease every run).
    if not text:
        return ""
    name = text.lstrip("-")
    if not name:
        raise argparse.ArgumentTypeError("a tag needs a name, e.g. --tag autocast")
    return f"-{name}"


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=[])
    p.add_argument("--tuned", type=Path, metavar="TUNE_DIR",
                   help="also the layout `hpctrain tune --out TUNE_DIR` picked (named 'tuned')")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=1, help="pairs per layout (ABBA order)")
    p.add_argument("--only", choices=["hpctrain", "torchtitan"], default=None)
    p.add_argument("--out", type=Path, default=Path("runs/peers"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for our side of every layout, and what it changes of the "
                   "peer's run where the peer has a counterpart (an A/B: name it --tag)")
    p.add_argument("--peer-arg", action="append", default=[], metavar="--FLAG[=VALUE]",
                   help="a torchtitan command-line argument for the peer of every layout (give "
                   "it as --peer-arg=--its.flag, so it is not read as ours)")
    p.add_argument("--tag", default="", type=_tag,
                   help="a name for the --set variant, appended to the layout names in the "
                   "results as -TAG")
    p.add_argument("--profile", action="store_true",
                   help="after each layout, profile 3 steps of our side in a run of its own")
    return p


def chosen_layout(name: str, args: argparse.Namespace) -> Layout:
    """Layout ``name`` with the command line's ``--set`` (ours, and what it changes of the
    peer's run where the peer runs) and ``--peer-arg`` (theirs, appended unless already
    there)."""
    base = LAYOUTS[name]
    peer, note = base.peer, base.note
    if args.set and args.only != "hpctrain":
        peer, notes = peer_following(base, args.set)
        note = "; ".join(n for n in (note, *notes) if n)
    extra = [*peer.extra, *(a for a in args.peer_arg if a not in peer.extra)]
    return replace(base, overrides=[*base.overrides, *args.set],
                   peer=replace(peer, extra=extra), note=note)


def peer_following(layout: Layout, overrides: list[str]) -> tuple[PeerRun, list[str]]:
    """``layout``'s peer run changed as ``overrides`` change our config, and the new notes.

    ``tuned.peer_run`` maps our config to torchtitan's settings; what it maps differently with
    the overrides than without them is applied to the layout's own peer run (whose other
    choices, such as pure bf16 without an FSDP dimension, stay), so ``--set
    parallel.reshard_after_forward=false`` gives the peer
    ``--parallelism.fsdp_reshard_after_forward=never``, ``--set train.precision=fp8`` its
    float8 converters, and so on. Exits when the peer cannot follow.
    """
    config = REPO / layout.config
    try:
        before, notes_before = peer_run(config, layout.gpus, layout.overrides)
        after, notes_after = peer_run(config, layout.gpus, [*layout.overrides, *overrides])
    except HpctrainError as e:
        sys.exit(f"compare: error: the peer cannot follow --set {' '.join(overrides)}: {e}\n"
                 "  HINT: run our side alone (--only hpctrain), or give the peer's flags with "
                 "--peer-arg")
    changed = {f.name: getattr(after, f.name) for f in fields(PeerRun)
               if f.name != "extra" and getattr(after, f.name) != getattr(before, f.name)}
    dropped = [a for a in before.extra if a not in after.extra]
    extra = [a for a in layout.peer.extra if a not in dropped]
    extra += [a for a in after.extra if a not in before.extra and a not in extra]
    return (replace(layout.peer, **changed, extra=extra),
            [n for n in notes_after if n not in notes_before])


def main() -> None:
    """Run the chosen layouts on both sides and print the table."""
    args = parser().parse_args()
    names = list(args.layouts)
    if args.tuned is not None:
        try:
            tuned = read_tuned(args.tuned)
        except HpctrainError as e:
            sys.exit(f"compare: error: {e}")
        LAYOUTS["tuned"] = Layout(tuned.gpus, str(tuned.config), [], tuned.peer, tuned.note)
        names.append("tuned")
    if not names:
        sys.exit("compare: error: name --layouts, --tuned or both")
    # Counted and named through NVML: a CUDA context in this process would hold ~0.5 GB of
    # GPU 0 for every run it measures (and shift their numbers).
    if torch.cuda.device_count() == 0:
        sys.exit("compare needs CUDA GPUs")
    out = args.out.resolve()
    rows = []
    notes = {}
    for name in names:
        layout = chosen_layout(name, args)
        notes[name] = layout.note
        if layout.gpus > torch.cuda.device_count():
            print(f"== {name}: needs {layout.gpus} GPUs, skipped", flush=True)
            continue
        sides = [run_ours, run_theirs]
        for i in range(args.repeat):
            for run in (sides if i % 2 == 0 else sides[::-1]):
                side = "hpctrain" if run is run_ours else "torchtitan"
                if args.only and side != args.only:
                    continue
                print(f"== {name} {side}", flush=True)
                row = run(name, layout, args.steps, out, args.timeout)
                row["tag"] = args.tag
                row["pair"] = i
                print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
                if "error" in row:
                    print(row.get("log_tail", ""), flush=True)
                rows.append(row)
        if args.profile:
            print(f"== {name} hpctrain profile\n" + profile_ours(name + args.tag, layout, out,
                                                                args.timeout), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(rows, indent=1))
    print(table(rows, gpu_name(0), notes))
    print(slow_window_lines(rows))


def slow_window_lines(rows: list[dict]) -> str:
    """Our windows more than 5% below their run's median, with the cause the metrics show."""
    lines = [f"- {r['layout']}{r.get('tag', '')}: the window ending at step {w['step']} ran "
             f"{w['below_median']:.1%} below the median: {w['cause']}"
             for r in rows for w in r.get("slow_windows") or []]
    return "\n".join(["Slow windows (hpctrain):", *lines] if lines else
                     ["Slow windows (hpctrain): none more than 5% below the median"])


if __name__ == "__main__":
    main()
