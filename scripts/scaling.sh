#!/usr/bin/env bash
# Data-parallel scaling, side by side in one run: samples per second of
# `stagecraft train` (MLP, CNN, GPT) on 1 process × 1 thread (pinned to core 0) against
# 2 processes × 1 thread each (one per core, `mpirun --bind-to core`),
# with the same batch per process, so the 2-process run's global batch
# is twice as large. Then the all-reduce bandwidth bench, whose latency
# and bandwidth docs/scaling.md fits its alpha-beta model to.
#
# Usage: scripts/scaling.sh [steps]   (needs scripts/mpi.sh's packages;
# uses data/mnist and data/shakespeare, fetched on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-300}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release -p stagecraft-cli --features mpi
bin=target/release/stagecraft
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(date -u +%F)"
summary() { python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["ms_per_step"], d.get("parameters", 0))'; }
rows=()
for model in mlp cnn gpt; do
    for device in lazy eager; do
        # The GPT step is nanoGPT's CPU run: 12 sequences of 64 per process.
        per=32 extra=()
        [ "$model" = gpt ] && per=12 extra=(--eval-every 0)
        read -r one params < <(RAYON_NUM_THREADS=1 taskset -c 0 $bin train --model $model \
            --device $device --batch-size $per --steps "$steps" --compare-steps 0 "${extra[@]}" \
            --json | summary)
        read -r two _ < <(RAYON_NUM_THREADS=1 mpirun --oversubscribe --bind-to core -np 2 $bin \
            train --distributed --model $model --device $device --batch-size $((2 * per)) \
            --steps "$steps" --compare-steps 0 "${extra[@]}" --json | summary)
        rows+=("$model $device $per $one $two $params")
        echo "row: ${rows[-1]}  (model device batch/process ms/step(1x1) ms/step(2x1) parameters)"
    done
done
# (Not `tee /dev/stderr`: when stderr is a file, tee's open truncates it.)
bench=$(cargo bench -p stagecraft --features mpi --bench allreduce)
printf '%s\n' "$bench"
printf '%s\n' "${rows[@]}" | python3 scripts/scaling_model.py "$bench"
