#!/usr/bin/env python3
"""Where a training step's time goes, per model and mode.

usage: scripts/step_breakdown.py [--models mlp,cnn] [--devices eager,lazy]
                                 [--steps N] [--threads 2|1] [--bin PATH]

Runs `stagecraft train --model M --device D --steps N --profile FILE` for
each model and device, then splits the mean step (the CLI's `step` events,
warm-up steps and the first lazy compile left out) into:

- matmul/conv: kernels of MatMul, Conv2d and their gradient ops (the
  bound no staging can beat), counted wherever they run: op by op, or in a
  compiled trace, fused with an epilogue or not;
- other kernels: elementwise, reductions, softmax, optimizer updates;
- compile: lazy traces built (a miss) during the counted steps;
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


def breakdown(events):
    """Mean ms per counted step: (step, matmul/conv, other kernels, compile)."""
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
        inside = lambda e: lo <= e["ts"] < hi  # noqa: E731
        totals[0] += step["dur"]
        for e in kernels:
            if inside(e):
                totals[1 if is_matmul(e["name"]) else 2] += e["dur"]
        totals[3] += sum(e["dur"] for e in compiles if inside(e))
    n = len(counted)
    return [t / n / 1e3 for t in totals], n


def run(binary, model, device, steps, threads):
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        cmd = [binary, "train", "--model", model, "--device", device,
               "--steps", str(steps), "--profile", profile]
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
