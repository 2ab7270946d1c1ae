#!/usr/bin/env bash
# Distributed stagecraft on MPI: installs what a fresh machine lacks (Open
# MPI and libclang, which the `mpi` crate binds it with; Debian packages,
# as root), then builds the `mpi` feature and runs its tests under mpirun:
# collectives, their gradients, lazy and staged collectives, bucketed
# data-parallel gradients, a mismatch, a hung rank, a dead rank and Ctrl-C
# (crates/stagecraft/tests/mpi.rs), and `stagecraft train --distributed`
# against one process (crates/stagecraft-cli/tests/cli.rs).
#
# A plain `cargo build` needs none of this: MPI is behind the feature.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pkg in openmpi-bin libopenmpi-dev libclang-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" -ne 0 ]; then
        echo "scripts/mpi.sh: ${missing[*]} missing; install them as root:" >&2
        echo "  apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Open MPI refuses to run as root without these; 2 cores need oversubscribing
# (the tests pass --oversubscribe themselves).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# `wgpu` as in the workspace's test run, so the crates it built are reused.
cargo test -p stagecraft --features mpi,wgpu --test mpi
cargo test -p stagecraft-cli --features mpi,wgpu --test cli distributed
