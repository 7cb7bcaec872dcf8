#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, client) and munge from Debian packages for the test suite.
#
#   sudo scripts/install-slurm.sh      # `make test` runs it before pytest
#
# Idempotent: returns at once when the binaries are already there. Where it cannot install (not
# root, no apt-get) it says why and exits 0: tests/slurm then skip, or fail when CI=true.
# Package scripts must not start daemons here (there is no systemd, and the test fixture starts
# its own cluster from a config under a temporary directory), so a policy-rc.d that answers 101
# ("action forbidden") is in place for the duration of the install.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sbatch srun scontrol sinfo squeue scancel munged)

missing=()
for bin in "${BINARIES[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-slurm: Slurm and munge already installed, nothing to do"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install-slurm: not root, cannot install ${PACKAGES[*]} (missing: ${missing[*]});" \
         "the real-Slurm tests in tests/slurm will skip (and fail under CI=true)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: no apt-get on this machine, cannot install ${PACKAGES[*]}" \
         "(missing: ${missing[*]}); the real-Slurm tests in tests/slurm will skip" \
         "(and fail under CI=true)"
    exit 0
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

echo "install-slurm: installing ${PACKAGES[*]} (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
echo "install-slurm: $(slurmctld -V 2>/dev/null || echo 'slurmctld ?') installed"
