"""Compile-cache round trip through ``hpctrain.train.compile_cache``, one phase per process.

    RUN=/tmp/cc; rm -rf $RUN
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_cache_roundtrip.py save $RUN
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_cache_roundtrip.py load $RUN
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_cache_roundtrip.py cold $RUN

Each phase compiles a small MLP (forward + backward) with an empty inductor cache, as a requeued
job on a new node does, and prints the first step's time and torch's cache counters; ``save``
then saves the artifacts into ``$RUN/cache``, ``load`` loads them first, ``cold`` neither.
Add ``--device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from hpctrain.train.compile_cache import CompileCache


def main() -> None:
    """Run one phase."""
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "load", "cold"])
    p.add_argument("run", type=Path)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.run.mkdir(parents=True, exist_ok=True)
    cache = CompileCache(args.run, {"bench": "mlp", "device": args.device}, rank=0)
    if args.phase == "load":
        start = time.perf_counter()
        print(f"loaded: {cache.load()} in {time.perf_counter() - start:.1f} s")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).to(args.device)
    step = torch.compile(model)
    start = time.perf_counter()
    step(torch.randn(8, 16, device=args.device)).sum().backward()
    if args.device != "cpu":
        torch.cuda.synchronize()
    print(f"{args.phase}: first step (compilation included) {time.perf_counter() - start:.1f} s")
    print("inductor:", dict(counters["inductor"]), "aot_autograd:", dict(counters["aot_autograd"]))
    if args.phase == "save":
        print(f"saved: {cache.save()}")


if __name__ == "__main__":
    main()
