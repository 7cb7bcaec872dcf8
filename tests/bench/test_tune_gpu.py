"""``tune`` and ``bench model`` read this node's GPU without initialising CUDA in their own
process (hpctrain.plan.gpu.node_gpu): it starts the measured runs, which would otherwise find
~0.5 GB of GPU 0 held by its context. On the CPU the machine is made to look like a node with
H100s (tests/gpu_node.py) and CUDA's initialisation fails the test if anything calls it; the
runs themselves are not started (what is under test happens before them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEMO, TINY
from gpu_node import H100_BYTES, H100_NAME, gpu_node
from hpctrain.bench import model
from hpctrain.bench.tune import candidates
from hpctrain.config import load_config
from hpctrain.errors import RuntimeEnvError
from hpctrain.plan.gpu import node_gpu

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = REPO / "configs" / "llama-8b-fsdp.yaml"
# 512 samples of 32 tokens per step on 2 ranks: the CPU's stand-in caps a micro-batch at 64 of
# them, an H100 at 512, so the two choices differ.
AUTO = [*TINY, "run.device=auto", "train.global_batch_tokens=32768", "train.micro_batch=auto",
        "parallel.strategy=auto", "parallel.activation_checkpointing=auto"]


def test_tune_sizes_its_short_list_for_the_gpu_nvml_reads(monkeypatch) -> None:
    """The memory, name and CUDA capability (fp8 tensor cores: 9.0) of NVML's H100."""
    gpu_node(monkeypatch, nvml=True)
    plan = candidates.plan_tuning(LLAMA_8B, [], 2, max_candidates=3)
    assert (plan.device, plan.device_name, plan.gpu_bytes) == ("cuda", H100_NAME, H100_BYTES)
    assert not any("capability" in note for note in plan.notes)
    assert not torch.cuda.is_initialized()


def test_bench_model_chooses_auto_for_the_gpu_nvml_reads(tmp_path: Path, monkeypatch) -> None:
    """The config it writes for the run holds the H100's choice (a micro-batch above the CPU
    stand-in's 64)."""
    gpu_node(monkeypatch, nvml=True)
    monkeypatch.setattr(model, "measure", lambda *a, **k: (_result(), 1.0))
    model.run_model_bench(Path(DEMO), AUTO, nproc=2, out=tmp_path, steps=4, log_every=2)
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["train"]["micro_batch"] > 64 and not torch.cuda.is_initialized()


def test_without_nvml_a_child_process_asks_cuda(monkeypatch) -> None:
    """No nvidia-ml-py: a child process reads the GPU (here it finds none, and says so)."""
    gpu_node(monkeypatch, nvml=False)
    # The child must find no GPU on a GPU machine too (its answer is cached per
    # CUDA_VISIBLE_DEVICES value: "" is this test's own).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeEnvError, match="child process") as e:
        node_gpu(load_config(DEMO, AUTO))
    assert e.value.lines and "nvidia-ml-py" in e.value.hint
    assert not torch.cuda.is_initialized()


def _result():
    return model.ModelResult(ranks=2, tokens_per_s_per_gpu=100.0, mfu=None, hfu=None,
                             peak_mem_gb=0.5, step_time_s=0.1, data_time_frac=0.0,
                             final_loss=5.0, measured_steps=(2, 4), measured_span_s=(0.0, 1.0))
