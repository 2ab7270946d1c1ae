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
# Usage: scripts/miri.sh   (installs its pinned nightly toolchain, with
# the miri and rust-src components, side by side with any other toolchain
# when it is missing; `stable` and an existing `nightly` are never
# touched. STAGECRAFT_MIRI_TOOLCHAIN names another toolchain to use. CI
# may cache ~/.rustup and target/miri).
set -euo pipefail
cd "$(dirname "$0")/.."

# The nightly this suite was last checked with, pinned by date so that a
# new nightly's Miri cannot change what passes.
toolchain="${STAGECRAFT_MIRI_TOOLCHAIN:-nightly-2026-10-30}"
if ! cargo "+$toolchain" miri --version >/dev/null 2>&1; then
    echo "scripts/miri.sh: installing the $toolchain toolchain with miri (side by side; stable and nightly are left alone)" >&2
    if ! rustup toolchain install "$toolchain" --profile minimal \
        --component miri --component rust-src >/tmp/stagecraft-miri-install.log 2>&1; then
        echo "scripts/miri.sh: cannot install the $toolchain toolchain (offline? see /tmp/stagecraft-miri-install.log); install it with \`rustup toolchain install $toolchain --component miri --component rust-src\` or name an installed nightly with miri in STAGECRAFT_MIRI_TOOLCHAIN" >&2
        exit 1
    fi
fi
# Prepares Miri's sysroot once (quietly); later runs reuse it.
cargo "+$toolchain" miri setup >/dev/null

# Miri reports leaks and undefined behaviour as failures. Thread-local
# caches and the process-lifetime device records are reachable from
# statics, so no leak suppression is needed.
export MIRIFLAGS="${MIRIFLAGS:-}"

cargo "+$toolchain" miri test -p stagecraft-tensor --lib --test buffers_across_threads -- buffer:: host:: dtype:: cross_threads
cargo "+$toolchain" miri test -p stagecraft-runtime --lib -- async_value:: handle::
# The kernel tests compare results bit for bit, NaN payloads included;
# Miri otherwise picks NaN signs and payloads and the last bits of
# transcendental functions at random, per operation.
MIRIFLAGS="$MIRIFLAGS -Zmiri-deterministic-floats" \
cargo "+$toolchain" miri test -p stagecraft-cpu --lib -- \
    kernels::fused::tests:: kernels::fused::chain::tests:: \
    kernels::reduce::tests::empty_and_nan_reductions \
    kernels::reduce::tests::kernels_resolve_axes_per_call \
    kernels::reduce::tests::arg_reductions_match_the_reference \
    kernels::reduce::tests::softmax_ \
    kernels::shape::tests::transpose_ kernels::shape::tests::permutations_reduce
