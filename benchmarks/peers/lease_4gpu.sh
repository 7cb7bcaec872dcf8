#!/usr/bin/env bash
# Issue 15's open measurements (and issue 14's 2-GPU and 8b targets) on one 4-GPU host, as one
# batch, most wanted first, each step beside torchtitan where there is a peer:
#   1. 1b on 1 GPU and FSDP on 4 (weak scaling, target 93%), slow windows and host_wait_ms;
#   2. hpctrain tune on 8b over 4 GPUs, then its pick on both sides (compare.py --tuned);
#   3. 1b FSDP on 2 of the GPUs (issue 14: 93% of 1 GPU, 1.2x the peer);
#   4. 1b FSDP4 with explicit FSDP prefetch of 1 and 2 blocks (parallel.fsdp_prefetch), as
#      ZeRO-2, and as ZeRO-2 reducing gradients in bf16 (half the reduce-scatter bytes);
#   5. 8b TP4 and PP4 1F1B with pure bf16 on our side too (the peer runs pure bf16 there);
#   6. a profile of 8b PP4 ZBV (our zero-bubble runs 28% behind).
# About 25 minutes in all, longer than one device call may run: start it detached, then poll.
#   (setsid nohup bash benchmarks/peers/lease_4gpu.sh /tmp/lease > /tmp/lease.out 2>&1 &)
#   test -f /tmp/lease/DONE      # each step's output: /tmp/lease/NAME.log and NAME/
# Needs fetch_wheels.sh's wheels installed into /tmp/site (README.md beside this file).
# tests/bench/test_lease_script.py parses every command below with the real parsers.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${1:-runs/lease}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
C="python3 benchmarks/peers/compare.py"

# step NAME COMMAND...: run it, its output and exit status into $R/NAME.log; go on either way.
step() {
    local name=$1
    shift
    echo "== $name $(date +%T)"
    "$@" > "$R/$name.log" 2>&1
    echo "rc=$? $(date +%T)" | tee -a "$R/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt" 2>&1
nvidia-smi topo -m >> "$R/gpus.txt" 2>&1
step 1b-weak $C --layouts 1b-1gpu 1b-fsdp4 --steps 40 --out "$R/1b-weak"
# train.grad_accum=2: a global batch of 16 x 2048 (8b-fsdp4's), so micro-batch 4 can be tried.
step tune-8b python3 -m hpctrain tune configs/llama-8b-fsdp.yaml train.grad_accum=2 --gpus 4 \
    --max-candidates 4 --steps 20 --out "$R/tune-8b"
step 8b-tuned $C --tuned "$R/tune-8b" --steps 30 --out "$R/8b-tuned"
CUDA_VISIBLE_DEVICES=0,1 step 1b-fsdp2 $C --layouts 1b-fsdp2 --steps 40 --out "$R/1b-fsdp2"
step 1b-prefetch1 $C --layouts 1b-fsdp4 --only hpctrain --steps 40 --set parallel.fsdp_prefetch=1 \
    --tag prefetch1 --out "$R/1b-prefetch1"
step 1b-prefetch2 $C --layouts 1b-fsdp4 --only hpctrain --steps 40 --set parallel.fsdp_prefetch=2 \
    --tag prefetch2 --out "$R/1b-prefetch2"
step 1b-zero2 $C --layouts 1b-fsdp4 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --tag zero2 --out "$R/1b-zero2"
step 1b-zero2-bf16rs $C --layouts 1b-fsdp4 --only hpctrain --steps 40 \
    --set parallel.reshard_after_forward=false --set parallel.reduce_precision=bf16 \
    --tag zero2-bf16rs --out "$R/1b-zero2-bf16rs"
step 8b-pure $C --layouts 8b-tp4 8b-pp4-1f1b --steps 30 --set train.master_weights=bf16 \
    --tag pure --out "$R/8b-pure"
step 8b-zbv-profile $C --layouts 8b-pp4-zbv --only hpctrain --steps 30 --profile \
    --out "$R/8b-zbv"
touch "$R/DONE"
