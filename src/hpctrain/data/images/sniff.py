"""What kind of image a file holds, by its first bytes (never by its name)."""

from __future__ import annotations

# (magic prefix, offset, extension stored in the shard). The extension is what the reader and
# WebDataset see: JPEGs are decoded in batches on the GPU, the others by Pillow.
_MAGIC = (
    (b"\xff\xd8\xff", 0, "jpg"),
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"BM", 0, "bmp"),
    (b"II*\x00", 0, "tiff"),
    (b"MM\x00*", 0, "tiff"),
)
HEAD_BYTES = 16
IMAGE_EXTS = frozenset({"jpg", "png", "gif", "bmp", "tiff", "webp"})
# Pillow's names of the formats above: the only plugins the decoder lets open a file.
PILLOW_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")


def image_ext(head: bytes) -> str | None:
    """The shard extension of an image starting with ``head`` (jpg, png, ...); None if no image."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, at, ext in _MAGIC if head[at:at + len(magic)] == magic), None)


def is_jpeg(head: bytes) -> bool:
    """Whether ``head`` starts a JPEG (SOI marker and the next marker's 0xFF)."""
    return image_ext(head) == "jpg"
