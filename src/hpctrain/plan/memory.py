"""Per-GPU memory of training a Llama-style decoder: states, working buffers and activations.

The activation model below is that of a pre-norm decoder block with grouped-query attention and
a gated (SwiGLU) FFN: the model families whose spec says so (``ModelFamily.plan_memory``; Llama).
The block's seven matmuls are, in the order it runs them: the query, key, value and attention
output projections, the FFN's gate, up and down projections.

    hpctrain plan memory --model 1b --strategy fsdp --gpus 4 --micro-batch 4 --seq-len 2048

Exact terms (tested against real modules and a real AdamW on CPU):

- parameters: fp32 master weights, 4 B per parameter (sharded 1/n by FSDP);
- gradients: fp32, 4 B per parameter (FSDP: sharded; DDP: see below);
- AdamW state: exp_avg + exp_avg_sq in fp32 (8 B per parameter) plus one 4 B ``step`` per
  parameter tensor.

With bf16 master weights (``train.master_weights=bf16``, pure bf16 training) the parameters,
their gradients and both moments are bf16: 2 + 2 + 4 B per parameter, the fp32 ``step`` per
tensor unchanged (also tested against a real AdamW step on bf16 parameters).

Modelled terms (byte counts per token derived from the model's code, then checked against the
measured peaks ``torch.cuda.max_memory_allocated`` in benchmarks/RESULTS.md, 4x H200):

- activations saved per layer per token: the two residual-stream tensors the norms keep
  (4 B each under autocast, whose residual stream stays fp32; else the compute dtype: FSDP's
  casts, like bf16 master weights, make the embedding output, hence the residual stream, bf16),
  plus in the compute dtype: two norm outputs (2·dim), q and the attention output
  (2·n_heads·head_dim: 2·dim for Llama, 4·dim for Qwen3-0.6B), k and v (2·kv_dim), the FFN's
  gate and up outputs and their SwiGLU product (3·ffn_dim), and SDPA's fp32 log-sum-exp per
  head. Eager mode (no torch.compile) also keeps fp32 RoPE/norm intermediates and the SiLU
  output: + (6·dim + 2·kv_dim + ffn_dim) elements, fitted on `1b` eager (35.0 GB measured).
- logits: 2 (compiled loss) or 4 (eager fp32 loss) compute-dtype copies of vocab per token.
  With the chunked loss (``train.loss_chunks`` = c, ``hpctrain.models.chunked_loss``) one chunk
  of tokens/c holds its logits in the compute dtype, in fp32 and as a gradient (2e + 4 B per
  logit) while backward runs, plus the fp32 gradient accumulator of the output weight (4·V·D).
- full activation checkpointing keeps only each block's input, plus one block's activations
  while it is recomputed.
- selective (per-op) checkpointing (``parallel/selective_ac.py``) keeps each block's input, the
  attention output and log-sum-exp, and the matmul outputs it saves: every other one (query,
  value, gate, down) or all seven (``ac_save_mm``); with TP the outputs of the attention output
  and down projections are whole
  partial sums and their reduce-scatters are kept too. Plus one block's activations while it
  is recomputed. Not yet checked against a measured peak.
- working buffers: autocast's bf16 copies of the weights (saved for backward, no FSDP; in a
  pipeline, one per stage-micro-batch in flight); FSDP's gathered root module (embedding +
  output) and two gathered blocks (current + prefetched; 1 + ``parallel.fsdp_prefetch`` where
  that asks for more than one ahead; FSDP units of ``parallel.fsdp_group_blocks`` blocks
  multiply both), all blocks gathered under ZeRO-2
  (``reshard_after_forward=false``: +2.2 GB on `1b`, measured 17.5 vs 15.3 GB); at the end of
  backward the root's unsharded fp32 gradients before reduce-scatter.
- mixed precision (``parallel.mixed_precision``, resolved as the trainer resolves it:
  ``MemoryOptions.mixed_precision_path``): where FSDP casts without sharding (strategy none,
  ``fsdp``: auto's choice with TP or PP from 2B parameters per model-parallel rank), the layout
  is sized as FSDP over one rank kept gathered (ZeRO-2): one resident bf16 copy of every
  parameter the rank holds, the embedding included, no autocast copies, a bf16 residual stream.
  Measured on 2xH200 (8b): TP2 107.6 GB predicted vs 110.0 measured, PP2 85.9 vs 86.5.
- bf16 master weights: without FSDP (strategy none: one GPU, TP, PP; or DDP) the path is
  ``pure``: the model is bf16, so no autocast copies (none in a pipeline either), a bf16
  residual stream, and a pipeline's gradient accumulators are the bf16 ``.grad`` (2 B per
  parameter). With strategy fsdp the path stays FSDP's (gathered bf16 parameters, accumulators
  in ``reduce_precision``: FSDP2 upcasts unsharded accumulated gradients to the reduction
  dtype), with the sharded states at their bf16 sizes. Not yet checked against a measured peak.
- DDP: the gradient buckets plus a second fp32 gradient copy (DDP rebuilds its buckets after the
  first step): 8 B per parameter, fitted on ddp4 `1b` (35.9 GB). With bf16 master weights both
  are bf16, 4 B per parameter: derived from the fp32 fit, not measured.

The peak is the larger of two moments: the start of backward (all activations live, gradients
not yet allocated since the optimizer sets them to None) and the end of backward / optimizer step
(all gradients live, activations freed).

Tensor parallelism (``tp``, with sequence parallelism, as ``hpctrain.parallel.tensor`` builds it):
matrices, embedding and output layer are split tp ways, norm weights are whole on every rank.
Activations split along the sequence (the residual stream the norms keep) or the heads and FFN
width (q, k, v, attention output, the gate and up outputs, their product, the log-sum-exp) are
divided by tp;
the two all-gathered norm outputs each projection saves for backward are whole. The loss, at its
peak, holds the rank's logits, their fp32 copy and the fp32 softmax it keeps for backward
((e + 8) B per logit / tp). Checked on 2 H200s (125m, micro-batch 16 x 1024, bf16, PyTorch
2.11): TP2 8.53 GB measured vs 8.2 predicted eager, 7.07 vs 6.6 compiled; PP2 (1F1B, 8
micro-batches of 2) 3.27 vs 3.17.

Pipeline parallelism (``pp`` ranks, ``pp_stages_per_rank`` stages each, cut where
``hpctrain.parallel.stages`` cuts them, embedding and output layer included): every pipeline rank
is sized and the largest is reported (``MemoryPlan.stage``). A rank holds the activations of the
stage-micro-batches in flight at its peak (``inflight_chunks``: p - r for 1F1B, all for GPipe,
the warm-up of interleaved 1F1B), each of ``micro_batch`` samples. The zero-bubble schedules
(zbv, interleaved_zb) split each backward into an input-gradient pass (I) and a deferred
weight-gradient pass (W). PyTorch's I (``stage_backward_input``) runs autograd with
``retain_graph=True``: past I a stage-micro-batch still holds all its saved activations and
autocast copies, plus the gradient I captured for W at every product with a weight (per block
the seven matmul outputs in the compute dtype and the two norm outputs in the residual stream's),
and its stage output and received gradient (``backward_state``); the last stage frees the loss's
tensors and keeps the logits' gradient; stage 0's I does nothing (its W runs the whole backward).
W frees it all. Each rank is walked through PyTorch's order of actions
(``hpctrain.parallel.stages.zero_bubble_actions``) and sized at its costliest moment (tested on
CPU against PyTorch's split backward: after I the same saved bytes as after F, the captured
gradients exactly these counts, nothing after W). Inside a pipeline
gradients accumulate over the micro-batches, unsharded even with FSDP (reduce-scattered once,
after the last backward), and FSDP keeps the stage's parameters gathered (by default from the
first forward on; with ``reshard_after_forward`` true once backward began, an overestimate):
so the peak is one moment holding the states, the gathered parameters, the gradient
accumulators and the in-flight activations. ``MemoryPlan.bubble`` is the schedule's idle share.
Checked on 4 H200s (1b through autocast, compiled, 8 micro-batches of 1 x 2048): PP4 1F1B 10.7
GB predicted vs 10.9 measured, GPipe 16.2 vs 14.9, interleaved 1F1B 12.8 vs 13.2, PP2 x TP2 7.7
vs 8.0; eager, the zero-bubble schedules: ZBV 13.1 vs 13.1 (rank 3 after its last I: seven
stage-micro-batches awaiting W), interleaved ZB 12.9 vs 13.1 (rank 0). Counted as 1F1B's
in-flight activations these were 11.5 and 15.3. Transients inside I and W are not modelled,
nor checked with activation checkpointing.

Gradient accumulators (``parallel.reduce_precision``): on FSDP's path, gradients accumulated over
micro-batches stay unsharded in the reduction dtype, 4 B per parameter in fp32 (the default) and
2 B in bf16; so do the root's gradients awaiting their reduce-scatter. Elsewhere they are the
parameters' own ``.grad``: fp32, or bf16 with bf16 master weights.

fp8 (``hpctrain.parallel.float8``): states, gradients and optimizer are as in bf16. Three things
shrink, each from the blocks' Linear layers (attention and FFN; not the embedding or output):

- compiled, with tensorwise scales, the Linears' inputs are kept for backward in float8 (1 B):
  the two norm outputs, the attention output and the SwiGLU product. Eager, torchao's
  ``Float8Linear`` keeps its bf16 input; rowwise needs the input scaled along the other axis for
  the weight gradient, so it is sized as bf16 too (neither measured);
- FSDP's float8 all-gather (tensorwise, weights sharded) holds the gathered Linear weights in
  1 B, in ZeRO-2's whole gathered model as in ZeRO-3's gathered blocks;
- under autocast, the Linears cast their fp32 weights to float8 themselves: no bf16 copies of
  them are made (the embedding is looked up in fp32; the output layer's copy stays).

Measured on H200s (benchmarks/RESULTS.md, 2026-11-27), against 14-27% over before these: 1b
FSDP2 ZeRO-2 micro-batch 4, 17.10 GB (predicted 17.48); 8b FSDP2 ZeRO-2 no AC micro-batch 4,
92.11 (91.03); the same on FSDP4, 68.02 (66.94); 1b on one GPU (autocast), 22.5 (24.46, +8.7%).

CUDA context and allocator fragmentation (outside max_memory_allocated, typically 0.5–2 GB) are
not included: keep ~10% headroom. What is sized (``MemoryOptions``) and the answer
(``MemoryPlan``) are in :mod:`hpctrain.plan.memory_options`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hpctrain.errors import ConfigError
from hpctrain.models import ModelArgs, count_params, family_of_args
from hpctrain.parallel.config import ZERO_BUBBLE_SCHEDULES
from hpctrain.parallel.stages import (
    balance_stages,
    bubble_estimate,
    held_chunks,
    inflight_chunks,
    module_costs,
    stage_indices,
    zero_bubble_actions,
)
from hpctrain.plan.memory_options import MemoryOptions, MemoryPlan


def n_param_tensors(args: ModelArgs) -> int:
    """Number of parameter tensors (each has one AdamW ``step``), as the model family counts."""
    return family_of_args(args).param_tensors(args)


@dataclass(frozen=True)
class RankShare:
    """What one rank holds: its blocks, the embedding and/or the head, and how many blocks'
    activations (per micro-batch, summed over the micro-batches in flight) it keeps."""

    blocks: int
    embedding: bool
    head: bool
    inflight_layers: float
    logits_live: int  # last-stage micro-batches holding the loss's tensors
    # Zero bubble, stage-micro-batches past their input-gradient pass (I), awaiting their weight
    # pass (W): block layers among inflight_layers that also keep the gradients W needs, stages
    # other than the last keeping their output and its gradient, last-stage micro-batches
    # keeping the logits' gradient instead of the loss's tensors.
    split_layers: float = 0.0
    split_outputs: int = 0
    split_logits: int = 0

    @staticmethod
    def whole(args: ModelArgs) -> RankShare:
        """The whole model on one rank (no pipeline)."""
        return RankShare(args.n_layers, True, True, args.n_layers, 1)


def rank_shares(args: ModelArgs, opts: MemoryOptions) -> list[RankShare]:
    """Each pipeline rank's share of the model, stages cut as the trainer cuts them."""
    if opts.pp == 1:
        return [RankShare.whole(args)]
    v, m = opts.stages_per_rank, opts.microbatches
    n_stages = opts.pp * v
    tokens = opts.micro_batch * opts.seq_len
    bounds = balance_stages(args.n_layers, n_stages, module_costs(args, opts.seq_len, tokens))
    shares = []
    for rank in range(opts.pp):
        stages = stage_indices(rank, opts.pp, v, opts.pp_schedule)
        if opts.pp_schedule in ZERO_BUBBLE_SCHEDULES:
            shares.append(_zero_bubble_share(args, opts, rank, stages, bounds))
            continue
        blocks = sum(bounds[s + 1] - bounds[s] for s in stages)
        chunks = inflight_chunks(opts.pp_schedule, opts.pp, m, v, rank)
        head = n_stages - 1 in stages
        shares.append(RankShare(blocks, 0 in stages, head, chunks * blocks / len(stages),
                                (m if opts.pp_schedule == "gpipe" else 1) if head else 0))
    return shares


