#!/usr/bin/env bash
# Issue 14's measurements on one 2-GPU host, as one batch, each step beside torchtitan where
# there is a peer (last run 2026-11-27: benchmarks/RESULTS.md, section "8b fp8 against the
# peer with its output layer in bf16..."):
#   1. 8b at tune's 2-GPU pick (fp8, ZeRO-2, no AC, micro-batch 4) on both sides (1.15x wanted;
#      1.06-1.10x), then ours in FSDP units of two blocks (parallel.fsdp_group_blocks=2: no
#      change on 2 GPUs; the 1b prototype gained 5.1% on a CPU-bound 4-GPU host), then ours as
#      before again (ABBA);
#   2. 1b on 1 GPU and FSDP2 as ZeRO-2 on both sides, then ours in units of two blocks;
#   3. hpctrain tune on 8b over 2 GPUs (no AC, micro-batch 4 as given: the 2-GPU layout that
#      holds 8b without AC on 141 GB cards), then its pick on both sides (compare.py --tuned).
# A --set that the peer has a counterpart for reaches its run too (compare.py).
# About 20 minutes in all, longer than one device call may run: start it detached, then poll.
#   (setsid nohup bash benchmarks/peers/lease_2gpu.sh /tmp/lease > /tmp/lease.out 2>&1 &)
#   test -f /tmp/lease/DONE      # each step's output: /tmp/lease/NAME.log and NAME/
# Runs from a copy of the checkout (lease_common.sh says why). Needs fetch_wheels.sh's wheels
# installed into /tmp/site (README.md beside this file).
# tests/bench/test_lease_script.py parses every command below with the real parsers.
set -uo pipefail
source "$(dirname "$0")/lease_common.sh"
step 8b-fp8-zero2 $C --layouts 8b-fsdp2 --steps 30 --set train.precision=fp8 \
    --set parallel.reshard_after_forward=false --tag fp8-zero2 --out "$R/8b-fp8-zero2"
step 8b-fp8-zero2-units2 $C --layouts 8b-fsdp2 --only hpctrain --steps 30 \
    --set train.precision=fp8 --set parallel.reshard_after_forward=false \
    --set parallel.fsdp_group_blocks=2 --tag fp8-zero2-units2 --out "$R/8b-fp8-zero2-units2"
step 8b-fp8-zero2-again $C --layouts 8b-fsdp2 --only hpctrain --steps 30 \
    --set train.precision=fp8 --set parallel.reshard_after_forward=false --tag fp8-zero2-again --out "$R/8b-fp8-zero2-again"
step 1b-1gpu $C --layouts 1b-1gpu --steps 40 --out "$R/1b-1gpu"
step 1b-zero2 $C --layouts 1b-fsdp2 --steps 40 --set parallel.reshard_after_forward=false \
    --tag zero2 --out "$R/1b-zero2"
step 1b-zero2-units2 $C --layouts 1b-fsdp2 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.fsdp_group_blocks=2 \
    --tag zero2-units2 --out "$R/1b-zero2-units2"
step tune-8b python3 -m hpctrain tune configs/llama-8b-fsdp.yaml \
    parallel.activation_checkpointing=none train.micro_batch=4 --gpus 2 --max-candidates 3 \
    --steps 20 --out "$R/tune-8b"
step 8b-tuned $C --tuned "$R/tune-8b" --steps 30 --out "$R/8b-tuned"
touch "$R/DONE"
