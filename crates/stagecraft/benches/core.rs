//! Core runtime benchmarks, each beside a baseline measured in the same run:
//! - eager dispatch of a tiny add ([4] + [4]) vs a plain Rust add into a
//!   fresh Vec (the floor for an allocating op);
//! - f32 matmul at 256³ and 1024³ (GFLOP/s = 2n³ / time), beside every
//!   pool thread's FMA peak (no memory traffic);
//! - a 16M-element f32 add, and the 8-op B3 chain at 16M on the lazy and
//!   eager devices, each vs a plain copy of the same 64 MiB;
//! - eager f32 activations (GELU, its tanh form, exp, tanh, sigmoid) over
//!   a GPT MLP's activation, per element, vs a plain copy of its bytes.
//!
//! Run with `scripts/bench.sh` for 2-thread and pinned 1-thread figures.

mod common;
use common::b3;
use criterion::measurement::WallTime;
use criterion::{
    black_box, criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use stagecraft::{Device, Rng, Tensor};

fn tiny_add(c: &mut Criterion) {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[4], &cpu).unwrap();
    let b = Tensor::<f32>::from_vec(vec![5.0, 6.0, 7.0, 8.0], &[4], &cpu).unwrap();
    let mut group = c.benchmark_group("B1_tiny_add");
    group.bench_function("stagecraft_eager", |bench| {
        bench.iter(|| black_box(&a + &b))
    });
    let (x, y) = ([1.0f32, 2.0, 3.0, 4.0], [5.0f32, 6.0, 7.0, 8.0]);
    group.bench_function("baseline_vec_alloc_add", |bench| {
        bench.iter(|| {
            let out: Vec<f32> = black_box(&x)
                .iter()
                .zip(black_box(&y))
                .map(|(p, q)| p + q)
                .collect();
            black_box(out)
        })
    });
    group.finish();
}

fn matmul(c: &mut Criterion) {
    let cpu = Device::cpu();
    let mut rng = Rng::new(1);
    let mut group = c.benchmark_group("B4_matmul_f32");
    for n in [256usize, 1024] {
        let a = Tensor::<f32>::rand_uniform(&[n, n], -1.0, 1.0, &mut rng, &cpu);
        let b = Tensor::<f32>::rand_uniform(&[n, n], -1.0, 1.0, &mut rng, &cpu);
        a.wait().unwrap();
        b.wait().unwrap();
        group.throughput(Throughput::Elements((2 * n * n * n) as u64));
        group.sample_size(if n >= 1024 { 20 } else { 50 });
        group.bench_with_input(BenchmarkId::new("stagecraft", n), &n, |bench, _| {
            bench.iter(|| a.matmul(&b).wait().unwrap())
        });
    }
    // The ceiling in the same run: every pool thread multiplying-adding in
    // registers, so the products read as a fraction of this machine's peak
    // (which differs between the hosts these benchmarks run on).
    #[cfg(target_arch = "x86_64")]
    if let Some(flops_per_step) = fma_peak::flops_per_step() {
        const STEPS: usize = 100_000;
        let threads = rayon::current_num_threads();
        group.throughput(Throughput::Elements(
            (flops_per_step * STEPS * threads) as u64,
        ));
        group.sample_size(50);
        group.bench_function("baseline_fma_peak", |bench| {
            bench.iter(|| rayon::broadcast(|_| black_box(fma_peak::run(STEPS))))
        });
    }
    group.finish();
}

/// Independent fused multiply-adds, as many as the vector registers keep
/// in flight: a core's arithmetic peak, with no memory traffic.
#[cfg(target_arch = "x86_64")]
mod fma_peak {
    use std::arch::x86_64::*;

    const AVX512_CHAINS: usize = 24;
    const AVX2_CHAINS: usize = 12;

    /// Flops per step of [`run`] on this CPU (`None` without FMA units).
    pub fn flops_per_step() -> Option<usize> {
        if is_x86_feature_detected!("avx512f") {
            Some(AVX512_CHAINS * 16 * 2)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some(AVX2_CHAINS * 8 * 2)
        } else {
            None
        }
    }

