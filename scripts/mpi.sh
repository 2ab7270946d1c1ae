#!/usr/bin/env bash
# Distributed stagecraft on MPI, its tests alone (the test command runs
# them with the rest): installs what a fresh machine lacks
# (scripts/system-packages.sh), then builds the `mpi` feature and runs its
# tests under mpirun:
# collectives, their gradients, lazy and staged collectives, bucketed
# data-parallel gradients, a mismatch, a hung rank, a dead rank and Ctrl-C
# (crates/stagecraft/tests/mpi.rs), and `stagecraft train --distributed`
# against one process (crates/stagecraft-cli/tests/cli.rs).
#
# A plain `cargo build` needs none of this: MPI is behind the feature.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/system-packages.sh

# Open MPI refuses to run as root without these; 2 cores need oversubscribing
# (the tests pass --oversubscribe themselves).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The test command's features, so the crates it built are reused.
cargo test -p stagecraft --features mpi,wgpu --test mpi
cargo test -p stagecraft-cli --features mpi,wgpu --test cli distributed
