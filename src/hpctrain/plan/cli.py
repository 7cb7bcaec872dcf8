"""``hpctrain plan ...``: memory per GPU, parallel layout, GPU-hours budget, checkpoint interval.

    hpctrain plan memory configs/llama-8b-fsdp.yaml --gpus 4 --gpu h100
    hpctrain plan memory configs/llama-8b-fsdp.yaml parallel.strategy=none parallel.tp=2 \
        parallel.pp=2 train.grad_accum=8 --gpu h100
    hpctrain plan parallel configs/llama-8b-fsdp.yaml --gpus-per-node 8 --nodes 4 --gpu h100
    hpctrain plan budget --tokens 1T --tokens-per-s 8600 --gpus 256
    hpctrain plan budget --tokens 1T --from-bench runs/bench/model-X --gpus 256 \
        --price-per-gpu-hour 2.5 --grid-gco2-per-kwh 400 --pue 1.2
    hpctrain plan interval --save-min 5 --mttf-h 24
    hpctrain plan interval configs/llama-8b-fsdp.yaml --from-run runs/pilot --gpus 1024
    hpctrain plan goodput checkpoint.mttf_gpu_hours=50000 --gpus 1024 --save-s 20 --restart-s 300

``memory`` and ``parallel`` size what ``hpctrain train`` runs: the same CONFIG and KEY=VALUE
overrides, read and checked by the same loader (``hpctrain.config``), mapped onto the memory
model in one place (``MemoryOptions.from_config``). ``plan parallel`` prints the ``hpctrain
train`` line of the layout it recommends. ``interval`` and ``goodput`` read the checkpoint
schedule's keys (``checkpoint.mttf_gpu_hours``, ``checkpoint.max_overhead``) the same way.
A task file (``my_task.py``, hpctrain.task) is read as train reads it: ``memory`` sizes its
model from a measured step, ``interval`` and ``goodput`` read its checkpoint keys, and
``parallel`` refuses it (it ranks layouts by a built-in family's memory model and
tensor-parallel plan, which a model of the user's own has not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.errors import ConfigError
from hpctrain.numeric_args import big_count, count, real

if TYPE_CHECKING:
    from hpctrain.config import JobConfig
    from hpctrain.plan.memory_options import MemoryOptions

# The flags ``plan memory`` and ``plan parallel`` took before they took the training config,
# kept (deprecated) for the commands the README showed: each is the override it stands for.
LEGACY_FLAGS = {"model": ("--model", "model.size"), "family": ("--family", "model.family"),
                "strategy": ("--strategy", "parallel.strategy"),
                "ac": ("--ac", "parallel.activation_checkpointing"),
                "micro_batch": ("--micro-batch", "train.micro_batch")}
# The other flags they took, now refused by name with the override that replaced each ("{}" is
# the value given): a script written for them gets more than argparse's "unrecognized".
REMOVED_FLAGS = {
    "--tp": "parallel.tp={}", "--pp": "parallel.pp={}", "--pp-schedule": "parallel.pp_schedule={}",
    "--pp-stages-per-rank": "parallel.pp_stages_per_rank={}",
    "--pp-microbatches": "train.grad_accum={}", "--zero": "parallel.reshard_after_forward=false",
    "--precision": "train.precision={}", "--master-weights": "train.master_weights={}",
    "--fp8-recipe": "train.fp8_recipe={}", "--grad-accum": "train.grad_accum={}",
    "--mixed-precision": "parallel.mixed_precision={}",
    "--reduce-precision": "parallel.reduce_precision={}",
    "--fsdp-prefetch": "parallel.fsdp_prefetch={}",
    "--fsdp-group-blocks": "parallel.fsdp_group_blocks={}", "--seq-len": "data.seq_len={}",
    "--no-compile": "parallel.compile=false", "--dim": "model.dim={}",
    "--layers": "model.n_layers={}", "--heads": "model.n_heads={}",
    "--kv-heads": "model.n_kv_heads={}", "--ffn-dim": "model.ffn_dim={}",
    "--vocab": "model.vocab_size={}", "--config": "{} as the first argument (CONFIG)"}
REMOVED_MTTF_FLAGS = {"--gpu-mttf-h": "checkpoint.mttf_gpu_hours={}",
                      "--max-overhead": "checkpoint.max_overhead={}"}


class _Removed(argparse.Action):
    """A flag plan no longer takes: refused, naming the override that replaced it."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        self.replacement = replacement
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is no longer a flag of plan, which takes `hpctrain train`'s "
                     f"config and KEY=VALUE overrides: write "
                     f"{self.replacement.format(values if values is not None else 'VALUE')}")


