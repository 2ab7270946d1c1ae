//! Where the time of one small op goes.
//!
//! Criterion rows: B1 (an eager add of two [4] f32 tensors, result
//! dropped), the same add recorded on the lazy device, and one step of a
//! cached 1,000-op lazy trace (record, then `mark_step`: lookup and
//! launch).
//!
//! Then a breakdown, printed as a table: each stage of the eager path run
//! alone, on the same values, counted with the CPU's time-stamp counter
//! over many calls (median of rounds); what the stages do not cover is
//! the glue between them (calls, moves, counters). The lazy path is split
//! into recording, and the step's collection, key hashing, cache lookup,
//! kernels and the rest, from the lazy runtime's own clocks.
//!
//! Run with `scripts/bench.sh dispatch` for 2-thread and pinned 1-thread
//! figures; the header names the host. `DISPATCH_NO_BREAKDOWN=1` skips the
//! breakdown (to profile a row alone).

mod common;
use common::host;
use criterion::{black_box, criterion_group, Criterion};
use stagecraft::distributed::{self, Reduction};
use stagecraft::layers::{cpu as kernels, ops, runtime, tensor};
use stagecraft::{Device, Tensor};
use std::time::{Duration, Instant};

/// Ops in the chain of the lazy-step rows.
const CHAIN: usize = 1000;

fn pair(device: &Device) -> (Tensor<f32>, Tensor<f32>) {
    let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[4], device).unwrap();
    let b = Tensor::<f32>::from_vec(vec![5.0, 6.0, 7.0, 8.0], &[4], device).unwrap();
    (a, b)
}

/// One lazy step: a chain of adds recorded, then materialized.
fn lazy_step(a: &Tensor<f32>, b: &Tensor<f32>) -> Tensor<f32> {
    let mut t = a.clone();
    for _ in 0..CHAIN {
        t = &t + b;
    }
    stagecraft::lazy::mark_step();
    t
}

fn rows(c: &mut Criterion) {
    let (a, b) = pair(&Device::cpu());
    let mut group = c.benchmark_group("B1_dispatch");
    group.bench_function("eager_add", |bench| bench.iter(|| black_box(&a + &b)));
    // A collective in a group of one: an op with attributes and a side
    // effect, whose kernel does no arithmetic (issue 24's all-reduce op
    // pays this over its communicator).
    group.bench_function("eager_all_reduce_one_process", |bench| {
        bench.iter(|| black_box(distributed::all_reduce(&a, Reduction::Sum)))
    });
    let lazy = Device::lazy(&Device::cpu());
    let (la, lb) = pair(&lazy);
    la.wait().unwrap();
    lb.wait().unwrap();
    group.bench_function("lazy_record_add", |bench| {
        bench.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let batch = (iters - done).min(CHAIN as u64);
                let start = Instant::now();
                let mut t = la.clone();
                for _ in 0..batch {
                    t = &t + &lb;
                }
                spent += start.elapsed();
                // Running the batch is not recording: left out of the time.
                drop(t);
                stagecraft::lazy::mark_step();
                done += batch;
            }
            spent
        })
    });
    group.bench_function("lazy_step_1000_adds", |bench| {
        bench.iter(|| lazy_step(&la, &lb).wait().unwrap())
    });
    group.finish();
}

/// Time-stamp counter ticks, for the breakdown.
#[cfg(target_arch = "x86_64")]
fn ticks() -> u64 {
    // SAFETY: RDTSC reads a counter; it has no memory effects and exists on
    // every x86-64 CPU.
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_rdtsc()
    }
}

