#!/usr/bin/env python3
"""Where a training step's time goes, per model and mode.

usage: scripts/step_breakdown.py [--models mlp,cnn,mlp:128,gpt]
                                 [--devices eager,lazy] [--steps N]
                                 [--threads 2|1] [--bin PATH]

Runs `stagecraft train --model M --device D --steps N --profile FILE` for
each model (`name:batch` sets the batch size: `mlp:128` is B5's MLP step;
`gpt` is a stack of transformer blocks) and device, then splits the mean
step (the CLI's `step` events, warm-up steps and the first lazy compile
left out) into wall time on the critical path (on two threads kernels
overlap; each column counts the time at least one of its kernels ran):

- matmul/conv: kernels of MatMul, Conv2d and their gradient ops (the
  bound no staging can beat), counted wherever they run: op by op, or in a
  compiled trace, fused with an epilogue or not (a fused epilogue's time
  counts here, so lazy's column can exceed eager's);
- other kernels: elementwise, reductions, softmax, optimizer updates, while
  no matmul/conv kernel runs;
- compile: lazy traces built (a miss) during the counted steps, while no
  kernel runs;
- runtime: the rest of the step, i.e. dispatch (eager) or recording plus
  collecting, looking up and launching the trace (lazy), and allocation
  and host sync outside kernels.

Profiling adds a timed event per kernel, so steps run a little slower than
without it; compare modes within one run of this script. `--threads 1`
pins the run to core 0 with one rayon thread. The header names the host.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from peers import host_line  # noqa: E402

# Steps left out at the start: the first ones compile the lazy trace and
# warm the buffer pools.
WARM_UP = 5
MATMUL_WORDS = ("MatMul", "Conv2d", "Gemm", "BatchMatMul")


def is_matmul(name):
    return any(w in name for w in MATMUL_WORDS)


def union_length(intervals):
    """Total time covered by (start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def breakdown(events):
    """Mean ms per counted step: (step, matmul/conv, other kernels, compile).

    Time is wall time on the critical path, not summed kernel time: on two
    threads kernels overlap, so each column is the time during which at
    least one such kernel ran. Matmul/conv is the time some matmul or
    convolution kernel ran; other kernels, the time some other kernel ran
    and no matmul/conv did; compile, the time a trace was being built and
    no kernel ran. The columns and the runtime rest add up to the step.
    """
    steps = sorted((e for e in events if e.get("cat") == "step" and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    counted = steps[WARM_UP:]
    if not counted:
        raise SystemExit("the run had too few steps to count; raise --steps")
    totals = [0.0, 0.0, 0.0, 0.0]
    kernels = [e for e in events if e.get("cat") in ("op", "kernel") and e.get("ph") == "X"]
    compiles = [e for e in events if e.get("cat") == "compile" and e.get("ph") == "X"]
    for step in counted:
        lo, hi = step["ts"], step["ts"] + step["dur"]

        def span(e):
            return (max(e["ts"], lo), min(e["ts"] + e["dur"], hi))

        inside = [e for e in kernels if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        matmul = [span(e) for e in inside if is_matmul(e["name"])]
        every_kernel = [span(e) for e in inside]
        building = [span(e) for e in compiles if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        mm = union_length(matmul)
        busy = union_length(every_kernel)
        totals[0] += step["dur"]
        totals[1] += mm
        totals[2] += busy - mm
        totals[3] += union_length(every_kernel + building) - busy
    n = len(counted)
    return [t / n / 1e3 for t in totals], n


def run(binary, spec, device, steps, threads):
    """Trains `spec` (a model name, or `name:batch` for another batch size)."""
    model, _, batch = spec.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        cmd = [binary, "train", "--model", model, "--device", device,
               "--steps", str(steps), "--profile", profile]
        if batch:
            cmd += ["--batch-size", batch]
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads), STAGECRAFT_QUIET="1")
        if threads == 1:
            cmd = ["taskset", "-c", "0"] + cmd
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(profile) as f:
            return json.load(f)["traceEvents"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--devices", default="eager,lazy")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "stagecraft"))
    a = ap.parse_args()
    print(host_line() + f", {a.threads} thread(s)" + (" pinned to core 0" if a.threads == 1 else ""))
    print()
    print("| model | mode | step, ms | matmul/conv | other kernels | compile | runtime (rest) | steps |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for model in a.models.split(","):
        for device in a.devices.split(","):
            (step, mm, other, compile_ms), n = breakdown(run(a.bin, model, device, a.steps, a.threads))
            rest = step - mm - other - compile_ms
            rows[(model, device)] = (step, mm, other, rest)
            print(f"| {model} | {device} | {step:.3f} | {mm:.3f} | {other:.3f} | {compile_ms:.3f} "
                  f"| {rest:.3f} | {n} |")
    print()
    for model in a.models.split(","):
        if (model, "eager") in rows and (model, "lazy") in rows:
            e, z = rows[(model, "eager")], rows[(model, "lazy")]
            print(f"{model}: lazy step / eager step = {z[0] / e[0]:.2f}; "
                  f"lazy / eager outside matmul/conv = {(z[0] - z[1]) / (e[0] - e[1]):.2f}; "
                  f"lazy step / its matmul/conv time = {z[0] / z[1]:.2f}")


if __name__ == "__main__":
    main()
