//! B7: scaled dot-product attention at batch 4, 8 heads, 1,024 positions,
//! head size 64, causal, f32 (the shape of a small transformer's layer):
//! - `fwd`: the fused forward op (`O` and the log-sum-exp `L`);
//! - `fwd+bwd`: the forward op and its fused backward op for a given
//!   `dO` (what `out.backward(dO)` runs in PyTorch), through the runtime;
//! - `baseline_unfused_fwd`: the same forward as separate ops in the same
//!   run (`q·kᵀ` by matmul, a mask added, softmax, `·v`), which writes the
//!   `T × S` scores of every head (128 MiB here);
//! - `attention_layouts_*`: forward and backward with `[B, H, T, D]`
//!   operands beside the same values as `[B, T, H, D]` read in place (the
//!   `"bthd"` layout `nn`'s attention layers use), here and at the GPT
//!   step's shape (batch 12, 4 heads of 32, T = 64).
//!
//! Throughput counts the multiply-adds of the products the causal mask
//! leaves (half of each `T × S` product, two products forward and five
//! backward, as FlashAttention's papers count), so `Elements` read as
//! flops. Before the rows, the bench prints the memory the fused kernels
//! allocate beyond their inputs and outputs, from their block sizes, and
//! the fused ops' speed on one thread by the CPU time the thread ran
//! (Linux's `/proc/thread-self/schedstat`), a figure other processes
//! sharing the cores do not change the way they change wall-clock time.
//!
//! PyTorch's side of the comparison (same shape, same threads):
//!
//! ```text
//! import torch, time
//! torch.set_num_threads(2)
//! q, k, v = (torch.randn(4, 8, 1024, 64, requires_grad=True) for _ in range(3))
//! g = torch.randn(4, 8, 1024, 64)
//! F = torch.nn.functional.scaled_dot_product_attention
//! for _ in range(3): F(q, k, v, is_causal=True).backward(g)
//! t = time.perf_counter(); [F(q, k, v, is_causal=True).backward(g) for _ in range(10)]
//! print((time.perf_counter() - t) / 10)
//! ```

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stagecraft::layers::cpu::attention_workspace_bytes;
use stagecraft::layers::ops::{self as ops, OpAttrs};
use stagecraft::layers::runtime::{self as runtime, Args};
use stagecraft::{DType, Device, Location, Rng, Tensor};
use std::time::Duration;

const B: usize = 4;
const H: usize = 8;
const T: usize = 1024;
const D: usize = 64;

