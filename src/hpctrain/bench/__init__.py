"""Micro-benchmarks of a node: GEMM, device copy, host<->device, collectives (nccl-tests semantics).

    hpctrain bench gemm --dtypes bf16 --sizes 8192
    hpctrain bench collective --nproc 4 -b 64M -e 1G -f 2
"""
