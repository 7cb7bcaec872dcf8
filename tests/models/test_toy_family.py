"""Adding a model family is one registration: a toy family, defined here and nowhere else,
trains through the normal trainer and parallel paths on CPU.

The toy is a token MLP: an embedding, residual blocks ``x + down(gelu(up(x)))`` and an output
layer, with its own tensor-parallel plan (``up`` split by columns, ``down`` by rows, the output
layer along the vocabulary for the vocabulary-parallel loss) and its own FSDP units (each
block's two Linears). It is registered in each process that trains it (``registry.register``),
then named by the config (``model.family=toy``): 1 process, 2 gloo ranks with FSDP, and 2 with
tensor parallelism, the same global batch, the same loss curve.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import DEMO, QUIET, RunResult, spawn_ranks
from hpctrain.errors import ConfigError
from hpctrain.models import ModelConfig
from hpctrain.models.costs import embedding_cost, lm_head_cost
from hpctrain.models.registry import families, get_family, register, unregister
from hpctrain.models.spec import ModelFamily, TensorPlan


@dataclass(frozen=True)
class ToyArgs:
    """The toy's shape."""

    dim: int
    n_layers: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False


class ToyBlock(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.up = nn.Linear(args.dim, args.ffn_dim)
        self.down = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class ToyModel(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(ToyBlock(args) for _ in range(args.n_layers))
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            if block is not None:
                h = block(h)
        return self.head(h) if self.head is not None else h

    def init_buffers(self) -> None:
        pass

    def init_parameter(self, name: str, tensor: torch.Tensor,
                       generator: torch.Generator | None = None) -> None:
        if name.endswith(".bias"):
            nn.init.zeros_(tensor)
        else:
            nn.init.normal_(tensor, std=0.02, generator=generator)


def _count(args: ToyArgs, *, include_embedding: bool) -> int:
    block = 2 * args.dim * args.ffn_dim + args.ffn_dim + args.dim
    head = args.vocab_size * args.dim
    return args.n_layers * block + head + (head if include_embedding else 0)


def _tensor_plan() -> TensorPlan:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return TensorPlan(
        root={"embed": RowwiseParallel(input_layouts=Replicate()),
              "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)},
        block={"up": ColwiseParallel(), "down": RowwiseParallel()})


def _units(model: ToyModel) -> list[nn.Module]:
    # Finer than the default (one unit per block): each Linear of each block.
    return [m for block in model.blocks if block is not None for m in (block.up, block.down)]


TOY = ModelFamily(
    name="toy", args_class=ToyArgs, model_class=ToyModel,
    presets={"small": ToyArgs(dim=32, n_layers=2, ffn_dim=64, vocab_size=256)},
    blocks="blocks", first=("embed",), last=("head",),
    check_args=lambda args: None,
    args_from_json=lambda raw, where: ToyArgs(**raw),
    count_params=_count,
    flops_per_token=lambda args, seq_len: 6.0 * _count(args, include_embedding=False),
    stage_costs=lambda args, seq_len, tokens: (
        embedding_cost(args.vocab_size, args.dim, tokens),
        6.0 * (2 * args.dim * args.ffn_dim), lm_head_cost(args.vocab_size, args.dim)),
    recomputed_flops=lambda args, save_mm: 0.0,
    tensor_plan=_tensor_plan,
    tp_splits=lambda args, seq_len: [("model.ffn_dim", args.ffn_dim, "up/down split"),
                                     ("model.vocab_size", args.vocab_size, "vocab-split loss")],
    fsdp_units=_units,
)

STEPS = 5
COMMON = [*QUIET, "model.family=toy", "model.size=small", "data.seq_len=32",
          "data.max_bytes=200000", f"train.steps={STEPS}", "optim.lr=0.01"]


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)


def _train(out: str, name: str, overrides: list[str]) -> list[float]:
    """One training run of the toy through hpctrain's real entry point (in this process)."""
    from hpctrain.config import load_config
    from hpctrain.train.job import run_training

    register(TOY)  # a spawned rank is a fresh process: the family is registered here
    cfg = load_config(DEMO, [*COMMON, *overrides, f"run.out_dir={out}", f"run.name={name}"])
    run_training(cfg)
    return RunResult([], 0, "", "", Path(out) / name).losses()


def _two(rank: int, port: int, queue, out: str) -> None:
    """Both 2-rank runs in one pair of processes, on one process group (as tests/rank_jobs)."""
    import torch.distributed as dist

    import hpctrain.train.job as job

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    job.shutdown = lambda: None  # the group outlives the first run
    fsdp = _train(out, "fsdp", ["parallel.strategy=fsdp", "train.micro_batch=2"])
    tp = _train(out, "tp", ["parallel.strategy=none", "parallel.tp=2", "train.micro_batch=4"])
    dist.destroy_process_group()
    queue.put((rank, (fsdp, tp)))


def _one(rank: int, port: int, queue, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    queue.put((rank, _train(out, "one", ["parallel.strategy=none", "train.micro_batch=4"])))


class _Target:
    """A picklable ``target(rank, port, queue)`` for ``spawn_ranks`` carrying its arguments."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, rank: int, port: int, queue) -> None:
        self.fn(rank, port, queue, *self.args)


def test_the_family_is_known_by_name_and_builds_on_meta(toy: ModelFamily) -> None:
    assert families()["toy"] is toy and get_family("toy") is toy
    args = ModelConfig(family="toy", size="small", n_layers=3).resolve()
    assert args == dataclasses.replace(toy.presets["small"], n_layers=3)
    model = toy.build(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == _count(args, include_embedding=True)


def test_an_unknown_family_is_refused_listing_the_registered_ones(toy: ModelFamily) -> None:
    from hpctrain.config import load_config

    with pytest.raises(ConfigError, match=r"model.family = 'nope' is not a registered model "
                       r"family\n.*one of llama, qwen, toy"):
        load_config(DEMO, ["model.family=nope"])


def test_a_second_family_of_a_taken_name_is_refused(toy: ModelFamily) -> None:
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register(dataclasses.replace(toy, presets={}))


def test_the_planner_says_it_has_no_memory_model_of_the_toy(toy: ModelFamily) -> None:
    from hpctrain.plan.memory import estimate_memory
    from hpctrain.plan.memory_options import MemoryOptions

    with pytest.raises(ConfigError, match="no memory model of the 'toy' family"):
        estimate_memory(toy.presets["small"], MemoryOptions())


def test_the_chunked_loss_is_refused_for_a_family_without_it(toy: ModelFamily) -> None:
    from hpctrain.config import load_config
    from hpctrain.parallel.layout import check_layout

    cfg = load_config(DEMO, [*COMMON, "train.loss_chunks=4", "parallel.strategy=none"])
    with pytest.raises(ConfigError, match="train.loss_chunks = 4 with model.family = toy"):
        check_layout(cfg, 1)


def test_a_field_the_family_lacks_is_refused_by_name(toy: ModelFamily) -> None:
    with pytest.raises(ConfigError, match="model.n_heads=4 is not a field of the 'toy'"):
        ModelConfig(family="toy", size="small", n_heads=4).resolve()


def test_the_toy_trains_alike_on_one_process_fsdp_and_tp(tmp_path: Path) -> None:
    out = str(tmp_path)
    [(_, one)] = spawn_ranks(_Target(_one, out), 1, timeout=300)
    fsdp, tp = dict(spawn_ranks(_Target(_two, out), 2, timeout=300))[0]
    assert len(one) == STEPS and one[-1] < one[0]  # it learns
    assert fsdp == pytest.approx(one, rel=1e-5)
    assert tp == pytest.approx(one, rel=1e-5)
