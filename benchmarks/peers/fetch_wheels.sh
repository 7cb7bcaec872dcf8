#!/usr/bin/env bash
# Download torchtitan 0.2.2 and what it needs beyond the GPU image into .whl/ (git-ignored via
# .git/info/exclude), for a machine without internet, and torchao 0.18.0 (train.precision=fp8;
# built for torch >= 2.11, no dependencies). The GPU image (Python 3.12) already has torch,
# huggingface-hub, fsspec, pyarrow, tokenizers and tensorboard.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    torchtitan==0.2.2 datasets==4.7.0 torchdata==0.11.0 tyro==1.0.5 dill==0.4.0 \
    multiprocess==0.70.18 docstring_parser==0.18.0 typeguard==4.6.1 torchao==0.18.0
