"""A whole batch's crops, resizes and flips in a fixed number of torch ops, whatever its size.

    geometry = [train_geometry(hw, box, size, flip) for ...]   # or centre_geometry(...)
    x = batch_crops(images, geometry, size)      # (B, 3, S, S) float, 0..255 levels

Cropping image by image costs ~4 kernel launches per image under the GIL (a slice, a cast,
``F.interpolate``, then a stack): at batch 256 the loader thread spends its time launching, and
the GPU waits. Here the batch is one flat uint8 buffer (one ``_chunk_cat``), and each resize is
separable: output = Wy @ crop @ Wx^T, with per-sample weight matrices built on the device from a
small geometry table (one pinned host->device copy). The weights are ``F.interpolate(bilinear,
antialias=True)``'s own (a triangle filter as wide as the downscale factor, renormalised at the
crop's edges: PyTorch's ``_compute_indices_min_size_weights_aa``), so the result equals the
per-image resize up to float rounding. A flipped sample reads its output columns in reverse: the
flip costs nothing and needs no host->device copy of which samples flip.

The crop of each sample is read as rows: ``flat.unfold(0, wmax, 1)`` views every offset of the
buffer as a row of ``wmax`` bytes, so one index of (B, hmax, 3) row starts gathers the (B, hmax,
3, wmax) crops without a per-pixel index tensor. Columns past a crop's width (and rows past
its height) read neighbouring bytes that get weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# One row of the geometry table: the image, the box read from it, the resized size that box
# becomes, where the output window sits in it, and whether it is mirrored.
FIELDS = ("H", "W", "top", "left", "h", "w", "out_h", "out_w", "shift_y", "shift_x", "flip")


def train_geometry(hw: tuple[int, int], box: tuple[int, int, int, int], size: int,
                   flip: bool) -> list[int]:
    """The geometry row of a random-resized crop: ``box`` (top, left, h, w) to size x size."""
    (H, W), (top, left, h, w) = hw, box
    return [H, W, top, left, h, w, size, size, 0, 0, int(flip)]


def centre_geometry(hw: tuple[int, int], resize: int, size: int) -> list[int]:
    """The geometry row of torchvision's Resize(resize) + CenterCrop(size) of an (H, W) image."""
    H, W = hw
    nh, nw = (resize, int(resize * W / H)) if H <= W else (int(resize * H / W), resize)
    return [H, W, 0, 0, H, W, nh, nw, round((nh - size) / 2), round((nw - size) / 2), 0]


