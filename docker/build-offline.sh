#!/usr/bin/env bash
# Build the swarmd image where no container registry can be reached: the base image from Debian's packages
# (debootstrap + docker import), the Python packages from a wheelhouse made here (pip download; sdists built into
# wheels here), nothing pulled by the build itself.
#
#   docker/build-offline.sh [image tag, default swarmd:latest]
#
# Needs root, a running dockerd, debootstrap and a Debian mirror (SWARMD_DEBIAN_MIRROR, default deb.debian.org).
# SWARMD_BUILD_CPU_SHARES: the build's CPU weight against other work on this host (docker build --cpu-shares;
# default 1024, as any container; the test suite builds at 2, beside its timed tests).
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-swarmd:latest}"
BASE="${SWARMD_BASE_IMAGE:-swarmd-base:bookworm}"
MIRROR="${SWARMD_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PY="${PYTHON:-python3}"

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "building the base image $BASE from Debian's packages (debootstrap) ..." >&2
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates,libgmp10 \
        bookworm "$rootfs" "$MIRROR" >&2
    tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
fi

fill_wheelhouse() {
    echo "filling docker/wheelhouse ..." >&2
    rm -f docker/wheelhouse/.filled
    # our own package's metadata is built with the setuptools at hand when there is one (an isolated build env
    # costs ~20 s per run)
    if "$PY" -c "import setuptools" 2>/dev/null; then isolation=--no-build-isolation; else isolation=; fi
    "$PY" -m pip download -q $isolation . -d docker/wheelhouse
    # packages published only as source: built into wheels here, so the image needs no compiler (a wheel built
    # before is kept). All in one pip run, with the setuptools at hand where there is one (one isolated run per
    # sdist took ~60 s for the 7 of them; this ~16 s), else isolated.
    local todo=() sdist name built
    for sdist in docker/wheelhouse/*.tar.gz; do
        [ -e "$sdist" ] || continue
        name="$(basename "$sdist" .tar.gz)"  # python-baseconv-1.2.2 -> python_baseconv-1.2.2-*.whl
        built="docker/wheelhouse/$(echo "${name%-*}" | tr '.-' '__')-${name##*-}-"
        if compgen -G "${built}*.whl" >/dev/null; then rm -f "$sdist"; else todo+=("$sdist"); fi
    done
    if [ ${#todo[@]} -gt 0 ]; then
        "$PY" -m pip wheel -q --no-deps $isolation -w docker/wheelhouse "${todo[@]}" ||
            { [ -n "$isolation" ] && "$PY" -m pip wheel -q --no-deps -w docker/wheelhouse "${todo[@]}"; }
        rm -f "${todo[@]}"
    fi
}

mkdir -p docker/wheelhouse
# The wheelhouse holds the dependencies only (swarmd itself is installed from the copied sources), so it is refilled
# only when pyproject.toml (the pinned dependencies) or the Python that fills it changed: resolving the ~140
# packages against the index took ~70 s of CPU on every build, even with every wheel at hand. One build at a time
# fills it (a second waits for the first, then finds it filled).
exec 9>docker/wheelhouse/.lock
flock 9
stamp="$( (cat pyproject.toml; "$PY" -V) | sha256sum | cut -d' ' -f1)"
if [ "$(cat docker/wheelhouse/.filled 2>/dev/null)" = "$stamp" ]; then
    echo "docker/wheelhouse is already filled for this pyproject.toml" >&2
else
    fill_wheelhouse
    echo "$stamp" > docker/wheelhouse/.filled
fi
exec 9>&-

echo "building $TAG from $BASE ..." >&2
previous="$(docker image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)"
DOCKER_BUILDKIT=0 docker build -q -f docker/Dockerfile --build-arg BASE="$BASE" \
    ${SWARMD_BUILD_CPU_SHARES:+--cpu-shares "$SWARMD_BUILD_CPU_SHARES"} -t "$TAG" . >&2
# the image this tag named before is untagged by the build: removed, or every rebuild would leave ~2 GB behind
# (kept where a container still uses it)
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$TAG")" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
echo "$TAG"
