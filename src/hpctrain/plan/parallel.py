"""Rank parallel layouts for a model on a cluster shape by predicted throughput, within memory.

    hpctrain plan parallel --model 8b --gpus-per-node 8 --nodes 4 --gpu h100

Layouts are compared at one global batch (``--global-batch`` samples per step, default 4 per
GPU). Every layout the trainer accepts is a candidate: tensor parallel ``tp`` inside a node
(dividing the GPUs per node, the heads, KV heads, FFN width and vocabulary), pipeline parallel
``pp`` (1F1B, a power of two), data parallel over what is left (DDP when the model is whole on
each GPU, else FSDP), micro-batch 8, 4, 2 or 1 (the rest of each replica's share of the batch is
accumulated, or is the pipeline's micro-batches), activation checkpointing off or full. Each is
sized with ``hpctrain.plan.memory`` (peak + 10% must fit) and timed with a model of one optimizer
step per GPU:

- compute: training FLOPs (PaLM convention, x4/3 with full recomputation) of the GPU's share of
  the replica's tokens at ``MATMUL_EFFICIENCY`` of the dense peak, times ``TP_EFFICIENCY`` with
  tensor parallelism and ``PP_EFFICIENCY`` with pipeline parallelism;
- tensor parallelism: per block and micro-batch, forward and backward, two all-gathers and two
  reduce-scatters of the ``[tokens, dim]`` activations over NVLink, not overlapped (PyTorch runs
  them in line);
- pipeline: the step stretched by the 1F1B bubble ``(p-1)/(m+p-1)``, plus the activations and
  their gradients sent between stages (over the network when the stages are on two nodes);
- data parallelism: FSDP's all-gathers (per micro-batch; once per step inside a pipeline) and
  reduce-scatter, or DDP's all-reduce, over NVLink when the group fits in a node, else over the
  network, overlapped with compute but for ``DP_EXPOSED`` of it.

Bandwidths are bus bandwidths measured here (``benchmarks/RESULTS.md``, FIELD_NOTES): ~340 GB/s
NVLink all-reduce for large buffers on H100/H200, ~240 GB/s for the tens of MB tensor parallelism
moves; the network is taken as 400 Gb/s per GPU (NDR InfiniBand). ``TP_EFFICIENCY`` and
``PP_EFFICIENCY`` are fitted to torchtitan 0.2.2's 1b runs on 2 H200s (FIELD_NOTES: TP2 39.1k and
PP2 31.4k tokens/s per GPU against FSDP2's ~56k): smaller matrix products, DTensor dispatch,
pipeline scheduling and stage waits. Refit them to hpctrain's own TP2/PP2 measurements. The model
ranks layouts; its absolute numbers are estimates.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from hpctrain.errors import ConfigError
from hpctrain.models import ModelArgs, flops_per_token
from hpctrain.observe.peaks import peak_tflops
from hpctrain.plan.memory import estimate_memory, fmt_gb
from hpctrain.plan.memory_options import MemoryOptions, MemoryPlan

MICRO_BATCHES = (8, 4, 2, 1)
# Share of the dense bf16 peak a 1b-8b Llama step reaches: 49.5% measured for 1b on an H200
# (benchmarks/RESULTS.md; the 52% once quoted came from windows timed before their sync).
MATMUL_EFFICIENCY = 0.50
NVLINK_BYTES_PER_S = 340e9
TP_NVLINK_BYTES_PER_S = 240e9  # all-gather / reduce-scatter of ~32 MB (nccl-tests, FIELD_NOTES)
TP_EFFICIENCY = 0.8
PP_EFFICIENCY = 0.65
NETWORK_BYTES_PER_S = 50e9
DP_EXPOSED = 0.3  # share of overlapped data-parallel traffic still seen in the step time
DEFAULT_PEAK_TFLOPS = 989.0  # H100 SXM / H200 dense bf16, when the GPU is given by memory only


@dataclass
class ParallelPlan:
    """One layout: degrees, batch shape, memory, predicted speed and a short explanation."""

    strategy: str
    dp: int
    tp: int
    pp: int
    micro_batch: int
    ac: str
    memory: MemoryPlan
    explanation: list[str]
    microbatches: int = 1  # per step: accumulated, or the pipeline's
    tokens_per_s: float = 0.0  # predicted, per GPU
    step_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds
    options: MemoryOptions = dataclasses.field(default_factory=MemoryOptions)  # as sized
    # (key, value) the layout sets back from the config's own: what the planner's layouts
    # cannot take (the chunked loss with tp/pp, FSDP's schedule without FSDP) or assume.
    resets: list[tuple[str, object]] = dataclasses.field(default_factory=list)

    def overrides(self) -> list[str]:
        """The config overrides that train this layout on top of the config it was planned
        for: every key the planner chose, and the ones it set back (``self.options``)."""
        o = self.options
        out = [f"parallel.strategy={self.strategy}", f"parallel.tp={self.tp}",
               f"parallel.pp={self.pp}", f"train.micro_batch={self.micro_batch}",
               f"train.grad_accum={self.microbatches}",
               f"parallel.activation_checkpointing={self.ac}"]
        if self.pp > 1:  # the micro-batch above is the pipeline's; one per accumulated one
            out += [f"parallel.pp_schedule={o.pp_schedule}", "parallel.pp_microbatches=0"]
        out += [f"{key}={value}" for key, value in self.resets]
        return out

    def command(self, config: str | None, overrides: list[str], gpus_per_node: int,
                nodes: int) -> str:
        """The command line that trains this layout: ``config`` (None: the word CONFIG, for the
        user's), the ``overrides`` it was planned with (less those the layout sets), then the
        layout's."""
        mine = self.overrides()
        keys = {o.partition("=")[0] for o in mine}
        kept = [o for o in overrides if o.partition("=")[0].strip() not in keys]
        words = " ".join(shlex.quote(w) for w in [config or "CONFIG", *kept, *mine])
        if nodes == 1:
            return f"hpctrain train {words} --nproc {gpus_per_node}"
        return (f"hpctrain sbatch {words} --nodes {nodes} "
                f"--tasks-per-node {gpus_per_node} --gpus-per-node {gpus_per_node}")


def rank_layouts(args: ModelArgs, base: MemoryOptions | None = None, *, gpus_per_node: int,
                 nodes: int, gpu_bytes: float, peak: float | None = None,
                 global_batch: int | None = None,
                 refusal: Callable[[ParallelPlan], str | None] | None = None
                 ) -> list[ParallelPlan]:
    """Every layout that fits, fastest first (predicted tokens/s per GPU).

    ``base`` is the training setup the layouts vary (``MemoryOptions.from_config`` of the
    config: sequence, precision, compile, ...); each layout sets its strategy, degrees,
    micro-batch and checkpointing, and sets back what that layout cannot take. ``refusal``
    says why training would refuse a layout (None: it accepts it); those are left out.
    """
    base = base or MemoryOptions()
    if gpus_per_node < 1 or nodes < 1:
        raise ConfigError(f"{nodes} nodes x {gpus_per_node} GPUs", expected="positive counts")
    # A bad precision or master-weights choice is said as such, not as "no layout fits".
    dataclasses.replace(base, strategy="none", gpus=1, tp=1, pp=1, loss_chunks=0,
                        fsdp_prefetch=0, fsdp_group_blocks=1, mixed_precision="auto",
                        reduce_precision="fp32").validate(args)
    total = gpus_per_node * nodes
    batch = global_batch or 4 * total
    peak = peak or DEFAULT_PEAK_TFLOPS
    plans = []
    for tp in tp_degrees(args, gpus_per_node, base.seq_len):
        for pp in pp_degrees(args, total // tp):
            dp = total // (tp * pp)
            if batch % dp:
                continue
            for strategy in strategies(tp, pp, dp):
                layout, resets = _layout(base, strategy, dp, tp, pp)
                best = None
                for opts, mem in _fitting(args, gpu_bytes, batch // dp, layout):
                    accum = batch // dp // opts.micro_batch
                    plan = ParallelPlan(strategy, dp, tp, pp, opts.micro_batch, opts.ac, mem,
                                        [], accum, options=opts, resets=resets)
                    predict_step(plan, args, opts, gpus_per_node, peak)
                    if best is None or plan.tokens_per_s > best.tokens_per_s:
                        best = plan
                if best is not None:
                    plans.append(best)
    refused = {describe(p): why for p in plans if refusal and (why := refusal(p))}
    if refused and len(refused) == len(plans):
        raise ConfigError("every layout that fits is refused by training",
                          lines=[f"  {layout}: {why}" for layout, why in refused.items()],
                          hint="change the config where the reasons point")
    plans = [p for p in plans if describe(p) not in refused]
    if not plans:
        raise ConfigError(
            f"no layout fits: {nodes} nodes x {gpus_per_node} GPUs of {fmt_gb(gpu_bytes)} at a "
            f"global batch of {batch} samples",
            expected="enough GPU memory for the model's states and activations",
            hint="use more nodes, GPUs with more memory, a shorter sequence (data.seq_len), or "
            "another --global-batch",
        )
    plans.sort(key=lambda p: -p.tokens_per_s)
    for plan in plans:
        plan.explanation = _explain(plan, plans, args)
    return plans


def plan_parallel(args: ModelArgs, base: MemoryOptions | None = None, *, gpus_per_node: int,
                  nodes: int, gpu_bytes: float, peak: float | None = None,
                  global_batch: int | None = None) -> ParallelPlan:
    """The fastest layout that fits ``nodes`` x ``gpus_per_node`` GPUs."""
    return rank_layouts(args, base, gpus_per_node=gpus_per_node, nodes=nodes,
                        gpu_bytes=gpu_bytes, peak=peak, global_batch=global_batch)[0]


def global_batch(cfg, gpus: int) -> tuple[int, int]:
    """(samples per step, data-parallel degree) of the config on ``gpus`` GPUs."""
    pc, tc = cfg.parallel, cfg.train
    model_ranks = pc.tp * pc.pp
    if gpus % model_ranks:
        raise ConfigError(
            f"{gpus} GPUs with the config's parallel.tp {pc.tp} x parallel.pp {pc.pp}",
            expected=f"a multiple of {model_ranks} GPUs: the global batch is the config's "
            f"micro_batch x grad_accum x data-parallel degree on the {gpus} GPUs",
            hint=f"plan or tune for a multiple of {model_ranks} GPUs, or pass parallel.tp=1 "
            "parallel.pp=1 (plan parallel and tune try tp and pp themselves)")
    dp = gpus // model_ranks
    if tc.global_batch_tokens is not None:  # fixed in tokens, whatever the GPUs
        return tc.global_batch_tokens // cfg.data.seq_len, dp
    return tc.micro_batch * tc.grad_accum * dp, dp


def gpu_peak_tflops(gpu: str, precision: str) -> float | None:
    """Dense peak of a GPU given by name (None for a size in GB or an unknown name).

    fp8 is planned at the bf16 peak: only the blocks' GEMMs run in float8, and what that buys
    depends on their shapes (1.10x for 1b on an H200), which `hpctrain tune` measures.
    """
    try:
        float(gpu)
        return None
    except ValueError:
        return peak_tflops(gpu, "bf16" if precision == "fp8" else precision)


def tp_degrees(args: ModelArgs, gpus: int, seq_len: int) -> list[int]:
    """Tensor-parallel degrees that divide ``gpus`` and every size tensor parallelism splits
    (heads, KV heads, FFN width, vocabulary, sequence): the ones plan parallel and tune try."""
    return [t for t in range(1, gpus + 1) if gpus % t == 0
            and all(x % t == 0 for x in (args.n_heads, args.n_kv_heads, args.ffn_dim,
                                         args.vocab_size, seq_len))]


def pp_degrees(args: ModelArgs, ranks: int) -> list[int]:
    """Pipeline degrees plan parallel and tune try: powers of two dividing ``ranks``, one layer
    per stage at least."""
    return [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= args.n_layers and ranks % p == 0]


def strategies(tp: int, pp: int, dp: int) -> list[str]:
    """The data-parallel strategies the trainer accepts for a dp x tp x pp layout."""
    if dp == 1:
        return ["none"]
    if tp == 1 and pp == 1:
        return ["ddp", "fsdp"]
    return ["fsdp"]  # the trainer refuses DDP with TP or PP


def _layout(base: MemoryOptions, strategy: str, dp: int, tp: int, pp: int
            ) -> tuple[MemoryOptions, list[tuple[str, object]]]:
    """``base`` laid out as ``strategy`` over dp x tp x pp, and the config keys set back for it
    (the trainer refuses the chunked loss with tp/pp and FSDP's schedule without FSDP)."""
    changes: dict[str, object] = {}
    if tp * pp > 1 and base.loss_chunks:
        changes["loss_chunks"] = 0
    if strategy != "fsdp":
        changes.update({k: v for k, v in (("fsdp_prefetch", 0), ("fsdp_group_blocks", 1))
                        if getattr(base, k) != v})
    if base.mixed_precision == "autocast" and strategy == "fsdp" or (
            base.mixed_precision == "fsdp" and strategy == "ddp"):
        changes["mixed_precision"] = "auto"  # the casts this strategy refuses
    if strategy == "fsdp" and pp == 1 and base.zero == 2:
        changes["zero"] = 3  # sized, and the step model timed, resharding after forward
    keys = {"loss_chunks": "train.loss_chunks", "zero": "parallel.reshard_after_forward"}
    resets = [(keys.get(k, f"parallel.{k}"), "true" if k == "zero" else v)
              for k, v in changes.items()]
    layout = dataclasses.replace(base, strategy=strategy, gpus=dp, tp=tp, pp=pp,
                                 zero=3 if pp == 1 else 2, grad_accum=1, pp_microbatches=0,
                                 **{"pp_schedule": "1f1b", "pp_stages_per_rank": 0}
                                 if pp > 1 else {},
                                 **{k: v for k, v in changes.items() if k != "zero"})
    return layout, resets


def _fitting(args: ModelArgs, gpu_bytes: float, replica_batch: int, layout: MemoryOptions):
    """(options, memory) of each micro-batch that fits, without recomputation where possible."""
    pp = layout.pp
    for ac in ("none", "full"):
        found = False
        for mb in MICRO_BATCHES:
            if replica_batch % mb or (pp > 1 and replica_batch // mb < pp):
                continue
            accum = replica_batch // mb
            opts = dataclasses.replace(layout, ac=ac, micro_batch=mb,
                                       **({"pp_microbatches": accum} if pp > 1
                                          else {"grad_accum": accum}))
            try:
                plan = estimate_memory(args, opts, gpu_bytes, suggest=False)
            except ConfigError:
                return
            if plan.fits:
                found = True
                yield opts, plan
        if found:
            return


def predict_step(plan: ParallelPlan, args: ModelArgs, opts: MemoryOptions, gpus_per_node: int,
                 peak: float) -> None:
    """Fill in ``plan``'s predicted step-time parts and tokens/s per GPU.

    The step-time model of ``hpctrain plan parallel``; ``hpctrain tune`` ranks its candidates
    with it too, so that both commands order layouts alike.
    """
    e = opts.compute_bytes
    tokens = opts.micro_batch * opts.seq_len * plan.microbatches  # per replica and step
    flops = flops_per_token(args, opts.seq_len) * tokens * (4 / 3 if opts.ac == "full" else 1)
    efficiency = (MATMUL_EFFICIENCY * (TP_EFFICIENCY if plan.tp > 1 else 1.0)
                  * (PP_EFFICIENCY if plan.pp > 1 else 1.0))
    compute = flops / (plan.tp * plan.pp) / (peak * 1e12 * efficiency)
    tp_comm = 0.0
    if plan.tp > 1:
        # Per block and micro-batch: 2 all-gathers + 2 reduce-scatters forward, as many
        # backward (and again when the forward is recomputed).
        passes = 12 if opts.ac == "full" else 8
        per_block = passes * (plan.tp - 1) / plan.tp * opts.micro_batch * opts.seq_len * args.dim
        blocks = args.n_layers / plan.pp
        tp_comm = per_block * e * blocks * plan.microbatches / TP_NVLINK_BYTES_PER_S
    pp_comm = 0.0
    if plan.pp > 1:
        # Each micro-batch's activations forward and their gradients back across a boundary;
        # pipeline ranks are the outermost mesh axis, so stages share a node only if the rest
        # of the mesh (tp x dp) leaves room in it.
        crossing = 2 * plan.microbatches * opts.micro_batch * opts.seq_len * args.dim * e
        same_node = plan.tp * plan.dp * plan.pp <= gpus_per_node
        pp_comm = crossing / (NVLINK_BYTES_PER_S if same_node else NETWORK_BYTES_PER_S)
    params = _rank_params(plan.memory, plan, opts)
    dp_bytes = 0.0
    if plan.strategy == "fsdp":
        # ZeRO-3 gathers for forward and again for backward, each micro-batch; inside a
        # pipeline the parameters stay gathered for the whole step.
        gathers = 2 * plan.microbatches if plan.pp == 1 else 1
        dp_bytes = params * (gathers * e + 4) * (plan.dp - 1) / plan.dp
    elif plan.strategy == "ddp":
        # All-reduce of the gradients, in the parameters' dtype.
        dp_bytes = 2 * params * opts.master_bytes * (plan.dp - 1) / plan.dp
    in_node = plan.tp * plan.dp <= gpus_per_node
    dp_comm = dp_bytes / (NVLINK_BYTES_PER_S if in_node else NETWORK_BYTES_PER_S)
    busy = compute + tp_comm + pp_comm
    bubble = (plan.pp - 1) / (plan.microbatches + plan.pp - 1) if plan.pp > 1 else 0.0
    step = busy / (1 - bubble) + max(0.0, dp_comm - busy) + DP_EXPOSED * min(dp_comm, busy)
    plan.step_parts = {"compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm,
                       "bubble": step * bubble, "dp_comm": dp_comm, "step": step}
    plan.tokens_per_s = tokens / (plan.tp * plan.pp) / step


def _rank_params(memory: MemoryPlan, plan: ParallelPlan, opts: MemoryOptions) -> float:
    """Parameters a GPU holds before data-parallel sharding (from the master weights' bytes)."""
    shard = opts.gpus if plan.strategy == "fsdp" else 1  # FSDP's shard group (HSDP: dp_shard)
    return memory.params / opts.master_bytes * shard


def _explain(plan: ParallelPlan, plans: list[ParallelPlan], args: ModelArgs) -> list[str]:
    parts = plan.step_parts
    where = []
    if plan.tp > 1:
        where.append(f"tensor parallel {plan.tp} inside each node (it all-gathers and "
                     "reduce-scatters activations in every block: NVLink only)")
    if plan.pp > 1:
        bubble = parts["bubble"] / parts["step"]
        where.append(f"pipeline parallel {plan.pp} over the {args.n_layers} layers "
                     f"({plan.microbatches} micro-batches, bubble {bubble:.0%})")
    dp = {"ddp": f"DDP over {plan.dp} GPUs (the model is whole on each)",
          "fsdp": f"FSDP over {plan.dp} GPUs", "none": "no data parallelism"}[plan.strategy]
    lines = [(", ".join(where) + "; " if where else "") + dp + ".",
             f"Predicted {plan.tokens_per_s:,.0f} tokens/s per GPU: compute "
             f"{parts['compute'] * 1e3:.0f} ms, TP traffic {parts['tp_comm'] * 1e3:.0f} ms, "
             f"data-parallel traffic {parts['dp_comm'] * 1e3:.0f} ms (mostly overlapped) per "
             f"step; {fmt_gb(plan.memory.peak)} per GPU at micro-batch {plan.micro_batch}, "
             f"activation checkpointing {plan.ac}."]
    others = [p for p in plans if p is not plan]
    if others and plan is plans[0]:
        nxt = others[0]
        lines.append(f"Next best: {_label(nxt)} at {nxt.tokens_per_s:,.0f} tokens/s per GPU "
                     f"({nxt.tokens_per_s / plan.tokens_per_s - 1:+.0%}).")
    return lines


def _label(plan: ParallelPlan) -> str:
    """'fsdp dp 8 x tp 2 x pp 1, micro-batch 4'."""
    return (f"{plan.strategy} dp {plan.dp} x tp {plan.tp} x pp {plan.pp}, micro-batch "
            f"{plan.micro_batch}{', AC full' if plan.ac == 'full' else ''}")


def describe(plan: ParallelPlan) -> str:
    """One line naming a layout and its predicted speed."""
    return (f"{_label(plan)}: ~{plan.tokens_per_s:,.0f} tokens/s per GPU, "
            f"{plan.memory.peak / 1e9:.1f} GB per GPU")

