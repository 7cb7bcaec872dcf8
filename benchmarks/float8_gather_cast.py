"""The cast of FSDP's float8 all-gather: torchao's against hpctrain's compiled one, on one GPU.

    python benchmarks/float8_gather_cast.py --model 8b --shards 2

Before each all-gather of a float8 weight, every rank casts its fp32 shard to float8 with the
precomputed scale. torchao does it in three eager kernels; ``hpctrain.parallel.float8``
replaces that with one compiled kernel (``fused_gather_cast``). This casts the shards one rank
holds of every block weight of ``--model`` (the attention and FFN matrices of all blocks, each
cut into ``--shards`` row shards, filled with normal values), both ways, and:

- checks that both give the same float8 bytes and scale for every shard (exit 1 if not);
- prints the time of a step's casts (every block's, back to back), median of ``--repeats``
  after a warm-up. Alone in a loop the calls are launch-bound: this is the CPU's and the GPU's
  time together, not the kernels'. What a training step gains is measured by compare.py
  (benchmarks/RESULTS.md).

Needs a CUDA GPU and torchao.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from importlib.metadata import version

import torch

from hpctrain.models.llama.hf_names import expected_shapes
from hpctrain.parallel.float8 import fused_gather_cast, import_float8
from hpctrain.plan.memory_options import resolve_model


def _block_shapes(size: str) -> list[tuple[int, ...]]:
    # One block's Linear weights (attention q/k/v/o, FFN w1/w2/w3): its 2-D parameters.
    return [shape for name, shape in expected_shapes(resolve_model(size)).items()
            if name.startswith("layers.0.") and len(shape) == 2]


def _time_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="8b")
    p.add_argument("--shards", type=int, default=2, help="FSDP ranks the weights are cut over")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import_float8()
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    torchao_cast = Weight.fsdp_pre_all_gather
    if not fused_gather_cast():
        print("this torchao's fsdp_pre_all_gather is not the one hpctrain fuses", file=sys.stderr)
        return 2
    ours = Weight.fsdp_pre_all_gather
    dtype = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = resolve_model(args.model).n_layers
    shards = []
    for rows, cols in _block_shapes(args.model):
        shard = torch.randn(rows // args.shards, cols, device="cuda", generator=gen) * 0.02
        scale = (torch.finfo(dtype).max / shard.abs().max().double()).float()
        shards.append(Weight(shard, LinearMMConfig(), dtype, precomputed_scale=scale))
    for w in shards:
        (a,), (sa,) = torchao_cast(w, None)
        (b,), (sb,) = ours(w, None)
        if not (torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)):
            print(f"MISMATCH on a shard of shape {tuple(w.shape)}", file=sys.stderr)
            return 1

    def step(cast):
        return lambda: [cast(w, None) for _ in range(layers) for w in shards]

    base, fused = _time_ms(step(torchao_cast), args.repeats), _time_ms(step(ours), args.repeats)
    elements = sum(w.numel() for w in shards) * layers
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, torchao "
          f"{version('torchao')}")
    print(f"{args.model}, {layers} blocks, shards of 1/{args.shards}: {elements / 1e9:.2f}G "
          "fp32 elements cast per step; float8 bytes and scales identical")
    print(f"torchao's casts: {base:.2f} ms a step; hpctrain's: {fused:.2f} ms "
          f"({base / fused:.2f}x; {fused * 1e3 / (len(shards) * layers):.0f} us a weight)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
