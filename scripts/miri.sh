#!/usr/bin/env bash
# Miri over the core data structures: buffers and their pools
# (stagecraft-tensor), async values and tensor handles (stagecraft-runtime).
# A subset of the unit tests, chosen to stay within a few minutes: the
# numeric kernels are far too slow under the interpreter and are covered by
# the ordinary test run.
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
