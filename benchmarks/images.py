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
    python benchmarks/images.py --paths b --nproc 8 --strategy fsdp --models vit_b_16
    python benchmarks/images.py --paths a b loader --b-variants gpu,serial,split0.25t8,cpu16
    python benchmarks/images.py --paths loader --loader-crops batched per-image   # crop kernels
    python benchmarks/images.py --models resnet50 --paths b --b-variants gpu,gpus0.5,gpug
    torchrun --nproc-per-node 8 benchmarks/images.py --paths a c       # (a), (c) DDP
    python benchmarks/images.py --device cpu --tiny                    # a CPU smoke run

Each path runs bf16 autocast, channels_last and torch.compile on CUDA (fp32, eager on the CPU),
SGD with momentum, the batch per GPU of ``--batch``. JPEGs are synthetic ImageNet-like photos
(500x375, quality 90; `hpctrain.data.images.synthetic`) written once into ``--jpegs`` and packed
into ``--shards``; both are reused by later runs. It prints a Markdown table (paste it into
benchmarks/RESULTS.md with the card and the date) and writes the rows as JSON to ``--out``.

Path (b) and the loader row run once per ``--b-variants`` entry, each a decode setting of the
image task (`hpctrain.tasks.images`): ``gpu`` (nvJPEG on a side stream, ahead of the step),
``serial`` (nvJPEG in the step, on its stream), ``split<F>`` (the share F of each batch to
Pillow threads, the rest to nvJPEG), ``cpu<N>`` (all on N Pillow threads); a suffix ``t<N>``
sets the Pillow threads, ``r<S>`` decodes at reduced size (Pillow keeps the shorter side >= S).
Two suffixes test whether the host bounds (b), the training thread's kernel launches
competing for the GIL with the loader's threads: ``s<MS>`` sets Python's GIL switch interval
of the training process to MS milliseconds (``task_args.gil_switch_ms``; Python's default is
5), ``g`` has inductor replay the compiled model as CUDA graphs (``task_args.cuda_graphs``;
one launch per graph: what ``torch.compile(mode="reduce-overhead")`` sets). Each row also
says NVML's GPU and JPEG engine utilisation over its timed steps: a GPU busy well below 100%
while the loader keeps up is a host-bound step.
Each row says its setting, the decode threads and cores of the process, and the milliseconds
per image spent decoding (wall time: nvJPEG returns when done) and augmenting (the side
stream's timing events, read once the device has passed them: neither the loader thread nor
the step's stream ever waits for them; ``serial`` has no augment time, as timing it would sync
the step's stream). The loader row also gives the CPU milliseconds per batch of the loader's
threads: reading the shards, decoding (launching nvJPEG) and cropping (launching the crop
kernels), once per ``--loader-crops`` way (the batched kernel training uses on CUDA, or the
per-image launches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models.vision import build

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"resnet50": "configs/resnet50-images.yaml", "vit_b_16": "configs/vit-b16-images.yaml"}
TINY_MODELS = {"resnet50": "resnet_tiny", "vit_b_16": "vit_tiny"}
VARIANT = re.compile(r"(?P<base>gpu|serial|split(?P<frac>[0-9.]+)|cpu(?P<cpus>[0-9]+))"
                     r"(?:t(?P<threads>[0-9]+))?(?:r(?P<side>[0-9]+))?"
                     r"(?:s(?P<switch>[0-9.]+))?(?P<graphs>g)?")


@dataclass(frozen=True)
class Variant:
    """One decode setting of path (b) and the loader row: its name and the task_args."""

    name: str
    decode_threads: int
    cpu_fraction: float = 0.0
    decode_ahead: bool = True
    decode_min_side: int = 0
    gil_switch_ms: float = 0.0  # 0: Python's default (5 ms)
    cuda_graphs: bool = False

    def task_args(self) -> list[str]:
        """The ``task_args.KEY=VALUE`` overrides of this setting."""
        return [f"task_args.{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in (("decode_threads", self.decode_threads),
                             ("cpu_fraction", self.cpu_fraction),
                             ("decode_ahead", self.decode_ahead),
                             ("decode_min_side", self.decode_min_side),
                             ("gil_switch_ms", self.gil_switch_ms),
                             ("cuda_graphs", self.cuda_graphs))]


