#!/usr/bin/env bash
# Issue 14's measurements on one 2-GPU host, as one batch, most wanted first, each step beside
# torchtitan where there is a peer (run on 2x H200, 2026-11-27: benchmarks/RESULTS.md, section
# "The tuner's picks beside the peer on 2 and 4 GPUs"):
#   1. 1b on 1 GPU and FSDP on 2 (1.20x the peer on 1 GPU; 93% weak scaling and 1.2x on 2);
#   2. hpctrain tune on 8b over 2 GPUs (no AC, micro-batch 4 as given: the 2-GPU layout that
#      holds 8b without AC on 141 GB cards), then its pick on both sides (compare.py --tuned);
#   3. 1b FSDP2 as ZeRO-2 on both sides, then ours reducing gradients in bf16 (no peer flag);
#   4. an A/B at once, one GPU each: 1b with inductor's coordinate-descent tuning of its
#      generated kernels against 1b without (the pointwise kernels are 14% of a 1-GPU step);
#   5. 1b FSDP2 with explicit FSDP prefetch of one block.
# About 25 minutes in all, longer than one device call may run: start it detached, then poll.
#   (setsid nohup bash benchmarks/peers/lease_2gpu.sh /tmp/lease > /tmp/lease.out 2>&1 &)
#   test -f /tmp/lease/DONE      # each step's output: /tmp/lease/NAME.log and NAME/
# Runs from a copy of the checkout (lease_common.sh says why). Needs fetch_wheels.sh's wheels
# installed into /tmp/site (README.md beside this file).
# tests/bench/test_lease_script.py parses every command below with the real parsers.
set -uo pipefail
source "$(dirname "$0")/lease_common.sh"
step 1b-weak $C --layouts 1b-1gpu 1b-fsdp2 --steps 40 --out "$R/1b-weak"
step tune-8b python3 -m hpctrain tune configs/llama-8b-fsdp.yaml \
    parallel.activation_checkpointing=none train.micro_batch=4 --gpus 2 --max-candidates 3 \
    --steps 20 --out "$R/tune-8b"
step 8b-tuned $C --tuned "$R/tune-8b" --steps 30 --out "$R/8b-tuned"
step 1b-zero2 $C --layouts 1b-fsdp2 --steps 40 --set parallel.reshard_after_forward=false \
    --tag zero2 --out "$R/1b-zero2"
step 1b-zero2-bf16rs $C --layouts 1b-fsdp2 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.reduce_precision=bf16 \
    --tag zero2-bf16rs --out "$R/1b-zero2-bf16rs"
CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 step 1b-cdt \
    $C --layouts 1b-1gpu --only hpctrain --steps 40 --tag cdt --out "$R/1b-cdt" &
CUDA_VISIBLE_DEVICES=1 step 1b-plain $C --layouts 1b-1gpu --only hpctrain --steps 40 \
    --out "$R/1b-plain"
wait
step 1b-prefetch1 $C --layouts 1b-fsdp2 --only hpctrain --steps 40 \
    --set parallel.fsdp_prefetch=1 --tag prefetch1 --out "$R/1b-prefetch1"
touch "$R/DONE"
