"""Hugging Face parity at real sizes: the 1b and 8b shapes in bf16 on one GPU.

For each shape a random Llama (transformers, bf16, on the GPU; the 8b one the Llama 3.1 8B
config with its RoPE scaling) is saved as safetensors, then:

1. transformers computes the logits of random tokens in bf16 and, the same weights cast up, in
   fp32 (the reference); hpctrain imports the folder (``init_from: hf:DIR``'s loader) and
   computes them in fp32 and in bf16. bf16 rounds differently in each implementation, so the
   bf16 check is relative: hpctrain's bf16 logits must be as close to the fp32 reference as
   transformers' own bf16 logits are (mean |error| at most 1.5x theirs); its fp32 logits must
   match transformers' fp32 ones (max |difference| <= 1e-3 on a GPU; the CPU tests hold 1e-5);
2. ``hpctrain import hf`` (DCP checkpoint) and ``hpctrain export hf --dtype bf16`` give back
   every tensor bit for bit (the same check the CPU tests make, at full size), with the time
   each conversion took.

Also reported: next-token agreement and mean KL of the bf16 logits with transformers' bf16 ones
(a random model's logits are flat, so near-ties make the agreement an indication only).
Prints one JSON line per shape and a Markdown table for benchmarks/RESULTS.md.

    python benchmarks/hf_parity_gpu.py                 # 1b and 8b, on cuda
    python benchmarks/hf_parity_gpu.py --shapes 1b --seq-len 1024 --workdir /tmp/parity
    python benchmarks/hf_parity_gpu.py --shapes tiny --device cpu   # the script itself, on a CPU

Needs transformers and safetensors (``pip install 'hpctrain[dev]'``); on a machine without
internet, download their wheels elsewhere and carry them (see the report of issue 13). Disk:
about 3 x the model in bf16 under ``--workdir`` (48 GB for 8b), removed as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.models import PRESETS, ModelArgs
from hpctrain.models.init_source import InitSource
from hpctrain.models.llama.hf_config import hf_config_from_args
from hpctrain.models.llama.sizes import RopeScaling
from hpctrain.pretrained.export_hf import export_hf
from hpctrain.pretrained.import_hf import import_hf
from hpctrain.pretrained.source import resolve_source
from hpctrain.pretrained.weights import load_model

SHAPES: dict[str, ModelArgs] = {
    "1b": PRESETS["1b"],
    # Llama 3.1 8B: the 8b preset with the llama3 RoPE scaling and a 128k table.
    "8b": dataclasses.replace(PRESETS["8b"], max_seq_len=131072,
                              rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                      vocab_size=256, max_seq_len=256),
}
FP32_ATOL = 1e-3
BF16_ERROR_RATIO = 1.5


def _hf_model(args: ModelArgs, device: torch.device, seed: int):
    """A random transformers Llama of shape ``args`` in bf16 on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**hf_config_from_args(args, None, "bfloat16",
                                               {"bos_token_id": 0, "eos_token_id": 1}))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(path))
    return out


def check_shape(name: str, device: torch.device, workdir: Path, seq_len: int,
                batch: int) -> dict:
    """Run both checks for one shape; returns its record."""
    args = SHAPES[name]
    root = workdir / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    record: dict = {"shape": name, "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "seq_len": seq_len, "batch": batch}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), generator=gen).to(device)

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the reference
    hf = _hf_model(args, device, seed=0)
    t0 = time.perf_counter()
    hf.save_pretrained(root / "hf")
    record["hf_save_s"] = time.perf_counter() - t0
    with torch.no_grad():
        hf_bf16 = hf(tokens).logits.float()
        hf = hf.float()
        reference = hf(tokens).logits.float()
    del hf
    _free(device)

    t0 = time.perf_counter()
    ours = load_model(InitSource("hf", root / "hf"), device, args)
    record["hf_load_s"] = time.perf_counter() - t0
    with torch.no_grad():
        ours_fp32 = ours(tokens).float()
        ours = ours.to(torch.bfloat16)
        ours_bf16 = ours(tokens).float()
    del ours
    _free(device)
    kl = F.kl_div(ours_bf16.log_softmax(-1), hf_bf16.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    record.update(
        fp32_max_abs_diff=(ours_fp32 - reference).abs().max().item(),
        bf16_error_hf=(hf_bf16 - reference).abs().mean().item(),
        bf16_error_ours=(ours_bf16 - reference).abs().mean().item(),
        bf16_max_abs_diff=(ours_bf16 - hf_bf16).abs().max().item(),
        logit_scale=reference.abs().mean().item(),
        argmax_agreement=(ours_bf16.argmax(-1) == hf_bf16.argmax(-1)).float().mean().item(),
        mean_kl=kl.mean().item())
    del ours_fp32, ours_bf16, hf_bf16, reference, kl

    t0 = time.perf_counter()
    import_hf(root / "hf", root / "ckpt", "bf16")
    record["import_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    export_hf(resolve_source(str(root / "ckpt")), root / "export", "bf16")
    record["export_s"] = time.perf_counter() - t0
    shutil.rmtree(root / "ckpt")
    original, exported = _tensors(root / "hf"), _tensors(root / "export")
    record["bytes"] = sum(t.numel() * t.element_size() for t in original.values())
    record["round_trip_exact"] = (sorted(original) == sorted(exported) and all(
        torch.equal(original[k], exported[k]) for k in original))
    shutil.rmtree(root)
    record["passed"] = (record["round_trip_exact"]
                        and record["fp32_max_abs_diff"] <= FP32_ATOL
                        and record["bf16_error_ours"]
                        <= BF16_ERROR_RATIO * record["bf16_error_hf"])
    return record


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    """Check the shapes asked for; exit 1 if one fails."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["1b", "8b"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the model folders go (default: a new temporary directory)")
    p.add_argument("--out", type=Path, default=None, help="also write the records here (JSON)")
    a = p.parse_args()
    device = torch.device(a.device)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="hf-parity-"))
    records = []
    for name in a.shapes:
        record = check_shape(name, device, workdir, a.seq_len, a.batch)
        print(json.dumps(record), flush=True)
        records.append(record)
    print("\n| shape | card | fp32 max abs diff | bf16 mean error vs fp32: hpctrain / "
          "transformers (mean abs logit) | next-token agreement | mean KL | import | export | "
          "round trip |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        gb = r["bytes"] / 1e9
        print(f"| {r['shape']} | {r['device']} | {r['fp32_max_abs_diff']:.3g} | "
              f"{r['bf16_error_ours']:.3g} / {r['bf16_error_hf']:.3g} ({r['logit_scale']:.3g})"
              f" | {100 * r['argmax_agreement']:.2f}% | {r['mean_kl']:.2e} | "
              f"{r['import_s']:.1f} s ({gb / r['import_s']:.2f} GB/s) | "
              f"{r['export_s']:.1f} s ({gb / r['export_s']:.2f} GB/s) | "
              f"{'bit-exact' if r['round_trip_exact'] else 'DIFFERS'} |")
    if a.out:
        a.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
