#!/usr/bin/env bash
# Build a minimal Debian 12 (bookworm) base image for podman without any registry: debootstrap a
# minbase root filesystem from this machine's Debian mirror and `podman import` it.
#
#   sudo scripts/make-base-image.sh [IMAGE]     # default IMAGE: localhost/hpctrain-base:bookworm
#
# `make container-test` runs it when docker.io cannot be reached, and builds
# containers/Containerfile on the result (BASE=IMAGE): the same content as the
# docker.io/library/debian:12-slim base it uses elsewhere, from a Debian mirror instead.
#
# Idempotent: returns at once when IMAGE already exists (`podman image rm IMAGE` to rebuild).
# The mirror is the first bookworm source in /etc/apt/sources.list{,.d/*.list,.d/*.sources}, or
# MIRROR when set (e.g. MIRROR=http://deb.debian.org/debian); APT_ETC replaces /etc/apt (the
# tests of this script use it). debootstrap is installed with apt-get when
# missing; that and debootstrap itself (chroot, device nodes) need root, so it refuses otherwise.
set -euo pipefail

IMAGE="${1:-localhost/hpctrain-base:bookworm}"
SUITE=bookworm
APT_ETC="${APT_ETC:-/etc/apt}"

say() { echo "make-base-image: $*"; }
die() { echo "make-base-image: $1" >&2; echo "make-base-image: HINT: $2" >&2; exit 1; }

command -v podman >/dev/null 2>&1 \
    || die "podman is not installed" "apt-get install podman (Debian), then rerun"
if podman image exists "$IMAGE"; then
    say "$IMAGE already exists, nothing to do"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    die "not root: debootstrap chroots and creates device nodes, which needs root" \
        "run 'sudo scripts/make-base-image.sh' once (or 'sudo make container-test')"
fi

# The first mirror that serves bookworm, in one-line (sources.list) or deb822 (.sources) form.
find_mirror() {
    local f
    for f in "$APT_ETC/sources.list" "$APT_ETC/sources.list.d/"*.list; do
        [ -r "$f" ] || continue
        awk -v s="$SUITE" '$1 == "deb" && $0 ~ " "s" " {
            for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; exit } }' "$f"
    done
    for f in "$APT_ETC/sources.list.d/"*.sources; do
        [ -r "$f" ] || continue
        # One stanza per paragraph: the URIs of the first binary (deb) one whose Suites name
        # bookworm itself (not bookworm-security).
        awk -v s="$SUITE" 'BEGIN { RS = "" }
            { uris = ""; deb = 0; suite = 0
              n = split($0, lines, "\n")
              for (i = 1; i <= n; i++) {
                  if (lines[i] ~ /^URIs:/) { split(lines[i], w, " "); uris = w[2] }
                  if (lines[i] ~ /^Types:/ && (lines[i] " ") ~ / deb /) deb = 1
                  if (lines[i] ~ /^Suites:/ && (lines[i] " ") ~ (" " s " ")) suite = 1 }
              if (deb && suite && uris != "") { print uris; exit } }' "$f"
    done
}
MIRROR="${MIRROR:-$(find_mirror | head -n 1)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

if ! command -v debootstrap >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 \
        || die "debootstrap is missing and there is no apt-get to install it" \
               "install debootstrap with this system's package manager, then rerun"
    say "installing debootstrap (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "'apt-get update' failed (offline, or no mirror reachable)" \
        "give this machine access to a Debian mirror, then rerun"
    apt-get install -y -q --no-install-recommends debootstrap \
        || die "'apt-get install debootstrap' failed" "install debootstrap by hand, then rerun"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/hpctrain-base.XXXXXX")"
# Only this script's own scratch folder: the image is in podman's store once imported.
trap 'rm -rf -- "$WORK"' EXIT
ROOTFS="$WORK/rootfs"

say "debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes: ~100 packages)"
debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -n 20 "$WORK/debootstrap.log" >&2
    die "debootstrap failed (its log above)" "check that $MIRROR serves $SUITE (or set MIRROR=)"
}
# Same trimming as the slim images: no downloaded .debs, no package lists (the Containerfile's
# apt-get update fetches fresh ones).
rm -rf -- "$ROOTFS/var/cache/apt/archives/"*.deb "$ROOTFS/var/lib/apt/lists/"*

say "podman import $IMAGE ($(du -sh "$ROOTFS" | cut -f1) root filesystem)"
# An imported tarball has no config: give it the PATH and command a Debian image has.
tar --numeric-owner -C "$ROOTFS" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$IMAGE" >/dev/null
say "done: $IMAGE"