def _zero_bubble_share(args: ModelArgs, opts: MemoryOptions, rank: int, stages: list[int],
                       bounds: tuple[int, ...]) -> RankShare:
    """A zero-bubble rank's share at its costliest moment over PyTorch's order of actions."""
    last = opts.pp * opts.stages_per_rank - 1
    size = {s: bounds[s + 1] - bounds[s] for s in stages}
    actions = zero_bubble_actions(opts.pp_schedule, opts.pp, opts.microbatches,
                                  opts.stages_per_rank, rank)
    moments = []
    for held in held_chunks(actions):
        split = {s: n for s, (_, n) in held.items()}
        moments.append(RankShare(
            blocks=sum(size.values()), embedding=0 in stages, head=last in stages,
            inflight_layers=sum(size[s] * (f + n) for s, (f, n) in held.items()),
            logits_live=held.get(last, (0, 0))[0],
            # Stage 0's I is no pass at all (its input needs no gradient): W runs its whole
            # backward, so it keeps no gradients for W.
            split_layers=sum(size[s] * n for s, n in split.items() if s != 0),
            split_outputs=sum(n for s, n in split.items() if s != last),
            split_logits=split.get(last, 0)))
    return max(moments, key=lambda share: (activation_bytes(args, opts, share)
                                           + _pipeline_working(args, opts, share)))