fn attention(c: &mut Criterion) {
    let cpu = Device::cpu();
    let mut rng = Rng::new(7);
    let dims = [B, H, T, D];
    let [q, k, v, g] = [0; 4].map(|_| Tensor::<f32>::rand_normal(&dims, 0.0, 1.0, &mut rng, &cpu));
    for x in [&q, &k, &v, &g] {
        x.wait().unwrap();
    }
    let mut attrs = OpAttrs::new();
    attrs.set_bool("causal", true);

    let metas = [&q, &k, &v].map(|x| x.handle().metadata().clone());
    let def = &ops::SCALED_DOT_PRODUCT_ATTENTION;
    let geometry =
        ops::attention_geometry(&metas, &ops::Attrs::new(&attrs, def)).expect("a valid shape");
    let bytes = attention_workspace_bytes(&geometry, DType::F32);
    let threads = rayon::current_num_threads();
    println!(
        "B7 workspace beyond inputs and outputs, {threads} threads: forward {} KiB per thread ({} KiB), backward {} KiB per thread ({} KiB) + {} KiB shared; the scores of one head alone would be {} KiB",
        bytes.forward_per_thread / 1024,
        bytes.forward_per_thread * threads / 1024,
        bytes.backward_per_thread / 1024,
        bytes.backward_per_thread * threads / 1024,
        bytes.backward_shared / 1024,
        T * T * 4 / 1024,
    );

    // Causal products: T·(T+1)/2 score pairs per head, D multiply-adds
    // each, 2 flops per multiply-add.
    let pairs = (B * H * T * (T + 1) / 2) as u64;
    let flops = |products: u64| 2 * pairs * D as u64 * products;

    let location = Location::caller();
    let run = |def: &'static ops::OpDef, args: Args| {
        runtime::execute(def, cpu, location, args, (&attrs).into())
    };
    let forward = || {
        let args: Args = [&q, &k, &v]
            .map(|x| x.handle().clone())
            .into_iter()
            .collect();
        let out = run(def, args);
        for x in &out {
            x.wait().unwrap();
        }
        out
    };
    let forward_backward = || fused_forward_backward([&q, &k, &v, &g], &attrs);

    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let cpu_time = |work: &(dyn Fn() + Sync), runs: usize| {
        one.install(|| {
            (0..runs)
                .filter_map(|_| {
                    let start = thread_cpu_seconds()?;
                    work();
                    Some(thread_cpu_seconds()? - start)
                })
                .fold(None, |best: Option<f64>, t| {
                    Some(best.map_or(t, |b| b.min(t)))
                })
        })
    };
    let fwd = cpu_time(&|| drop(forward()), 5);
    let both = cpu_time(&forward_backward, 3);
    if let (Some(fwd), Some(both)) = (fwd, both) {
        let gflops = |f: u64, t: f64| f as f64 / t / 1e9;
        println!(
            "B7 on one thread, by the thread's CPU time (best of 5 and 3): fwd {:.1} ms ({:.0} GFLOP/s), fwd+bwd {:.1} ms ({:.0} GFLOP/s)",
            fwd * 1e3,
            gflops(flops(2), fwd),
            both * 1e3,
            gflops(flops(7), both)
        );
    }

    let mut group = c.benchmark_group("B7_attention_b4_h8_t1024_d64_causal_f32");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(flops(2)));
    group.bench_function("fwd", |bench| {
        bench.iter(|| {
            q.scaled_dot_product_attention(&k, &v, true, None)
                .wait()
                .unwrap()
        })
    });

    group.throughput(Throughput::Elements(flops(7)));
    group.bench_function("fwd+bwd", |bench| bench.iter(&forward_backward));

    // The unfused formula: the mask as 0 or -∞ added to the scores.
    let mask: Vec<f32> = (0..T * T)
        .map(|at| {
            if at % T <= at / T {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, &[T, T], &cpu).unwrap();
    let scale = Tensor::scalar(1.0 / (D as f32).sqrt(), &cpu);
    group.throughput(Throughput::Elements(flops(2)));
    group.bench_function("baseline_unfused_fwd", |bench| {
        bench.iter(|| {
            let scores = q.matmul(&k.transpose(-2, -1)) * &scale + &mask;
            scores.softmax(-1).matmul(&v).wait().unwrap()
        })
    });
    group.finish();
}

/// The CPU time the calling thread has run, in seconds (Linux only).
/// Forward and backward of the fused op on `q`, `k`, `v` with incoming
/// gradient `g`, waiting for every output.
fn fused_forward_backward(tensors: [&Tensor<f32>; 4], attrs: &OpAttrs) {
    let cpu = Device::cpu();
    let location = Location::caller();
    let [q, k, v, g] = tensors;
    let run = |def: &'static ops::OpDef, args: Args| {
        runtime::execute(def, cpu, location, args, attrs.into())
    };
    let args: Args = [q, k, v].map(|x| x.handle().clone()).into_iter().collect();
    let out = run(&ops::SCALED_DOT_PRODUCT_ATTENTION, args);
    let args: Args = [
        g.handle(),
        q.handle(),
        k.handle(),
        v.handle(),
        &out[0],
        &out[1],
    ]
    .map(|x| x.clone())
    .into_iter()
    .collect();
    for x in &run(&ops::SCALED_DOT_PRODUCT_ATTENTION_GRAD, args) {
        x.wait().unwrap();
    }
}

/// The two layouts side by side, forward and backward: `"bhtd"` operands,
/// and the same values as `[B, T, H, D]` read in place (`"bthd"`), at the
/// long-sequence shape above and at the GPT step's (B7: batch 12, 4 heads
/// of 32, T = 64).
fn layouts(c: &mut Criterion) {
    let cpu = Device::cpu();
    let mut rng = Rng::new(8);
    for (name, [b, h, t, d]) in [
        ("b4_h8_t1024_d64", [B, H, T, D]),
        ("b12_h4_t64_d32", [12, 4, 64, 32]),
    ] {
        let heads_first =
            [0; 4].map(|_| Tensor::<f32>::rand_normal(&[b, h, t, d], 0.0, 1.0, &mut rng, &cpu));
        let sequence_first = heads_first.clone().map(|x| x.transpose(1, 2));
        for x in heads_first.iter().chain(&sequence_first) {
            x.wait().unwrap();
        }
        let mut attrs = OpAttrs::new();
        attrs.set_bool("causal", true);
        let mut group = c.benchmark_group(format!("attention_layouts_{name}_causal_f32"));
        group.sample_size(10);
        group.measurement_time(Duration::from_secs(5));
        let [q, k, v, g] = &heads_first;
        group.bench_function("bhtd fwd+bwd", |bench| {
            bench.iter(|| fused_forward_backward([q, k, v, g], &attrs))
        });
        attrs.set_str("layout", ops::SEQUENCE_FIRST);
        let [q, k, v, g] = &sequence_first;
        group.bench_function("bthd fwd+bwd", |bench| {
            bench.iter(|| fused_forward_backward([q, k, v, g], &attrs))
        });
        group.finish();
    }
}

fn thread_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanoseconds: f64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(nanoseconds / 1e9)
}

criterion_group!(benches, attention, layouts);
criterion_main!(benches);