/// Elsewhere: nanoseconds since the first call, so the table reads in ns.
#[cfg(not(target_arch = "x86_64"))]
fn ticks() -> u64 {
    use std::sync::OnceLock;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Ticks per nanosecond, measured against the monotonic clock.
fn ticks_per_ns() -> f64 {
    let (t0, i0) = (ticks(), Instant::now());
    while i0.elapsed() < Duration::from_millis(100) {}
    (ticks() - t0) as f64 / i0.elapsed().as_nanos() as f64
}

/// Median ticks per call of `f` over rounds of `calls` calls.
fn per_call(calls: u64, mut f: impl FnMut()) -> f64 {
    for _ in 0..calls {
        f();
    }
    let mut rounds: Vec<f64> = (0..9)
        .map(|_| {
            let start = ticks();
            for _ in 0..calls {
                f();
            }
            (ticks() - start) as f64 / calls as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

/// One line of the breakdown: a stage and its cost.
struct Stage {
    name: &'static str,
    ticks: f64,
}

/// The eager add, whole and stage by stage (its inputs are ready, so it
/// takes the synchronous fast path), and what a call pays on a miss of
/// its thread's prepared ops.
fn eager_stages(calls: u64) -> (f64, Vec<Stage>, Vec<Stage>) {
    let device = Device::cpu();
    let (a, b) = pair(&device);
    let total = per_call(calls, || drop(black_box(&a + &b)));

    let args: runtime::Args = [a.handle().clone(), b.handle().clone()]
        .into_iter()
        .collect();
    let attrs = ops::OpAttrs::new();
    let metas: runtime::InputMetas = args.iter().map(|h| h.metadata().clone()).collect();
    let outputs = ops::ADD.infer(&metas, &attrs).unwrap();
    let cache = device
        .handler()
        .host_kernels()
        .expect("the CPU caches kernels");
    let kernels::AnyKernel::Dense(kernel) = cache.get(&ops::ADD, &attrs, &metas).unwrap() else {
        panic!("Add has a dense kernel");
    };
    let values: kernels::Inputs = args
        .iter()
        .map(|h| match h.wait().unwrap() {
            tensor::HostTensor::Dense(d) => d.clone(),
            other => panic!("a dense input was expected, not {other:?}"),
        })
        .collect();
    let ctx = kernels::KernelContext {
        attrs: ops::Attrs::new(&attrs, &ops::ADD),
        outputs: &outputs,
    };
    let output =
        tensor::HostTensor::Dense(tensor::DenseHostTensor::zeros(outputs[0].clone()).unwrap());

    let mut stages = Vec::new();
    let mut stage = |name, ticks| stages.push(Stage { name, ticks });
    stage(
        "placement",
        per_call(calls, || {
            black_box(runtime::place(black_box(&args)));
        }),
    );
    stage(
        "argument checks (device, value ready)",
        per_call(calls, || {
            for arg in black_box(&args) {
                black_box(arg.device() != device);
                black_box(arg.is_resolved());
            }
        }),
    );
    stage(
        "prepared-op lookup (key, compare)",
        per_call(calls, || {
            black_box(cache.is_prepared(&ops::ADD, &attrs, black_box(&args)));
        }),
    );
    // The operands are borrowed (`&a + &b`): each value is shared with
    // the kernel, which drops it.
    stage(
        "input values (shared buffers)",
        per_call(calls, || {
            for h in black_box(&args) {
                if let Ok(tensor::HostTensor::Dense(d)) = h.wait() {
                    drop(black_box(d.clone()));
                }
            }
        }),
    );
    // What a call that misses its thread's prepared ops pays instead of
    // the lookup (the first call, or after another op took the slot).
    let mut miss = Vec::new();
    let mut on_miss = |name, ticks| miss.push(Stage { name, ticks });
    on_miss(
        "input metadata",
        per_call(calls, || {
            let m: runtime::InputMetas = black_box(&args)
                .iter()
                .map(|h| h.metadata().clone())
                .collect();
            drop(black_box(m))
        }),
    );
    on_miss(
        "shape function",
        per_call(calls, || {
            drop(black_box(ops::ADD.infer(black_box(&metas), &attrs)))
        }),
    );
    on_miss(
        "kernel lookup",
        per_call(calls, || {
            drop(black_box(cache.get(&ops::ADD, &attrs, black_box(&metas))))
        }),
    );
    let inputs_copy = per_call(calls, || drop(black_box(values.clone())));
    stage(
        "kernel, with its output allocation",
        per_call(calls, || drop(black_box(kernel(values.clone(), &ctx)))) - inputs_copy,
    );
    let output_copy = per_call(calls, || drop(black_box(output.clone())));
    stage(
        "output handle: create and drop",
        per_call(calls, || {
            drop(black_box(runtime::TensorHandle::available(
                device,
                output.clone(),
            )))
        }) - output_copy,
    );
    (total, stages, miss)
}

/// The lazy add recorded (ticks per op), and one cached step's phases,
/// medians: `mark_step` whole (ticks), then its collection, key hashing,
/// cache lookup and kernels (ns).
fn lazy_stages(calls: u64) -> (f64, [f64; 5]) {
    let lazy = Device::lazy(&Device::cpu());
    let (a, b) = pair(&lazy);
    a.wait().unwrap();
    b.wait().unwrap();
    let batches = (calls / CHAIN as u64).max(1);
    let mut record = Vec::new();
    for _ in 0..9 {
        let mut spent = 0;
        for _ in 0..batches {
            let start = ticks();
            let mut t = a.clone();
            for _ in 0..CHAIN {
                t = &t + &b;
            }
            spent += ticks() - start;
            drop(t);
            stagecraft::lazy::mark_step();
        }
        record.push(spent as f64 / (batches * CHAIN as u64) as f64);
    }
    record.sort_by(f64::total_cmp);
    let record = record[record.len() / 2];

    // A step's phases: `mark_step` on a recorded chain whose trace is
    // cached, with the runtime's own clocks for collecting, hashing the
    // key, looking it up and running the kernels.
    let mut phases: [Vec<f64>; 5] = Default::default();
    let nanos = |d: std::time::Duration| d.as_nanos() as f64;
    for _ in 0..(9 * batches) {
        let mut t = a.clone();
        for _ in 0..CHAIN {
            t = &t + &b;
        }
        let before = stagecraft::lazy::metrics();
        let start = ticks();
        stagecraft::lazy::mark_step();
        phases[0].push((ticks() - start) as f64);
        let after = stagecraft::lazy::metrics();
        phases[1].push(nanos(after.collect_time - before.collect_time));
        phases[2].push(nanos(after.key_time - before.key_time));
        phases[3].push(nanos(after.lookup_time - before.lookup_time));
        phases[4].push(nanos(after.execute_time - before.execute_time));
        drop(black_box(t));
    }
    let medians = phases.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    });
    (record, medians)
}

fn breakdown() {
    let calls = 200_000;
    let per_ns = ticks_per_ns();
    println!();
    println!("dispatch breakdown on {}", host());
    println!("time-stamp counter: {per_ns:.3} ticks/ns; medians of 9 rounds of {calls} calls");
    let (total, stages, miss) = eager_stages(calls);
    let line = |name: &str, t: f64| {
        println!(
            "  {name:<46} {:>8.1} ticks {:>7.1} ns {:>5.1} %",
            t,
            t / per_ns,
            100.0 * t / total
        )
    };
    println!("eager add of two [4] f32 tensors, result dropped:");
    line("whole op", total);
    let mut covered = 0.0;
    for s in &stages {
        line(s.name, s.ticks);
        covered += s.ticks;
    }
    line("glue (calls, moves, counters; the rest)", total - covered);
    println!("instead of the prepared-op lookup, on a miss:");
    for s in &miss {
        line(s.name, s.ticks);
    }
    // Units the stages are made of, on this host.
    let counter = std::sync::atomic::AtomicU64::new(0);
    let atomic = per_call(calls, || {
        black_box(&counter).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    let malloc = per_call(calls, || drop(black_box(Box::new([0u64; 8]))));
    let buffer = per_call(calls, || drop(black_box(tensor::Buffer::for_overwrite(16))));
    println!("for scale, on this host:");
    println!(
        "  {:<46} {:>8.1} ticks {:>7.1} ns",
        "a 16-byte tensor buffer: take and drop",
        buffer,
        buffer / per_ns
    );
    println!(
        "  {:<46} {:>8.1} ticks {:>7.1} ns",
        "one atomic add (a locked read-modify-write)",
        atomic,
        atomic / per_ns
    );
    println!(
        "  {:<46} {:>8.1} ticks {:>7.1} ns",
        "malloc and free of 64 bytes",
        malloc,
        malloc / per_ns
    );
    let (record, [whole_ticks, collect, key, lookup, run]) = lazy_stages(calls);
    println!("lazy add on the CPU's lazy device:");
    println!(
        "  {:<46} {:>8.1} ticks {:>7.1} ns",
        "record one op",
        record,
        record / per_ns
    );
    let whole = whole_ticks / per_ns;
    println!(
        "  {:<46} {:>8.1} ticks {:>7.1} ns {:>7.1} ns/op",
        format!("mark_step of a cached {CHAIN}-op trace"),
        whole_ticks,
        whole,
        whole / CHAIN as f64
    );
    let rest = whole - collect - key - lookup - run;
    for (name, ns) in [
        ("  collect (walk, claims, the key's words)", collect),
        ("  key hashing", key),
        ("  cache lookup (compare, arguments)", lookup),
        ("  its kernels ran", run),
        ("  the rest (live roots, outputs, claims ended)", rest),
    ] {
        println!(
            "  {name:<46} {:>8} {:>13.1} ns {:>7.1} ns/op",
            "",
            ns,
            ns / CHAIN as f64
        );
    }
}

criterion_group!(benches, rows);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Left out when profiling a criterion row (`--profile-time`), whose
    // samples it would otherwise swamp.
    if std::env::var_os("DISPATCH_NO_BREAKDOWN").is_none() {
        breakdown();
    }
}
