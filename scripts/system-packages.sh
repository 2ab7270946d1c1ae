#!/usr/bin/env bash
# The system packages the test command needs, installed together (one
# `apt-get update`) when any is missing (Debian packages, as root; else it
# says what to run):
# - Mesa's software Vulkan driver (lavapipe), so that `gpu:0` exists on a
#   machine without a GPU. A machine with a GPU and its vendor's Vulkan
#   driver needs nothing from here: wgpu lists real GPUs first.
# - Open MPI, and libclang, which the `mpi` crate binds it with, for the
#   `mpi` feature (distributed training; `scripts/mpi.sh` runs only its
#   tests).
#
# A plain `cargo build` needs none of this: both are behind features.
set -euo pipefail

# The driver without its recommends (X and Wayland libraries a compute
# device does not use); Open MPI as Debian installs it by default.
driver=(mesa-vulkan-drivers libvulkan1)
mpi=(openmpi-bin libopenmpi-dev libclang-dev)
missing_of() {
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || echo "$pkg"
    done
}
mapfile -t missing_driver < <(missing_of "${driver[@]}")
mapfile -t missing_mpi < <(missing_of "${mpi[@]}")
missing=("${missing_driver[@]}" "${missing_mpi[@]}")
if ((${#missing[@]})); then
    if [ "$(id -u)" -ne 0 ]; then
        echo "scripts/system-packages.sh: ${missing[*]} missing; install them as root:" >&2
        echo "  apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "installing ${missing[*]}"
    apt-get update -qq
    if ((${#missing_driver[@]})); then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing_driver[@]}" >/dev/null
    fi
    if ((${#missing_mpi[@]})); then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing_mpi[@]}" >/dev/null
    fi
fi