def _weights(n_in: torch.Tensor, n_out: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor,
             size: int, span: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, size, span): each output index's antialiased bilinear weights over the box's
    ``n_in`` input indices (zero past them), as ``F.interpolate(antialias=True)`` computes."""
    device = n_in.device
    i = torch.arange(size, device=device, dtype=torch.float32)
    i = torch.where(flip[:, None], size - 1 - i, i) + shift[:, None]  # (B, size)
    scale = (n_in.float() / n_out.float())[:, None, None]  # float32 in PyTorch too
    invscale = torch.where(scale >= 1, 1.0 / scale, torch.ones_like(scale))
    center = scale * (i[:, :, None] + 0.5)
    j = torch.arange(span, device=device, dtype=torch.float32)
    # One (B, size, span) float32 buffer, built in place (`groups_by_size` counts it): out of
    # place, each step of the formula would be one more.
    w = torch.sub(j, center)
    w.add_(0.5).mul_(invscale).abs_().neg_().add_(1).clamp_(min=0)
    w.mul_(j < n_in[:, None, None])
    return w.div_(w.sum(-1, keepdim=True)).to(dtype)


# Elements of one group's temporaries, each counted as 3 bytes: the padded crops (B, hmax, 3,
# wmax) in uint8 + float16; twice the weights (B, S, hmax) and (B, S, wmax), each built in one
# float32 buffer then cast to float16; twice the rows resized (B, S, 3, wmax) in float16:
# ~0.8 GB at most. A batch of ImageNet-sized photos
# is one group; a 4000 x 3000 photo among them would pad every crop to its size (tens of GB),
# so the largest boxes go to groups of their own.
MAX_GROUP_ELEMENTS = 1 << 28


def groups_by_size(geometry: list[list[int]], size: int,
                   max_elements: int = MAX_GROUP_ELEMENTS) -> list[list[int]]:
    """The samples in groups whose temporaries (boxes padded to the group's largest height
    and width, resized to ``size``) hold at most ``max_elements`` (one group, in batch order,
    when the whole batch fits)."""
    def padded(rows: list[int]) -> int:
        hmax = max(geometry[k][4] for k in rows)
        wmax = max(geometry[k][5] for k in rows)
        return len(rows) * (3 * hmax * wmax + 2 * size * (hmax + wmax) + 2 * size * wmax)

    everything = list(range(len(geometry)))
    if padded(everything) <= max_elements:
        return [everything]
    groups: list[list[int]] = [[]]
    for k in sorted(everything, key=lambda k: (geometry[k][4] * geometry[k][5], k)):
        if groups[-1] and padded([*groups[-1], k]) > max_elements:
            groups.append([])
        groups[-1].append(k)
    return groups


def batch_crops(images: Sequence[torch.Tensor], geometry: list[list[int]], size: int,
                compute: torch.dtype = torch.float32,
                max_elements: int = MAX_GROUP_ELEMENTS) -> torch.Tensor:
    """uint8 (3, H, W) images -> (B, 3, size, size) of their boxes resized (float, 0..255),
    in ``compute`` precision (float16 on CUDA keeps uint8 levels exact and halves the traffic).
    A fixed number of ops per group of `groups_by_size` (one group, as a rule)."""
    device = images[0].device
    groups = groups_by_size(geometry, size, max_elements)
    order = [k for g in groups for k in g]
    # Rows in group order; the last column puts the results back in batch order.
    inverse = [0] * len(order)
    for position, k in enumerate(order):
        inverse[k] = position
    table = torch.tensor([[*geometry[k], inverse[i]] for i, k in enumerate(order)],
                         dtype=torch.int64)
    if device.type == "cuda":
        # A pageable host->device copy can wait on the device: pinned, it only queues.
        table = table.pin_memory()
    table = table.to(device, non_blocking=True)
    H, W = table[:, 0], table[:, 1]
    # The images end to end, each (3, H, W) in that order: CUDA's _chunk_cat copies a dense
    # tensor's memory as it lies, so a permuted one (Pillow's HWC) is made contiguous first
    # (nvJPEG's are: no op for them). The tail pad lets the last row's window exist.
    images = [images[k] if images[k].is_contiguous() else images[k].contiguous() for k in order]
    wmax = max(g[5] for g in geometry)
    flat = torch._chunk_cat([*images, torch.zeros(wmax, dtype=torch.uint8, device=device)],
                            0, 1)[0]
    plane = H * W
    offset = plane.mul(3).cumsum(0) - plane * 3  # where each image starts in ``flat``
    outs, first = [], 0
    for g in groups:
        rows = slice(first, first + len(g))
        first += len(g)
        outs.append(_group_crops(flat, table[rows], offset[rows], size, compute,
                                 max(geometry[k][4] for k in g),
                                 max(geometry[k][5] for k in g)))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)[table[:, 11]]
    return out.view(-1, size, 3, size).permute(0, 2, 1, 3)


def _group_crops(flat: torch.Tensor, table: torch.Tensor, offset: torch.Tensor, size: int,
                 compute: torch.dtype, hmax: int, wmax: int) -> torch.Tensor:
    """(n, size, 3, size): one group's crops resized, from its rows of the geometry table."""
    H, W, top, left, h, w, out_h, out_w, shift_y, shift_x, flip = table[:, :11].unbind(1)
    device, n = flat.device, table.shape[0]
    rows = torch.minimum(torch.arange(hmax, device=device), (h - 1)[:, None])  # (n, hmax)
    # Row starts in (n, hmax, 3) order: the crops come out as (n, hmax, 3 * wmax), so both
    # passes are plain batched matmuls over all channels at once.
    starts = ((offset + top * W + left)[:, None, None] + (rows * W[:, None])[:, :, None]
              + torch.arange(3, device=device)[None, None, :] * (H * W)[:, None, None])
    crops = flat.unfold(0, wmax, 1)[starts].to(compute).view(n, hmax, 3 * wmax)
    no_flip = torch.zeros_like(flip, dtype=torch.bool)
    wy = _weights(h, out_h, shift_y, no_flip, size, hmax, compute)  # (n, S, hmax)
    wx = _weights(w, out_w, shift_x, flip.bool(), size, wmax, compute)  # (n, S, wmax)
    rows_done = torch.bmm(wy, crops).view(n, size * 3, wmax)  # (n, S, 3, wmax)
    return torch.bmm(rows_done, wx.transpose(1, 2))  # (n, S * 3, S)