def _removed_args(q: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    for flag, replacement in flags.items():
        q.add_argument(flag, action=_Removed, replacement=replacement)


# What those commands assumed, without a CONFIG, where train's defaults differ.
LEGACY_DEFAULTS = {
    "memory": ["parallel.strategy=fsdp", "train.micro_batch=1", "data.seq_len=2048",
               "parallel.compile=true"],
    # 4 samples per GPU: the global batch plan parallel compared layouts at.
    "parallel": ["train.micro_batch=4", "data.seq_len=2048", "parallel.compile=true"]}
# What plan parallel chooses itself (the config's own values are what the layouts replace).
CHOSEN_BY_PLAN = ("parallel.strategy", "parallel.activation_checkpointing")


def _tokens(text: str) -> float:
    """--tokens: '300B' -> 3e11, '1T' -> 1e12, '2e9' -> 2e9 (up to 1e18)."""
    try:
        return big_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` and its sub-commands on the top-level sub-parser set."""
    p = sub.add_parser("plan", help="memory, parallel layout, budget, checkpoint interval",
                       description="Size a job before it runs: memory per GPU, the fastest "
                       "parallel layout that fits, walltime and GPU-hours (cost, energy, CO2e), "
                       "the checkpoint interval and the goodput it buys.")
    psub = p.add_subparsers(dest="plan_command", required=True, metavar="PLAN")

    m = psub.add_parser("memory", help="per-GPU memory of a training config on N GPUs",
                        description="Per-GPU memory of what `hpctrain train CONFIG KEY=VALUE ...` "
                        "runs on --gpus GPUs (parameters, gradients, optimizer state, working "
                        "buffers, activations, the peak), and whether it fits --gpu.")
    _job_args(m, legacy=("model", "family", "strategy", "ac", "micro_batch"))
    m.add_argument("--gpus", type=count(1, 1 << 24), default=None,
                   help="GPUs the job trains on, as train's --nproc (default: the fewest the "
                   "config's layout needs, tp x pp x dp_replicate)")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")

    q = psub.add_parser("parallel", help="recommend a layout for a cluster shape, as a command",
                        description="Rank the layouts of CONFIG (strategy, tp, pp, micro-batch, "
                        "activation checkpointing) that fit --nodes x --gpus-per-node GPUs by "
                        "predicted tokens/s per GPU, and print the `hpctrain train` (or sbatch) "
                        "command of the fastest.")
    _job_args(q, legacy=("model", "family"))
    q.add_argument("--gpus-per-node", type=count(1, 1024), default=8, help="GPUs in each node")
    q.add_argument("--nodes", type=count(1, 1 << 20), default=1, help="nodes of the cluster shape")
    q.add_argument("--global-batch", type=count(1, 1 << 30), default=None,
                   help="samples per optimizer step all layouts are compared at (default: the "
                   "config's, train.micro_batch x train.grad_accum x its data-parallel degree "
                   "on these GPUs)")
    q.add_argument("--top", type=count(1, 10_000), default=5, help="how many layouts to list")

    b = psub.add_parser("budget", help="walltime and GPU-hours from tokens and tokens/s")
    b.add_argument("--tokens", type=_tokens, required=True, help="tokens to train, e.g. 300B or 1T")
    b.add_argument("--tokens-per-s", type=real(0, 1e12, open_min=True), default=None,
                   help="per GPU")
    b.add_argument("--from-run", type=Path, default=None,
                   help="pilot run directory: tokens/s from its metrics/rank-*.jsonl")
    b.add_argument("--gpus", type=count(1, 1 << 24), required=True, help="GPUs the job trains on")
    b.add_argument("--margin", type=real(0, 10), default=0.15, help="safety margin (0.1-0.2)")
    b.add_argument("--from-bench", type=Path, default=None,
                   help="`bench model` results folder: its tokens/s and joules/token")
    b.add_argument("--warn-gpu-hours", type=real(0), default=10_000.0,
                   help="warn when the budget exceeds this many GPU-hours")
    b.add_argument("--price-per-gpu-hour", type=real(0, 1e6), default=None,
                   help="e.g. 2.5 (dollars)")
    b.add_argument("--gpu-watts", type=real(0, 1e6, open_min=True), default=None,
                   help="mean board power per GPU (e.g. 700 for an H100 SXM at TDP)")
    b.add_argument("--joules-per-token", type=real(0, 1e9, open_min=True), default=None,
                   help="measured energy per token (bench model), all GPUs together")
    b.add_argument("--grid-gco2-per-kwh", type=real(0, 1e5), default=None,
                   help="grid carbon intensity, gCO2e per kWh (e.g. 400)")
    b.add_argument("--pue", type=real(1, 10), default=1.0,
                   help="data-centre power usage effectiveness (1.0 = GPUs only)")

    def mttf_args(q: argparse.ArgumentParser, keys: str) -> None:
        q.add_argument("job", nargs="*", metavar="[CONFIG] KEY=VALUE",
                       help=f"the training config and its overrides, as `hpctrain train` takes "
                       f"them: {keys} as the training schedule reads them (no CONFIG: train's "
                       "defaults)")
        q.add_argument("--mttf-h", type=real(0, 1e9, open_min=True), default=None,
                       help="MTTF of the whole job, hours")
        q.add_argument("--gpus", type=count(1, 1 << 24), default=None,
                       help="GPUs in the job: its MTTF is checkpoint.mttf_gpu_hours over them")
        q.add_argument("--from-run", type=Path, default=None,
                       help="run directory: what a save (and a restart) cost it, measured "
                       "(its goodput ledgers: stall plus the slowdown beside background "
                       "writes)")
        _removed_args(q, REMOVED_MTTF_FLAGS)

    i = psub.add_parser("interval", help="Young/Daly checkpoint interval")
    i.add_argument("--save-min", type=real(0, 1e7, open_min=True), default=None,
                   help="what a save costs the run, minutes (or --from-run)")
    mttf_args(i, "checkpoint.mttf_gpu_hours and checkpoint.max_overhead")

    g = psub.add_parser("goodput", help="expected goodput under failures (Daly's model)")
    g.add_argument("--save-s", type=real(0, 1e9, open_min=True), default=None,
                   help="what a save costs the run, seconds (or --from-run)")
    g.add_argument("--restart-s", type=real(0, 1e9), default=None,
                   help="what a restart costs: gap and start-up, seconds (or --from-run)")
    g.add_argument("--interval-min", type=real(0, 1e9, open_min=True), default=None,
                   help="training time between saves, minutes (default: Daly's optimum)")
    mttf_args(g, "checkpoint.mttf_gpu_hours")


def run(args: argparse.Namespace) -> None:
    """Dispatch ``hpctrain plan <command>``."""
    {"memory": _memory, "parallel": _parallel, "budget": _budget,
     "interval": _interval, "goodput": _goodput}[args.plan_command](args)


def _job_args(q: argparse.ArgumentParser, legacy: tuple[str, ...]) -> None:
    """CONFIG and KEY=VALUE overrides as ``hpctrain train`` takes them, --gpu, and the
    deprecated flags of ``legacy`` (hidden; each prints the override it stands for)."""
    q.add_argument("job", nargs="*", metavar="[CONFIG] KEY=VALUE",
                   help="the training config (YAML, or a task file such as my_task.py) and its "
                   "overrides, exactly as `hpctrain train` takes them, e.g. "
                   "configs/llama-8b-fsdp.yaml train.micro_batch=4 (no CONFIG: train's "
                   "defaults)")
    q.add_argument("--gpu", default=None, help="h100, h200, a100-40, ... or memory in GB")
    for dest in legacy:
        q.add_argument(LEGACY_FLAGS[dest][0], dest=f"legacy_{dest}", default=None,
                       help=argparse.SUPPRESS)
    _removed_args(q, REMOVED_FLAGS)


def _job(args: argparse.Namespace, command: str, world_size: int = 1
         ) -> tuple[Path | None, list[str], JobConfig]:
    """(CONFIG, overrides, the loaded config) of ``plan <command>``: read and checked as
    ``hpctrain train`` reads them (a YAML config, or a task file for ``world_size`` ranks);
    deprecated flags become the overrides they stand for."""
    from hpctrain.config import load_config
    from hpctrain.task import load_run_config

    words = list(args.job)
    config = None
    if words and ("=" not in words[0] or Path(words[0]).exists()):
        config = Path(words.pop(0))
    stray = [w for w in words if "=" not in w]
    if stray:
        raise ConfigError(f"plan {command}: {stray[0]!r} is not a KEY=VALUE override",
                          expected="[CONFIG] KEY=VALUE ...: one config file first, then "
                          "dotted overrides as `hpctrain train` takes them",
                          hint="e.g. hpctrain plan memory configs/llama-8b-fsdp.yaml "
                          "train.micro_batch=4 --gpus 4 --gpu h100")
    legacy = [(LEGACY_FLAGS[dest][0], value, f"{LEGACY_FLAGS[dest][1]}={value}")
              for dest in LEGACY_FLAGS
              if (value := getattr(args, f"legacy_{dest}", None)) is not None]
    if legacy:
        assumed = LEGACY_DEFAULTS[command] if config is None else []
        words = [*assumed, *(o for _, _, o in legacy), *words]
        print(f"hpctrain: note: {', '.join(f'{f} {v}' for f, v, _ in legacy)}: deprecated, "
              f"write {' '.join(o for _, _, o in legacy)}"
              + (f" (without a CONFIG these flags also assume {' '.join(assumed)})"
                 if assumed else ""), file=sys.stderr)
    if command == "parallel":
        chosen = [w for w in words if w.partition("=")[0].strip() in CHOSEN_BY_PLAN]
        if chosen:
            raise ConfigError(f"plan parallel: {chosen[0]!r} is what plan parallel chooses",
                              expected="overrides of what the layouts keep (model, data, "
                              "precision, compile, ...): each layout sets its strategy, tp, "
                              "pp, micro-batch and activation checkpointing",
                              hint="drop it; `hpctrain plan memory CONFIG "
                              f"{chosen[0]}` sizes that choice")
    cfg = (load_config(None, words) if config is None
           else load_run_config(config, words, world_size))
    if command == "parallel" and cfg.task:
        raise ConfigError(
            f"plan parallel: task {cfg.task} is a model of your own (hpctrain.task)",
            expected="a config of a built-in model family: plan parallel ranks tensor, "
            "pipeline and FSDP layouts by the family's memory model and tensor-parallel plan, "
            "which a task's model has not (a task trains data-parallel, DDP or FSDP)",
            hint="size a task with `hpctrain plan memory TASK --gpus N --gpu TYPE` (from a "
            "measured step); plan interval and plan goodput take it too")
    return config, words, cfg


