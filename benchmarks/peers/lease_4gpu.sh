#!/usr/bin/env bash
# Issue 15's open measurements on one 4-GPU host, as one batch, most wanted first, each step
# beside torchtitan where there is a peer (tune's 8b pick on 4 GPUs, the 2-GPU targets and
# explicit prefetch were measured on 2026-11-27: benchmarks/RESULTS.md):
#   1. 1b on 1 GPU and FSDP on 4 (weak scaling, target 93%; 89.9% at ZeRO-2 last time);
#   2. 1b FSDP4 as ZeRO-2 on both sides, then ours reducing gradients in bf16 (half the
#      reduce-scatter bytes: 97.6% of 1 GPU on 2 GPUs);
#   3. 8b at tune's 4-GPU pick (fp8, ZeRO-2, no AC, micro-batch 4) on both sides, now with the
#      fused float8 gather cast (4-way shards: its per-call CPU cost weighs more; 14,780 vs
#      13,927 tok/s/GPU before it);
#   4. 8b TP4 and PP4 1F1B with pure bf16 on our side too (the peer runs pure bf16 there);
#   5. a profile of 8b PP4 ZBV (our zero-bubble runs 28% behind).
# About 18 minutes in all, longer than one device call may run: start it detached, then poll.
#   (setsid nohup bash benchmarks/peers/lease_4gpu.sh /tmp/lease > /tmp/lease.out 2>&1 &)
#   test -f /tmp/lease/DONE      # each step's output: /tmp/lease/NAME.log and NAME/
# Runs from a copy of the checkout (lease_common.sh says why). Needs fetch_wheels.sh's wheels
# installed into /tmp/site (README.md beside this file).
# tests/bench/test_lease_script.py parses every command below with the real parsers.
set -uo pipefail
source "$(dirname "$0")/lease_common.sh"
step 1b-weak $C --layouts 1b-1gpu 1b-fsdp4 --steps 40 --out "$R/1b-weak"
step 1b-zero2 $C --layouts 1b-fsdp4 --steps 40 --set parallel.reshard_after_forward=false \
    --peer-arg=--parallelism.fsdp_reshard_after_forward=never --tag zero2 --out "$R/1b-zero2"
step 1b-zero2-bf16rs $C --layouts 1b-fsdp4 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.reduce_precision=bf16 \
    --tag zero2-bf16rs --out "$R/1b-zero2-bf16rs"
step 8b-fp8-zero2 $C --layouts 8b-fsdp4 --steps 30 --set train.precision=fp8 \
    --set parallel.reshard_after_forward=false \
    --peer-arg=--parallelism.fsdp_reshard_after_forward=never \
    --peer-arg=--model.converters=quantize.linear.float8 \
    --peer-arg=--quantize.linear.float8.enable_fsdp_float8_all_gather \
    --peer-arg=--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp \
    --tag fp8-zero2 --out "$R/8b-fp8-zero2"
step 8b-pure $C --layouts 8b-tp4 8b-pp4-1f1b --steps 30 --set train.master_weights=bf16 \
    --tag pure --out "$R/8b-pure"
step 8b-zbv-profile $C --layouts 8b-pp4-zbv --only hpctrain --steps 30 --profile \
    --out "$R/8b-zbv"
touch "$R/DONE"
