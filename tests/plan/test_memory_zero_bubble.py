"""`plan memory` for the zero-bubble schedules (zbv, interleaved_zb): PyTorch's order of actions,
and what a stage-micro-batch keeps between its input- and weight-gradient passes. The peaks
measured on 4 H200s are pinned with the others in ``test_parallel_memory.py``."""

from __future__ import annotations

import dataclasses
import gc
import types
import weakref

import pytest
import torch
import torch.distributed.pipelining.schedules as pt_schedules
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from hpctrain.models import PRESETS, ModelArgs, Transformer
from hpctrain.parallel.stages import held_chunks, inflight_chunks, zero_bubble_actions
from hpctrain.plan.memory import RankShare, activation_bytes, rank_shares
from hpctrain.plan.memory_options import MemoryOptions

TINY = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=1000,
                 max_seq_len=16)
TOKENS = 16
FP32 = MemoryOptions(strategy="none", precision="fp32", micro_batch=1, seq_len=TOKENS)


def pytorch_order(schedule: str, pp: int, m: int, v: int, rank: int) -> list[str]:
    """PyTorch's own action table for one rank, built without a process group or stages."""
    if schedule == "zbv":
        fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        ops = pt_schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank)
    else:
        rounds = max(1, m // pp)
        fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, n_local_stages=v,
                                     microbatches_per_round=m // rounds)
        cls = pt_schedules.ScheduleInterleavedZeroBubble
        fake.pipeline_order = {r: cls._calculate_single_rank_operations(fake, r)
                               for r in range(pp)}
        ops = cls._add_bubbles_to_actions(fake, v * pp)[rank]
    return [str(a) for a in ops if a is not None]  # e.g. "6I3": stage 6, I, micro-batch 3


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [
    ("zbv", 2, 4, 2), ("zbv", 4, 8, 2), ("zbv", 3, 6, 2), ("zbv", 4, 16, 2), ("zbv", 4, 4, 2),
    ("interleaved_zb", 2, 4, 2), ("interleaved_zb", 4, 8, 2), ("interleaved_zb", 4, 16, 3),
    ("interleaved_zb", 3, 6, 2), ("interleaved_zb", 4, 4, 2), ("interleaved_zb", 2, 8, 3),
])
def test_zero_bubble_orders_match_pytorchs_tables(schedule: str, pp: int, m: int, v: int
                                                  ) -> None:
    for rank in range(pp):
        ours = [f"{stage}{kind}{mb}"
                for kind, stage, mb in zero_bubble_actions(schedule, pp, m, v, rank)]
        assert ours == pytorch_order(schedule, pp, m, v, rank)


def test_held_stage_micro_batches_counted_by_hand() -> None:
    """zbv, PP2, 4 micro-batches, rank 1 (stages 1 and 2). Its order: 1F0 2F0 1F1 2F1 2I0 2W0
    1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3."""
    moments = held_chunks(zero_bubble_actions("zbv", 2, 4, 2, 1))
    assert moments[3] == {1: (2, 0), 2: (2, 0)}  # after 2F1: four forwarded
    assert moments[4] == {1: (2, 0), 2: (1, 1)}  # after 2I0: one of them past I
    assert moments[20] == {1: (0, 2), 2: (0, 1)}  # after 1I3: three awaiting W, none new
    assert moments[-1] == {1: (0, 0), 2: (0, 0)}
    assert max(sum(f + s for f, s in held.values()) for held in moments) == 4
    assert inflight_chunks("zbv", 2, 4, 2, 1) == 4


class SavedTensors:
    """Bytes of the tensors autograd saved in a forward that are still alive."""

    def __init__(self, model: torch.nn.Module):
        self.own = {t.untyped_storage().data_ptr()
                    for t in [*model.parameters(), *model.buffers()]}
        self.saved: list[tuple[weakref.ref, int, int]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Record a saved tensor (detached: its grad_fn would make the graph a cycle)."""
        t = t.detach()
        storage = t.untyped_storage()
        self.saved.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return t

    def live(self) -> int:
        """Bytes of the live saved storages that are not the model's parameters or buffers."""
        gc.collect()
        alive = {ptr: n for ref, ptr, n in self.saved
                 if ref() is not None and ptr not in self.own}
        return sum(alive.values())


def split_backward(last: bool) -> tuple[int, int, int, int]:
    """Saved bytes after F, I and W of one tiny stage (blocks 2-3, with the head if ``last``),
    through PyTorch's own split backward; and the bytes I captured for W."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.tok_embeddings = None
    model.layers[0] = model.layers[1] = None
    if not last:
        model.norm = model.output = None
    saved = SavedTensors(model)
    x = torch.randn(1, TOKENS, TINY.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = model(x)
        if last:  # the trainer's eager loss (hpctrain.train.loss.cross_entropy_loss)
            targets = torch.randint(0, TINY.vocab_size, (TOKENS,))
            out = F.cross_entropy(out.flatten(0, 1).float(), targets, reduction="sum")
    after_f = saved.live()
    grads = None if last else [torch.randn_like(out)]
    _, groups = stage_backward_input([out], grads, [x], model.parameters())
    after_i = saved.live()
    captured = sum(g.numel() * g.element_size() for group in groups
                   for grads_in in group["grads"] for g in grads_in if g is not None)
    stage_backward_weight(model.parameters(), groups)
    del groups, out
    return after_f, after_i, saved.live(), captured


def test_input_pass_keeps_the_activations_and_adds_the_weight_passes_gradients() -> None:
    """PyTorch's I retains the whole graph for W and captures the gradient of every product
    with a weight: the planner's split layers, exactly (fp32: no autocast copies)."""
    after_f, after_i, after_w, captured = split_backward(last=False)
    assert after_i == after_f > 0 and after_w == 0
    held = RankShare(2, False, False, inflight_layers=2, logits_live=0)
    split = dataclasses.replace(held, split_layers=2)
    assert activation_bytes(TINY, FP32, split) - activation_bytes(TINY, FP32, held) == captured


def test_last_stages_input_pass_frees_the_loss_and_keeps_the_logits_gradient() -> None:
    after_f, after_i, after_w, captured = split_backward(last=True)
    logsoftmax = TOKENS * TINY.vocab_size * 4  # fp32, saved by the loss, unused by W
    assert logsoftmax <= after_f - after_i < logsoftmax + TOKENS * TINY.vocab_size
    assert after_w == 0
    held = RankShare(2, False, True, inflight_layers=2, logits_live=0)
    split = dataclasses.replace(held, split_layers=2, split_logits=1)
    assert activation_bytes(TINY, FP32, split) - activation_bytes(TINY, FP32, held) == captured


PP8 = dict(strategy="none", micro_batch=1, grad_accum=8, pp_microbatches=8, pp=4,
           compile=False)


def test_zbv_last_rank_peaks_with_seven_stage_micro_batches_awaiting_w() -> None:
    """1b PP4 zbv, rank 3 (stages 3 and 4, 3 blocks each): its cool-down runs 3I4 4I5 3I5 4I6
    3I6 4I7 3I7 before any of their W, so after 3I7 it holds 4 + 3 stage-micro-batches, all
    past I: its costliest moment."""
    share = rank_shares(PRESETS["1b"], MemoryOptions(**PP8, pp_schedule="zbv"))[3]
    assert (share.inflight_layers, share.split_layers, share.split_outputs) == (21, 21, 7)
    assert (share.logits_live, share.split_logits) == (0, 0)
