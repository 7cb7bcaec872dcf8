"""``hpctrain tune CONFIG --gpus N``: measure configurations the memory model allows, keep the best.

    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 2 --dry-run    # the short list, nothing run
    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 4 --gpu h200 --dry-run   # on a login node
    hpctrain tune configs/llama-8b-fsdp.yaml --gpus 2              # measure it (minutes)
    hpctrain train runs/tune/llama-8b-fsdp/best.yaml --nproc 2      # train the winner

What is varied, on one node of ``--gpus`` GPUs: the layout (data parallel only; tensor parallel
``tp`` dividing the GPUs, the heads, KV heads, FFN width, vocabulary and sequence; pipeline
parallel ``pp``, a power of two up to the layer count), the data-parallel strategy (DDP, FSDP
ZeRO-3 ``reshard_after_forward=true`` or ZeRO-2 ``=false``; ``none`` when one replica spans all
GPUs), activation checkpointing (none, every k-th block, selective, full), the micro-batch
(powers of two), and fp8 (``train.precision=fp8``) where the config accepts it and the GPU has
fp8 tensor cores (CUDA capability 8.9 or newer; never on a CPU). Compilation, sequence length,
optimizer, data, the chunked loss and async TP are the config's (``train.loss_chunks`` is set to
0 for tp/pp layouts, which refuse it and split the logits themselves; ``parallel.async_tp`` is
kept for tp layouts and turned off for the others, which refuse it).

**The global batch is never changed.** It is the config's ``micro_batch x grad_accum x dp`` on
``--gpus`` GPUs, and every candidate reaches it by adjusting ``train.grad_accum`` (for a
pipeline: its micro-batches). A tuner that changed the batch would change the optimisation
problem (the loss curve, the learning-rate schedule's meaning) to buy speed: that is not tuning.

How the short list is chosen: every combination is sized with `hpctrain.plan.memory` and dropped
unless its peak plus 10% fits the GPU (its memory as NVML reads it, or a child process's
CUDA where NVML cannot read it: this process, which runs the candidates, holds no CUDA context; or
``--gpu-mem-gb``; 16 GB per rank on a CPU; with ``--gpu TYPE --dry-run``, that type's memory and
peak from the planner's tables, on a machine without it). The rest are ranked by the step-time
model of ``hpctrain plan parallel`` (predicted tokens/s per GPU). That model has no ZeRO-2 term
(ranked just ahead of its ZeRO-3 twin: one all-gather fewer per micro-batch) and knows only
``none`` and ``full`` checkpointing: ``every_k`` and ``selective`` step times are interpolated
between the two by the share of the forward they recompute; ``every_k``'s memory too (the memory
model has no ``every_k``; the peak so interpolated errs high, but leaves out up to half a
block's activations).
Nor does it know fp8's speed: the best fp8 settings are added, ranked as their bf16 twins but
sized as fp8 (the memory model's float8 terms), so a setting that fits only in fp8 is tried.
``--max-candidates`` are kept: the config as given first (the baseline), the best of each
layout/strategy, then the next best. The list is printed before anything runs.

Measuring: each candidate is a real ``hpctrain train`` run via `hpctrain.bench.model` (``--steps``
steps; warm-up windows skipped, tokens/s per GPU and MFU as ``bench model`` reads them), one
after the other. A candidate that fails (out of memory, a refused layout, a timeout) is recorded
with a one-line reason and the next one runs. Ctrl-C stops the one running, writes what was
measured, and exits 130. The winner is the highest tokens/s per GPU (all candidates train the
same global batch on the same GPUs, so that is the fastest time to a given loss per step).
``--resume`` continues an interrupted call into the same ``--out``: the candidates it finished
are kept, the rest run (a call can so be split to fit a time limit).

Files in ``--out`` (default ``runs/tune/<config stem>``), written atomically:

- ``results.json``: ``meta`` (device and its name, memory used for the model, GPUs, torch
  version, date, the command, config, global batch, steps, notes, ``interrupted``), and
  ``candidates``: per candidate its label, overrides, settings, predicted peak GB and tokens/s
  per GPU, ``status`` (ok, failed, interrupted, not_run), the reason of a failure, the measured
  numbers and ``mem_ratio`` (measured peak / predicted; on a CPU the measured peak is the
  process's RSS, not comparable), and ``winner`` (its index, or null);
- ``best.overrides``: one ``key=value`` per line (the command's own overrides, then the winner's);
- ``best.yaml``: the resolved config with the winner applied (``hpctrain train best.yaml``);
- ``cNN/``: candidate NN's ``bench model`` folder (``config.yaml`` and the run in ``train/``).

A task of your own (``my_task.py``, or a config with ``task:``; hpctrain.task) is read as
``hpctrain train`` reads it (DDP on several ranks) and tuned over what training accepts for a
task: one replica on one GPU; DDP, FSDP ZeRO-2 and ZeRO-3 on several; each at the micro-batches
its own value, x2, x4 and /2 that divide each rank's share of the global batch (the config's,
as ever). Its model has no memory or step-time model: on this node's GPU each strategy's step
is measured as ``hpctrain plan memory TASK`` measures it (in a child process), and settings
whose extrapolated peak plus 10% would not fit are left out; no speed is predicted. After the
config as given, the candidates run in order of memory appetite (the smaller micro-batch
first, and at one micro-batch ZeRO-3, ZeRO-2, then DDP), and one that runs out of memory
records the larger micro-batches of its setting as failed without running them. They are
ranked by measured samples/s per GPU (``samples_per_s_per_gpu`` beside tokens/s in
results.json; the two differ where the task gives ``tokens_per_sample``), and the same files are
written.
Training takes the winner with ``$(cat best.overrides)``, or ``best.yaml``; a config that
leaves ``parallel.strategy`` / ``reshard_after_forward`` to ``auto`` takes it from
``parallel.tune_results=OUT`` (its ``train.micro_batch`` is a number: ``auto`` is refused for a
task).

Exit codes: 0 with a winner (also after ``--dry-run``), 1 when every candidate failed (their
reasons are printed), 2 for bad input (unknown config, ``--gpus`` < 1 or more than visible on a
GPU machine, no candidate that fits), 130 after Ctrl-C.

Modules, each importing only those before it: ``space`` (a setting, the search space, what the
models predict of a setting), ``candidates`` (the short list), ``measure`` (running it, resume, the
files above), ``task_candidates`` (a task's short list), ``cli`` (the parser, the command, its
tables).
"""
