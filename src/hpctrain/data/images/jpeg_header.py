"""What a JPEG's markers say before its first scan, and whether the GPU's hardware JPEG
engines take it: read on the host in microseconds (the header only, never the scan).

    header = read_jpeg_header(data)            # None: the markers do not parse
    why = engine_refusal(header)               # None: the engines decode it

The engines (nvJPEG's hardware backend, `hpctrain.data.images.nvjpeg_hw`) take baseline or
extended 8-bit Huffman frames of 1 or 3 components in one interleaved scan, subsampled 4:4:4,
4:2:2, 4:2:0, 4:4:0 or grey (nvjpeg.h: the hardware backend refuses 4:1:1 and 4:1:0); not
progressive, CMYK or Adobe RGB-coded files. A file without an EOI marker after its scan is
truncated: it goes to the other decoders, which count it bad as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Frame markers (SOFn) with the frame header layout; 0xC4 (DHT), 0xC8 (JPG), 0xCC (DAC) are not.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_SOS, _EOI, _APP14 = 0xDA, 0xD9, 0xEE
# Luma (h, v) sampling factors, the chroma's being (1, 1), to nvJPEG's subsampling names.
_SUBSAMPLING = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0",
                (4, 1): "4:1:1", (4, 2): "4:1:0"}
_ENGINE_SUBSAMPLING = frozenset({"4:4:4", "4:2:2", "4:2:0", "4:4:0", "gray"})


@dataclass(frozen=True)
class JpegHeader:
    """What the markers before the first scan say about a JPEG."""

    sof: int  # the frame marker: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    precision: int  # bits per sample
    height: int
    width: int
    sampling: tuple[tuple[int, int], ...]  # (h, v) per component
    scan_components: int  # components interleaved in the first scan
    adobe_transform: int | None  # APP14 "Adobe": 0 RGB/CMYK, 1 YCbCr, 2 YCCK
    ends: bool  # an EOI marker follows the first scan (False: truncated)

    @property
    def subsampling(self) -> str:
        """"gray", "4:2:0", ... or "other"."""
        if len(self.sampling) == 1:
            return "gray"
        if len(self.sampling) == 3 and self.sampling[1] == self.sampling[2] == (1, 1):
            return _SUBSAMPLING.get(self.sampling[0], "other")
        return "other"


def read_jpeg_header(data: bytes | np.ndarray) -> JpegHeader | None:
    """The header of a JPEG (bytes or a uint8 array), or None if its markers do not parse up to
    the first scan."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    pos, frame, adobe = 2, None, None
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            pos += 2
            continue
        if marker == _EOI:
            return None
        length = buf[pos + 2] << 8 | buf[pos + 3]
        seg, end = pos + 4, pos + 2 + length
        if length < 2 or end > n:
            return None
        if marker in _SOF:
            if length < 8 or frame is not None:
                return None
            count = buf[seg + 5]
            if length < 8 + 3 * count:
                return None
            sampling = tuple((buf[seg + 7 + 3 * k] >> 4, buf[seg + 7 + 3 * k] & 15)
                             for k in range(count))
            frame = (marker, buf[seg], buf[seg + 1] << 8 | buf[seg + 2],
                     buf[seg + 3] << 8 | buf[seg + 4], sampling)
        elif marker == _APP14 and length >= 14 and bytes(buf[seg:seg + 5]) == b"Adobe":
            adobe = buf[seg + 11]
        elif marker == _SOS:
            if frame is None or length < 3:
                return None
            # An EOI after the scan's start: where a whole file ends (trailing bytes after it
            # are allowed); none in a truncated one (0xFF 0xD9 cannot occur inside the
            # entropy-coded data, where every 0xFF byte is stuffed).
            tail = bytes(buf[max(end, n - 2):])
            ends = tail == b"\xff\xd9" or bytes(buf[end:]).rfind(b"\xff\xd9") >= 0
            return JpegHeader(*frame, scan_components=buf[seg], adobe_transform=adobe,
                              ends=ends)
        pos = end
    return None


def engine_refusal(header: JpegHeader | None) -> str | None:
    """Why the hardware engines would not decode a JPEG with this header (None: they would)."""
    if header is None:
        return "its markers do not parse"
    if header.sof not in (0xC0, 0xC1):
        return "progressive" if header.sof in (0xC2, 0xC6, 0xCA, 0xCE) else (
            f"frame type 0x{header.sof:X} (not baseline)")
    if header.precision != 8:
        return f"{header.precision}-bit samples"
    if len(header.sampling) not in (1, 3):
        return f"{len(header.sampling)} components (CMYK?)"
    if len(header.sampling) == 3 and header.adobe_transform == 0:
        return "RGB-coded (Adobe transform 0)"
    if header.subsampling not in _ENGINE_SUBSAMPLING:
        return f"subsampling {header.subsampling}"
    if header.scan_components != len(header.sampling):
        return "one scan per component (not interleaved)"
    if header.width < 1 or header.height < 1:
        return "no size in the frame header"
    if not header.ends:
        return "truncated (no end-of-image marker)"
    return None
