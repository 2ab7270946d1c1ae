"""PyTorch CUDA beside stagecraft's GPU rows (B3, B4, B5, B7) on the same machine.

stagecraft's side: `cargo bench -p stagecraft --features wgpu --bench gpu` (B3-B5) and
`STAGECRAFT_BENCH_GPU=1 cargo bench -p stagecraft-cli --features wgpu --bench gpt_step` (B7).
The programs are the peers' (`../shared/peers/README.md`), on `cuda:0`, in f32 with PyTorch's
default matmul precision (full f32, no TF32), as stagecraft's WGSL kernels compute. Every timed
call ends with `torch.cuda.synchronize()` or a value read on the host, so a time is the GPU's
work done, not only queued.

Prints one JSON object per line: bench, variant, median of the samples, unit, samples.
  BENCH_ONLY=B3,B7     restrict the benchmarks (also: overheads)
  BENCH_NO_COMPILE=1   skip the torch.compile rows (their first call compiles for tens of seconds)
  BENCH_DEVICE=cpu     run the same programs on the CPU (to try the script on a machine without a GPU)
"""
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device(os.environ.get("BENCH_DEVICE", "cuda:0"))


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)
COMPILE = os.environ.get("BENCH_NO_COMPILE") != "1"


def want(name):
    only = os.environ.get("BENCH_ONLY")
    return not only or name in only.split(",")


def timed(fn, reps, warmup=3):
    """Seconds per call of fn, each call ending with the GPU idle."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def emit(bench, variant, seconds, unit="ms", per=None, **extra):
    if per is None:
        samples = [s * 1e3 for s in seconds]
    else:
        samples = [per / s for s in seconds]
    print(json.dumps(dict(fw="torch-cuda", bench=bench, variant=variant, value=statistics.median(samples),
                          unit=unit, samples=[round(x, 6) for x in samples], extra=extra)), flush=True)


gpu = torch.cuda.get_device_properties(DEV).name if DEV.type == "cuda" else "none"
print(json.dumps(dict(fw="torch-cuda", bench="meta", torch=torch.__version__, device=str(DEV), gpu=gpu,
                      tf32=torch.backends.cuda.matmul.allow_tf32)), flush=True)


def b3_chain(x):
    t = x * 2
    t = t + 1
    t = t * x
    t = t - 3
    t = torch.relu(t)
    t = t * 0.5
    t = t + x
    return t * t


if want("overheads"):
    # The fixed costs under every row: waiting for an idle GPU, one tiny kernel.
    emit("overheads", "synchronize_idle", timed(sync, 200))
    small = torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEV)
    emit("overheads", "add_4_elements", timed(lambda: small + small, 200))

if want("B3"):
    n = 16 * 1024 * 1024
    x = torch.full((n,), 0.5, device=DEV)
    fused_bytes = 2 * n * 4
    emit("B3", "eager", timed(lambda: b3_chain(x), 30), "GB/s", per=fused_bytes / 1e9)
    emit("B3", "one_elementwise_kernel", timed(lambda: x * 2, 30), "GB/s", per=fused_bytes / 1e9)
    if COMPILE:
        chain = torch.compile(b3_chain)
        t0 = time.perf_counter()
        chain(x)
        sync()
        emit("B3", "torch.compile", timed(lambda: chain(x), 30), "GB/s", per=fused_bytes / 1e9,
             first_call_s=round(time.perf_counter() - t0, 2))

if want("B4"):
    torch.manual_seed(0)
    for n in (256, 1024):
        a = torch.rand(n, n, device=DEV) * 2 - 1
        b = torch.rand(n, n, device=DEV) * 2 - 1
        emit("B4", f"matmul_{n}", timed(lambda: a @ b, 50), "GFLOP/s", per=2 * n ** 3 / 1e9)


def mlp_step_fn(model, opt, xb, yb):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        return loss.item()
    return step


if want("B5"):
    def make_mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10)).to(DEV)
    xb = torch.rand(128, 784, device=DEV)
    yb = torch.randint(0, 10, (128,), device=DEV)
    model = make_mlp()
    emit("B5", "eager", timed(mlp_step_fn(model, torch.optim.SGD(model.parameters(), lr=0.01), xb, yb), 100))
    if COMPILE:
        model = make_mlp()
        step = mlp_step_fn(torch.compile(model), torch.optim.SGD(model.parameters(), lr=0.01), xb, yb)
        t0 = time.perf_counter()
        step()
        emit("B5", "torch.compile(model)", timed(step, 100), first_call_s=round(time.perf_counter() - t0, 2))

# B7: nanoGPT's CPU settings, the architecture of the peers' bench_gpt_torch.py.
CFG = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=12, vocab=84)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln2 = nn.LayerNorm(width, bias=False)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.fc2 = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        heads = (p.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                 for p in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        w = CFG["n_embd"]
        self.tokens = nn.Embedding(CFG["vocab"], w)
        self.positions = nn.Embedding(CFG["block_size"], w)
        self.blocks = nn.ModuleList(Block(w, CFG["n_head"]) for _ in range(CFG["n_layer"]))
        self.ln_f = nn.LayerNorm(w, bias=False)
        self.head = nn.Linear(w, CFG["vocab"], bias=False)
        self.head.weight = self.tokens.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                small = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * CFG["n_layer"]) if small else 0.02)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def token_stream(n=200_000):
    """The stream gpt_step.rs draws its batches from (the same LCG)."""
    state, out = 0x5EED, []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((state >> 33) % CFG["vocab"])
    return torch.tensor(out, dtype=torch.long)


if want("B7"):
    stream = token_stream()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        ix = torch.randint(len(stream) - CFG["block_size"] - 1, (CFG["batch"],), generator=g)
        x = torch.stack([stream[i:i + CFG["block_size"]] for i in ix]).to(DEV)
        y = torch.stack([stream[i + 1:i + 1 + CFG["block_size"]] for i in ix]).to(DEV)
        batches.append((x, y))
    for variant, compiled in [("eager", False)] + ([("torch.compile", True)] if COMPILE else []):
        torch.manual_seed(1337)
        model = Gpt().to(DEV)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.99))
        forward = torch.compile(model) if compiled else model
        k = [0]

        def step():
            x, y = batches[k[0] % 8]
            k[0] += 1
            loss = forward(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss.item()
        t0 = time.perf_counter()
        step()
        emit("B7", variant, timed(step, 50, warmup=5), first_step_s=round(time.perf_counter() - t0, 2))