def parse_variant(name: str, threads: int) -> Variant:
    """A ``--b-variants`` entry (see the module docstring); ``threads``: the default Pillow
    threads (``--decode-threads``)."""
    m = VARIANT.fullmatch(name)
    if m is None:
        raise ValueError(f"decode setting {name!r}: expected gpu, serial, split<F> or cpu<N>, "
                         "then optionally t<threads>, r<min side>, s<GIL switch ms> and g "
                         "(CUDA graphs), e.g. split0.25t8 or gpus0.5g")
    fraction = 1.0 if m["cpus"] else float(m["frac"] or 0)
    if not 0 <= fraction <= 1:
        raise ValueError(f"decode setting {name!r}: the split {fraction} is not in [0, 1]")
    threads = int(m["threads"] or m["cpus"] or threads)
    if threads < 1:
        raise ValueError(f"decode setting {name!r}: needs at least 1 thread")
    switch = float(m["switch"] or 0)
    if m["switch"] is not None and switch <= 0:
        raise ValueError(f"decode setting {name!r}: the GIL switch interval must be > 0 ms")
    return Variant(name, threads, fraction, decode_ahead=m["base"] != "serial",
                   decode_min_side=int(m["side"] or 0), gil_switch_ms=switch,
                   cuda_graphs=m["graphs"] is not None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"],
                   choices=sorted(RECIPES))
    p.add_argument("--paths", nargs="+", default=["a", "b", "c", "d", "loader"],
                   choices=["a", "b", "c", "d", "loader"])
    p.add_argument("--decode-threads", type=int, default=1,
                   help="Pillow threads per rank of (b) and the loader row (unless a "
                   "--b-variants entry says)")
    p.add_argument("--b-variants", default="gpu",
                   help="comma-separated decode settings; (b) and the loader row run once "
                   "per setting, e.g. gpu,serial,split0.25t8,cpu16,cpu16r160")
    p.add_argument("--loader-crops", nargs="+", default=["batched"],
                   choices=["batched", "per-image"],
                   help="the loader row's crops: the batched kernel (what training uses on "
                   "CUDA) and/or image by image (the CPU's way; on CUDA: the old launches)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true",
                   help="tiny models, 32-pixel images, few steps: checks the paths run")
    p.add_argument("--batch", type=int, default=256, help="images per GPU per step")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=1, help="ranks of path (b)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                   help="how path (b) spreads over --nproc > 1 ranks (fsdp: ViT-B/16; the "
                   "ResNet-50 recipe's SGD is refused with sharded parameters)")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers per GPU of path (c) (0: the cores per GPU)")
    p.add_argument("--images", type=int, default=20_000, help="synthetic JPEGs to write")
    p.add_argument("--jpegs", type=Path, default=REPO / "runs" / "bench-images" / "jpegs")
    p.add_argument("--shards", type=Path, default=REPO / "runs" / "bench-images" / "shards")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-images" / "results.json")
    args = p.parse_args(argv)
    try:
        args.variants = [parse_variant(v, args.decode_threads)
                         for v in args.b_variants.split(",") if v]
    except ValueError as e:
        p.error(str(e))
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


def path_a(args: argparse.Namespace, model: str, variant: Variant | None = None) -> dict:
    """(a) synthetic tensors already on the device: the ceiling."""
    net, device, world = _setup(args, model)
    s = image_size(args)
    x = torch.randn(args.batch, 3, s, s, device=device)
    y = torch.randint(0, 100, (args.batch,), device=device)
    rate = _timed_loop(net, device, iter(lambda: (x, y), None), args.steps)
    return {"path": "a", "images_per_s_per_gpu": rate, "ranks": world}


