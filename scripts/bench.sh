#!/usr/bin/env bash
# Runs the core benchmarks twice: on both cores, and pinned to one core with
# one rayon thread, so a busy neighbour on the second core is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
# Usage: scripts/bench.sh [core|staging] [criterion filter]
bench="${1:-core}"
filter="${2:-}"
echo "== 2 threads =="
RAYON_NUM_THREADS=2 cargo bench -p stagecraft --bench "$bench" -- $filter
echo "== 1 thread, pinned to core 0 =="
RAYON_NUM_THREADS=1 taskset -c 0 cargo bench -p stagecraft --bench "$bench" -- $filter
