"""The vision models: torchvision's parameter names and shapes, zero-init, channels_last, FLOPs.

torchvision does not import beside this machine's CPU torch, so its facts are written out here
(parameter counts from its weights' metadata, names and shapes from its source); the models are
built on the meta device, which costs nothing.
"""

from __future__ import annotations

import pytest
import torch

from hpctrain.errors import ConfigError
from hpctrain.models.vision import build, flops_per_sample

# (parameter count, state_dict entries, {name: shape}) of torchvision.models.<name>().
TORCHVISION = {
    "resnet18": (11_689_512, 122, {
        "conv1.weight": (64, 3, 7, 7), "bn1.num_batches_tracked": (),
        "layer1.1.conv2.weight": (64, 64, 3, 3),
        "layer2.0.downsample.0.weight": (128, 64, 1, 1),
        "layer2.0.downsample.1.running_var": (128,), "layer4.1.bn2.weight": (512,),
        "fc.weight": (1000, 512), "fc.bias": (1000,)}),
    "resnet50": (25_557_032, 320, {
        "conv1.weight": (64, 3, 7, 7), "bn1.running_mean": (64,),
        "layer1.0.conv1.weight": (64, 64, 1, 1), "layer1.0.conv3.weight": (256, 64, 1, 1),
        "layer1.0.downsample.0.weight": (256, 64, 1, 1),
        "layer1.0.downsample.1.num_batches_tracked": (),
        "layer2.0.conv2.weight": (128, 128, 3, 3),
        "layer2.0.downsample.0.weight": (512, 256, 1, 1), "layer3.5.bn3.weight": (1024,),
        "layer4.2.conv3.weight": (2048, 512, 1, 1), "fc.weight": (1000, 2048)}),
    "vit_b_16": (86_567_656, 152, {
        "class_token": (1, 1, 768), "conv_proj.weight": (768, 3, 16, 16),
        "conv_proj.bias": (768,), "encoder.pos_embedding": (1, 197, 768),
        "encoder.layers.encoder_layer_0.ln_1.weight": (768,),
        "encoder.layers.encoder_layer_11.self_attention.in_proj_weight": (2304, 768),
        "encoder.layers.encoder_layer_11.self_attention.in_proj_bias": (2304,),
        "encoder.layers.encoder_layer_11.self_attention.out_proj.weight": (768, 768),
        "encoder.layers.encoder_layer_5.ln_2.bias": (768,),
        "encoder.layers.encoder_layer_5.mlp.0.weight": (3072, 768),
        "encoder.layers.encoder_layer_5.mlp.3.weight": (768, 3072),
        "encoder.ln.weight": (768,), "heads.head.weight": (1000, 768),
        "heads.head.bias": (1000,)}),
}


@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_torchvision_names_and_shapes(name):
    params, entries, shapes = TORCHVISION[name]
    with torch.device("meta"):
        model = build(name)
    state = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(state) == entries
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    # Every key follows torchvision's vocabulary (no stray module names of ours).
    allowed = {"conv1", "conv2", "conv3", "bn1", "bn2", "bn3", "downsample", "fc", "layer1",
               "layer2", "layer3", "layer4", "class_token", "conv_proj", "encoder",
               "pos_embedding", "layers", "ln_1", "ln_2", "self_attention", "in_proj_weight",
               "in_proj_bias", "out_proj", "mlp", "ln", "heads", "head", "weight", "bias",
               "running_mean", "running_var", "num_batches_tracked"}
    words = {w for k in state for w in k.split(".")
             if not w.isdigit() and not w.startswith("encoder_layer_")}
    assert words <= allowed


def test_zero_init_residual_starts_each_block_at_identity():
    plain = build("resnet18", 10, zero_init_residual=False)
    zero = build("resnet50", 10, zero_init_residual=True)
    assert all(b.bn2.weight.abs().sum() > 0 for b in plain.blocks())
    assert all((b.bn3.weight == 0).all() for b in zero.blocks())
    assert all((b.bn1.weight == 1).all() for b in zero.blocks())


@pytest.mark.parametrize("name", ["resnet_tiny", "vit_tiny"])
def test_tiny_models_run_channels_last(name):
    torch.manual_seed(0)
    model = build(name, num_classes=10, image_size=32).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        out = model.to(memory_format=torch.channels_last)(
            x.contiguous(memory_format=torch.channels_last))
    assert out.shape == (3, 10)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_flops_match_torchvision_published_counts():
    # torchvision's "_ops" (GFLOPS that are multiply-adds): 4.09 for ResNet-50, 17.56 for
    # ViT-B/16; ours are forward + backward FLOPs, 3 x 2 x the multiply-adds.
    assert flops_per_sample("resnet50") / 6 == pytest.approx(4.09e9, rel=0.01)
    assert flops_per_sample("vit_b_16") / 6 == pytest.approx(17.56e9, rel=0.01)


def test_unknown_model_is_a_config_error_listing_the_names():
    with pytest.raises(ConfigError, match="resnet50.*vit_b_16"):
        build("resnet51")


def test_the_image_tasks_fsdp_units_for_each_model_shape() -> None:
    """hpctrain's models name their blocks by a method; timm's hold them in a ``blocks``
    Sequential (calling it ran its forward); a torchvision ViT's are ``encoder.layers``; an
    ``encoder`` without ``layers`` (it raised AttributeError) falls back to the children."""
    from torch import nn

    from hpctrain.tasks.images import _blocks

    with torch.device("meta"):
        vit = build("vit_tiny", 10, 16)
        resnet = build("resnet_tiny", 10, 16)
    assert _blocks(vit) == list(vit.encoder.layers) and len(_blocks(resnet)) == 4

    class Timm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3)
            self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    class TorchvisionVit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    class OwnEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.act, self.head = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

    timm, tv, own = Timm(), TorchvisionVit(), OwnEncoder()
    assert _blocks(timm) == list(timm.blocks)
    assert _blocks(tv) == list(tv.encoder.layers)
    assert _blocks(own) == [own.encoder, own.head]