def _rank_params(args: ModelArgs, opts: MemoryOptions, share: RankShare
                 ) -> tuple[float, float, float]:
    """(all, root, one block) parameter counts on a rank, before data-parallel sharding.

    Matrices, embedding and output layer are split tp ways; norm weights are whole.
    """
    d, vd = args.dim, args.vocab_size * args.dim
    layer = count_params(dataclasses.replace(args, n_layers=1, vocab_size=0),
                         include_embedding=True) - d  # one block's parameters
    block = (layer - 2 * d) / opts.tp + 2 * d
    root = (vd / opts.tp if share.embedding else 0.0)
    if share.head:
        root += d + (0 if args.tie_embeddings and share.embedding else vd / opts.tp)
    return share.blocks * block + root, root, block


def state_bytes(args: ModelArgs, opts: MemoryOptions, share: RankShare | None = None
                ) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per GPU, as persistent tensors in the master
    weights' dtype (AdamW's ``step`` always fp32)."""
    share = share or rank_shares(args, opts)[0]
    p, _, _ = _rank_params(args, opts, share)
    per_block = n_param_tensors(dataclasses.replace(args, n_layers=1)) - n_param_tensors(
        dataclasses.replace(args, n_layers=0))  # Llama 9, Qwen3 11 (q/k norms), Qwen2 12
    tensors = per_block * share.blocks + share.embedding + share.head * (
        1 + (0 if args.tie_embeddings and share.embedding else 1))
    shard = opts.gpus if opts.strategy == "fsdp" else 1
    b = opts.master_bytes
    params = b * p / shard
    grads = b * p / shard
    optimizer = 2.0 * b * p / shard + 4.0 * tensors  # exp_avg + exp_avg_sq, and the steps
    return params, grads, optimizer


def activation_bytes(args: ModelArgs, opts: MemoryOptions, share: RankShare | None = None
                     ) -> float:
    """Bytes of activations alive at the start of backward on one GPU (see module docstring)."""
    share = share or rank_shares(args, opts)[0]
    e = opts.compute_bytes
    r = 4 if opts.mixed_precision_path(args) == "autocast" else e
    d, kv, f, tp = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, opts.tp
    q = args.n_heads * args.head_dim  # the queries' and attention output's width (Llama: d)
    # Residual stream (split along the sequence), the two gathered norm outputs (whole), the
    # head- and width-split projections.
    layer = 2 * r * d / tp + e * 2 * d + (e * (2 * q + 2 * kv + 3 * f) + 4 * args.n_heads) / tp
    if opts.float8_saved_inputs:
        # The Linears' inputs in 1 B: both norm outputs, the attention output, SwiGLU's product.
        layer -= (e - 1) * (2 * d + (q + f) / tp)
    if not opts.compile:
        layer += e * (6 * d + 2 * kv + f) / tp
    tokens = opts.micro_batch * opts.seq_len
    # Full AC: the block inputs, plus one block's activations while it is recomputed.
    if opts.ac == "full":
        layers = share.inflight_layers * r * d / tp + layer
    elif opts.ac == "selective":
        layers = share.inflight_layers * _selective_layer(args, opts, e, r) + layer
    else:
        layers = share.inflight_layers * layer
    layers += share.split_layers * _weight_pass_layer(args, opts, e, r)
    # Past I a stage keeps its output and the gradient it received (backward_state) until W.
    layers += share.split_outputs * 2 * r * d / tp
    head_buffers = 0.0
    if tp > 1:
        # The vocabulary-parallel loss at its peak: the rank's logits, their fp32 copy and
        # the fp32 exponentials that become the saved softmax.
        logits = (e + 8) * args.vocab_size / tp
    elif opts.loss_chunks:
        # One chunk's logits (compute dtype, fp32, gradient) and the fp32 weight gradient.
        logits = (2 * e + 4) * args.vocab_size / min(opts.loss_chunks, tokens)
        head_buffers = 4.0 * args.vocab_size * d * share.logits_live
    else:
        logits = (2 if opts.compile else 4) * e * args.vocab_size
    # Past I the loss's tensors are freed; the output layer's W keeps the logits' gradient and
    # the final norm's the gradient of its output.
    split_logits = share.split_logits * (e * args.vocab_size + r * d) / tp
    return tokens * (layers + share.logits_live * logits + split_logits) + head_buffers


def _weight_pass_layer(args: ModelArgs, opts: MemoryOptions, e: int, r: int) -> float:
    """Bytes per token one block keeps between its input- and weight-gradient passes (zero
    bubble) beyond its activations: the gradient of each weight's product.

    PyTorch's I (``stage_backward_input``) runs autograd with ``retain_graph=True`` and captures
    the gradient flowing into every node where a weight meets the activations, for W to finish:
    the seven matmuls' outputs (compute dtype; the query, key, value, gate and up projections'
    split over tp, the row-parallel attention output and down projections' whole partial sums)
    and the two norms' outputs (the residual stream's dtype).
    The retained graph also keeps every activation saved in the forward until W.
    """
    d, kv, f, tp = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, opts.tp
    q = args.n_heads * args.head_dim
    return e * ((q + 2 * kv + 2 * f) / tp + 2 * d) + 2 * r * d / tp


def _selective_layer(args: ModelArgs, opts: MemoryOptions, e: int, r: int) -> float:
    """Bytes per token one block keeps under selective checkpointing (module docstring)."""
    d, kv, f, tp = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, opts.tp
    q = args.n_heads * args.head_dim
    if opts.ac_save_mm == "every_other":
        split, whole = q + kv + f, d  # query, value, gate split over tp; down's output
    else:
        split, whole = q + 2 * kv + 2 * f, 2 * d  # q, k, v, gate, up; attn out's and down's
    # The block's input, SDPA's output (q wide) and log-sum-exp, the kept matmul outputs.
    saved = r * d / tp + e * (q + split) / tp + 4 * args.n_heads / tp + e * whole
    if tp > 1:
        saved += e * 2 * d / tp  # the reduce-scatters of the attention output and down
    return saved


def estimate_memory(args: ModelArgs, opts: MemoryOptions, gpu_bytes: float | None = None,
                    *, suggest: bool = True) -> MemoryPlan:
    """Estimate the per-GPU peak for training `args` with `opts`; suggest fixes if it won't fit.

    With pipeline parallelism every pipeline rank is sized and the largest peak is returned.
    """
    family = family_of_args(args)
    if not family.plan_memory:
        raise ConfigError(f"plan memory has no memory model of the {family.name!r} family",
                          expected="a family whose spec says plan_memory (a pre-norm decoder "
                          "with grouped-query attention and a gated FFN, like llama)",
                          hint="measure a few steps instead (hpctrain bench model, tune)")
    opts.validate(args)
    plans = [_estimate_rank(args, opts, share, gpu_bytes) for share in rank_shares(args, opts)]
    rank = max(range(len(plans)), key=lambda i: plans[i].peak)
    plan = plans[rank]
    if opts.pp > 1:
        plan.stage = rank
        plan.bubble = bubble_estimate(opts.pp_schedule, opts.pp, opts.microbatches,
                                      opts.stages_per_rank)
    if plan.fits is False and suggest:
        plan.suggestions = _suggest(args, opts, gpu_bytes)
    return plan


def _gathered_block(args: ModelArgs, opts: MemoryOptions, p_block: float) -> float:
    """Bytes of one block's parameters as FSDP gathers them: in the compute dtype, the
    Linear weights in float8 under FSDP's float8 all-gather."""
    e = opts.compute_bytes
    if not opts.float8_gather:
        return e * p_block
    return e * p_block - (e - 1) * (p_block - 2 * args.dim)  # all but the two norms' weights


