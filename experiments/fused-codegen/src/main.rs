//! The measurement: the B3 chain on stagecraft's interpreter kernel and on
//! Cranelift-generated code, beside a plain copy of the same bytes, and
//! the compile (setup) time of each.
//!
//! Usage: `fused-codegen [ROUNDS]`. Threads come from the rayon pool, so
//! `RAYON_NUM_THREADS=1 taskset -c 0 fused-codegen` gives 1-thread figures
//! and a plain run uses every core. The variants run interleaved, one call
//! each per round, so load from other processes falls on all of them
//! alike; each figure is the median over rounds with the 10th and 90th
//! percentiles; `x copy` and the speed-up over the interpreter are medians
//! of per-round ratios, which are steadier under load than ratios of
//! medians. Compile times are with Cranelift's verifier off, from the
//! encoded program to a callable function (decode, module, code
//! generation, making the memory executable).

use fused_codegen::interp::Interpreter;
use fused_codegen::jit::{self, JitKernel, Options, CHUNK};
use fused_codegen::programs::{self, Workload};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// The 10th, 50th and 90th percentiles.
fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.1), at(0.5), at(0.9))
}

/// Copies `src` into `dst` split the way the kernels split their work.
fn copy(src: &[f32], dst: &mut [f32]) {
    if dst.len() >= stagecraft_cpu::PARALLEL_THRESHOLD {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    } else {
        dst.copy_from_slice(src);
    }
}

/// B3 written out in Rust: a reference for what ahead-of-time compiled,
/// specialised code reaches (no interpreter, no 128-bit limit).
#[inline(always)]
fn b3_by_hand_loop(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        let t = x * 2.0 + 1.0;
        let t = t * x - 3.0;
        // stagecraft's relu: x if x > 0 or x is NaN, else +0.
        let t = if t > 0.0 || t.is_nan() { t } else { 0.0 };
        let t = t * 0.5 + x;
        *o = t * t;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn b3_by_hand_avx512(x: &[f32], out: &mut [f32]) {
    b3_by_hand_loop(x, out)
}

/// [`b3_by_hand_loop`] with the widest vectors the CPU has, split across
/// threads like the kernels.
fn b3_by_hand(x: &[f32], out: &mut [f32]) {
    let run = |x: &[f32], out: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU reported AVX-512F, all the function uses.
            return unsafe { b3_by_hand_avx512(x, out) };
        }
        b3_by_hand_loop(x, out)
    };
    if out.len() >= stagecraft_cpu::PARALLEL_THRESHOLD {
        out.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| run(x, o));
    } else {
        run(x, out);
    }
}

