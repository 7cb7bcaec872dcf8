#!/usr/bin/env bash
# The 4-GPU measurements of issues 14 and 15 on one host, as one batch, most wanted first, each
# step beside torchtitan where there is a peer (results so far: benchmarks/RESULTS.md):
#   1. 1b on 1 GPU, then FSDP on 4 as ZeRO-2 on both sides (weak scaling, target 93%; hosts
#      have given 79.9-95.8%);
#   2. ours in FSDP units of two blocks (parallel.fsdp_group_blocks=2; +5.1% as a prototype,
#      the committed option not yet run on a GPU), then ours reducing gradients in bf16;
#   3. 1b FSDP4 at the default ZeRO-3 on both sides;
#   4. 8b at tune's 4-GPU pick (fp8, ZeRO-2, no AC, micro-batch 4) on both sides, then ours
#      in units of two blocks;
#   5. 1b on 1 GPU again, ours only: did the host's single-GPU rate hold over the batch;
#   6. 8b TP4 and PP4 1F1B with pure bf16 on our side too (the peer runs pure bf16 there).
# A --set that the peer has a counterpart for reaches its run too (compare.py).
# About 20 minutes in all, longer than one device call may run: start it detached, then poll.
#   (setsid nohup bash benchmarks/peers/lease_4gpu.sh /tmp/lease > /tmp/lease.out 2>&1 &)
#   test -f /tmp/lease/DONE      # each step's output: /tmp/lease/NAME.log and NAME/
# Runs from a copy of the checkout (lease_common.sh says why). Needs fetch_wheels.sh's wheels
# installed into /tmp/site (README.md beside this file).
# tests/bench/test_lease_script.py parses every command below with the real parsers.
set -uo pipefail
source "$(dirname "$0")/lease_common.sh"
step 1b-1gpu $C --layouts 1b-1gpu --steps 40 --out "$R/1b-1gpu"
step 1b-zero2 $C --layouts 1b-fsdp4 --steps 40 --set parallel.reshard_after_forward=false \
    --tag zero2 --out "$R/1b-zero2"
step 1b-zero2-units2 $C --layouts 1b-fsdp4 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.fsdp_group_blocks=2 \
    --tag zero2-units2 --out "$R/1b-zero2-units2"
step 1b-zero2-bf16rs $C --layouts 1b-fsdp4 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.reduce_precision=bf16 \
    --tag zero2-bf16rs --out "$R/1b-zero2-bf16rs"
step 1b-zero3 $C --layouts 1b-fsdp4 --steps 40 --out "$R/1b-zero3"
step 8b-fp8-zero2 $C --layouts 8b-fsdp4 --steps 30 --set train.precision=fp8 \
    --set parallel.reshard_after_forward=false --tag fp8-zero2 --out "$R/8b-fp8-zero2"
step 8b-fp8-zero2-units2 $C --layouts 8b-fsdp4 --only hpctrain --steps 30 \
    --set train.precision=fp8 --set parallel.reshard_after_forward=false \
    --set parallel.fsdp_group_blocks=2 --tag fp8-zero2-units2 --out "$R/8b-fp8-zero2-units2"
step 1b-1gpu-again $C --layouts 1b-1gpu --only hpctrain --steps 40 --tag again \
    --out "$R/1b-1gpu-again"
step 8b-pure $C --layouts 8b-tp4 8b-pp4-1f1b --steps 30 --set train.master_weights=bf16 \
    --tag pure --out "$R/8b-pure"
touch "$R/DONE"