    /// `steps` steps; the result keeps the work from being optimised away.
    pub fn run(steps: usize) -> f32 {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU reported AVX-512F.
            unsafe { avx512(steps) }
        } else {
            // SAFETY: only benchmarked where `flops_per_step` found AVX2
            // and FMA.
            unsafe { avx2(steps) }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(steps: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(1.0); AVX512_CHAINS];
        let (x, y) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..steps {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(steps: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); AVX2_CHAINS];
        let (x, y) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..steps {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        let mut lanes = [0.0f32; 8];
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
        // SAFETY: `lanes` holds the 8 floats stored.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum()
    }
}

fn big_add(c: &mut Criterion) {
    const N: usize = 16 << 20;
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![1.0; N], &[N], &cpu).unwrap();
    let b = Tensor::<f32>::from_vec(vec![2.0; N], &[N], &cpu).unwrap();
    let mut group = c.benchmark_group("B3_16M");
    group.sample_size(20);
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.bench_function("stagecraft_add", |bench| {
        bench.iter(|| (&a + &b).wait().unwrap())
    });
    copy_baseline(&mut group, &vec![1.0f32; N]);
    group.finish();
}

/// B3 at the peers' size (16M f32): the lazy device fuses the chain into
/// one kernel; side by side with eager and a plain copy of the same bytes.
fn b3_chain(c: &mut Criterion) {
    const N: usize = 16 << 20;
    let mut group = c.benchmark_group("B3_chain_16M");
    group.sample_size(10);
    group.throughput(Throughput::Bytes((2 * N * 4) as u64));
    for (name, d) in [
        ("stagecraft_lazy", Device::lazy(&Device::cpu())),
        ("stagecraft_eager", Device::cpu()),
    ] {
        let x = Tensor::<f32>::from_vec(vec![0.5; N], &[N], &d).unwrap();
        group.bench_function(name, |bench| bench.iter(|| b3(&x).wait().unwrap()));
    }
    copy_baseline(&mut group, &vec![1.0f32; N]);
    group.finish();
}

/// Eager f32 activations over [393216] (a GPT MLP's activation: batch 12 ·
/// context 64 · 512 wide), in elements per second, beside a copy of the
/// same bytes: how far each is from memory speed. Each evaluates a
/// branch-free form in f64 that vectorizes (libm's functions are branchy
/// calls per element) and rounds once to f32.
fn activations(c: &mut Criterion) {
    const N: usize = 393_216;
    let cpu = Device::cpu();
    let values: Vec<f32> = (0..N).map(|i| (i % 2000) as f32 * 0.004 - 4.0).collect();
    let x = Tensor::<f32>::from_vec(values.clone(), &[N], &cpu).unwrap();
    let mut group = c.benchmark_group("activations_f32_393K");
    group.throughput(Throughput::Elements(N as u64));
    type Activation = fn(&Tensor<f32>) -> Tensor<f32>;
    let rows: [(&str, Activation); 5] = [
        ("gelu", |x| x.gelu()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("exp", |x| x.exp()),
        ("tanh", |x| x.tanh()),
        ("sigmoid", |x| x.sigmoid()),
    ];
    for (name, f) in rows {
        group.bench_function(name, |bench| bench.iter(|| f(&x).wait().unwrap()));
    }
    copy_baseline(&mut group, &values);
    group.finish();
}

/// The `baseline_copy_same_bytes` row: a plain copy of `src`, the memory
/// rate a group's rows are read against.
fn copy_baseline(group: &mut BenchmarkGroup<'_, WallTime>, src: &[f32]) {
    let mut dst = vec![0.0f32; src.len()];
    group.bench_function("baseline_copy_same_bytes", |bench| {
        bench.iter(|| {
            dst.copy_from_slice(black_box(src));
            black_box(&dst);
        })
    });
}

criterion_group!(benches, tiny_add, matmul, big_add, b3_chain, activations);
criterion_main!(benches);
