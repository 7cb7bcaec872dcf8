#!/usr/bin/env bash
# Build containers/Containerfile as a CPU image with podman and run hpctrain inside it: the
# preflight (`hpctrain doctor`) and 5 training steps on 2 CPU ranks. `make container-test` runs
# it (opt-in, never part of `make test`); it fails (non-zero) when the build or either run does.
#
#   scripts/container-test.sh            # as root where it must build the base (see below)
#
# Where its pieces come from, picked in this order:
#   base   docker.io/library/debian:12-slim when docker.io answers; else a Debian 12 root
#          filesystem built from this machine's Debian mirror (scripts/make-base-image.sh,
#          localhost/hpctrain-base:bookworm; root needed once)
#   torch  TORCH_WHEEL=/path/torch-....whl when set; with the docker.io base, $TORCH (default
#          torch==2.13.0) from download.pytorch.org's CPU index; else the newest
#          $WHEEL_DIR/torch-*-cp311-*.whl (default /opt/wheels; cp311: Debian 12's Python).
#          A wheel is mounted read-only into the build (podman build -v) and its own
#          dependencies come from PyPI.
# Where podman's defaults cannot start a container (inside another container: no
# CAP_SYS_RESOURCE to raise the open-files and process limits, or a hybrid cgroup v1/v2 layout
# that crun refuses), it says so and retries with the limits this shell has and runc.
# When the host's pip trusts a CA bundle of its own (PIP_CERT, e.g. behind a TLS-inspecting
# proxy), the build's pip gets the same bundle, mounted read-only.
# Everything it prints also goes to $CONTAINER_TEST_LOG (default runs/container-test.log).
set -euo pipefail

cd "$(dirname "$0")/.."
IMAGE="${CONTAINER_TAG:-hpctrain:cpu-test}"
TORCH="${TORCH:-torch==2.13.0}"
TORCH_WHEEL="${TORCH_WHEEL:-}"
WHEEL_DIR="${WHEEL_DIR:-/opt/wheels}"
REMOTE_BASE=docker.io/library/debian:12-slim
LOCAL_BASE=localhost/hpctrain-base:bookworm
LOG="${CONTAINER_TEST_LOG:-runs/container-test.log}"

mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

say() { echo "container-test: $*"; }
die() { echo "container-test: $1" >&2; echo "container-test: HINT: $2" >&2; exit 1; }

command -v podman >/dev/null 2>&1 \
    || die "podman is not installed" "apt-get install podman (Debian), then rerun"
START=$SECONDS

# --- base image -------------------------------------------------------------------------------
# Pulled, not just looked up: docker.io answering is also the sign that download.pytorch.org will.
if podman pull -q "$REMOTE_BASE" >/dev/null 2>&1; then
    BASE="$REMOTE_BASE"
    say "base: $BASE"
else
    say "base: docker.io cannot be reached; $LOCAL_BASE from the Debian mirror instead"
    bash scripts/make-base-image.sh "$LOCAL_BASE"
    BASE="$LOCAL_BASE"
fi

# --- torch ------------------------------------------------------------------------------------
BUILD_ARGS=(--build-arg "BASE=$BASE")
if [ -z "$TORCH_WHEEL" ] && [ "$BASE" != "$REMOTE_BASE" ]; then
    # sort -V: torch-2.10 after torch-2.9. No WHEEL_DIR at all is the same as no wheel in it.
    TORCH_WHEEL="$( (find "$WHEEL_DIR" -maxdepth 1 -name 'torch-*-cp311-*.whl' 2>/dev/null || true) \
                   | sort -V | tail -n 1)"
    [ -n "$TORCH_WHEEL" ] || die "no registry and no torch wheel for Python 3.11 in $WHEEL_DIR" \
        "set TORCH_WHEEL=/path/to/torch-<version>-cp311-cp311-<platform>.whl"
fi
if [ -n "$TORCH_WHEEL" ]; then
    [ -f "$TORCH_WHEEL" ] || die "TORCH_WHEEL=$TORCH_WHEEL is not a file" \
        "point TORCH_WHEEL at a torch .whl built for Python 3.11 (Debian 12)"
    WHEEL_PATH="$(cd "$(dirname "$TORCH_WHEEL")" && pwd)"
    BUILD_ARGS+=(-v "$WHEEL_PATH:/wheels:ro"
                 --build-arg "TORCH=/wheels/$(basename "$TORCH_WHEEL")"
                 --build-arg TORCH_INDEX=https://pypi.org/simple)
    say "torch: $TORCH_WHEEL (its dependencies from PyPI)"
else
    BUILD_ARGS+=(--build-arg "TORCH=$TORCH"
                 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu)
    say "torch: $TORCH from download.pytorch.org/whl/cpu"
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    BUILD_ARGS+=(-v "$PIP_CERT:/etc/hpctrain-build-ca.crt:ro"
                 --build-arg PIP_CERT=/etc/hpctrain-build-ca.crt)
    say "pip in the build trusts PIP_CERT=$PIP_CERT, as pip does here"
fi

# --- how podman can start containers here ---------------------------------------------------
GLOBAL=()
LIMITS=()
if ! err="$(podman run --rm "$BASE" true 2>&1)"; then
    say "podman cannot start a container with its defaults: $(tail -n 1 <<<"$err")"
    # A container's hard limits may not exceed podman's own (raising them needs
    # CAP_SYS_RESOURCE); a process limit above pid_max would mean nothing anyway.
    nproc="$(ulimit -Hu)"
    pid_max="$(cat /proc/sys/kernel/pid_max)"
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc="$pid_max"; fi
    LIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=$nproc:$nproc")
    # crun refuses hybrid cgroup layouts (v1 controllers plus a cgroup2 mount); runc does not.
    if command -v runc >/dev/null 2>&1; then GLOBAL=(--runtime runc); fi
    err="$(podman "${GLOBAL[@]}" run --rm "${LIMITS[@]}" "$BASE" true 2>&1)" \
        || die "podman still cannot start a container (${GLOBAL[*]} ${LIMITS[*]}): $err" \
               "where crun reports a hybrid cgroup layout, apt-get install runc"
    say "using: podman ${GLOBAL[*]} ... ${LIMITS[*]}"
fi

# --- build and run ----------------------------------------------------------------------------
say "building $IMAGE (torch and hpctrain's dependencies are installed: minutes)"
podman "${GLOBAL[@]}" build -f containers/Containerfile -t "$IMAGE" "${LIMITS[@]}" \
    "${BUILD_ARGS[@]}" .
say "built $IMAGE in $((SECONDS - START)) s"

in_image() { podman "${GLOBAL[@]}" run --rm "${LIMITS[@]}" "$IMAGE" "$@"; }
say "inside the image: hpctrain doctor configs/demo.yaml"
in_image python3 -m hpctrain doctor configs/demo.yaml run.out_dir=/tmp/runs
say "inside the image: 5 training steps on 2 CPU ranks"
in_image python3 -m hpctrain train configs/demo.yaml run.out_dir=/tmp/runs train.steps=5 \
    data.max_bytes=200000 --nproc 2
say "passed in $((SECONDS - START)) s (log: $LOG)"
