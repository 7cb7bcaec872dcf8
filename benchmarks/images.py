"""Images/s of ResNet-50 and ViT-B/16 training, four ways, on the same model, batch and JPEGs.

    (a) the model on synthetic tensors already on the device: the ceiling
    (b) hpctrain from tar shards: `hpctrain train` with the image task (decode + augment on
        the device, nvJPEG on CUDA), the rate read from its metrics
    (c) torchvision ImageFolder + DataLoader(workers) + Pillow transforms: plain PyTorch
    (d) PyTorch Lightning 2.6 with the same loader: benchmarks/peers/lightning_images.py
    loader: hpctrain's loader alone (read + decode + augment, no model; decoding ahead in the
        loader thread as training does), with the decode and augment milliseconds per image

    python benchmarks/images.py --models resnet50 vit_b_16            # 1 GPU, (a)-(c)
    python benchmarks/images.py --paths b --nproc 8                    # (b) DDP on 8 GPUs
    torchrun --nproc-per-node 8 benchmarks/images.py --paths a c       # (a), (c) DDP
    python benchmarks/images.py --device cpu --tiny                    # a CPU smoke run

Each path runs bf16 autocast, channels_last and torch.compile on CUDA (fp32, eager on the CPU),
SGD with momentum, the batch per GPU of ``--batch``. JPEGs are synthetic ImageNet-like photos
(500x375, quality 90; `hpctrain.data.images.synthetic`) written once into ``--jpegs`` and packed
into ``--shards``; both are reused by later runs. It prints a Markdown table (paste it into
benchmarks/RESULTS.md with the card and the date) and writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models.vision import build

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"resnet50": "configs/resnet50-images.yaml", "vit_b_16": "configs/vit-b16-images.yaml"}
TINY_MODELS = {"resnet50": "resnet_tiny", "vit_b_16": "vit_tiny"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"],
                   choices=sorted(RECIPES))
    p.add_argument("--paths", nargs="+", default=["a", "b", "c", "d", "loader"],
                   choices=["a", "b", "c", "d", "loader"])
    p.add_argument("--decode-threads", type=int, default=1,
                   help="Pillow threads per rank of (b) and the loader row")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true",
                   help="tiny models, 32-pixel images, few steps: checks the paths run")
    p.add_argument("--batch", type=int, default=256, help="images per GPU per step")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=1, help="ranks of path (b)")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers per GPU of path (c) (0: the cores per GPU)")
    p.add_argument("--images", type=int, default=20_000, help="synthetic JPEGs to write")
    p.add_argument("--jpegs", type=Path, default=REPO / "runs" / "bench-images" / "jpegs")
    p.add_argument("--shards", type=Path, default=REPO / "runs" / "bench-images" / "shards")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-images" / "results.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.steps = min(args.batch, 8), min(args.steps, 6)
        args.images = min(args.images, 48)
    return args


def image_size(args: argparse.Namespace) -> int:
    """The training crop: 224, or 32 with --tiny."""
    return 32 if args.tiny else 224


def model_name(args: argparse.Namespace, model: str) -> str:
    """The model a row trains (its tiny stand-in with --tiny)."""
    return TINY_MODELS[model] if args.tiny else model


def prepare_data(args: argparse.Namespace) -> None:
    """Write the synthetic JPEGs and pack them, unless they are there already."""
    from hpctrain.data.images.pack import PackSettings, pack_images
    from hpctrain.data.images.synthetic import write_synthetic_jpegs

    if not args.jpegs.exists():
        size = (64, 48) if args.tiny else (500, 375)
        write_synthetic_jpegs(args.jpegs, args.images, classes=4 if args.tiny else 100,
                              size=size)
    if not (args.shards / "manifest.json").exists():
        pack_images(args.jpegs, args.shards, PackSettings())


def _world() -> tuple[int, int]:
    """(rank, world size) under torchrun, with the process group started; (0, 1) alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _setup(args: argparse.Namespace, model: str) -> tuple[torch.nn.Module, torch.device, int]:
    """The model on this rank's device (DDP under torchrun), channels_last, compiled on CUDA."""
    rank, world = _world()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))
                          if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = build(model_name(args, model), 100, image_size(args)).to(device)
    net = net.to(memory_format=torch.channels_last)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if device.type == "cuda":
        net.compile()
    return net, device, world


