"""Where pipeline stages cut the model and what they cost: plain arithmetic, shared by the
pipeline (``parallel/pipeline.py``) and the planner (``hpctrain plan``).

Stages are balanced by the model family's cost model (``ModelFamily.stage_costs``, through
``module_costs``): per token, what the parts before the blocks, one block, and the parts after
them cost, in FLOP-equivalents (memory traffic converted at ``models/costs.py``'s
``FLOPS_PER_BYTE``).

The zero-bubble schedules' order of actions (``zero_bubble_actions``) is PyTorch's own
(``ScheduleZBVZeroBubble`` and ``ScheduleInterleavedZeroBubble`` in
``torch.distributed.pipelining.schedules``), re-derived here without a process group and tested
against PyTorch's tables: forward (F), input-gradient (I) and weight-gradient (W) passes, each of
one stage and micro-batch. ``held_chunks`` follows what a rank holds through that order.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

from hpctrain.models.registry import family_of_args


def module_costs(args: Any, seq_len: int, microbatch_tokens: int
                 ) -> tuple[float, float, float]:
    """Modelled training cost per token, in FLOP-equivalents, of (the parts before the blocks,
    one block, the parts after them) of the model of shape ``args``."""
    return family_of_args(args).stage_costs(args, seq_len, microbatch_tokens)


@functools.lru_cache(maxsize=1024)  # the planner sizes many layouts of one model
def balance_stages(n_layers: int, num_stages: int, costs: tuple[float, float, float]
                   ) -> tuple[int, ...]:
    """Stage boundaries ``b`` (stage s holds blocks ``b[s]..b[s+1]-1``) minimising the costliest
    stage; every stage gets at least one block."""
    embedding, block, head = costs

    def stage_cost(s: int, lo: int, hi: int) -> float:
        return ((hi - lo) * block + (embedding if s == 0 else 0.0)
                + (head if s == num_stages - 1 else 0.0))

    # best[s][i]: the least possible max cost of stages 0..s-1 holding blocks 0..i-1.
    best = [[math.inf] * (n_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n_layers - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], stage_cost(s - 1, j, i))
                # Ties go to the later cut: earlier stages hold more micro-batches in flight
                # (1F1B), so they get the fewer blocks.
                if value <= best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return tuple(bounds[::-1])


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds: ``r, r + pp, ...`` (loop) or ``r, 2pp-1-r`` (zbv)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def bubble_estimate(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle share of a step, with equal costs per micro-batch for forward and backward.

    GPipe and 1F1B: (p-1)/(m+p-1); interleaved 1F1B: (p-1)/(v*m+p-1) (Narayanan et al. 2021).
    Zero bubble (Qi et al. 2024), with forward = input-gradient = weight-gradient time:
    (p-1)/(3*v*m+p-1) (zbv: v = 2), which is what counting PyTorch's own action tables gives.
    """
    p, m, v = pp, microbatches, stages_per_rank
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)


def inflight_chunks(schedule: str, pp: int, microbatches: int, stages_per_rank: int,
                    pp_rank: int) -> int:
    """Stage-micro-batches whose activations a rank holds at its peak (start of its first
    backward): all for GPipe; p - r for 1F1B; the warm-up forwards plus one for interleaved
    1F1B (PyTorch's warm-up count); for the zero-bubble schedules the most held at once over
    PyTorch's order of actions (forwarded, not yet through their weight pass)."""
    p, m, v = pp, microbatches, stages_per_rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - pp_rank)
    if schedule in ("zbv", "interleaved_zb"):
        moments = held_chunks(zero_bubble_actions(schedule, p, m, v, pp_rank))
        return max(sum(f + s for f, s in held.values()) for held in moments)
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - pp_rank), m * v)
    return min(warmup + 1, m * v)


# One compute action of a pipeline rank: ("F" | "I" | "W", stage index, micro-batch index).
Action = tuple[str, int, int]


class _Actions:
    """A rank's actions as they are appended, each numbered per (kind, stage) in order."""

    def __init__(self) -> None:
        self.done: Counter[tuple[str, int]] = Counter()
        self.order: list[Action] = []

    def add(self, kind: str, stage: int) -> None:
        """Append the next micro-batch's ``kind`` pass of ``stage``."""
        self.order.append((kind, stage, self.done[kind, stage]))
        self.done[kind, stage] += 1


def zero_bubble_actions(schedule: str, pp: int, microbatches: int, stages_per_rank: int,
                        pp_rank: int) -> list[Action]:
    """A rank's F / I / W actions in the order PyTorch's zbv or interleaved_zb runs them."""
    if schedule == "zbv":
        return _zbv_actions(pp, microbatches, pp_rank)
    return _interleaved_zb_actions(pp, microbatches, stages_per_rank, pp_rank)


def _zbv_actions(pp: int, m: int, rank: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations`` without its idle steps."""
    # PyTorch plans at least 2p - 1 micro-batches (enough to fill the V), then drops the extra.
    n = max(2 * pp - 1, m)
    down, up = rank, 2 * pp - 1 - rank  # the V's two stages on this rank
    acts = _Actions()
    for _ in range(2 * (pp - rank) - 1):
        acts.add("F", down)
    for _ in range(rank):
        acts.add("F", up)
        acts.add("F", down)
    for _ in range(pp - rank):
        for kind in "FIW":
            acts.add(kind, up)
    while acts.done["F", up] < acts.done["F", down] or acts.done["F", down] < n:
        if acts.done["F", down] < n:
            acts.add("F", down)
        for stage, kinds in ((down, "IW"), (up, "FIW")):
            for kind in kinds:
                acts.add(kind, stage)
    for _ in range(rank):
        acts.add("I", down)
        acts.add("I", up)
    for _ in range(pp - rank):
        acts.add("I", down)
        acts.add("W", down)
    for stage in (up, down):
        while acts.done["W", stage] < acts.done["I", stage]:
            acts.add("W", stage)
    return [a for a in acts.order if a[2] < m]


def _interleaved_zb_actions(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """``ScheduleInterleavedZeroBubble``'s order: PyTorch's ``_get_1f1b_rank_ops`` with zero
    bubble. The bubbles it then inserts are idle steps; they reorder nothing."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (pp - 1 - rank), m * v)  # multiply_factor 1

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * pp + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * pp + rank

    acts = _Actions()
    weights = 0  # W passes so far; the k-th follows the k-th I's stage
    for op in range(m * v + warmup):
        if op < m * v:
            acts.add("F", forward_stage(op))
        if op >= warmup:
            acts.add("I", backward_stage(op))
            # The first `rank` input passes run without their weight pass (1F1B's steady
            # state); from then on each I is followed by the oldest pending W.
            if op - warmup >= rank:
                acts.add("W", backward_stage(warmup + weights))
                weights += 1
    for op in range(warmup + weights, m * v + warmup):
        acts.add("W", backward_stage(op))
    return acts.order


def held_chunks(actions: list[Action]) -> list[dict[int, tuple[int, int]]]:
    """After each action, per stage: the stage-micro-batches the rank holds, as (forwarded,
    past their input-gradient pass), both awaiting their weight pass."""
    forwarded: Counter[int] = Counter()
    split: Counter[int] = Counter()
    moments = []
    for kind, stage, _ in actions:
        if kind == "F":
            forwarded[stage] += 1
        elif kind == "I":
            forwarded[stage] -= 1
            split[stage] += 1
        else:
            split[stage] -= 1
        moments.append({s: (forwarded[s], split[s]) for s in forwarded.keys() | split.keys()})
    return moments
