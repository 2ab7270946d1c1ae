//! Core runtime benchmarks, each beside a baseline measured in the same run:
//! - eager dispatch of a tiny add ([4] + [4]) vs a plain Rust add into a
//!   fresh Vec (the floor for an allocating op);
//! - f32 matmul at 256³ and 1024³ (GFLOP/s = 2n³ / time);
//! - a 16M-element f32 add, and the 8-op B3 chain at 16M on the lazy and
//!   eager devices, each vs a plain copy of the same 64 MiB.
//!
//! Run with `scripts/bench.sh` for 2-thread and pinned 1-thread figures.

mod common;
use common::b3;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
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
    group.finish();
}

fn big_add(c: &mut Criterion) {
    const N: usize = 16 << 20;
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![1.0; N], &[N], &cpu).unwrap();
    let b = Tensor::<f32>::from_vec(vec![2.0; N], &[N], &cpu).unwrap();
    let src = vec![1.0f32; N];
    let mut dst = vec![0.0f32; N];
    let mut group = c.benchmark_group("B3_16M");
    group.sample_size(20);
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.bench_function("stagecraft_add", |bench| {
        bench.iter(|| (&a + &b).wait().unwrap())
    });
    group.bench_function("baseline_copy_same_bytes", |bench| {
        bench.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
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
    let src = vec![1.0f32; N];
    let mut dst = vec![0.0f32; N];
    group.bench_function("baseline_copy_same_bytes", |bench| {
        bench.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    group.finish();
}

criterion_group!(benches, tiny_add, matmul, big_add, b3_chain);
criterion_main!(benches);
