"""Images at line rate: JPEGs packed into tar shards, read in the global order, decoded and
augmented in batches on the device.

    hpctrain data pack-images images/ --out data/images --val-fraction 0.02
    ds = ImageShards("data/images", split="train")
    pipe = ImagePipeline(224, train=True, device="cuda", dtype=torch.bfloat16)
    x, y = pipe(*collate_images([ds[i] for i in range(256)]), augment_generator(seed, step, rank))
"""

from hpctrain.data.images.ahead import DecodeAhead, batch_generator
from hpctrain.data.images.augment import ImagePipeline, augment_generator, crop_boxes
from hpctrain.data.images.decode import Decoded, DecodeStats, decode_batch
from hpctrain.data.images.reader import (
    EncodedImages,
    ImageSample,
    ImageShards,
    PreparedImages,
    collate_images,
)

__all__ = ["DecodeAhead", "Decoded", "DecodeStats", "EncodedImages", "ImagePipeline",
           "ImageSample", "ImageShards", "PreparedImages", "augment_generator",
           "batch_generator", "collate_images", "crop_boxes", "decode_batch"]