def _cast_block(args: ModelArgs, opts: MemoryOptions, p_block: float) -> float:
    """Parameters of one block that autocast copies to bf16 for backward: all, or with fp8
    only the norms' (the block Linears cast their fp32 weights to float8 themselves)."""
    return 2 * args.dim if opts.precision == "fp8" else p_block


def _pipeline_working(args: ModelArgs, opts: MemoryOptions, share: RankShare) -> float:
    """Working bytes of a pipeline rank: FSDP's gathered parameters or autocast's copies."""
    p, p_root, p_block = _rank_params(args, opts, share)
    e = opts.compute_bytes
    # FSDP keeps the stage's parameters gathered (from the first forward by default).
    if opts.fsdp_wrapped(args):
        return e * p_root + share.blocks * _gathered_block(args, opts, p_block)
    if opts.mixed_precision_path(args) in ("none", "pure"):
        return 0.0
    # Autocast casts the weights in every micro-batch's forward, and each keeps its copies for
    # its backward: one per stage-micro-batch in flight (the blocks' and the output layer's; the
    # embedding is looked up in fp32). Zero bubble: until its W, whose retained graph holds them.
    # 1b PP4 1F1B on H200: 10.9 GB measured, 9.1 predicted with one copy, 10.7 with these.
    embedding = args.vocab_size * args.dim / opts.tp if share.embedding else 0.0
    head_copies = share.logits_live + share.split_logits
    return 2.0 * (share.inflight_layers * _cast_block(args, opts, p_block)
                  + (p_root - embedding) * head_copies)


