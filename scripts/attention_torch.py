"""PyTorch's side of the fused-attention benchmark (`cargo bench -p
stagecraft --bench attention`): `scaled_dot_product_attention` forward and
backward at batch 4, 8 heads, 1,024 positions, head size 64, causal, f32,
for a given output gradient. Prints one JSON line per row with the median
of the timed repetitions in milliseconds.

Threads: PEERS_THREADS (default 2); pin with `taskset -c 0` for one.
Run with a Python that has torch, e.g. the peers' venv:
  /tmp/peers-venv/bin/python scripts/attention_torch.py
"""
import json
import os
import statistics
import time

threads = int(os.environ.get("PEERS_THREADS", "2"))
os.environ.setdefault("OMP_NUM_THREADS", str(threads))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(threads)
torch.manual_seed(0)
B, H, T, D = 4, 8, 1024, 64
q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
g = torch.randn(B, H, T, D)


def fwd():
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fwd_bwd():
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)


for name, fn in [("fwd", fwd), ("fwd+bwd", fwd_bwd)]:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    print(json.dumps(dict(fw="torch", torch=torch.__version__, bench="attention", row=name,
                          threads=threads, ms=round(statistics.median(samples), 3),
                          samples=[round(s, 3) for s in samples])), flush=True)
