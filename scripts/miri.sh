#!/usr/bin/env bash
# Miri over the core data structures: buffers and their pools, typed views
# of bytes (stagecraft-tensor), async values and tensor handles
# (stagecraft-runtime); and over stagecraft-cpu's kernels where they are
# not assembly: the fused interpreter and its chains, streamed copies,
# reductions and softmax, transposes. Under Miri the kernels choose the
# baseline instruction set (no vector intrinsics, no sgemm: its inner loop
# is `asm!`, which Miri cannot run), and tests that cross the parallel
# thresholds run only their small cases (`kernels::runs_in_this_build`).
# A subset of the unit tests, chosen to stay within a few minutes.
#
# Usage: scripts/miri.sh   (installs the nightly toolchain's miri component
# when it is missing; CI may cache ~/.rustup and target/miri).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    # One component per `--component` flag would also do; `component add`
    # covers a nightly that is installed without them, too.
    rustup toolchain install nightly --profile minimal
    rustup component add --toolchain nightly miri rust-src
fi
# Prepares Miri's sysroot once (quietly); later runs reuse it.
cargo +nightly miri setup >/dev/null

# Miri reports leaks and undefined behaviour as failures. Thread-local
# caches and the process-lifetime device records are reachable from
# statics, so no leak suppression is needed.
export MIRIFLAGS="${MIRIFLAGS:-}"

cargo +nightly miri test -p stagecraft-tensor --lib --test buffers_across_threads -- buffer:: host:: dtype:: cross_threads
cargo +nightly miri test -p stagecraft-runtime --lib -- async_value:: handle::
# The kernel tests compare results bit for bit, NaN payloads included;
# Miri otherwise picks NaN signs and payloads and the last bits of
# transcendental functions at random, per operation.
MIRIFLAGS="$MIRIFLAGS -Zmiri-deterministic-floats" \
cargo +nightly miri test -p stagecraft-cpu --lib -- \
    kernels::fused::tests:: kernels::fused::chain::tests:: \
    kernels::reduce::tests::empty_and_nan_reductions \
    kernels::reduce::tests::kernels_resolve_axes_per_call \
    kernels::reduce::tests::arg_reductions_match_the_reference \
    kernels::reduce::tests::softmax_ \
    kernels::shape::tests::transpose_ kernels::shape::tests::permutations_reduce