def _estimate_rank(args: ModelArgs, opts: MemoryOptions, share: RankShare,
                   gpu_bytes: float | None) -> MemoryPlan:
    params, grads, optimizer = state_bytes(args, opts, share)
    p, p_root, p_block = _rank_params(args, opts, share)
    e = opts.compute_bytes
    acts = activation_bytes(args, opts, share)
    embedding = args.vocab_size * args.dim / opts.tp if share.embedding else 0.0
    # fp32 computes in fp32 and pure bf16 in its bf16 parameters: no copies to make.
    no_casts = opts.mixed_precision_path(args) in ("none", "pure")

    if opts.pp > 1:
        # Gradients accumulate unsharded over the micro-batches; FSDP reduce-scatters them
        # after the last one.
        working = _pipeline_working(args, opts, share)
        accumulators = opts.accumulator_bytes(args) * p
        peak = params + optimizer + working + accumulators + acts
        return MemoryPlan(params=params, grads=accumulators, optimizer=optimizer,
                          working=working,
                          activations=acts, peak=peak, peak_moment="pipeline steady state",
                          gpu_bytes=gpu_bytes)
    if opts.fsdp_wrapped(args):
        # Without sharding (FSDP for its casts only) the parameters stay gathered: ZeRO-2.
        zero2 = opts.zero == 2 or opts.strategy != "fsdp"
        # Under ZeRO-3 the unit computing and the ones prefetched are gathered, each of
        # fsdp_group_blocks blocks (no more than there are).
        unit = min(opts.fsdp_group_blocks, max(1, share.blocks))
        units = -(-share.blocks // unit)
        ahead = min(max(1, opts.fsdp_prefetch), max(1, units - 1))  # units that exist
        block = _gathered_block(args, opts, p_block)
        gathered = e * p_root + (share.blocks if zero2 else min(
            share.blocks, (1 + ahead) * unit)) * block
        acc = opts.accumulator_bytes(args)
        if opts.grad_accum > 1:  # every block's unsharded accumulators
            gathered += acc * p
        working_start = gathered
        working_end = gathered + acc * p_root  # root's unsharded grads before reduce-scatter
        start = params + optimizer + working_start + acts
        end = params + optimizer + grads + working_end
        working = max(working_start, working_end)
    else:
        if opts.strategy == "ddp":
            # Buckets + a second gradient copy (calibrated in fp32; bf16 derived, docstring).
            grads = 2.0 * opts.master_bytes * p
        # Autocast keeps bf16 copies of the weights (not the embedding) for backward.
        working = 0.0 if no_casts else 2.0 * (
            share.blocks * _cast_block(args, opts, p_block) + p_root - embedding)
        persistent_grads = grads if opts.strategy == "ddp" else 0.0
        start = params + optimizer + working + acts + persistent_grads
        end = params + optimizer + grads
    moment = "start of backward" if start >= end else "end of backward"
    return MemoryPlan(params=params, grads=grads, optimizer=optimizer, working=working,
                      activations=acts, peak=max(start, end), peak_moment=moment,
                      gpu_bytes=gpu_bytes)


def _suggest(args: ModelArgs, opts: MemoryOptions, gpu_bytes: float) -> list[str]:
    """Single changes, cheapest first, each of which makes the estimate fit."""
    def fits(**change) -> bool:
        new = dataclasses.replace(opts, **change)
        try:
            return estimate_memory(args, new, gpu_bytes, suggest=False).fits is True
        except ConfigError:
            return False

    out = []
    if opts.ac == "none" and fits(ac="selective"):
        out.append("turn on selective activation checkpointing (parallel."
                   "activation_checkpointing=selective): recomputes the pointwise ops and "
                   "every other matmul of each block")
    elif opts.ac != "full" and fits(ac="full"):
        out.append("turn on activation checkpointing (parallel.activation_checkpointing=full), "
                   "~33% more compute")
    # Memory grows with the micro-batch: the largest that fits by bisection (a linear search
    # from --micro-batch 1048576 down took minutes).
    low, high = 0, opts.micro_batch  # fits(low) (or low == 0), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(micro_batch=mid) else (low, mid)
    if low:
        out.append(f"lower the micro-batch to {low} (raise grad_accum to keep the batch)")
    # Strategy fsdp casts through its own policy: the mixed-precision choice goes back to auto.
    sharded_fits = opts.gpus > 1 and fits(strategy="fsdp", zero=3, mixed_precision="auto")
    if opts.strategy != "fsdp" and sharded_fits:
        out.append("shard with FSDP (parallel.strategy=fsdp)")
    if opts.strategy == "fsdp" and opts.zero == 2 and fits(zero=3):
        out.append("reshard after forward (ZeRO-3: parallel.reshard_after_forward=true)")
    if not sharded_fits:
        for n in (2, 4, 8, 16, 32, 64, 128, 256, 512):
            if n > opts.gpus and fits(strategy="fsdp", gpus=n, mixed_precision="auto"):
                out.append(f"shard with FSDP over {n} GPUs")
                break
    for tp in (2, 4, 8):
        if tp > opts.tp and fits(tp=tp):
            out.append(f"tensor parallel {tp} inside a node")
            break
    if not out:
        out.append("no single change fits: combine FSDP over more GPUs, activation "
                   "checkpointing and tensor/pipeline parallelism (see `hpctrain plan parallel`)")
    return out


def gb(x: float) -> float:
    """Bytes to GB (1e9)."""
    return x / 1e9


def fmt_gb(x: float) -> str:
    """'12.3 GB'."""
    return f"{gb(x):.1f} GB" if math.isfinite(x) else "-"