def _memory(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from hpctrain.models import count_params
    from hpctrain.plan.memory import estimate_memory, fmt_gb
    from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes

    _, _, cfg = _job(args, "memory", args.gpus or 1)  # a task file: DDP on several, as train
    pc = cfg.parallel
    gpus = args.gpus or pc.tp * pc.pp * pc.dp_replicate
    chosen = _resolve_auto(cfg, gpus, args.gpu)
    if chosen and not args.json:
        print(f"auto on {gpus} x {args.gpu}: {chosen}")
    if cfg.task:  # a user's own model: its step is measured, not modelled
        from hpctrain.plan.task_memory import plan_task_memory

        return plan_task_memory(cfg, gpus, args.gpu, args.json)
    opts = MemoryOptions.from_config(cfg, gpus)
    model = cfg.model.resolve()
    gpu = gpu_memory_bytes(args.gpu) if args.gpu else None
    plan = estimate_memory(model, opts, gpu)
    path = opts.mixed_precision_path(model)
    if args.json:
        print(json.dumps({**plan.__dict__, "fits": plan.fits, "mixed_precision": path,
                          "master_weights": opts.master_weights, "gpus": gpus}, indent=2))
        return
    n = count_params(model, include_embedding=True)
    layout = f"{opts.strategy}" + (f" ZeRO-{opts.zero}" if opts.strategy == "fsdp" else "")
    pipeline = (f" ({opts.pp_schedule}, {opts.microbatches} micro-batches, "
                f"{opts.stages_per_rank} stage{'s' if opts.stages_per_rank > 1 else ''} per rank)"
                if opts.pp > 1 else "")
    name = cfg.model.init_from or cfg.model.size
    title = (f"{name} ({n / 1e9:.2f}B params), {layout} over {opts.gpus} GPU"
             f"{'s' if opts.gpus > 1 else ''}, tp {opts.tp}, pp {opts.pp}{pipeline}, "
             f"{opts.precision}{_path_title(opts, path)}, AC {opts.ac}, micro-batch "
             f"{opts.micro_batch} x {opts.seq_len}"
             f"{'' if opts.compile else ', eager'}")
    console = Console(width=160)
    console.print(title)
    table = Table()
    table.add_column("per GPU")
    table.add_column("GB", justify="right")
    # Inside a pipeline the gradients are the unsharded accumulators (FSDP's: in the reduction
    # dtype); elsewhere the sharded or DDP-bucketed gradients, in the master weights' dtype.
    grad_bytes = opts.accumulator_bytes(model) if opts.pp > 1 else opts.master_bytes
    grads = "bf16" if grad_bytes == 2 else "fp32"
    master = "bf16" if opts.master_bytes == 2 else "fp32"
    for label, value in ((f"parameters ({master})", plan.params),
                         (f"gradients ({grads})", plan.grads),
                         (f"AdamW state ({master})", plan.optimizer),
                         ("working buffers", plan.working), ("activations", plan.activations)):
        table.add_row(label, f"{value / 1e9:.1f}")
    table.add_row(f"peak ({plan.peak_moment})", f"{plan.peak / 1e9:.1f}", style="bold")
    console.print(table)
    if plan.stage is not None:
        console.print(f"largest on pipeline rank {plan.stage} of {opts.pp}; pipeline bubble "
                      f"{plan.bubble:.1%} of each step")
    if plan.fits is None:
        console.print("give --gpu (e.g. h100 or 80) to check whether it fits")
    elif plan.fits:
        console.print(f"fits: {fmt_gb(plan.peak)} + 10% headroom <= {fmt_gb(gpu)}")
    else:
        console.print(f"does NOT fit: {fmt_gb(plan.peak)} + 10% headroom > {fmt_gb(gpu)}. "
                      "Any one of:")
        for s in plan.suggestions:
            console.print(f"  - {s}")


def _resolve_auto(cfg: JobConfig, gpus: int, gpu: str | None, *, must_fit: bool = True
                  ) -> str | None:
    """Choose the config's ``auto`` values for ``gpus`` GPUs of type ``gpu`` as training does
    at start (hpctrain.plan.auto); what they became, as overrides (None: nothing was auto)."""
    from hpctrain.plan.auto import Gpu, auto_keys, leaves_to_auto, named_gpu, resolve_auto

    keys = auto_keys(cfg)
    if keys and gpu is None:
        raise ConfigError(f"{', '.join(keys)} = auto: chosen at start for the GPUs the run has",
                          expected="--gpu TYPE (or GB) to choose them for",
                          hint="add --gpu h100 (for example), or give the values as overrides")
    if not leaves_to_auto(cfg):
        return None
    # Without --gpu only grad_accum is derived: no memory is sized.
    chosen = resolve_auto(cfg, gpus, named_gpu(gpu, cfg.train.precision) if gpu
                          else Gpu("gpu", 0.0), must_fit=must_fit)
    return chosen.summary() if chosen is not None and keys else None


# How the title names each mixed-precision path (``MemoryOptions.mixed_precision_path``).
_PATHS = {"none": "", "autocast": " (autocast)", "fsdp": " (FSDP casts)",
          "pure": " (pure bf16: bf16 parameters, gradients and AdamW moments)"}


def _path_title(opts: MemoryOptions, path: str) -> str:
    """The title's words for ``path``; FSDP with bf16 master weights casts nothing."""
    if path == "fsdp" and opts.master_weights == "bf16":
        return (" (pure bf16: bf16 parameters, gradients and AdamW moments, FSDP reduces in "
                f"{opts.reduce_precision})")
    return _PATHS[path]


def _parallel(args: argparse.Namespace) -> None:
    from hpctrain.config import load_config
    from hpctrain.parallel.layout import check_layout
    from hpctrain.plan.memory_options import MemoryOptions, gpu_memory_bytes
    from hpctrain.plan.parallel import (
        ParallelPlan,
        describe,
        global_batch,
        gpu_peak_tflops,
        rank_layouts,
    )

    if not args.gpu:
        raise ConfigError("plan parallel needs the GPU memory", expected="--gpu h100 or --gpu 80")
    config, overrides, cfg = _job(args, "parallel")
    pc = cfg.parallel
    total = args.gpus_per_node * args.nodes
    batch = args.global_batch or global_batch(cfg, total)[0]
    # What every layout keeps of the config: sized on the fewest ranks its own layout needs
    # (its auto values chosen there; the layouts choose strategy, batch shape and AC again).
    _resolve_auto(cfg, pc.tp * pc.pp * pc.dp_replicate, args.gpu, must_fit=False)
    base = MemoryOptions.from_config(cfg, pc.tp * pc.pp * pc.dp_replicate)
    peak = gpu_peak_tflops(args.gpu, cfg.train.precision)
    if pc.dp_replicate != 1:  # the layouts shard over all data-parallel ranks (no HSDP)
        overrides = [*overrides, "parallel.dp_replicate=1"]
    if config is None or (args.global_batch and cfg.train.global_batch_tokens is not None):
        # The batch planned for, in tokens: a user's CONFIG that gives one keeps this split.
        overrides = [*overrides, f"train.global_batch_tokens={batch * cfg.data.seq_len}"]
    refused: dict[str, str] = {}

    def refusal(plan: ParallelPlan) -> str | None:
        """Why `hpctrain train` would refuse the layout's command (rules the memory model
        does not know, e.g. tied embeddings with tp/pp), checked as it checks it first."""
        try:
            job = load_config(config, [*overrides, *plan.overrides()])
            _resolve_auto(job, total, args.gpu, must_fit=False)  # what is left to auto
            check_layout(job, total)
        except ConfigError as e:
            refused[describe(plan)] = e.what
            return e.what
        return None

    plans = rank_layouts(cfg.model.resolve(), base, gpus_per_node=args.gpus_per_node,
                         nodes=args.nodes, gpu_bytes=gpu_memory_bytes(args.gpu), peak=peak,
                         global_batch=batch, refusal=refusal)
    best = plans[0]
    print(f"strategy {best.strategy}: data {best.dp} x tensor {best.tp} x pipeline {best.pp}, "
          f"micro-batch {best.micro_batch}, activation checkpointing {best.ac}, "
          f"~{best.memory.peak / 1e9:.1f} GB per GPU, global batch {batch} samples")
    for line in best.explanation:
        print(f"  {line}")
    if peak is None:
        print("  (GPU given by memory only: speeds assume an H100's 989 TFLOP/s)")
    command = best.command(str(config) if config else None, overrides, args.gpus_per_node,
                           args.nodes)
    print(f"\n  {command}")
    if config is None:
        print("  (CONFIG: your config; the overrides above state everything this plan "
              "assumed beyond train's defaults)")
    print(f"\n{len(plans)} layouts fit; the fastest {min(args.top, len(plans))} by predicted "
          "tokens/s per GPU:")
    for i, plan in enumerate(plans[: args.top], start=1):
        print(f"  {i}. {describe(plan)}")
    if refused:
        why = next(iter(refused.values()))
        print(f"({len(refused)} more fit but training refuses them, e.g.: {why})")


def _budget(args: argparse.Namespace) -> None:
    from hpctrain.plan.budget import (
        format_duration,
        from_bench,
        plan_budget,
        plan_energy,
        tokens_per_s_from_run,
    )

    sources = [x for x in (args.tokens_per_s, args.from_run, args.from_bench) if x is not None]
    if len(sources) != 1:
        raise ConfigError("give exactly one of --tokens-per-s, --from-run and --from-bench",
                          hint="--from-run runs/<pilot> reads its metrics; --from-bench a "
                          "`bench model` results folder")
    rate = args.tokens_per_s
    source = "given"
    jpt = args.joules_per_token
    if args.from_run is not None:
        rate = tokens_per_s_from_run(args.from_run)
        source = f"median of {args.from_run}/metrics"
    elif args.from_bench is not None:
        rate, measured_jpt = from_bench(args.from_bench)
        source = f"bench model {args.from_bench}"
        if jpt is None and args.gpu_watts is None:
            jpt = measured_jpt
    b = plan_budget(args.tokens, rate, args.gpus, margin=args.margin,
                    warn_gpu_hours=args.warn_gpu_hours)
    print(f"{b.tokens:.3g} tokens at {rate:,.0f} tokens/s per GPU ({source}) on {b.gpus} GPUs")
    print(f"walltime {format_duration(b.walltime_s)} (incl. {b.margin:.0%} margin), "
          f"{b.gpu_hours:,.0f} GPU-hours")
    e = plan_energy(b, price_per_gpu_hour=args.price_per_gpu_hour, gpu_watts=args.gpu_watts,
                    joules_per_token=jpt, grid_gco2_per_kwh=args.grid_gco2_per_kwh,
                    pue=args.pue)
    if e.cost is not None:
        print(f"cost {e.cost:,.0f} at {args.price_per_gpu_hour:g} per GPU-hour")
    if e.gpu_kwh is not None:
        site = f", {e.site_kwh:,.0f} kWh with PUE {args.pue:g}" if args.pue != 1 else ""
        print(f"energy {e.gpu_kwh:,.0f} kWh on the GPUs ({e.basis}){site}")
    if e.co2e_kg is not None:
        print(f"emissions {e.co2e_kg / 1000:,.2f} t CO2e at {args.grid_gco2_per_kwh:g} "
              "gCO2e/kWh (GPUs only: CPUs, network and storage add to it)")
    if b.warning:
        print(f"WARNING: {b.warning}")


def _mttf_s(args: argparse.Namespace, cfg: JobConfig) -> float:
    """The job's MTTF in seconds: --mttf-h, else checkpoint.mttf_gpu_hours over --gpus GPUs
    (the expression the training schedule uses, so both give the same interval)."""
    from hpctrain.plan.interval import job_mttf

    if args.mttf_h is not None:
        return args.mttf_h * 3600
    if args.gpus is not None:
        return job_mttf(cfg.checkpoint.mttf_gpu_hours * 3600, args.gpus)
    raise ConfigError("no MTTF given", expected="--mttf-h H (the whole job's), or --gpus N: "
                      f"checkpoint.mttf_gpu_hours ({cfg.checkpoint.mttf_gpu_hours:g}) over N GPUs",
                      hint="Llama 3 saw ~50,000 GPU-hours per GPU, the default; "
                      "checkpoint.mttf_gpu_hours=H sets another")


def _measured(args: argparse.Namespace, given: float | None, key: str, flag: str) -> float:
    """A cost given on the command line, else measured in ``--from-run``'s goodput.json."""
    if given is not None:
        return given
    if args.from_run is None:
        raise ConfigError(f"no {flag} given", expected=f"{flag}, or --from-run RUN_DIR",
                          hint="--from-run reads what saves and restarts cost a run you made")
    from hpctrain.observe.goodput import compute_goodput

    value = compute_goodput(args.from_run).get(key)  # from its ledgers, also mid-run
    if not isinstance(value, int | float):
        raise ConfigError(f"{args.from_run} has no measured {key.removesuffix('_s')}",
                          expected="a run directory with goodput.json and at least one save",
                          hint=f"give {flag} instead")
    return float(value)


def _interval(args: argparse.Namespace) -> None:
    from hpctrain.plan.interval import auto_interval, daly_interval, young_interval

    _, _, cfg = _job(args, "interval")
    mttf_s = _mttf_s(args, cfg)
    if args.save_min is not None:
        save_s, source = args.save_min * 60, "given"
    else:
        save_s = _measured(args, None, "checkpoint_cost_s", "--save-min")
        source = f"measured in {args.from_run}: stall + slowdown"
    print(f"job MTTF {mttf_s / 3600:.2f} h, checkpoint save {_seconds(save_s)} ({source})")
    print(f"Young: checkpoint every {young_interval(save_s, mttf_s) / 60:.1f} min")
    print(f"Daly:  checkpoint every {daly_interval(save_s, mttf_s) / 60:.1f} min")
    auto = auto_interval(save_s, mttf_s, cfg.checkpoint.max_overhead)
    print(f"auto:  checkpoint every {auto.reason()} (checkpoint.interval=auto)")


def _seconds(s: float) -> str:
    return f"{s / 60:.3g} min" if s >= 60 else f"{s:.3g} s"


def _goodput(args: argparse.Namespace) -> None:
    from hpctrain.plan.goodput import predict_goodput

    _, _, cfg = _job(args, "goodput")
    mttf_s = _mttf_s(args, cfg)
    save_s = _measured(args, args.save_s, "checkpoint_cost_s", "--save-s")
    restart_s = _measured(args, args.restart_s, "restart_cost_s", "--restart-s")
    interval = args.interval_min * 60 if args.interval_min is not None else None
    p = predict_goodput(mttf_s, save_s, restart_s, interval)
    chosen = "given" if interval is not None else "Daly's optimum"
    print(f"job MTTF {mttf_s / 3600:.2f} h, save {save_s:.3g} s, restart {restart_s:.3g} s, "
          f"checkpoint every {p.interval_s / 60:.1f} min of training ({chosen})")
    print(f"expected goodput {p.goodput:.1%}: checkpoints {p.checkpoint:.1%}, work computed "
          f"again {p.lost_work:.1%}, restarts {p.restart:.1%}")