/// Run times of the B3 chain over `n` elements; returns the medians of
/// the interpreter and of the fastest Cranelift variant, in seconds.
fn run_times(n: usize, rounds: usize) -> Result<(f64, f64), Error> {
    let w = programs::b3();
    let inputs = w.tensors(n, false)?;
    let metas = w.metas(n);
    let interp = Interpreter::new(&w.program, &metas)?;
    let jits = [1, 2, 4]
        .into_iter()
        .map(|unroll| {
            let options = Options {
                unroll,
                verify: false,
            };
            Ok((unroll, JitKernel::new(&w.program, &metas, options)?))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let src = programs::data(n, 0, false);
    // Pre-faulted: every page written once before timing.
    let mut dst = vec![1.0f32; n];
    // Calls per sample: enough that a sample of a small size lasts ~5 ms.
    let batch = (1usize << 24).div_ceil(n).clamp(1, 256);

    let mut names: Vec<String> = vec!["interpreter (stagecraft kernel)".into()];
    for (u, _) in &jits {
        names.push(format!("cranelift f32x4, unroll {u}"));
    }
    names.push("B3 by hand in Rust (reference)".into());
    names.push("copy (same bytes)".into());
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let warmup = 3;
    for round in 0..warmup + rounds {
        let mut times = Vec::with_capacity(names.len());
        let time = |f: &mut dyn FnMut() -> Result<(), Error>| -> Result<f64, Error> {
            let start = Instant::now();
            for _ in 0..batch {
                f()?;
            }
            Ok(start.elapsed().as_secs_f64() / batch as f64)
        };
        times.push(time(&mut || {
            black_box(interp.run(&inputs)?);
            Ok(())
        })?);
        for (_, k) in &jits {
            times.push(time(&mut || {
                black_box(k.run(&inputs)?);
                Ok(())
            })?);
        }
        times.push(time(&mut || {
            b3_by_hand(black_box(&src), &mut dst);
            black_box(&mut dst);
            Ok(())
        })?);
        times.push(time(&mut || {
            copy(black_box(&src), &mut dst);
            black_box(&mut dst);
            Ok(())
        })?);
        if round >= warmup {
            for (s, t) in samples.iter_mut().zip(times) {
                s.push(t);
            }
        }
    }
    let copy_samples = samples[samples.len() - 1].clone();
    let medians: Vec<f64> = samples.iter().map(|s| percentiles(s.clone()).1).collect();
    let best_jit = medians[1..=jits.len()]
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min);
    println!(
        "\nB3 over {n} f32 ({kib} KiB in, {kib} KiB out), {} thread(s), {rounds} rounds of {batch} call(s)",
        rayon::current_num_threads(),
        kib = n * 4 / 1024,
    );
    println!(
        "| variant | median ms | p10–p90 ms | ns/element | GB/s (read+write) | x copy | speed-up over interpreter |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, s) in names.iter().zip(&samples) {
        let ratio: Vec<f64> = s.iter().zip(&copy_samples).map(|(t, c)| t / c).collect();
        let (lo, mid, hi) = percentiles(s.clone());
        let (_, r, _) = percentiles(ratio);
        let speedup: Vec<f64> = samples[0].iter().zip(s).map(|(i, t)| i / t).collect();
        let (_, up, _) = percentiles(speedup);
        println!(
            "| {name} | {:.3} | {:.3}–{:.3} | {:.3} | {:.1} | {r:.2} | {up:.2} |",
            mid * 1e3,
            lo * 1e3,
            hi * 1e3,
            mid * 1e9 / n as f64,
            8.0 * n as f64 / mid / 1e9,
        );
    }
    Ok((medians[0], best_jit))
}

/// Times `f` `reps` times after two warm-up calls; percentiles in µs.
fn setup_time<T>(
    reps: usize,
    mut f: impl FnMut() -> Result<T, Error>,
) -> Result<(f64, f64, f64), Error> {
    let mut v = Vec::with_capacity(reps);
    for i in 0..reps + 2 {
        let start = Instant::now();
        let made = f()?;
        let t: Duration = start.elapsed();
        drop(made);
        if i >= 2 {
            v.push(t.as_secs_f64() * 1e6);
        }
    }
    Ok(percentiles(v))
}

/// Setup times: the interpreter's factory against Cranelift's compile.
fn compile_times(reps: usize) -> Result<f64, Error> {
    println!("\nSetup per kernel instance, {reps} repetitions (µs: median, p10–p90)");
    println!("| program | interpreter factory | cranelift module (ISA, fixed part) | cranelift compile, unroll 1 | cranelift compile, unroll 2 | cranelift compile, unroll 4 |");
    println!("|---|---|---|---|---|---|");
    let fmt = |(lo, mid, hi): (f64, f64, f64)| format!("{mid:.1} ({lo:.1}–{hi:.1})");
    let workloads: [(String, Workload); 3] = [
        ("B3 (8 instructions)".into(), programs::b3()),
        ("100 instructions".into(), programs::long(100)),
        ("1,000 instructions".into(), programs::long(1000)),
    ];
    let mut b3_compile = f64::INFINITY;
    for (label, w) in workloads {
        let metas = w.metas(1 << 16);
        let reps_here = if w.program.len() > 3 * 200 {
            reps / 5
        } else {
            reps
        }
        .max(3);
        let interp = setup_time(reps_here, || Ok(Interpreter::new(&w.program, &metas)?))?;
        let module = setup_time(reps_here, || Ok(jit::new_module(false)?))?;
        let mut row = format!("| {label} | {} | {} |", fmt(interp), fmt(module));
        for unroll in [1, 2, 4] {
            let options = Options {
                unroll,
                verify: false,
            };
            let t = setup_time(reps_here, || {
                Ok(JitKernel::new(&w.program, &metas, options)?)
            })?;
            if w.name == "b3" {
                b3_compile = b3_compile.min(t.1 * 1e-6);
            }
            row.push_str(&format!(" {} |", fmt(t)));
        }
        println!("{row}");
    }
    Ok(b3_compile)
}

fn main() -> Result<(), Error> {
    let rounds: usize = match std::env::args().nth(1) {
        Some(r) => r.parse()?,
        None => 30,
    };
    #[cfg(target_arch = "x86_64")]
    println!(
        "fused-codegen: {} rayon thread(s), AVX2 {}, AVX-512F {}",
        rayon::current_num_threads(),
        std::arch::is_x86_feature_detected!("avx2"),
        std::arch::is_x86_feature_detected!("avx512f"),
    );
    let sizes = [16usize << 20, 64 << 10];
    let mut medians = Vec::new();
    for n in sizes {
        medians.push((n, run_times(n, rounds)?));
    }
    let compile = compile_times(rounds.max(10))?;
    println!("\nBreak-even: calls of the same B3 kernel before Cranelift's compile is paid back");
    for (n, (interp, jit)) in medians {
        let saved = interp - jit;
        if saved > 0.0 {
            println!(
                "- {n} elements: {:.1} µs compile / {:.1} µs saved per call = {:.2} calls",
                compile * 1e6,
                saved * 1e6,
                compile / saved
            );
        } else {
            println!("- {n} elements: no saving per call, never paid back");
        }
    }
    Ok(())
}
