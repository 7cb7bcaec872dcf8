"""The image recipes: they load, render as sbatch scripts, and the settings they use exist
(task_args for the built-in task, SGD with nesterov momentum)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.train.config import OptimConfig
from hpctrain.train.optim import build_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["resnet50-images.yaml", "vit-b16-images.yaml"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_renders_an_sbatch_script_that_trains_it(name: str, project: Path) -> None:
    shutil.copy(REPO / "configs" / name, project / "configs" / name)
    main(["sbatch", f"configs/{name}", "--nodes", "2", "--tasks-per-node", "4",
          "--gpus-per-node", "4", "--cpus-per-task", "16", "--time", "24:00:00",
          "task_args.data=/scratch/imagenet shards", "-o", "job.sh"])
    text = (project / "job.sh").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    (srun,) = [ln for ln in text.splitlines() if ln.startswith("srun ") and "doctor" not in ln]
    argv = shlex.split(srun)
    train = argv[argv.index("train"):]
    assert train[1] == f"configs/{name}"
    assert "task_args.data=/scratch/imagenet shards" in train  # one word, quoted
    cfg = load_config(project / "configs" / name, ["task_args.data=/x"])
    assert cfg.task == "hpctrain.tasks.images:classifier"
    assert cfg.train.precision == "bf16" and cfg.parallel.compile
    assert cfg.task_args["channels_last"] and cfg.task_args["label_smoothing"] == 0.1
    assert (cfg.optim.name, cfg.optim.nesterov) == (
        ("sgd", True) if "resnet" in name else ("adamw", False))


def test_task_args_need_a_task_and_a_mapping() -> None:
    with pytest.raises(ConfigError, match="task_args is set but task is not"):
        load_config(None, ["task_args.model=resnet50"])
    with pytest.raises(ConfigError, match="task_args = 3 is not a mapping"):
        load_config(None, ["task=x.py", "task_args=3"])


def test_sgd_nesterov_without_decay_on_vectors_and_skips_a_flagged_step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = build_optimizer(model, OptimConfig(name="sgd", nesterov=True, weight_decay=1e-4), 0.1)
    assert isinstance(opt, torch.optim.SGD)
    decay, no_decay = opt.param_groups
    assert decay["nesterov"] and decay["momentum"] == 0.9
    assert [p.shape for p in decay["params"]] == [(3, 4)]  # BN gain/bias and biases: no decay
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
    model(torch.randn(5, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.found_inf = torch.ones(())  # the bad-step guard's flag: the fused kernel skips
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.found_inf = torch.zeros(())
    opt.step()
    assert not torch.equal(before[0], model[0].weight)


def test_nesterov_is_refused_without_sgd_momentum() -> None:
    with pytest.raises(ConfigError, match="nesterov"):
        load_config(None, ["optim.nesterov=true"])
    with pytest.raises(ConfigError, match="nesterov"):
        load_config(None, ["optim.name=sgd", "optim.momentum=0", "optim.nesterov=true"])


def test_image_task_args_are_checked_with_the_key_named() -> None:
    from hpctrain.task import load_task

    with pytest.raises(ConfigError, match="unknown config key 'task_args.modle'") as info:
        load_task("hpctrain.tasks.images:classifier", {"modle": "resnet50", "data": "x"})
    assert info.value.hint == "did you mean 'model'?"
    with pytest.raises(ConfigError, match="task_args.data is not set"):
        load_task("hpctrain.tasks.images:classifier", {"model": "resnet50"})
    with pytest.raises(ConfigError, match="task_args.model = 'resnet51' is not known"):
        load_task("hpctrain.tasks.images:classifier", {"model": "resnet51", "data": "x"})
    with pytest.raises(ConfigError, match="not a multiple of vit_tiny's patch size 4") as info:
        load_task("hpctrain.tasks.images:classifier",
                  {"model": "vit_tiny", "data": "x", "image_size": 30})
    assert info.value.hint == "task_args.image_size=28"
