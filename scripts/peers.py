#!/usr/bin/env python3
"""Print stagecraft against the peers (numpy, PyTorch, TensorFlow, JAX, candle,
burn) on the shared benchmarks B1-B6, 2 threads and 1 thread pinned.

usage: scripts/peers.py [--rerun-peers] [--rounds N] [--skip-bench]

- stagecraft: runs `cargo bench -p stagecraft` (benches `core` and `staging`)
  twice, with RAYON_NUM_THREADS=2 and pinned to core 0 with one thread, and
  reads criterion's medians after each run (criterion keeps only the last
  run's estimates). `--skip-bench` reads whatever the last run left, as 2t.
- peers: reads ../shared/peers/results/summary.md, or with --rerun-peers
  reruns ../shared/peers/run_all.py (which needs the peers installed, see its
  README) into a fresh file and summarizes that.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.normpath(os.path.join(ROOT, "..", "shared", "peers"))
CRITERION = os.path.join(ROOT, "target", "criterion")

# (row label, criterion id, how to turn the median in ns into the row's unit)
OURS = [
    ("B1 add [4], µs/op", "B1_tiny_add/stagecraft_eager", lambda ns: ns / 1e3),
    ("B2 steady call, 1000-op chain, µs", "function/steady_call_1000_op_chain", lambda ns: ns / 1e3),
    ("B2 first call, fresh 1000-op chain, ms", "lazy_1000_op_trace/first_compile_fresh_chain", lambda ns: ns / 1e6),
    ("B3 8-op chain 16M, ms (lazy, fused)", "B3_chain_16M/stagecraft_lazy", lambda ns: ns / 1e6),
    ("B3 8-op chain 16M, ms (eager)", "B3_chain_16M/stagecraft_eager", lambda ns: ns / 1e6),
    ("B4 matmul 256, GFLOP/s", "B4_matmul_f32/stagecraft/256", lambda ns: 2 * 256**3 / ns),
    ("B4 matmul 1024, GFLOP/s", "B4_matmul_f32/stagecraft/1024", lambda ns: 2 * 1024**3 / ns),
    ("B5 MLP step, ms (lazy)", "mlp_autodiff_784_256_256_10_b128/lazy", lambda ns: ns / 1e6),
    ("B5 MLP step, ms (eager)", "mlp_autodiff_784_256_256_10_b128/eager", lambda ns: ns / 1e6),
    ("B6 while loop, µs (staged)", "function/while_loop_staged", lambda ns: ns / 1e3),
]

# The peer rows each of our rows is compared with: (bench, metric, variant
# filter or None, unit scale to our unit), lower is better unless GFLOP/s.
PEER_ROWS = {
    "B1": ("B1", "per_op", None, 1.0),
    "B2 steady": ("B2", "per_call", "chain1000_steady_call", 1.0),
    "B2 first": ("B2", "time", "chain1000_first_call", 1e3),
    "B3": ("B3", "time", None, 1.0),
    "B4 matmul 256": ("B4", "gflops", "matmul_256", 1.0),
    "B4 matmul 1024": ("B4", "gflops", "matmul_1024", 1.0),
    "B5": ("B5", "per_step", None, 1.0),
    "B6": ("B6", "per_loop", None, 1.0),
}


def peer_key(label):
    for key in sorted(PEER_ROWS, key=len, reverse=True):
        if label.startswith(key):
            return key
    return None


def read_ours():
    found = {}
    for _, bench_id, convert in OURS:
        path = os.path.join(CRITERION, *bench_id.split("/"), "new", "estimates.json")
        try:
            with open(path) as f:
                found[bench_id] = convert(json.load(f)["median"]["point_estimate"])
        except (OSError, KeyError, ValueError):
            pass
    return found


def run_benches(threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    pin = ["taskset", "-c", "0"] if threads == 1 else []
    for bench in ["core", "staging"]:
        cmd = pin + ["cargo", "bench", "-p", "stagecraft", "--bench", bench]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_ours()


def read_peer_summary(path):
    rows = []
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 7 or not cells[0].startswith("B"):
                continue
            bench, fw, variant, metric, threads, median, unit = cells[:7]
            try:
                rows.append((bench, fw, variant, metric, int(threads), float(median), unit))
            except ValueError:
                continue
    return rows


def rerun_peers(rounds):
    raw = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    subprocess.run([sys.executable, os.path.join(PEERS, "run_all.py"), "--rounds", str(rounds), "--out", raw],
                   cwd=PEERS, check=True)
    out = subprocess.run([sys.executable, os.path.join(PEERS, "summarize.py"), raw],
                         cwd=PEERS, check=True, capture_output=True, text=True).stdout
    summary = raw.replace(".jsonl", ".md")
    with open(summary, "w") as f:
        f.write(out)
    return summary


def best_peer(rows, key, threads):
    bench, metric, variant, scale = PEER_ROWS[key]
    higher_is_better = metric == "gflops"
    candidates = [r for r in rows if r[0] == bench and r[3] == metric and r[4] == threads
                  and (variant is None or variant in r[2])]
    if bench == "B3":  # the chain itself, not the memory-bandwidth probes
        candidates = [r for r in candidates if not any(s in r[2] for s in ("memcpy", "fill", "x*2", "read_"))]
    if not candidates:
        return None
    pick = (max if higher_is_better else min)(candidates, key=lambda r: r[5])
    return pick[5] * scale, f"{pick[1]} {pick[2]}"


def fmt(v):
    if v is None:
        return "–"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def host_line():
    """The host the figures come from: CPU model, cores, vector set, date."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    # STAGECRAFT_CPU_ISA lowers the kernels' level (crates/stagecraft-cpu/src/isa.rs).
    cap = os.environ.get("STAGECRAFT_CPU_ISA", "").strip().lower()
    if cap in ("avx2",) and isa == "AVX-512":
        isa = "AVX2 (forced by STAGECRAFT_CPU_ISA on an AVX-512 CPU)"
    elif cap in ("baseline", "sse2", "none") and isa != "no AVX2":
        isa = f"baseline (forced by STAGECRAFT_CPU_ISA on an {isa} CPU)"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"host: {model}, {os.cpu_count()} cores, kernels' vector set: {isa}, {date}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rerun-peers", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    summary = rerun_peers(a.rounds) if a.rerun_peers else os.path.join(PEERS, "results", "summary.md")
    peers = read_peer_summary(summary)
    if a.skip_bench:
        ours = {2: read_ours(), 1: {}}
    else:
        ours = {2: run_benches(2), 1: run_benches(1)}
    print(host_line() + "\n")
    print("| benchmark | stagecraft 2t (1t) | best peer 2t (1t) | which | stagecraft ÷ best, 2t |")
    print("|---|---|---|---|---|")
    for label, bench_id, _ in OURS:
        key = peer_key(label)
        two, one = ours[2].get(bench_id), ours[1].get(bench_id)
        p2 = best_peer(peers, key, 2) if key else None
        p1 = best_peer(peers, key, 1) if key else None
        ratio = "–"
        if two is not None and p2 is not None:
            ratio = f"{two / p2[0]:.2f}"
        print(f"| {label} | {fmt(two)} ({fmt(one)}) | {fmt(p2[0] if p2 else None)} ({fmt(p1[0] if p1 else None)}) "
              f"| {p2[1] if p2 else '–'} | {ratio} |")
    print(f"\npeers: {summary}; for GFLOP/s higher is better, for times lower is better.")


if __name__ == "__main__":
    main()
