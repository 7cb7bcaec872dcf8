"""A GPU-sized model on a machine without a GPU is refused before anything is allocated, with
the override that forces it; small models and an explicit CPU choice go ahead.

The CLI checks run under a 3 GB address-space limit: had the 1.1B model been built (4.4 GB of
fp32 weights alone), the run would die of it instead of exiting 2 with the message.
"""

from __future__ import annotations

import resource
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_command, cli_env
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.runtime.config import CPU_AUTO_MAX_PARAMS, refuse_large_model_on_cpu
from hpctrain.train.job import check_device_fits

LIMIT_BYTES = 3 * 1024**3


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_threshold() -> None:
    refuse_large_model_on_cpu(CPU_AUTO_MAX_PARAMS, model="m", force="run.device=cpu")
    with pytest.raises(ConfigError) as info:
        refuse_large_model_on_cpu(CPU_AUTO_MAX_PARAMS + 1, model="m", force="run.device=cpu")
    assert "set run.device=cpu to train it on the CPU anyway" in info.value.render()


def test_gpu_config_without_gpu_is_refused(no_gpu: None) -> None:
    cfg = load_config(REPO / "configs" / "llama-1b.yaml")
    with pytest.raises(ConfigError) as info:
        check_device_fits(cfg)
    message = info.value.render()
    assert "model.size=1b has 1.10B parameters and no GPU is visible" in message
    assert "run.device=cpu" in message


@pytest.mark.parametrize("overrides", [["run.device=cpu"], ["model.size=125m"], []],
                         ids=["forced", "small", "demo"])
def test_small_or_forced_models_pass(no_gpu: None, overrides: list[str]) -> None:
    config = "llama-1b.yaml" if overrides != [] else "demo.yaml"
    check_device_fits(load_config(REPO / "configs" / config, overrides))


def test_with_a_gpu_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_device_fits(load_config(REPO / "configs" / "llama-1b.yaml"))


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = cli_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, also on a GPU machine
    return subprocess.run(cli_command(args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=_limited, start_new_session=True)


@pytest.mark.parametrize("launcher", [[], ["--nproc", "2"]], ids=["single", "launcher"])
def test_cli_refuses_the_1b_config_on_a_cpu(tmp_path: Path, launcher: list[str]) -> None:
    done = _cli(["train", "configs/llama-1b.yaml", f"run.out_dir={tmp_path / 'runs'}",
                 *launcher])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "1.10B parameters and no GPU is visible" in done.stderr, done.stderr[-3000:]
    assert "set run.device=cpu" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_bench_model_refuses_a_gpu_size_on_a_cpu(tmp_path: Path) -> None:
    done = _cli(["bench", "model", "--size", "1b", "--out", str(tmp_path / "bench")])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "1.10B parameters and no GPU is visible" in done.stderr, done.stderr[-3000:]
    assert "set --device cpu" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "bench").exists()


def test_a_large_pretrained_model_is_named_by_its_folder(no_gpu: None, tmp_path: Path) -> None:
    # Only config.json is read to size the model: an 8B Llama folder without its weights.
    import json

    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    cfg = load_config(None, [f"model.init_from=hf:{folder}"])
    with pytest.raises(ConfigError) as info:
        check_device_fits(cfg)
    assert f"model.init_from=hf:{folder} has 8.03B parameters" in info.value.what
