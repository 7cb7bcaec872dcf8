"""Image classification from packed JPEG shards: the task behind the ResNet and ViT recipes.

    task: hpctrain.tasks.images:classifier
    task_args:
      model: resnet50            # hpctrain.models.vision names: resnet18/50, vit_b_16, ...
      data: /scratch/imagenet    # `hpctrain data pack-images` output (train/ and val/ splits)
      image_size: 224
      label_smoothing: 0.1
      decode_threads: 1          # how images are decoded: see "Decode choices" below
      cpu_fraction: 0.0

Each micro-batch arrives as encoded JPEG bytes (`ImageShards` through hpctrain's loader: global
order, equal per-rank counts, exact resume) and is decoded, cropped, flipped and normalised on
the model's device (`ImagePipeline`: nvJPEG on CUDA, Pillow on the CPU), ``channels_last``, bf16
on the GPU, in the loader's prefetch thread (`DecodeAhead`), overlapping the training step. The
crops are seeded by the batch's sample keys, so a resume crops bit-identically. An image that
does not decode is skipped (counted, and named in a warning): a step's loss is the mean over the
images that decoded in all its micro-batches and ranks, each weighing the same. ``mixup``
(none by default; mixup, cutmix or both) mixes each training batch on the device and its loss
mixes the labels alike; top-1/top-5 count the images' own labels. Validation is the
centre crop, every sample of the ``val`` split counted once over all ranks (top-1/top-5 exact,
`hpctrain.train.exact_eval`).

Decode choices (``task_args``; `benchmarks/images.py --b-variants` trains once per choice):
nvJPEG on a side stream ahead of the step is the default on CUDA; ``cpu_fraction`` (0..1) of
each batch's JPEGs go to Pillow on ``decode_threads`` host threads while nvJPEG decodes the
rest (1: all on the host); ``decode_min_side`` lets Pillow decode at reduced size;
``decode_ahead: false`` decodes in the step on its own stream (serially: the baseline);
``gil_switch_ms`` shortens Python's GIL switch interval for the process (the training thread
launching kernels waits less for the loader's threads); ``cuda_graphs`` has inductor replay the
compiled model as CUDA graphs (one launch per graph: the training thread no longer queues each
kernel while the loader's threads want the GIL). Training
metrics carry ``decode_ms_per_image`` (and ``augment_ms_per_image`` where it costs the step's
stream no sync: the side stream's events, read once the device has passed them, so a step reports
an earlier batch's; or wall time on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import from_dict
from hpctrain.data.images import (
    DecodeAhead,
    EncodedImages,
    ImagePipeline,
    ImageShards,
    PreparedImages,
    collate_images,
)
from hpctrain.data.images.mix import Mixing, MixMode
from hpctrain.data.images.reader import IMAGES_FORMAT
from hpctrain.data.tar_samples import MANIFEST
from hpctrain.errors import ConfigError
from hpctrain.models import vision
from hpctrain.observe.accuracy import topk_correct
from hpctrain.task import Task, TaskError


@dataclasses.dataclass
class ImageTaskConfig:
    """``task_args`` of :func:`classifier`."""

    model: str = "resnet50"
    # The packed shards (a folder with train/ and, for validation, val/ splits).
    data: str = ""
    image_size: int = 224
    # Evaluation resizes the shorter side to this, then takes the centre crop (0: size / 0.875).
    eval_resize: int = 0
    # 0: the number of classes in the shards' manifest.
    num_classes: int = 0
    label_smoothing: float = 0.1
    # Random-resized-crop's smallest area, as a fraction of the image (torchvision: 0.08);
    # small or centred images (digits, thumbnails) train better with a larger one.
    crop_scale_min: float = 0.08
    # Random horizontal flips (off for images whose class changes when mirrored: text, digits).
    hflip: bool = True
    # Mixup/CutMix of each training batch on the device (`hpctrain.data.images.mix`): none,
    # mixup, cutmix, or both (one of the two per batch, DeiT's way), with Beta(alpha, alpha)
    # weights drawn from the batch's sample keys (a resume mixes the same way). The loss mixes
    # the labels with the same weight; top-1/top-5 count the images' own labels.
    mixup: MixMode = "none"
    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    # ResNet: each block's last BatchNorm gain starts at 0 (Goyal et al. 2017).
    zero_init_residual: bool = True
    channels_last: bool = True
    # How images are decoded (the GPU benchmark measures which wins; see the module docstring):
    # Pillow decoding threads per rank, and (on CUDA) the share of each batch they decode
    # while nvJPEG decodes the rest: a knob for the balance of CPU and GPU per machine.
    decode_threads: int = 1
    cpu_fraction: float = 0.0
    # Decode + augment in the loader's prefetch thread (on CUDA: a side stream), overlapping
    # the step; false: in the step, on its own stream (serially: the baseline).
    decode_ahead: bool = True
    # Training: Pillow decodes a JPEG at 1/2, 1/4 or 1/8 size while its shorter side stays
    # >= this (0: full size). nvJPEG always decodes at full size: this acts on the images
    # Pillow decodes (all on the CPU, ``cpu_fraction`` of them on CUDA).
    decode_min_side: int = 0
    # Seeds the crops (with each batch's sample keys: the same crops after a resume).
    augment_seed: int = 0
    # Python's GIL switch interval for the training process, in milliseconds (0: Python's
    # default, 5): the longest a thread waiting for the GIL waits. The training thread that
    # launches the model's kernels shares the GIL with the loader's reading and decoding
    # threads; with a compiled ResNet-50 on an H200 the GPU idled 28% of the step while the
    # loader kept up. 0.5 ms measured +10.6% and -1% in two calls (benchmarks/images.py
    # --b-variants gpu,gpus0.5): within the calls' noise, so not a default.
    gil_switch_ms: float = 0.0
    # With parallel.compile: inductor replays the compiled model as CUDA graphs (what
    # torch.compile(mode="reduce-overhead") sets), for every compile of the rank's process. The
    # batch keeps its shape (a batch that lost images is padded), so the graphs are recorded
    # once. ResNet-50 on one H200, batch 256: GPU busy 86% of the step instead of 72-88%, +8.5%
    # and +11% images/s in two calls (benchmarks/images.py --b-variants gpu,gpug); one GPU
    # only measured (not under DDP or FSDP), hence off by default.
    cuda_graphs: bool = False
    # Copy each split once per node to this node-local folder first (e.g. $SLURM_TMPDIR).
    stage_to: str | None = None

    def validate(self) -> None:
        """Refuse settings the task cannot train with, naming the key."""
        if not self.data:
            raise ConfigError("task_args.data is not set",
                              expected="the folder `hpctrain data pack-images` wrote",
                              hint="task_args.data=/path/to/shards")
        if self.model not in vision.MODELS:
            raise ConfigError(f"task_args.model = {self.model!r} is not known",
                              expected=", ".join(vision.MODELS))
        if self.image_size < 8:
            raise ConfigError(f"task_args.image_size = {self.image_size}",
                              expected="at least 8 pixels")
        patch = vision.VIT_SIZES.get(self.model, {}).get("patch_size")
        if patch and self.image_size % patch:
            fit = max(patch, self.image_size // patch * patch)
            raise ConfigError(f"task_args.image_size = {self.image_size} is not a multiple of "
                              f"{self.model}'s patch size {patch}",
                              expected=f"a multiple of {patch}",
                              hint=f"task_args.image_size={fit}")
        if self.eval_resize and self.eval_resize < self.image_size:
            raise ConfigError(f"task_args.eval_resize = {self.eval_resize} is smaller than "
                              f"image_size {self.image_size}",
                              expected="0 (size / 0.875) or >= image_size")
        if not 0 < self.crop_scale_min <= 1:
            raise ConfigError(f"task_args.crop_scale_min = {self.crop_scale_min}",
                              expected="0 < value <= 1 (0.08 is torchvision's)")
        if self.decode_min_side < 0:
            raise ConfigError(f"task_args.decode_min_side = {self.decode_min_side}",
                              expected="0 (decode at full size) or the shorter side to keep, "
                              "e.g. 160")
        if self.decode_threads < 1 or not 0 <= self.cpu_fraction <= 1:
            raise ConfigError(f"task_args.decode_threads = {self.decode_threads}, "
                              f"cpu_fraction = {self.cpu_fraction}",
                              expected="decode_threads >= 1 and 0 <= cpu_fraction <= 1")
        if self.gil_switch_ms < 0:
            raise ConfigError(f"task_args.gil_switch_ms = {self.gil_switch_ms}",
                              expected="0 (Python's default, 5 ms) or a positive interval, "
                              "e.g. 0.5")
        if self.mixup_alpha <= 0 or self.cutmix_alpha <= 0:
            raise ConfigError(f"task_args.mixup_alpha = {self.mixup_alpha}, cutmix_alpha = "
                              f"{self.cutmix_alpha}", expected="both > 0 (DeiT: 0.8 and 1.0)")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"task_args.label_smoothing = {self.label_smoothing}",
                              expected="0 <= value < 1 (0.1 is the usual)")


class ImageClassifier:
    """The task's parts: model factory, collates that decode + augment ahead, and the step.

    Decoding and augmenting run in the loader's prefetch thread (`DecodeAhead`: a CUDA side
    stream on the GPU), so they overlap the training step. Batches are decoded on the device
    the model was last built on (the trainer calls the model factory under its device before
    the first batch is read; the CPU before any model). A pipeline is built per (split, device)
    on first use, so a batch collated before the model (a plan, a notebook) pins nothing; the
    step refuses a batch on another device than the model's.
    """

    def __init__(self, cfg: ImageTaskConfig, num_classes: int,
                 build: Callable[[int, int], nn.Module] | None = None) -> None:
        self.cfg, self.num_classes, self.build = cfg, num_classes, build
        if cfg.gil_switch_ms:  # process-wide: every thread of this rank
            sys.setswitchinterval(cfg.gil_switch_ms / 1e3)
        if cfg.cuda_graphs:  # process-wide too: the trainer compiles the model later
            import torch._inductor.config as inductor

            inductor.triton.cudagraphs = True
        self.device = torch.device("cpu")
        self._decoders: dict[tuple[bool, torch.device], DecodeAhead] = {}
        # Training batches: random-resized crops and flips, seeded by the batch's keys;
        # validation batches: resize and centre crop.
        self.collate = ImageCollate(self, train=True)
        self.eval_collate = ImageCollate(self, train=False)

    def model(self) -> nn.Module:
        """The classifier, on the trainer's device (which it remembers for the pipelines)."""
        device = torch.get_default_device()
        if device.type != "meta":  # a model built only to be measured (a plan, a preflight)
            self.device = device
        cfg = self.cfg
        model = (self.build(self.num_classes, cfg.image_size) if self.build else
                 vision.build(cfg.model, self.num_classes, cfg.image_size,
                              zero_init_residual=cfg.zero_init_residual))
        return model.to(memory_format=torch.channels_last) if cfg.channels_last else model

    def _decoder(self, train: bool, device: torch.device | None = None) -> DecodeAhead:
        """The decoder of training or evaluation batches on ``device`` (default: the model's
        latest)."""
        device = self.device if device is None else device
        key = (train, device)
        if key not in self._decoders:
            cfg = self.cfg
            # bf16 on the GPU (half the bytes; the step casts for an fp32 run), fp32 on the CPU.
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            pipe = ImagePipeline(cfg.image_size, train=train, device=device, dtype=dtype,
                                 resize=cfg.eval_resize or None, scale=(cfg.crop_scale_min, 1.0),
                                 flip=cfg.hflip, threads=cfg.decode_threads,
                                 cpu_fraction=cfg.cpu_fraction,
                                 min_side=cfg.decode_min_side or None)
            mixing = (Mixing(cfg.mixup, cfg.mixup_alpha, cfg.cutmix_alpha)
                      if train and cfg.mixup != "none" else None)
            self._decoders[key] = DecodeAhead(pipe, cfg.augment_seed,
                                              side_stream=cfg.decode_ahead, mixing=mixing)
        return self._decoders[key]

    def step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """Cross entropy (label smoothing in training), per-sample top-1/top-5 hits and, in
        training, the milliseconds per image spent decoding (and augmenting, where known)."""
        prepared, labels = batch
        device = _device_of(model)
        if isinstance(prepared, EncodedImages):  # decode_ahead=false: decode here, serially
            prepared, labels = self._decoder(model.training, device).prepare(prepared, labels)
            labels = labels.to(prepared.tensor.device, non_blocking=True)
        images = prepared.use()  # the step's stream waits for the loader's side stream
        if device is not None and images.device != device:
            raise TaskError(f"the image batch is on {images.device}, the model on {device}",
                            expected="batches decoded on the model's device",
                            hint="build the model (the task's model factory, under its device) "
                            "before collating batches for it")
        if not torch.is_autocast_enabled(images.device.type):
            # fp32 runs (and FSDP, whose mixed precision casts its inputs itself).
            images = images.float()
        logits = model(images)
        if len(labels) < logits.shape[0]:
            # Rows past the labels pad a batch that lost images (`DecodeAhead`): one shape
            # for the compiled model, no loss or metric for them.
            logits = logits[:len(labels)]
        smoothing = self.cfg.label_smoothing if model.training else 0.0
        if not len(labels):
            # Every image failed to decode: no loss to add, but a zero still tied to the graph
            # (the backward and DDP's gradient sync run as on every rank), never cross
            # entropy's NaN mean of nothing.
            return (logits.sum() * 0,
                    {**topk_correct(logits.detach(), labels), **_timings(prepared, model)})
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=smoothing)
        if model.training and prepared.lam is not None:  # mixed images: mixed labels
            partners = F.cross_entropy(logits.float(), labels.flip(0), label_smoothing=smoothing)
            loss = prepared.lam * loss + (1 - prepared.lam) * partners
        return loss, {**topk_correct(logits.detach(), labels), **_timings(prepared, model)}


