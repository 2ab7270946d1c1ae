#!/usr/bin/env bash
# The GPU tests' driver: Mesa's software Vulkan driver (lavapipe), so that
# `gpu:0` exists on a machine without a GPU. A machine with a GPU and its
# vendor's Vulkan driver needs nothing from here (wgpu lists real GPUs
# first). Installs the Debian packages when missing (as root), else says
# how.
set -euo pipefail

missing=()
for pkg in mesa-vulkan-drivers libvulkan1; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" -ne 0 ]; then
        echo "scripts/gpu-driver.sh: ${missing[*]} missing; install them as root:" >&2
        echo "  apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi
