"""What the multi-run tests read back from their run directories, and the closeness they assert.

    checkpoint_dir(out, "tp2", 2)          # the folder a job's step-2 checkpoint commits to
    logged(out, "tp2")                     # {step: loss} from rank 0's metrics
    assert_close(run[3], ref[3], 2e-3, "tp2 vs one rank at step 3")
"""

from __future__ import annotations

import math
from pathlib import Path

from hpctrain.observe.metrics import read_metrics


def checkpoint_dir(out: Path, run: str, step: int) -> str:
    """Where run ``run`` under ``out`` commits its checkpoint of ``step``."""
    return str(out / run / "checkpoints" / f"step-{step:08d}")


def logged(out: Path, name: str, key: str = "loss") -> dict[int, float]:
    """Rank 0's logged ``key`` of run ``name`` under ``out``, by step."""
    records = read_metrics(out / name / "metrics" / "rank-000.jsonl")
    return {r["step"]: r[key] for r in records if key in r}


def assert_close(actual: float, expected: float, rtol: float, what: str) -> None:
    """``actual`` is finite and within ``rtol`` of ``expected``, relatively; the message says
    by how much it is not."""
    assert math.isfinite(actual) and abs(actual - expected) <= rtol * abs(expected), (
        f"{what}: {actual!r} vs {expected!r} ({abs(actual - expected) / abs(expected):.2e} "
        f"relative, rtol {rtol:.0e})")
