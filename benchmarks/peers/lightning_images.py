"""Path (d) of benchmarks/images.py: the same model and loader under PyTorch Lightning 2.6.

    python benchmarks/peers/lightning_images.py --model resnet50 --jpegs runs/bench-images/jpegs \
        --devices 8 --batch 256 --steps 60 --out runs/bench-images/d-resnet50.json

Lightning's best settings for the model: ``precision="bf16-mixed"``, the module compiled with
``torch.compile``, ``channels_last`` weights and inputs, DDP over ``--devices`` GPUs; the loader
is (c)'s (torchvision ImageFolder + DataLoader(workers) + Pillow transforms, an endless random
order per rank: Lightning's DistributedSampler is off, whose short epochs per rank a run of many
GPUs would cross and one GPU would not), built on each rank. Images/s per GPU
are timed by a callback over the steps after the first third (compilation, warm-up). Lightning
and torchvision exist on the GPU image only: benchmarks/images.py skips this path elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


def run_lightning(args: argparse.Namespace, model: str) -> dict:
    """Run this script for ``model`` with benchmarks/images.py's settings; its result row.

    A process of its own: Lightning's DDP launcher starts the other ranks by re-running the
    script it was started from."""
    out = args.out.parent / f"d-{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--model", model, "--jpegs", str(args.jpegs),
                    "--devices", str(args.nproc), "--batch", str(args.batch), "--steps",
                    str(args.steps), "--workers", str(args.workers), "--out", str(out),
                    *(["--tiny"] if args.tiny else []), "--device", args.device], check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps under Lightning and write the rate to ``--out``."""
    import lightning as L

    sys.path.insert(0, str(REPO / "benchmarks"))
    from hpctrain.models.vision import build
    from images import image_size, imagefolder_loader, model_name

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--jpegs", type=Path, required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            net = build(model_name(args, args.model), 100, image_size(args))
            self.net = net.to(memory_format=torch.channels_last)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.net(x.contiguous(memory_format=torch.channels_last)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Rate(L.Callback):
        def __init__(self) -> None:
            self.start, self.seen = 0.0, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if i + 1 == max(1, args.steps // 3):  # the first third warms up
                if args.device == "cuda":
                    torch.cuda.synchronize()
                self.start, self.seen = time.perf_counter(), 0
            elif i + 1 > args.steps // 3:
                self.seen += len(batch[1])

    class Images(L.LightningDataModule):
        def train_dataloader(self):
            # (c)'s loader and sampler on each rank: Lightning's own DistributedSampler is off
            # (use_distributed_sampler=False), its rank and world size come from the trainer.
            return imagefolder_loader(args, self.trainer.world_size, self.trainer.global_rank)

    gpu = args.device == "cuda"
    module = Classifier()
    if gpu:
        module = torch.compile(module)
    rate = Rate()
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto",
                        precision="bf16-mixed" if gpu else "32-true", max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[rate],
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=Images())
    if gpu:
        torch.cuda.synchronize()
    images_per_s = rate.seen / (time.perf_counter() - rate.start)
    if trainer.global_rank == 0:
        args.out.write_text(json.dumps({"images_per_s_per_gpu": images_per_s,
                                        "ranks": args.devices,
                                        "lightning": L.__version__}))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    main()
