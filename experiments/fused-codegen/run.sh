#!/usr/bin/env bash
# Builds the experiment and runs the measurement three times pinned to one
# core with one rayon thread, and three times on every core, alternating,
# writing each run's output to results/.
set -euo pipefail
cd "$(dirname "$0")"
rounds="${1:-40}"
cargo build --release
mkdir -p results
for r in 1 2 3; do
    { uptime; RAYON_NUM_THREADS=1 taskset -c 0 target/release/fused-codegen "$rounds"; } \
        > "results/1-thread-run$r.txt" 2>&1
    { uptime; target/release/fused-codegen "$rounds"; } > "results/all-threads-run$r.txt" 2>&1
done
grep -h "load average" results/*.txt
python3 summarize.py
