"""``pick_device``: the one device choice of training (``run.device``) and the benchmarks
(``--device``), on a machine without GPUs (CI). The GPU branches run on the device machines."""

from __future__ import annotations

import pytest
import torch

from hpctrain.errors import ConfigError, RuntimeEnvError
from hpctrain.runtime.dist import pick_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")


@pytest.mark.parametrize("name", ["auto", "cpu"])
def test_auto_and_cpu_give_the_cpu_without_cuda(name: str) -> None:
    assert pick_device(name, 1, setting="run.device", host="n1") == torch.device("cpu")


@pytest.mark.parametrize(("setting", "name"), [("run.device", "cuda"), ("--device", "cuda:1")])
def test_cuda_without_a_gpu_names_the_option(setting: str, name: str) -> None:
    with pytest.raises(RuntimeEnvError, match=f"{setting} = '{name}' but no CUDA") as info:
        pick_device(name, 0, setting=setting, host="n1")
    assert f"set {setting} to cpu" in info.value.hint
    assert "CUDA_VISIBLE_DEVICES=" in info.value.hint


@pytest.mark.parametrize("name", ["tpu", "cuda:", "cuda:-1", "CUDA"])
def test_an_unknown_device_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown device") as info:
        pick_device(name, 0, setting="--device", host="n1")
    assert info.value.expected == "auto, cpu, cuda or cuda:N"