def imagefolder_loader(args: argparse.Namespace, world: int, rank: int):
    """torchvision's ImageFolder + DataLoader + Pillow transforms, as users write it; each
    rank draws its own endless random order (with replacement, seeded by the rank), as one GPU
    does: a DistributedSampler's epoch of len/world samples per rank would end inside a run of
    many ranks (a loader restart one GPU never pays)."""
    from torchvision import datasets, transforms

    s = image_size(args)
    tf = transforms.Compose([transforms.RandomResizedCrop(s), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(),
                             transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = datasets.ImageFolder(str(args.jpegs), tf)
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=1 << 30,
                                             generator=torch.Generator().manual_seed(rank))
    workers = args.workers or max(1, len(os.sched_getaffinity(0)) // max(1, world))
    return torch.utils.data.DataLoader(ds, args.batch, sampler=sampler, num_workers=workers,
                                       pin_memory=args.device == "cuda", drop_last=True,
                                       persistent_workers=True, prefetch_factor=4)


def _forever(loader):
    while True:
        yield from loader


def path_c(args: argparse.Namespace, model: str, variant: Variant | None = None) -> dict:
    """(c) ImageFolder + DataLoader + Pillow, plain PyTorch."""
    net, device, world = _setup(args, model)
    loader = imagefolder_loader(args, world, _world()[0])
    rate = _timed_loop(net, device, _forever(loader), args.steps)
    return {"path": "c", "images_per_s_per_gpu": rate, "ranks": world,
            "workers_per_gpu": loader.num_workers}


def path_b(args: argparse.Namespace, model: str, variant: Variant) -> dict:
    """(b) hpctrain from the tar shards: the recipe trained by `hpctrain train`, decoding as
    ``variant`` says."""
    out = args.out.parent / f"b-{model}-{args.nproc}-{args.strategy}-{variant.name}"
    overrides = [f"task_args.data={args.shards}", f"task_args.model={model_name(args, model)}",
                 f"task_args.image_size={image_size(args)}", f"train.micro_batch={args.batch}",
                 f"train.steps={args.steps}", "train.val_every=0", f"run.out_dir={out}",
                 "run.name=train", "run.suffix=none", "checkpoint.interval=none",
                 "checkpoint.save_at_end=false", "checkpoint.resume=never",
                 "metrics.progress=false", f"metrics.log_every={max(1, args.steps // 6)}",
                 *variant.task_args(), f"run.device={args.device}", "optim.warmup_steps=1"]
    if args.device == "cpu":
        overrides += ["train.precision=fp32", "parallel.compile=false"]
    overrides.append(f"parallel.strategy={args.strategy if args.nproc > 1 else 'none'}")
    if args.nproc == 1:
        import torch._inductor.config as inductor

        from hpctrain import fit  # in this process: no second start-up to pay

        # The task sets the GIL switch interval and inductor's CUDA graphs for its process,
        # this one: put both back for the next row.
        switch, graphs = sys.getswitchinterval(), inductor.triton.cudagraphs
        try:
            fit(config=str(REPO / RECIPES[model]), overrides=overrides, fresh=True)
        finally:
            sys.setswitchinterval(switch)
            inductor.triton.cudagraphs = graphs
    else:
        subprocess.run([sys.executable, "-m", "hpctrain", "train", str(REPO / RECIPES[model]),
                        "--nproc", str(args.nproc), *overrides], check=True)
    from hpctrain.observe.metrics import read_metrics

    records = [r for r in read_metrics(out / "train" / "metrics" / "rank-000.jsonl")
               if "samples_per_s" in r]
    late = records[len(records) // 3:] or records  # the first windows compile and warm up

    def median(key: str) -> float | None:
        values = [r[key] for r in late if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {"path": "b", "images_per_s_per_gpu": median("samples_per_s"), "ranks": args.nproc,
            "strategy": args.strategy if args.nproc > 1 else "none",
            **_setting(variant),
            "data_time_pct": statistics.median(100 * r["data_time_s"] / r["step_time_s"]
                                               for r in late),
            "mfu_pct": statistics.median(100 * (r["mfu"] or 0.0) for r in late),
            "decode_ms_per_image": median("decode_ms_per_image"),
            "augment_ms_per_image": median("augment_ms_per_image")}


def _setting(variant: Variant) -> dict:
    """The columns that say a row's decode setting and the cores it had."""
    return {"setting": variant.name, "decode_threads": variant.decode_threads,
            "gil_switch_ms": variant.gil_switch_ms, "cuda_graphs": variant.cuda_graphs,
            "cpu_fraction": variant.cpu_fraction, "decode_ahead": variant.decode_ahead,
            "decode_min_side": variant.decode_min_side,
            "cores": len(os.sched_getaffinity(0))}


def path_d(args: argparse.Namespace, model: str, variant: Variant | None = None) -> dict:
    """(d) PyTorch Lightning 2.6 on the same model and loader."""
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    from lightning_images import run_lightning

    return {"path": "d", **run_lightning(args, model)}


def path_loader(args: argparse.Namespace, model: str, variant: Variant) -> list[dict]:
    """hpctrain's loader alone: images/s read, decoded and augmented (no model), once per
    ``--loader-crops`` way, with the CPU time per batch of its threads."""
    from hpctrain.data.images.throughput import loader_throughput

    gpu = args.device == "cuda"
    rows = []
    for crops in args.loader_crops:
        row = loader_throughput(args.shards, batch=args.batch, steps=max(2, args.steps // 2),
                                size=image_size(args), device=args.device,
                                dtype=torch.bfloat16 if gpu else torch.float32,
                                threads=variant.decode_threads,
                                cpu_fraction=variant.cpu_fraction,
                                min_side=variant.decode_min_side or None,
                                ahead=variant.decode_ahead, timed=not variant.decode_ahead,
                                batched=crops == "batched")
        rows.append({"path": "loader", "images_per_s_per_gpu": row.pop("images_per_s"),
                     "ranks": 1, **_setting(variant), "crops": crops,
                     **{k: row.get(k) for k in LOADER_KEYS}})
    return rows


# The loader row's timings: per image on the device, and CPU per batch of its threads.
LOADER_KEYS = ("decode_ms_per_image", "augment_ms_per_image", "read_cpu_ms_per_batch",
               "decode_cpu_ms_per_batch", "crop_cpu_ms_per_batch")


PATHS = {"a": path_a, "b": path_b, "c": path_c, "d": path_d, "loader": path_loader}
NEEDS = {"c": "torchvision", "d": "lightning"}
PER_VARIANT = {"b", "loader"}


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
            for variant in args.variants if path in PER_VARIANT else [None]:
                with EngineUse(args) as use:
                    made = PATHS[path](args, model, variant)
                for r in made if isinstance(made, list) else [made]:
                    row = {"model": model_name(args, model), "device": _device_name(args),
                           "batch_per_gpu": args.batch, **r, **use.summary(_timed_s(args, r))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if _world()[0] == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
        print(table(rows))
    return rows


class EngineUse:
    """NVML's GPU and JPEG engine utilisation (%) of this rank's GPU, sampled every
    ``interval_s`` on a thread while a row runs (``with``): a GPU idle while the loader keeps
    up is a host-bound step; the engines show whether the JPEGs decode on them (torchvision's
    batched decode uses them on H100/H200). Nothing on the CPU, or without NVML (the row says
    why)."""

    def __init__(self, args: argparse.Namespace, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []  # (time, JPEG engines, GPU)
        self.why_not: str | None = None
        self.nvml = self.handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if args.device != "cuda":
            return
        try:
            from hpctrain.observe.power import load_nvml, nvml_handle

            self.nvml = load_nvml()
            self.nvml.nvmlInit()
            self.handle = nvml_handle(self.nvml, torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001 - a diagnostic: say why, never fail the row
            self.why_not, self.nvml = f"not measured: {e}", None

    def __enter__(self) -> EngineUse:
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True,
                                            name="bench-engine-use")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append((time.monotonic(),
                                     self.nvml.nvmlDeviceGetJpgUtilization(self.handle)[0],
                                     self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except self.nvml.NVMLError as e:
                self.why_not = f"not measured: {e}"
                return

    def summary(self, last_s: float) -> dict:
        """Mean and peak over the samples of the last ``last_s`` seconds (the row's timed
        steps: compiling first leaves the GPU idle, which a mean over the whole row counted)."""
        if not self.samples:
            return {"engine_use": self.why_not} if self.why_not else {}
        end = self.samples[-1][0]
        late = [s for s in self.samples if s[0] >= end - last_s] or self.samples[-1:]
        _, jpeg, gpu = zip(*late, strict=True)
        return {"jpeg_engine_util_pct": statistics.mean(jpeg),
                "jpeg_engine_util_peak_pct": max(jpeg), "gpu_util_pct": statistics.mean(gpu),
                "util_samples": len(late)}


def _timed_s(args: argparse.Namespace, row: dict) -> float:
    """Seconds of ``--steps // 2`` steps at a row's rate: inside the timed last 2/3 of (a) and
    (b), the whole timed part of the loader row (which times ``--steps // 2``), so NVML's
    samples of that window are the steady state's."""
    rate = row.get("images_per_s_per_gpu") or 0.0
    return args.steps // 2 * args.batch / rate if rate > 0 else 0.0


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
    lines = ["| model | path | decode setting | ranks | images/s per GPU | of (a) | "
             "decode threads / cores | decode ms/img | augment ms/img | "
             "loader CPU ms/batch: read / decode / crop | GPU % / JPEG engines % |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = ceiling.get((r["model"], r["ranks"]))
        frac = f"{r['images_per_s_per_gpu'] / a:.2f}" if a else "-"
        cores = f"{r['decode_threads']} / {r['cores']}" if "cores" in r else "-"
        lines.append(f"| {r['model']} | ({r['path']}) | {r.get('setting', '-')} | "
                     f"{_ranks(r)} | {r['images_per_s_per_gpu']:,.0f} | {frac} | {cores} | "
                     f"{_ms(r.get('decode_ms_per_image'))} | "
                     f"{_ms(r.get('augment_ms_per_image'))} | {_cpu(r)} | {_engines(r)} |")
    return "\n".join(lines)


def _ranks(row: dict) -> str:
    """The row's ranks, and the strategy of (b) on several."""
    strategy = row.get("strategy", "none")
    return f"{row['ranks']}" if strategy == "none" else f"{row['ranks']} {strategy}"


def _cpu(row: dict) -> str:
    """The loader row's CPU milliseconds per batch (read / decode / crop) and its crops."""
    if "read_cpu_ms_per_batch" not in row:
        return "-"
    parts = " / ".join(f"{row[k]:.1f}" for k in LOADER_KEYS[2:])
    return f"{parts} ({row['crops']})"


def _engines(row: dict) -> str:
    """NVML's GPU and JPEG engine utilisation over the row's timed steps (means), or "-"."""
    if "gpu_util_pct" not in row:
        return "-"
    return f"{row['gpu_util_pct']:.0f} / {row['jpeg_engine_util_pct']:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
