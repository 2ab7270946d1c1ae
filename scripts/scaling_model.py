"""Data-parallel scaling from measured figures (scripts/scaling.sh).

Reads rows `model device per_rank_batch ms_1rank ms_2ranks parameters` on
stdin and the allreduce bench's table as argv[1]. Prints the measured
scaling, fits the alpha-beta model of a ring all-reduce to the plain
rsmpi row's latency (4 KiB, taken as all latency) and bandwidth (64 MiB)
on 2 processes,
T(n, p) = 2 (p - 1) alpha + 2 (p - 1) / p * n * beta, and predicts the
scaling efficiency at 8, 64 and 256 processes, with no overlap and with
the reduction hidden behind backward (about 2/3 of a step's compute).
"""
import sys

sizes = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
rsmpi = {}
for line in sys.argv[1].splitlines():
    parts = line.split()
    if len(parts) >= 3 and f"{parts[0]} {parts[1]}" in sizes:
        rsmpi[sizes[f"{parts[0]} {parts[1]}"]] = float(parts[2]) * 1e9
small, large = 4 << 10, 64 << 20
t_small, t_large = small / rsmpi[small], large / rsmpi[large]
# A 4 KiB message travels eagerly, from cache, faster per byte than the
# 64 MiB one: a straight line through both can give a negative alpha. So
# the 4 KiB time is taken as all latency (an upper bound on alpha: the
# predictions err towards pessimism) and beta as what remains of the
# 64 MiB time.
alpha = t_small / 2
beta = (t_large - 2 * alpha) / large
print(f"alpha-beta fit (2 processes, shared memory): alpha = {alpha * 1e6:.2f} us, "
      f"1/beta = {1 / beta / 1e9:.2f} GB/s")


def allreduce(n, p, alpha, beta):
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


print(f"{'model':5} {'device':6} {'1x1 samples/s':>14} {'2x1 samples/s':>14} {'scaling':>8}"
      f" {'grad MB':>8} {'compute ms':>10}  efficiency at p = 8 / 64 / 256 (no overlap | overlap)")
for row in sys.stdin:
    model, device, per, one, two, params = row.split()
    per, one, two, params = int(per), float(one), float(two), int(params)
    s1, s2 = per / one * 1e3, 2 * per / two * 1e3
    grad = params * 4
    compute = one / 1e3
    effs = []
    for p in (8, 64, 256):
        comm = allreduce(grad, p, alpha, beta)
        plain = compute / (compute + comm)
        hidden = compute / (compute + max(0.0, comm - 2 / 3 * compute))
        effs.append(f"{plain:.2f}|{hidden:.2f}")
    print(f"{model:5} {device:6} {s1:14.0f} {s2:14.0f} {s2 / s1:7.2f}x {grad / 1e6:8.2f} "
          f"{one:10.3f}  {' / '.join(effs)}")