def _timed_loop(net: torch.nn.Module, device: torch.device, batches, steps: int) -> float:
    """Images/s of this rank over the last 2/3 of ``steps`` (the first third warms up)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    ctx = (torch.autocast("cuda", torch.bfloat16) if device.type == "cuda"
           else contextlib.nullcontext())
    warm = max(1, steps // 3)
    seen, start = 0, 0.0
    for step in range(steps):
        if step == warm:
            _sync(device)
            seen, start = 0, time.perf_counter()
        x, y = next(batches)
        x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with ctx:
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += len(y)
    _sync(device)
    return seen / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def path_a(args: argparse.Namespace, model: str) -> dict:
    """(a) synthetic tensors already on the device: the ceiling."""
    net, device, world = _setup(args, model)
    s = image_size(args)
    x = torch.randn(args.batch, 3, s, s, device=device)
    y = torch.randint(0, 100, (args.batch,), device=device)
    rate = _timed_loop(net, device, iter(lambda: (x, y), None), args.steps)
    return {"path": "a", "images_per_s_per_gpu": rate, "ranks": world}


def imagefolder_loader(args: argparse.Namespace, world: int):
    """torchvision's ImageFolder + DataLoader + Pillow transforms, as users write it."""
    from torchvision import datasets, transforms

    s = image_size(args)
    tf = transforms.Compose([transforms.RandomResizedCrop(s), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(),
                             transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = datasets.ImageFolder(str(args.jpegs), tf)
    sampler = (torch.utils.data.DistributedSampler(ds, shuffle=True) if world > 1 else
               torch.utils.data.RandomSampler(ds, replacement=True, num_samples=1 << 30))
    workers = args.workers or max(1, len(os.sched_getaffinity(0)) // max(1, world))
    return torch.utils.data.DataLoader(ds, args.batch, sampler=sampler, num_workers=workers,
                                       pin_memory=args.device == "cuda", drop_last=True,
                                       persistent_workers=True, prefetch_factor=4)


def _forever(loader):
    while True:
        yield from loader


def path_c(args: argparse.Namespace, model: str) -> dict:
    """(c) ImageFolder + DataLoader + Pillow, plain PyTorch."""
    net, device, world = _setup(args, model)
    loader = imagefolder_loader(args, world)
    rate = _timed_loop(net, device, _forever(loader), args.steps)
    return {"path": "c", "images_per_s_per_gpu": rate, "ranks": world,
            "workers_per_gpu": loader.num_workers}


def path_b(args: argparse.Namespace, model: str) -> dict:
    """(b) hpctrain from the tar shards: the recipe trained by `hpctrain train`."""
    out = args.out.parent / f"b-{model}-{args.nproc}"
    overrides = [f"task_args.data={args.shards}", f"task_args.model={model_name(args, model)}",
                 f"task_args.image_size={image_size(args)}", f"train.micro_batch={args.batch}",
                 f"train.steps={args.steps}", "train.val_every=0", f"run.out_dir={out}",
                 "run.name=train", "run.suffix=none", "checkpoint.interval=none",
                 "checkpoint.save_at_end=false", "checkpoint.resume=never",
                 "metrics.progress=false", f"metrics.log_every={max(1, args.steps // 6)}",
                 f"task_args.decode_threads={args.decode_threads}",
                 f"run.device={args.device}", "optim.warmup_steps=1"]
    if args.device == "cpu":
        overrides += ["train.precision=fp32", "parallel.compile=false"]
    if args.nproc == 1:
        overrides.append("parallel.strategy=none")
        from hpctrain import fit  # in this process: no second start-up to pay

        fit(config=str(REPO / RECIPES[model]), overrides=overrides, fresh=True)
    else:
        subprocess.run([sys.executable, "-m", "hpctrain", "train", str(REPO / RECIPES[model]),
                        "--nproc", str(args.nproc), *overrides], check=True)
    from hpctrain.observe.metrics import read_metrics

    records = [r for r in read_metrics(out / "train" / "metrics" / "rank-000.jsonl")
               if "samples_per_s" in r]
    late = records[len(records) // 3:] or records  # the first windows compile and warm up
    return {"path": "b", "images_per_s_per_gpu": statistics.median(
        r["samples_per_s"] for r in late), "ranks": args.nproc,
        "data_time_pct": statistics.median(100 * r["data_time_s"] / r["step_time_s"]
                                           for r in late),
        "mfu_pct": statistics.median(100 * (r["mfu"] or 0.0) for r in late)}


def path_d(args: argparse.Namespace, model: str) -> dict:
    """(d) PyTorch Lightning 2.6 on the same model and loader."""
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    from lightning_images import run_lightning

    return {"path": "d", **run_lightning(args, model)}


def path_loader(args: argparse.Namespace, model: str) -> dict:
    """hpctrain's loader alone: images/s read, decoded and augmented (no model)."""
    from hpctrain.data.images.throughput import loader_throughput

    gpu = args.device == "cuda"
    row = loader_throughput(args.shards, batch=args.batch, steps=max(2, args.steps // 2),
                            size=image_size(args), device=args.device,
                            dtype=torch.bfloat16 if gpu else torch.float32,
                            threads=args.decode_threads, ahead=True, timed=True)
    return {"path": "loader", "images_per_s_per_gpu": row.pop("images_per_s"), "ranks": 1,
            **{k: row[k] for k in ("decode_ms_per_image", "augment_ms_per_image", "cpus",
                                   "threads")}}


PATHS = {"a": path_a, "b": path_b, "c": path_c, "d": path_d, "loader": path_loader}
NEEDS = {"c": "torchvision", "d": "lightning"}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the chosen paths for each model; print the table, write the rows."""
    args = parse_args(argv)
    if {"b", "c", "d"} & set(args.paths):
        prepare_data(args)
    rows = []
    for model in args.models:
        for path in args.paths:
            missing = _missing(NEEDS.get(path))
            if missing:
                print(f"skipping ({path}) for {model}: {missing} does not import here "
                      f"(it does on the GPU image)", file=sys.stderr)
                continue
            row = {"model": model_name(args, model), "device": _device_name(args),
                   "batch_per_gpu": args.batch, **PATHS[path](args, model)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if _world()[0] == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
        print(table(rows))
    return rows


def _missing(module: str | None) -> str | None:
    if module is None:
        return None
    try:
        __import__(module)
    except Exception:  # not installed, or (torchvision) built for another torch
        return module
    return None


def _device_name(args: argparse.Namespace) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, with each path as a fraction of (a) for its model."""
    ceiling = {(r["model"], r["ranks"]): r["images_per_s_per_gpu"] for r in rows
               if r["path"] == "a"}
    lines = ["| model | path | ranks | images/s per GPU | of (a) |", "|---|---|---|---|---|"]
    for r in rows:
        a = ceiling.get((r["model"], r["ranks"]))
        frac = f"{r['images_per_s_per_gpu'] / a:.2f}" if a else "-"
        lines.append(f"| {r['model']} | ({r['path']}) | {r['ranks']} | "
                     f"{r['images_per_s_per_gpu']:,.0f} | {frac} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
