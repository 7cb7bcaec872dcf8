"""A plain MLP regressor on a Parquet table: the smallest task of your own.

    hpctrain train examples/mlp_parquet.py --nproc 2 train.steps=200 train.precision=fp32

The table (``MLP_TABLE``, default ``mlp_table.parquet``) is generated on first use: 16 feature
columns and a target that is a fixed nonlinear function of them. Point ``MLP_TABLE`` at a table
of your own with columns ``x0 .. x15`` and ``y`` to train on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from hpctrain.task import Task

FEATURES = 16


def write_table(path: Path, rows: int = 8192) -> None:
    """A synthetic table: features x0..x15, target y (written atomically: ranks may race)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    y = np.sin(x[:, :4]).sum(1) + 0.5 * x[:, 4] * x[:, 5]
    table = pa.table({**{f"x{i}": x[:, i] for i in range(FEATURES)}, "y": y.astype(np.float32)})
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_table(path: Path) -> torch.utils.data.TensorDataset:
    """The table's features and target as tensors."""
    table = pq.read_table(path)
    x = np.stack([table[f"x{i}"].to_numpy() for i in range(FEATURES)], axis=1)
    y = table["y"].to_numpy()[:, None]
    return torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))


def model() -> nn.Module:
    """Two hidden layers of 64."""
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def task() -> Task:
    """The MLP, the table (the last 1024 rows held out), mean squared error."""
    path = Path(os.environ.get("MLP_TABLE", "mlp_table.parquet"))
    if not path.exists():
        write_table(path)
    data = read_table(path)
    n = len(data)
    train = torch.utils.data.Subset(data, range(n - 1024))
    held_out = torch.utils.data.Subset(data, range(n - 1024, n))
    return Task(model=model, data=train, eval_data=held_out, loss=nn.functional.mse_loss)