class ImageCollate:
    """The task's ``collate``, in two parts that `SampleLoader` runs on two threads: gathering
    the encoded bytes (with the reading), then decoding and augmenting them (`DecodeAhead`)."""

    def __init__(self, parts: ImageClassifier, train: bool) -> None:
        self.parts, self.train = parts, train

    def __call__(self, samples: list) -> tuple[Any, torch.Tensor]:
        """Both parts: the batch as the step takes it."""
        return self.finish(self.gather(samples))

    def gather(self, samples: list) -> tuple[EncodedImages, torch.Tensor]:
        """Encoded images and labels, on the host."""
        return collate_images(samples)

    def finish(self, gathered: tuple[EncodedImages, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Decoded and augmented ahead (or left encoded with ``decode_ahead: false``: the step
        decodes)."""
        if not self.parts.cfg.decode_ahead:
            return gathered
        return self.parts._decoder(self.train).prepare(*gathered)


def classifier(build: Callable[[int, int], nn.Module] | None = None, **task_args: Any) -> Task:
    """The image classifier task that ``task_args`` describe (see :class:`ImageTaskConfig`);
    ``build(num_classes, image_size)``, if given, makes the model instead of ``model``'s
    (whose name still gives the FLOPs per sample)."""
    cfg = from_dict(ImageTaskConfig, task_args, "task_args")
    cfg.validate()
    train = ImageShards(cfg.data, "train", stage_to=cfg.stage_to)
    num_classes = cfg.num_classes or len(train.classes)
    if num_classes < len(train.classes):
        raise ConfigError(f"task_args.num_classes = {num_classes}, but the shards hold "
                          f"{len(train.classes)} classes",
                          hint="set 0 to take the manifest's count")
    parts = ImageClassifier(cfg, num_classes, build)
    return Task(model=parts.model, data=train, eval_data=_val_split(cfg), step=parts.step,
                collate=parts.collate, eval_collate=parts.eval_collate,
                flops_per_sample=vision.flops_per_sample(cfg.model, cfg.image_size, num_classes),
                shard_units=_blocks, samples_in_batch=_labels)


def _labels(batch: tuple[Any, torch.Tensor]) -> int:
    """The images a micro-batch's loss is the mean over: those that decoded (decoding ahead;
    ``decode_ahead: false`` decodes in the step, after the weights are set: all offered)."""
    return len(batch[1])


def _device_of(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None without parameters)."""
    p = next(model.parameters(), None)
    return None if p is None else p.device


def _timings(prepared: PreparedImages, model: nn.Module) -> dict[str, torch.Tensor]:
    """The batch's decode (and augment) milliseconds per image, as metrics of training steps
    (made on the device by a fill, not copied: no sync)."""
    if not model.training:
        return {}
    device = prepared.tensor.device
    return {f"{name}_ms_per_image": torch.full((), ms, device=device)
            for name, ms in (("decode", prepared.decode_ms), ("augment", prepared.augment_ms))
            if ms is not None}


def _blocks(model: nn.Module) -> list[nn.Module]:
    """FSDP's units: a ResNet's four stages (its 16 blocks of ResNet-50 are small: per-stage
    all-gathers are 4 instead of 16 latency-bound ones), a ViT's encoder blocks (torchvision's
    models have the same names). Each unit's BatchNorms are one more group that keeps fp32
    parameters (`TaskTrainer`)."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [getattr(model, f"layer{i}") for i in range(1, 5)]
    if callable(getattr(type(model), "blocks", None)):  # hpctrain.models.vision's method
        return list(model.blocks())
    if isinstance(getattr(model, "blocks", None), nn.Sequential | nn.ModuleList):  # timm's
        return list(model.blocks)
    try:
        layers = model.encoder.layers  # torchvision's VisionTransformer
    except AttributeError:  # no encoder, or one without blocks of that name
        layers = None
    if layers is not None:
        return list(layers)
    # A model of the user's own (classifier(build=...)): its children that hold parameters.
    return [m for m in model.children() if any(True for _ in m.parameters())]


def _val_split(cfg: ImageTaskConfig) -> ImageShards | None:
    """The ``val`` split if the shards have one (else training runs without validation)."""
    try:
        manifest = json.loads((Path(cfg.data) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None  # ImageShards of the train split has said what is wrong already
    if manifest.get("format") != IMAGES_FORMAT or "val" not in (manifest.get("splits") or {}):
        return None  # one split only (a split folder itself: its val would be train)
    return ImageShards(cfg.data, "val", stage_to=cfg.stage_to)
