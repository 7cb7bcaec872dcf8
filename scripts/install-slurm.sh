#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, client) and munge from Debian packages for the test suite.
#
#   sudo scripts/install-slurm.sh      # `make test` runs it before pytest
#
# Installing is all it does: the tests in tests/slurm start their own munged, slurmctld and
# slurmd from a config under a temporary directory, and stop them at the end.
#
# Idempotent: returns at once when the binaries are already there. Where it cannot install (not
# root, no apt-get, apt offline or without the packages) it says what failed and what that
# means: the real-Slurm tests will skip. Under CI=true (.ci/run sets it) they would fail, so this
# script fails at once instead (exit 1), before the test suite runs.
# Package scripts must not start daemons here (there is no systemd, and the test fixture starts
# its own cluster from a config under a temporary directory), so a policy-rc.d that answers 101
# ("action forbidden") is in place for the duration of the install.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sbatch srun scontrol sinfo squeue scancel munged)
# Where the binaries are looked for: PATH and the sbin folders (often not on a user's PATH).
# INSTALL_SLURM_PATH replaces it (the tests of this script use it).
SEARCH_PATH="${INSTALL_SLURM_PATH-$PATH:/usr/sbin:/sbin}"

in_ci() {
    case "$(printf '%s' "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
        1|true|yes) return 0 ;;
        *) return 1 ;;
    esac
}

# Say what failed and what it means; fail under CI=true, where the tests could not skip.
cannot_install() {
    echo "install-slurm: cannot install ${PACKAGES[*]} (missing: ${missing[*]}): $1" >&2
    if in_ci; then
        echo "install-slurm: CI=true: the real-Slurm tests in tests/slurm cannot run, and a" \
             "skip there would hide it; failing now. HINT: $2" >&2
        exit 1
    fi
    echo "install-slurm: the real-Slurm tests in tests/slurm will be SKIPPED (preemption," \
         "requeue and the generated sbatch script stay untested). HINT: $2" >&2
    exit 0
}

find_missing() {
    missing=()
    for bin in "${BINARIES[@]}"; do
        PATH="$SEARCH_PATH" command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
    done
}

find_missing
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-slurm: Slurm and munge already installed, nothing to do"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    cannot_install "not root (apt-get needs root)" \
        "run 'sudo scripts/install-slurm.sh' once, then the tests as root"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    cannot_install "no apt-get on this machine (the script knows Debian/Ubuntu packages only)" \
        "install slurmctld, slurmd, the Slurm clients and munge with this system's package manager"
fi

export DEBIAN_FRONTEND=noninteractive
echo "install-slurm: installing ${PACKAGES[*]} (missing: ${missing[*]})"
# Before the policy below: updating the package lists starts nothing. Offline, apt-get update
# fails (or only warns, and the install then finds no package): both end in cannot_install.
if ! apt-get update -q; then
    cannot_install "'apt-get update' failed (offline, or no package mirror reachable)" \
        "give this machine access to a Debian mirror (or a local one), then rerun"
fi

POLICY=/usr/sbin/policy-rc.d
BACKUP="$POLICY.hpctrain-backup"
cleanup() {
    rm -f "$POLICY"
    if [ -e "$BACKUP" ]; then mv -f "$BACKUP" "$POLICY"; fi
}
trap cleanup EXIT
# Put our own policy in place (an existing one, e.g. Docker's, is set aside and restored after).
if [ -e "$POLICY" ]; then mv -f "$POLICY" "$BACKUP"; fi
printf '#!/bin/sh\n# installed by hpctrain scripts/install-slurm.sh for the install only\nexit 101\n' \
    > "$POLICY"
chmod 755 "$POLICY"

if ! apt-get install -o DPkg::Lock::Timeout=300 -y -q --no-install-recommends "${PACKAGES[@]}"; then
    cannot_install "'apt-get install' failed (offline, or the packages are not in the lists)" \
        "give this machine access to a Debian mirror (or a local one), then rerun"
fi
find_missing
if [ ${#missing[@]} -ne 0 ]; then
    cannot_install "the packages installed but these binaries are still not found" \
        "check the packages' contents (dpkg -L slurmd slurmctld slurm-client munge)"
fi
echo "install-slurm: $(PATH="$SEARCH_PATH" slurmctld -V 2>/dev/null || echo 'slurmctld ?') installed"
