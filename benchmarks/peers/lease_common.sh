# Sourced by lease_*.sh: what every detached GPU batch needs before its steps.
#   - The device tool copies the working tree onto the machine again at the start of each call,
#     and a batch spans several calls: it re-executes itself from a copy of its own, so no
#     source file changes under a running step (a run started in the seconds a new call began
#     died at import, a module of the tree not found).
#   - $R (the first argument, default runs/lease of the checkout) holds each step's log;
#     $C is compare.py; multicast stays off (device README); `step NAME COMMAND...` runs one
#     command.
if [ -z "${LEASE_COPY:-}" ]; then
    _src=$(cd "$(dirname "${BASH_SOURCE[1]}")/../.." && pwd)
    _out=$(realpath -m "${1:-$_src/runs/lease}")
    _dst=$(mktemp -d /tmp/hpctrain-lease.XXXXXX)
    tar -C "$_src" --exclude=./.git --exclude=./.venv --exclude=./runs -cf - . \
        | tar -C "$_dst" -xf -
    LEASE_COPY=1 exec bash "$_dst/benchmarks/peers/$(basename "${BASH_SOURCE[1]}")" "$_out"
fi
cd "$(dirname "${BASH_SOURCE[1]}")/../.."
R=$1
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
