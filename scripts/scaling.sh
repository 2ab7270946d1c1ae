#!/usr/bin/env bash
# Data-parallel scaling, side by side in one run: samples per second of
# `stagecraft train` on 1 process × 1 thread (pinned to core 0) against
# 2 processes × 1 thread each (one per core, `mpirun --bind-to core`),
# with the same batch per process, so the 2-process run's global batch
# is twice as large. Then the all-reduce bandwidth bench, whose latency
# and bandwidth docs/scaling.md fits its alpha-beta model to.
#
# Usage: scripts/scaling.sh [steps]   (needs scripts/mpi.sh's packages;
# uses data/mnist, fetched on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-300}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release -p stagecraft-cli --features mpi
bin=target/release/stagecraft
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(date -u +%F)"
ms_per_step() { python3 -c 'import json,sys; print(json.load(sys.stdin)["ms_per_step"])'; }
for model in mlp cnn; do
    for device in lazy eager; do
        per=32
        one=$(RAYON_NUM_THREADS=1 taskset -c 0 $bin train --model $model --device $device \
            --batch-size $per --steps "$steps" --compare-steps 0 --json | ms_per_step)
        two=$(RAYON_NUM_THREADS=1 mpirun --oversubscribe --bind-to core -np 2 $bin train \
            --distributed --model $model --device $device --batch-size $((2 * per)) \
            --steps "$steps" --compare-steps 0 --json | ms_per_step)
        python3 - "$model" "$device" "$per" "$one" "$two" <<'PY'
import sys
model, device, per, one, two = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
s1, s2 = per / one * 1e3, 2 * per / two * 1e3
print(f"{model:4} {device:5}: 1 rank x 1 thread {one:7.3f} ms/step {s1:8.0f} samples/s | "
      f"2 ranks x 1 thread {two:7.3f} ms/step {s2:8.0f} samples/s | scaling {s2 / s1:.2f}x")
PY
    done
done
cargo bench -p stagecraft --features mpi --bench allreduce
