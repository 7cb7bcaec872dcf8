"""``hpctrain bench ...``: argument parsing for the benchmarks and the per-rank collective worker.

    hpctrain bench gemm --dtypes bf16 --sizes 8192
    hpctrain bench membw
    hpctrain bench h2d
    hpctrain bench collective --nproc 4 -b 64M -e 1G -f 2
    hpctrain bench model --size 1b --strategy fsdp --nproc 4 --micro-batch 4
    hpctrain bench roofline --from runs/bench-gpu
    hpctrain bench node                 # health summary of this node; exit 1 if a GPU is off
    hpctrain bench disk /scratch/me --size 8G --threads 8
    hpctrain bench checkpoint /scratch/me --params 1e9

Results go to ``--out`` (default ``runs/bench/<name>-<timestamp>``): ``<name>.csv``,
``<name>.json`` and, when matplotlib is installed, a PNG.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hpctrain.bench.busbw import OPS
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.numeric_args import count, real


class WrongResultError(HpctrainError):
    """A collective returned wrong values (#wrong > 0)."""

    exit_code = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its sub-commands on the top-level sub-parser set."""
    b = sub.add_parser("bench", help="benchmark GEMM, memory, host<->device and collectives",
                       description="Benchmarks of this machine and of training: GEMM, memory "
                       "and host-device bandwidth, collectives (nccl-tests semantics), the "
                       "model's tokens/s and MFU, a roofline, a node health check. Results go "
                       "to runs/bench/<name>-<time> (CSV, JSON, and a PNG with matplotlib).")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    def common(p: argparse.ArgumentParser, warmup: int, iters: int) -> None:
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--out", type=Path, default=None,
                       help="results folder (default runs/bench/<name>-<timestamp>)")
        p.add_argument("-w", "--warmup", type=count(0, 100_000), default=warmup,
                       help="warm-up repetitions")
        p.add_argument("-n", "--iters", type=count(1, 1_000_000), default=iters,
                       help="timed repetitions (the median is reported)")
        p.add_argument("--no-plot", action="store_true", help="do not draw a PNG")

    g = bsub.add_parser("gemm", help="matmul TFLOP/s per dtype and size vs the peak table")
    g.add_argument("--dtypes", nargs="+", default=None,
                   help="fp32 tf32 bf16 fp16 fp8 (default: all on GPU, fp32 bf16 on CPU)")
    g.add_argument("--sizes", nargs="+", default=None,
                   help="square sizes M=N=K (default 1024..8192 on GPU, 256..1024 on CPU)")
    common(g, 5, 20)

    m = bsub.add_parser("membw", help="device copy bandwidth (read + write)")
    m.add_argument("--sizes", nargs="+", default=None, help="bytes, e.g. 256M 1G")
    common(m, 5, 20)

    h = bsub.add_parser("h2d", help="host<->device bandwidth, pageable vs pinned")
    h.add_argument("--sizes", nargs="+", default=["256M"], help="bytes, e.g. 64M 1G")
    common(h, 3, 10)

    c = bsub.add_parser("collective", help="collectives with nccl-tests semantics (busbw, #wrong)")
    c.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, metavar="OP",
                   help=f"some of: {' '.join(OPS)}")
    c.add_argument("-b", "--minbytes", default="8", help="smallest size S (e.g. 8, 64M)")
    c.add_argument("-e", "--maxbytes", default="32M", help="largest size S")
    c.add_argument("-f", "--stepfactor", type=real(1, 1e6, open_min=True), default=2.0,
                   help="size multiplier")
    c.add_argument("-d", "--datatype", default="float32",
                   help="float32, bfloat16, float16 or float64")
    c.add_argument("--no-check", action="store_true", help="skip the correctness check")
    c.add_argument("--seed", type=count(0, 2**63 - 1), default=0,
                   help="seed of the random buffers")
    c.add_argument("--nproc", type=count(1, 4096), default=None,
                   help="start this many local ranks (one per GPU, or CPU processes)")
    c.add_argument("--cuda-graph", type=count(0, 100_000), nargs="?", const=10, default=0,
                   metavar="N",
                   help="capture N calls (default 10) in a CUDA graph, time its replays "
                   "(nccl-tests -G; GPUs only)")
    c.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)
    common(c, 5, 20)

    md = bsub.add_parser("model", help="tokens/s, MFU and HFU of a model (real runs): the "
                         "built-in one or your task's")
    md.add_argument("--config", type=Path, default=None,
                    help="base training YAML, or a task file (my_task.py: your own model, as "
                    "`hpctrain train` takes it) (default: built-in settings for the device)")
    md.add_argument("--size", default=None, help="model size: tiny, 125m, 1b, 8b")
    md.add_argument("--strategy", default=None, help="none, ddp or fsdp")
    md.add_argument("--nproc", type=count(1, 4096), default=1, help="local ranks (one per GPU)")
    md.add_argument("--micro-batch", type=count(1, 1 << 20), default=None,
                    help="samples per rank per step (default: 4 on GPU, 8 on CPU)")
    md.add_argument("--seq-len", type=count(1, 1 << 24), default=None,
                    help="tokens per sample (default: 2048 on GPU, 256 on CPU)")
    md.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the model (default: on for GPU, off on CPU)")
    md.add_argument("--ac", default=None, choices=["none", "full", "every_k", "selective"],
                    help="activation checkpointing")
    md.add_argument("--ac-every", type=count(1, 100_000), default=None, help="with --ac every_k")
    md.add_argument("--precision", default=None, choices=["bf16", "fp16", "fp32", "fp8"],
                    help="training precision; fp8 (H100-class GPUs, torchao) states MFU against "
                    "the bf16 peak")
    md.add_argument("--steps", type=count(1, 10_000_000), default=None,
                    help="training steps (default 40 on GPU, 12 on CPU)")
    md.add_argument("--log-every", type=count(1, 10_000_000), default=None,
                    help="steps per metrics window (default 5 on GPU, 2 on CPU)")
    md.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more training-config overrides, e.g. model.n_layers=4")
    md.add_argument("--timeout", type=real(0, 1e7, open_min=True), default=900.0,
                    help="seconds for the training run")
    md.add_argument("--no-power", action="store_true", help="do not sample GPU power (NVML)")
    md.add_argument("--device", default="auto", help="auto, cpu or cuda")
    md.add_argument("--out", type=Path, default=None,
                    help="results folder (default runs/bench/model-<timestamp>)")

    r = bsub.add_parser("roofline", help="roofline plot with measured GEMM and copy results")
    r.add_argument("--from", dest="sources", type=Path, nargs="*", default=[],
                   help="folders holding gemm.json / membw.json (also one level down); "
                   "what is missing is measured briefly")
    common(r, 3, 10)

    nd = bsub.add_parser("node", help="health check: every GPU vs its siblings and the datasheet")
    nd.add_argument("--device", default="auto", help="auto (all GPUs, else the CPU), cpu or cuda")
    nd.add_argument("--tolerance", type=real(0, 1), default=0.10,
                    help="flag a GPU this fraction below its siblings' median")
    nd.add_argument("--min-peak-frac", type=real(0, 1), default=0.60,
                    help="flag GEMM below this fraction of the datasheet peak")
    nd.add_argument("--min-membw-frac", type=real(0, 1), default=0.70,
                    help="flag copy bandwidth below this fraction of the datasheet")
    nd.add_argument("--min-busbw", type=real(0, 1e6), default=None,
                    help="flag all_reduce busbw (GB/s) below this")
    nd.add_argument("--no-collective", action="store_true", help="skip the all_reduce")
    nd.add_argument("--quick", action="store_true", help="smaller sizes (a rougher check)")
    nd.add_argument("--out", type=Path, default=None,
                    help="results folder (default runs/bench/node-<timestamp>)")

    dk = bsub.add_parser("disk", help="sequential write and read GB/s of a folder's file system",
                         description="Write then read --size bytes in --threads files under "
                         "PATH (O_DIRECT where allowed, fsync, page cache dropped before the "
                         "read); the files are removed afterwards.")
    dk.add_argument("path", type=Path, help="a writable directory on the file system to measure")
    dk.add_argument("--size", default="4G", help="bytes in all, e.g. 512M, 8G (default 4G)")
    dk.add_argument("--threads", type=count(1, 256), default=4, help="files written at once")
    dk.add_argument("--block", default="16M", help="bytes per write call (default 16M)")
    dk.add_argument("--out", type=Path, default=None,
                    help="results folder (default runs/bench/disk-<timestamp>)")

    ck = bsub.add_parser("checkpoint", help="checkpoint save and restore GB/s beside bench disk",
                         description="Save and restore a model-sized state (bf16 parameters, "
                         "fp32 Adam moments) under PATH the way training does (staged, written "
                         "by the writer process, committed; verified and loaded), timed as the "
                         "caller pays it, beside bench disk's numbers for the same PATH.")
    ck.add_argument("path", type=Path, help="a writable directory (checkpoints go to a temporary "
                    "folder inside it, removed afterwards)")
    ck.add_argument("--params", type=real(1e3, 1e12), default=1e8,
                    help="parameters of the state (10 bytes each: bf16 + 2 fp32 moments)")
    ck.add_argument("--saves", type=count(1, 100), default=2,
                    help="saves timed (the first one pays the writer's warm-up; best is kept)")
    ck.add_argument("--write-threads", type=count(0, 64), default=0,
                    help="checkpoint.write_threads (0: the automatic choice)")
    ck.add_argument("--writer", choices=["process", "thread", "inline"], default="process",
                    help="who writes: the writer process (default), a thread, or inline")
    ck.add_argument("--no-disk", action="store_true", help="skip the bench disk reference")
    ck.add_argument("--out", type=Path, default=None,
                    help="results folder (default runs/bench/checkpoint-<timestamp>)")


def run(args: argparse.Namespace) -> None:
    """Dispatch ``hpctrain bench <command>``."""
    {"gemm": _gemm, "membw": _membw, "h2d": _h2d,
     "collective": _collective, "model": _model,
     "roofline": _roofline, "disk": _disk, "checkpoint": _checkpoint,
     "node": _node}[args.bench_command](args)


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    if args.out is not None:
        return Path(args.out)
    return Path("runs") / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _finish(res, args: argparse.Namespace, out: Path, title: str, plot=None) -> None:
    res.print_table(title)
    paths = res.write(out)
    note = ""
    if plot is not None and not args.no_plot:
        note = plot()
    print(f"results: {', '.join(str(p) for p in paths)}" + (f"\n{note}" if note else ""))


def _sizes(values: list[str] | None, default: list[str]) -> list[int]:
    from hpctrain.bench.common import parse_size

    return [parse_size(v) for v in (values or default)]


def _disk(args: argparse.Namespace) -> None:
    from hpctrain.bench.common import parse_size
    from hpctrain.bench.disk import disk_results, run_disk

    rows = run_disk(args.path, parse_size(args.size), threads=args.threads,
                    block=parse_size(args.block),
                    echo=lambda line: print(line, file=sys.stderr, flush=True))
    res = disk_results(rows, args.path)
    _finish(res, args, _out_dir(args, "disk"),
            f"disk: {args.path} ({res.meta['fs_type'] or 'file system unknown'})")


def _checkpoint(args: argparse.Namespace) -> None:
    from hpctrain.bench.checkpoint import run_checkpoint_bench

    res = run_checkpoint_bench(args.path, int(args.params), saves=args.saves,
                               write_threads=args.write_threads, writer=args.writer,
                               disk=not args.no_disk,
                               echo=lambda line: print(line, file=sys.stderr, flush=True))
    _finish(res, args, _out_dir(args, "checkpoint"), f"checkpoint save/restore: {args.path}")


def _gemm(args: argparse.Namespace) -> None:
    from hpctrain.bench.common import plot, select_device
    from hpctrain.bench.gemm import GEMM_DTYPES, run_gemm

    device = select_device(args.device)
    on_gpu = device.type == "cuda"
    dtypes = args.dtypes or (list(GEMM_DTYPES) if on_gpu else ["fp32", "bf16"])
    default = ["1024", "2048", "4096", "8192"] if on_gpu else ["256", "512", "1024"]
    sizes = _sizes(args.sizes, default)
    res = run_gemm(dtypes, sizes, device, warmup=args.warmup, iters=args.iters,
                   echo=lambda line: print(line, file=sys.stderr, flush=True))
    out = _out_dir(args, "gemm")

    def draw() -> str:
        series = {d: ([r["m"] for r in res.rows if r["dtype"] == d and r.get("tflops")],
                      [r["tflops"] for r in res.rows if r["dtype"] == d and r.get("tflops")])
                  for d in dtypes}
        return plot(out / "gemm.png", series, xlabel="M = N = K", ylabel="TFLOP/s",
                    title=f"GEMM on {res.meta['device']}")

    _finish(res, args, out, f"GEMM on {res.meta['device']}", draw)


def _membw(args: argparse.Namespace) -> None:
    from hpctrain.bench.common import select_device
    from hpctrain.bench.membw import run_membw

    device = select_device(args.device)
    sizes = _sizes(args.sizes, ["256M", "1G"] if device.type == "cuda" else ["16M", "64M"])
    res = run_membw(sizes, device, warmup=args.warmup, iters=args.iters)
    _finish(res, args, _out_dir(args, "membw"), f"device copy on {res.meta['device']}")


def _h2d(args: argparse.Namespace) -> None:
    from hpctrain.bench.common import select_device
    from hpctrain.bench.h2d import run_h2d

    device = select_device(args.device)
    res = run_h2d(_sizes(args.sizes, ["256M"]), device, warmup=args.warmup, iters=args.iters)
    _finish(res, args, _out_dir(args, "h2d"), f"host<->device on {res.meta['device']}")


def _collective_worker_args(args: argparse.Namespace, out: Path) -> list[str]:
    argv = ["bench", "collective", "--ops", *args.ops, "-b", str(args.minbytes),
            "-e", str(args.maxbytes), "-f", str(args.stepfactor), "-d", args.datatype,
            "--seed", str(args.seed), "--device", args.device, "--out", str(out),
            "-w", str(args.warmup), "-n", str(args.iters)]
    if args.no_check:
        argv.append("--no-check")
    if args.no_plot:
        argv.append("--no-plot")
    if args.corrupt_rank is not None:
        argv += ["--corrupt-rank", str(args.corrupt_rank)]
    if args.cuda_graph:
        argv += ["--cuda-graph", str(args.cuda_graph)]
    return argv


def _collective(args: argparse.Namespace) -> None:
    from hpctrain.bench.collective import CollectiveOptions
    from hpctrain.bench.common import size_sweep

    opts = CollectiveOptions(ops=args.ops, sizes=size_sweep(args.minbytes, args.maxbytes,
                                                            args.stepfactor),
                             dtype=args.datatype, warmup=args.warmup, iters=args.iters,
                             check=not args.no_check, seed=args.seed,
                             corrupt_rank=args.corrupt_rank, cuda_graph=args.cuda_graph)
    opts.validate()  # fail before any rank starts
    if opts.cuda_graph:
        import torch

        if args.device == "cpu" or not torch.cuda.is_available():
            raise ConfigError("--cuda-graph captures NCCL calls in a CUDA graph, but this run "
                              "uses the CPU (gloo)", expected="GPUs (--device auto or cuda)",
                              hint="drop --cuda-graph on a machine without GPUs")
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}", expected="at least 1 rank")
        from hpctrain.launch.local import launch_local
        from hpctrain.runtime.rundir import RunDir

        run_id = time.strftime("%Y%m%d-%H%M%S")
        out = _out_dir(args, "collective")
        run_dir = RunDir(out)
        run_dir.logs_dir.mkdir(parents=True, exist_ok=True)
        launch_local(args.nproc, _collective_worker_args(args, out), run_dir, run_id=run_id)
        return
    _collective_rank(args, opts)


def _collective_rank(args: argparse.Namespace, opts) -> None:
    """One rank of the collective benchmark: join the group, run, rank 0 reports."""
    import os

    import torch.distributed as dist

    from hpctrain.bench.collective import COLUMNS, run_collectives
    from hpctrain.bench.common import Results, device_name, plot, select_device
    from hpctrain.runtime.env import detect_env, export_torch_env

    env = detect_env()
    device = select_device(args.device, env.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        os.environ.update(export_torch_env(env))
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, **extra)
    try:
        rows = run_collectives(opts, device)
    finally:
        dist.destroy_process_group()
    if env.rank != 0:
        return
    res = Results("collective", COLUMNS, rows=rows,
                  meta={"device": device_name(device), "backend": backend,
                        "ranks": env.world_size, "warmup": opts.warmup, "iters": opts.iters,
                        "dtype": opts.dtype, "time": "slowest rank's median",
                        "cuda_graph": opts.cuda_graph})
    out = _out_dir(args, "collective")

    def draw() -> str:
        series = {op: ([r["size"] for r in rows if r["op"] == op],
                       [r["oop_busbw"] if r["oop_busbw"] is not None else r["ip_busbw"]
                        for r in rows if r["op"] == op]) for op in opts.ops}
        return plot(out / "collective_busbw.png", series, xlabel="size S (bytes)",
                    ylabel="busbw GB/s",
                    title=f"busbw, {env.world_size} ranks, {backend}, {device_name(device)}")

    title = (f"collectives: {env.world_size} ranks, {backend} on {device_name(device)}, "
             f"{opts.dtype}, median of {opts.iters}"
             + (f" graph replays of {opts.cuda_graph} calls" if opts.cuda_graph else ""))
    _finish(res, args, out, title, draw)
    wrong = sum((r["oop_wrong"] or 0) + (r["ip_wrong"] or 0) for r in rows)
    if wrong:
        raise WrongResultError(f"{wrong} wrong elements in collective results",
                               hint="see the #wrong columns: a bad link, GPU or NCCL setup")


def _model(args: argparse.Namespace) -> None:
    from hpctrain.bench.common import Results
    from hpctrain.bench.model import COLUMNS, describe, device_defaults, run_model_bench

    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown device {args.device!r}", expected="auto, cpu or cuda",
                          hint="bench model uses GPUs 0..nproc-1; set CUDA_VISIBLE_DEVICES")
    import torch

    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    overrides = [] if args.config else device_defaults(on_gpu)
    if args.config is None and args.nproc > 1:
        overrides.append(f"parallel.strategy={'fsdp' if on_gpu else 'ddp'}")
    if args.config is None or args.device != "auto":
        overrides.append(f"run.device={'cuda' if on_gpu else 'cpu'}")
    for flag, key in (("size", "model.size"), ("strategy", "parallel.strategy"),
                      ("micro_batch", "train.micro_batch"), ("seq_len", "data.seq_len"),
                      ("compile", "parallel.compile"), ("ac", "parallel.activation_checkpointing"),
                      ("ac_every", "parallel.ac_every"), ("precision", "train.precision")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    overrides += args.set
    if not on_gpu and args.device == "auto":
        from hpctrain.bench.model import refuse_gpu_size_on_cpu

        refuse_gpu_size_on_cpu(args.config, overrides)  # before anything is allocated
    steps = args.steps or (40 if on_gpu else 12)
    log_every = args.log_every or (5 if on_gpu else 2)
    out = _out_dir(args, "model")
    sampler_factory, power_note = (None, "power: not sampled (--no-power)") if args.no_power \
        else _power_sampler_factory(on_gpu)
    row, cfg = run_model_bench(args.config, overrides, nproc=args.nproc, out=out, steps=steps,
                               log_every=log_every, timeout=args.timeout,
                               sampler_factory=sampler_factory)
    note = None
    if row["mfu_pct"] is None:
        note = "MFU/HFU unknown: no datasheet peak for this device (set metrics.peak_tflops)"
    res = Results("model", COLUMNS, rows=[row],
                  meta={"device": "cuda" if on_gpu else "cpu", "config": str(out / "config.yaml"),
                        "steps": steps, "log_every": log_every, "power": power_note,
                        "note": note})
    first, last = row["measured_steps"]
    unit = "GPU" if on_gpu else "rank"
    print(f"bench model: {describe(cfg)}, {cfg.parallel.strategy} on {args.nproc} {unit}(s), "
          f"steps {first + 1}-{last} measured (earlier ones are warm-up)")
    _print_vertical(row, unit, cfg.train.precision)
    for w in row["slow_windows"]:
        print(f"slow window: steps to {w['step']} ran {w['below_median']:.1%} below the median: "
              f"{w['cause']}")
    if note:
        print(note)
    paths = res.write(out)
    print(f"results: {', '.join(str(p) for p in paths)}; run: {out / 'train'}")
    if row["joules_per_token"] is not None:
        print(f"energy: {row['gpu_watts']:.0f} W over the measured steps, "
              f"{row['joules_per_token']:.3g} J/token, {row['tokens_per_joule']:.3g} tokens/J")
    else:
        print(power_note)


def _print_vertical(row: dict, unit: str, precision: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from hpctrain.bench.common import _fmt
    from hpctrain.observe.peaks import mfu_peak_dtype

    # An fp8 run's MFU is against the bf16 peak: the label says so.
    against = mfu_peak_dtype(precision)
    peak = f" ({against} peak)" if against != precision else ""
    labels = {"tokens_per_s_per_gpu": f"tokens/s per {unit}", "mfu_pct": f"MFU %{peak}",
              "hfu_pct": f"HFU %{peak}", "peak_mem_gb": "peak memory GB",
              "step_time_s": "step time s",
              "data_time_pct": "data wait % of step", "gpu_watts": "GPU power W (all GPUs)",
              "joules_per_token": "joules per token", "tokens_per_joule": "tokens per joule",
              "final_loss": "final loss"}
    table = Table(show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    for key in ("micro_batch", "seq_len", "compile", "ac", *labels):
        value = row.get(key)
        if key in ("mfu_pct", "hfu_pct") and value is None:
            value = "unknown"
        table.add_row(labels.get(key, key.replace("_", " ")), _fmt(value))
    Console(width=120).print(table)


def _power_sampler_factory(on_gpu: bool):
    """(factory or None, note) for sampling GPU power during bench model."""
    if not on_gpu:
        return None, "power: not sampled: no GPU (NVML reads NVIDIA GPUs only)"
    from hpctrain.observe.power import sampler_factory

    return sampler_factory()


def _roofline(args: argparse.Namespace) -> None:
    import json

    from hpctrain.bench.common import device_name, select_device
    from hpctrain.bench.gemm import GEMM_DTYPES, run_gemm
    from hpctrain.bench.membw import run_membw
    from hpctrain.bench.roofline import build_roofline, find_results, plot_roofline

    for folder in args.sources:
        if not folder.is_dir():
            raise ConfigError(f"--from {folder}: no such folder",
                              expected="a results folder of bench gemm/membw (or bench_gpu.py)")
    out = _out_dir(args, "roofline")
    loaded = {}
    for name in ("gemm", "membw"):
        path = find_results(args.sources, name)
        if path is not None:
            loaded[name] = json.loads(path.read_text())
            print(f"{name}: {path}")
    device = None
    if len(loaded) < 2:
        device = select_device(args.device)
    if "gemm" not in loaded:
        on_gpu = device.type == "cuda"
        dtypes = list(GEMM_DTYPES) if on_gpu else ["fp32"]
        sizes = [256, 1024, 4096, 8192] if on_gpu else [64, 256, 512]
        res = run_gemm(dtypes, sizes, device, warmup=args.warmup, iters=args.iters)
        res.write(out / "gemm")
        loaded["gemm"] = {"meta": res.meta, "rows": res.rows}
    if "membw" not in loaded:
        sizes = [1024**3] if device.type == "cuda" else [64 * 1024**2]
        res = run_membw(sizes, device, warmup=args.warmup, iters=args.iters)
        res.write(out / "membw")
        loaded["membw"] = {"meta": res.meta, "rows": res.rows}
    name = loaded["gemm"]["meta"].get("device") or device_name(device)
    if loaded["membw"]["meta"].get("device") not in (None, name):
        print(f"warning: gemm ran on {name} but membw on {loaded['membw']['meta']['device']}")
    res = build_roofline(name, loaded["gemm"]["rows"], loaded["membw"]["rows"])
    roofs = res.meta["compute_roofs_tflops"]
    print("compute roofs: " + (", ".join(f"{d} {p:g} TFLOP/s" for d, p in roofs.items())
                               or "unknown for this device (no datasheet peaks)"))
    bw_kind = res.meta["bandwidth_roof"]
    bw = res.meta["datasheet_gbps"] or res.meta["measured_copy_gbps"]
    print(f"bandwidth roof: {bw:,.0f} GB/s ({bw_kind})" if bw else "bandwidth roof: unknown")
    _finish(res, args, out, f"roofline of {name}", lambda: plot_roofline(out / "roofline.png", res))


def _node(args: argparse.Namespace) -> None:
    import json
    import sys

    import torch

    from hpctrain.bench.common import human_bytes, run_command, select_device
    from hpctrain.bench.node import (
        METRICS,
        CollectiveResult,
        NodeUnhealthy,
        Thresholds,
        assess,
        measure_device,
    )

    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown device {args.device!r}", expected="auto, cpu or cuda",
                          hint="bench node checks every visible GPU; CUDA_VISIBLE_DEVICES "
                          "narrows them")
    if not 0 < args.tolerance < 1:
        raise ConfigError(f"--tolerance {args.tolerance}", expected="a fraction, e.g. 0.1")
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if on_gpu:
        select_device("cuda")  # a clear error when --device cuda finds none
    devices = ([torch.device("cuda", i) for i in range(torch.cuda.device_count())] if on_gpu
               else [torch.device("cpu")])
    out = _out_dir(args, "node")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for device in devices:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        print(f"measuring {'GPU ' + str(device.index) if on_gpu else 'CPU'} ...", flush=True)
        results.append(measure_device(device, quick=args.quick))

    collective = None
    ranks = len(devices) if on_gpu else 2
    if not args.no_collective and ranks >= 2:
        size = (64 if args.quick else 256) * 1024**2 if on_gpu else 1024**2
        coll_out = out / "collective"
        argv = [sys.executable, "-m", "hpctrain", "bench", "collective", "--nproc", str(ranks),
                "--ops", "all_reduce", "-b", str(size), "-e", str(size), "-w", "5", "-n", "20",
                "--device", "cuda" if on_gpu else "cpu", "--no-plot", "--out", str(coll_out)]
        print(f"all_reduce {human_bytes(size)} over {ranks} ranks ...", flush=True)
        code, tail, _ = run_command(argv, timeout=300)
        collective = CollectiveResult(ranks, size)
        path = coll_out / "collective.json"
        if code == 0 and path.exists():
            row = json.loads(path.read_text())["rows"][0]
            collective.busbw_gbps, collective.wrong = row["ip_busbw"], row["ip_wrong"]
        else:
            collective.error = f"exit {code}: {tail.strip().splitlines()[-1] if tail else ''}"
            if path.exists():  # it ran, and found wrong values
                row = json.loads(path.read_text())["rows"][0]
                collective.busbw_gbps, collective.wrong = row["ip_busbw"], row["ip_wrong"]
                collective.error = None if row["ip_wrong"] else collective.error

    report = assess(results, collective,
                    Thresholds(args.tolerance, args.min_peak_frac, args.min_membw_frac,
                               args.min_busbw))
    _print_node(report, METRICS)
    (out / "node.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(f"results: {out / 'node.json'}")
    if not report.healthy:
        raise NodeUnhealthy(f"{len(report.findings)} problem(s) on this node",
                            hint="drain it or exclude it (sbatch --exclude) and tell the admins")


def _print_node(report, metrics: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from hpctrain.bench.common import _fmt

    table = Table(title="node health")
    for col in ("device", "name", "GEMM TFLOP/s", "% peak", "copy GB/s", "% datasheet",
                "h2d GB/s", "d2h GB/s", "status"):
        table.add_column(col, justify="right")
    flagged = {f.device for f in report.findings}
    for d in report.devices:
        peak = 100 * d.gemm_tflops / d.gemm_peak_tflops if d.gemm_tflops and \
            d.gemm_peak_tflops else None
        sheet = 100 * d.membw_gbps / d.membw_datasheet_gbps if d.membw_gbps and \
            d.membw_datasheet_gbps else None
        table.add_row(d.device, d.name, _fmt(d.gemm_tflops), _fmt(peak), _fmt(d.membw_gbps),
                      _fmt(sheet), _fmt(d.h2d_gbps), _fmt(d.d2h_gbps),
                      "FLAGGED" if d.device in flagged else "ok")
    console = Console(width=160)
    console.print(table)
    c = report.collective
    if c is not None:
        console.print(f"all_reduce {c.size / 1024**2:g} MiB over {c.ranks} ranks: busbw "
                      f"{_fmt(c.busbw_gbps)} GB/s, #wrong {_fmt(c.wrong)}"
                      + (f", error: {c.error}" if c.error else ""))
    if report.healthy:
        n = len(report.devices)
        sheet = any(d.gemm_peak_tflops for d in report.devices)
        console.print("node healthy: " + (f"{n} devices within tolerance of each other"
                                          if n > 1 else "one device, no siblings to compare")
                      + ("; within the datasheet floors" if sheet else "; no datasheet for it"))
    else:
        for f in report.findings:
            console.print(f"PROBLEM: {f.message}")
