#!/usr/bin/env bash
# Runs the core benchmarks twice: on both cores, and pinned to one core with
# one rayon thread, so a busy neighbour on the second core is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
# Usage: scripts/bench.sh [core|staging|dispatch] [criterion filter]
bench="${1:-core}"
filter="${2:-}"
# Every figure names its host: CPU model, cores, the widest vector set the
# kernels can use here, and the date.
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
if grep -qw avx512f /proc/cpuinfo; then isa=AVX-512; elif grep -qw avx2 /proc/cpuinfo; then isa=AVX2; else isa="no AVX2"; fi
echo "host: ${model:-unknown CPU}, $(nproc) cores, kernels' vector set: $isa, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "== 2 threads =="
RAYON_NUM_THREADS=2 cargo bench -p stagecraft --bench "$bench" -- $filter
echo "== 1 thread, pinned to core 0 =="
RAYON_NUM_THREADS=1 taskset -c 0 cargo bench -p stagecraft --bench "$bench" -- $filter
