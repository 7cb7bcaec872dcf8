"""The hardware JPEG decoder: which JPEGs go to the engines, finding the library, choosing the
decoder (CPU); pixels, fallbacks and streams against torchvision's decode (GPU: the lead's run).
"""

from __future__ import annotations

import ctypes
import io
import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image

from hpctrain.data.images import nvjpeg_hw
from hpctrain.data.images.jpeg_header import engine_refusal, read_jpeg_header
from hpctrain.data.images.nvjpeg_hw import (
    HardwareUnavailable,
    NvjpegImage,
    choose_decoder,
    library_candidates,
    load_library,
    plane_table,
)
from hpctrain.data.images.synthetic import synthetic_jpeg
from hpctrain.errors import ConfigError
from hpctrain.tasks.images import ImageTaskConfig

# An odd size (333x251): chroma planes of 4:2:0 and 4:2:2 round up, pitches are not multiples
# of anything.
W, H = 333, 251


def _photo(i: int = 0) -> Image.Image:
    """A photo-like image (smooth colour fields and texture: `synthetic_jpeg`'s) of W x H."""
    return Image.open(io.BytesIO(synthetic_jpeg(i, seed=3, size=(W, H), quality=95)))


def _jpeg(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def _cases() -> dict[str, bytes]:
    """The JPEG kinds of the tests, in batch order: four the engines take, then three they
    must refuse (and others decode or count bad)."""
    photo = _photo()
    whole = _jpeg(photo, subsampling=2)
    return {"4:2:0": whole, "4:4:4": _jpeg(_photo(1), subsampling=0),
            "4:2:2": _jpeg(_photo(2), subsampling=1), "gray": _jpeg(_photo(3).convert("L")),
            "progressive": _jpeg(photo, progressive=True), "cmyk": _jpeg(photo.convert("CMYK")),
            "truncated": whole[:len(whole) // 2]}


ENGINE_KINDS = ("4:2:0", "4:4:4", "4:2:2", "gray")


def test_nvjpeg_image_has_the_layout_of_nvjpeg_h() -> None:
    # typedef struct { unsigned char *channel[4]; size_t pitch[4]; } nvjpegImage_t;
    ptr, size = ctypes.sizeof(ctypes.c_void_p), ctypes.sizeof(ctypes.c_size_t)
    assert ctypes.sizeof(NvjpegImage) == 4 * ptr + 4 * size
    assert NvjpegImage.channel.offset == 0 and NvjpegImage.pitch.offset == 4 * ptr


def test_the_markers_say_which_jpegs_the_engines_take() -> None:
    refusals = {kind: engine_refusal(read_jpeg_header(np.frombuffer(data, np.uint8)))
                for kind, data in _cases().items()}
    assert {k: refusals[k] for k in ENGINE_KINDS} == dict.fromkeys(ENGINE_KINDS)
    assert refusals["progressive"] == "progressive"
    assert "4 components" in refusals["cmyk"]
    assert "truncated" in refusals["truncated"]
    header = read_jpeg_header(_cases()["4:2:2"])
    assert (header.height, header.width, header.subsampling) == (H, W, "4:2:2")
    assert read_jpeg_header(b"\xff\xd8\xff" + bytes(200)) is None  # garbage after SOI
    assert read_jpeg_header(b"\x89PNG\r\n\x1a\n" + bytes(20)) is None
    assert engine_refusal(None) == "its markers do not parse"


def test_the_library_is_never_a_stub_and_a_missing_one_says_where_it_looked(tmp_path) -> None:
    stubs = tmp_path / "cuda" / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    (stubs / "libnvjpeg.so").write_bytes(b"stub")
    fake = tmp_path / "cuda" / "lib64" / "libnvjpeg.so.13"
    fake.write_bytes(b"not an ELF file")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 00000000 08:01 42    {stubs / 'libnvjpeg.so'}\n"
                    "7f02-7f03 r--p 00000000 00:00 0 [heap]\n")
    assert library_candidates(maps, [stubs, fake.parent]) == [fake]
    with pytest.raises(HardwareUnavailable, match="no libnvjpeg loads: .*libnvjpeg.so.13"):
        load_library(maps, [fake.parent])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HardwareUnavailable, match=f"libnvjpeg not found .*{empty}"):
        load_library(tmp_path / "no-maps", [empty])


def test_auto_falls_back_with_the_reason_and_hardware_is_an_error(monkeypatch, caplog) -> None:
    why = "libnvjpeg not found (not loaded, nor in /nowhere)"
    monkeypatch.setattr(nvjpeg_hw, "hardware_unavailable", lambda device: why)
    monkeypatch.setattr(nvjpeg_hw, "_said", set())
    with caplog.at_level(logging.INFO, logger="hpctrain.data"):
        assert choose_decoder("auto", "cuda:0") == "cuda"
        assert choose_decoder("auto", "cuda:0") == "cuda"  # said once
    assert caplog.text.count(f"hardware JPEG decoder not available: {why}; decoding on the "
                             "SMs") == 1
    with pytest.raises(ConfigError, match=re.escape(f"asked for, but {why}")) as e:
        choose_decoder("hardware", "cuda:0")
    assert "task_args.jpeg_decoder=auto" in e.value.hint
    assert choose_decoder("cuda", "cuda:0") == "cuda"
    with pytest.raises(ConfigError, match="'gpu' is not known"):
        choose_decoder("gpu", "cuda:0")
    with pytest.raises(ConfigError, match="jpeg_decoder = 'nvjpg'"):
        ImageTaskConfig(data="x", jpeg_decoder="nvjpg").validate()


# --- on a GPU with JPEG engines (the lead's run) --------------------------------------------

def _engines() -> str | None:
    if not torch.cuda.is_available():
        return "needs a GPU (the lead's run)"
    why = nvjpeg_hw.hardware_unavailable("cuda")
    return None if why is None else f"no hardware JPEG decoder: {why}"


engines = pytest.mark.skipif(_engines() is not None, reason=str(_engines()))

# Tolerances against libjpeg-turbo (torchvision's CPU decode). The engines' chroma upsampling is
# not libjpeg's "fancy" (triangular) one, so with 4:2:0 or 4:2:2 the colours differ along every
# chroma edge: on the H200, 4:2:0 of a textured photo differed by 4.4 levels on average (p99 17).
# The luma recomputed from RGB (the weights are nvJPEG's and libjpeg's alike) cancels the chroma
# out, so it holds the engines' IDCT and rounding only: tight. A swapped or shifted plane, a
# wrong pitch or colour conversion is tens of levels off in both, and biased.
LUMA_MEAN, LUMA_P99 = 1.5, 6  # levels of 255: mean and 99th percentile of |difference|
RGB_MEAN, RGB_P99 = 6.0, 24
BIAS = 1.5  # levels: |mean signed difference| of each channel


def _compare(img: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """How far ``img`` is from ``want`` (uint8 (3, H, W)): RGB and luma |difference| (mean, p99,
    max), each channel's signed bias, and the RGB mean after shifting ``img`` a pixel (a
    shifted plane shows as a shift that fits better)."""
    a, b = img.cpu().float(), want.float()
    d = a - b
    weights = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    luma = ((a * weights).sum(0) - (b * weights).sum(0)).abs()
    shifted = min((a.roll(s, dims=dim) - b)[:, 1:-1, 1:-1].abs().mean().item()
                  for s in (1, -1) for dim in (1, 2))
    return {"mean": d.abs().mean().item(), "p99": d.abs().flatten().quantile(0.99).item(),
            "max": d.abs().max().item(), "luma_mean": luma.mean().item(),
            "luma_p99": luma.flatten().quantile(0.99).item(),
            "bias": max(abs(v) for v in d.mean((1, 2)).tolist()), "shifted_mean": shifted}

@engines
def test_the_engines_decode_like_torchvision_and_refused_ones_fall_back() -> None:
    from torchvision.io import ImageReadMode, decode_jpeg

    from hpctrain.data.images import DecodeStats, EncodedImages, decode_batch

    cases = _cases()
    names = list(cases)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in cases.values()]
    batch = EncodedImages(data, [("shard-000001.tar", k, 100) for k in names])
    stats, before = DecodeStats(), DecodeStats()
    out = decode_batch(batch, "cuda", stats=stats, jpeg_decoder="hardware")
    today = decode_batch(batch, "cuda", stats=before, jpeg_decoder="cuda")
    torch.cuda.synchronize()
    # The engines took the four kinds; the progressive, CMYK and truncated ones went where
    # they go today, and are kept or counted bad alike.
    assert stats.hardware == len(ENGINE_KINDS)
    assert out.kept == today.kept and (stats.decoded, stats.bad) == (before.decoded, before.bad)
    assert set(ENGINE_KINDS) | {"progressive", "cmyk"} <= {names[k] for k in out.kept}
    report, bad = [], []
    for k, img, before_img in zip(out.kept, out, today, strict=True):
        if names[k] not in ENGINE_KINDS:  # decoded as today, by the same decoder
            assert torch.equal(img, before_img), names[k]
            continue
        want = decode_jpeg(data[k], mode=ImageReadMode.RGB)  # libjpeg-turbo on the CPU
        assert img.shape == want.shape == (3, H, W), names[k]
        c, t = _compare(img, want), _compare(img, before_img)  # t: torchvision's on CUDA
        report.append(f"{names[k]}: vs libjpeg-turbo RGB mean {c['mean']:.2f} p99 "
                      f"{c['p99']:.0f} max {c['max']:.0f}, luma mean {c['luma_mean']:.2f} p99 "
                      f"{c['luma_p99']:.0f}, bias {c['bias']:.2f}, best 1-px shift "
                      f"{c['shifted_mean']:.2f}; vs torchvision on CUDA mean {t['mean']:.2f} "
                      f"max {t['max']:.0f}")
        if not (c["luma_mean"] <= LUMA_MEAN and c["luma_p99"] <= LUMA_P99
                and c["mean"] <= RGB_MEAN and c["p99"] <= RGB_P99 and c["bias"] <= BIAS):
            bad.append(report[-1])
    print("\nhardware decode:\n" + "\n".join(report))
    assert not bad, bad
    # Broken entropy data behind a sound header: the engines take it; whatever becomes of it
    # (decoded as noise, or failed and retried alone), the good image after it comes out right.
    garbled = bytearray(cases["4:4:4"])
    garbled[len(garbled) // 2:len(garbled) // 2 + 64] = bytes(range(64))  # no 0xFF: no marker
    pair = [torch.frombuffer(garbled, dtype=torch.uint8), data[0]]
    got = decode_batch(pair, "cuda", jpeg_decoder="hardware")
    assert got.kept[-1] == 1 and torch.equal(got[-1], out[0])
    print("hardware vs libjpeg-turbo:", "; ".join(report))


@engines
def test_decoding_ahead_on_the_engines_equals_decoding_in_the_step() -> None:
    from hpctrain.data.images import DecodeAhead, EncodedImages, ImagePipeline

    pipe = ImagePipeline(64, train=True, device="cuda", jpeg_decoder="hardware")
    serial = ImagePipeline(64, train=True, device="cuda", jpeg_decoder="hardware")
    assert pipe.jpeg_decoder == "hardware"
    ahead, inline = DecodeAhead(pipe, seed=5), DecodeAhead(serial, seed=5, side_stream=False)
    labels = torch.arange(16)
    for step in range(4):  # batches of another size in turn: the state is set up again
        n = 16 if step % 2 == 0 else 12
        jpegs = [synthetic_jpeg(step * 100 + i, size=(W - i, H + i)) for i in range(n)]
        batch = EncodedImages([torch.frombuffer(bytearray(b), dtype=torch.uint8)
                               for b in jpegs], [("s", f"{step}-{i}", n) for i in range(n)])
        got, _ = ahead.prepare(batch, labels[:n])
        want, _ = inline.prepare(batch, labels[:n])
        x = got.use()
        torch.cuda.synchronize()
        assert torch.equal(x, want.tensor), step
    assert pipe.stats.hardware == serial.stats.hardware == 2 * 16 + 2 * 12


def test_plane_table_points_each_plane_at_its_view() -> None:
    # nvJPEG writes plane c of image k at channel[c], rows pitch[c] apart: written here through
    # the same addresses (on the host), each view must show exactly its own planes.
    sizes = [(3, 5), (2, 7), (4, 1)]
    out = torch.zeros(sum(3 * h * w for h, w in sizes), dtype=torch.uint8)
    planes, views = plane_table(out, sizes)
    assert planes.dtype.itemsize == ctypes.sizeof(NvjpegImage)
    assert planes.dtype.fields["pitch"][1] == NvjpegImage.pitch.offset
    for k, (h, w) in enumerate(sizes):
        for c in range(3):
            assert planes["pitch"][k, c] == w
            for row in range(h):
                line = bytes([10 * k + c] * w)
                ctypes.memmove(int(planes["channel"][k, c]) + row * w, line, w)
    for k, view in enumerate(views):
        assert view.shape == (3, *sizes[k])
        assert view.flatten(1).tolist() == [[10 * k + c] * view[0].numel() for c in range(3)]
