//! Concurrency (issue 9, point 5): many threads at once execute eager ops
//! (sync and async mode), record and materialize lazy traces, call one
//! shared staged function (its trace cache is shared), and trace their own
//! `while_loop`s and `cond`s, each on its own inputs. Every result must be
//! bit-identical to the answer the same work gave on one thread before.

use stagecraft::{
    cond, function, lazy, while_loop, with_execution_mode, Device, ExecutionMode, Rng,
    StagedFunction, Tensor,
};

const THREADS: usize = 16;
const ROUNDS: usize = 40;

/// The workloads, each a pure function of `seed` (and the device).
#[derive(Clone, Copy, Debug)]
enum Work {
    Eager,
    EagerAsync,
    Lazy,
    Function,
    Loop,
}

const WORKS: [Work; 5] = [
    Work::Eager,
    Work::EagerAsync,
    Work::Lazy,
    Work::Function,
    Work::Loop,
];

/// A layer's input, weights and bias.
type Args = (Tensor<f32>, Tensor<f32>, Tensor<f32>);

fn inputs(seed: u64, device: &Device) -> Args {
    let mut rng = Rng::new(seed);
    let x = Tensor::rand_normal(&[16, 48], 0.0, 1.0, &mut rng, device);
    let w = Tensor::rand_normal(&[48, 32], 0.0, 0.3, &mut rng, device);
    let b = Tensor::rand_uniform(&[32], -0.5, 0.5, &mut rng, device);
    (x, w, b)
}

/// A small network layer, its softmax and a reduction: matmul, broadcasting,
/// transcendental and reduce kernels.
fn layer(x: &Tensor<f32>, w: &Tensor<f32>, b: &Tensor<f32>) -> Tensor<f32> {
    let h = (x.matmul(w) + b).tanh();
    let p = h.softmax(-1);
    (&p * &h).sum(&[-1], false) + h.exp().mean(&[-1], false).log()
}

fn run<F>(work: Work, seed: u64, shared: &StagedFunction<Args, Tensor<f32>, F>) -> Vec<f32>
where
    F: Fn(Args) -> Tensor<f32>,
{
    let cpu = Device::cpu();
    match work {
        Work::Eager => {
            let (x, w, b) = inputs(seed, &cpu);
            layer(&x, &w, &b).to_vec().unwrap()
        }
        Work::EagerAsync => with_execution_mode(ExecutionMode::Async, || {
            let (x, w, b) = inputs(seed, &cpu);
            let mut y = layer(&x, &w, &b);
            for _ in 0..4 {
                y = (&y * 0.5).sigmoid() + &y;
            }
            y
        })
        .to_vec()
        .unwrap(),
        Work::Lazy => {
            let d = Device::lazy(&cpu);
            let (x, w, b) = inputs(seed, &d);
            // Two traces: a step ended by mark_step, then one read.
            let first = layer(&x, &w, &b);
            lazy::mark_step();
            let second = (&first * 2.0 - 1.0).relu() + first.sum(&[0], true);
            second.to_vec().unwrap()
        }
        Work::Function => {
            let (x, w, b) = inputs(seed, &cpu);
            shared.call((x, w, b)).to_vec().unwrap()
        }
        Work::Loop => {
            let (x, w, b) = inputs(seed, &cpu);
            let h = layer(&x, &w, &b);
            // The trip count depends on the data: halve until small.
            let (small, steps) = while_loop(
                (h.abs() + 1.0, Tensor::<f32>::scalar(0.0, &cpu)),
                |(v, _)| v.sum(&[0], false).gt(&Tensor::scalar(1.0, &cpu)),
                |(v, n)| (v * 0.5, n + 1.0),
            );
            let positive = h.sum(&[0], false).gt(&Tensor::scalar(0.0, &cpu));
            let picked = cond(&positive, || small.sqrt(), || small.cos());
            let mut out = picked.to_vec().unwrap();
            out.extend(steps.to_vec().unwrap());
            out
        }
    }
}

#[test]
fn many_threads_execute_trace_and_call_functions_at_once() {
    let shared = function(|(x, w, b): Args| {
        let y = layer(&x, &w, &b);
        (&y * &y).rsqrt() + y.sin()
    });
    let seeds = |t: usize, r: usize| (t * ROUNDS + r) as u64 % 17 + 1;
    // One thread first: the answers (every seed the threads will use).
    let mut expected = std::collections::HashMap::new();
    for work in WORKS {
        for seed in 1..=17 {
            expected.insert((work as usize, seed), run(work, seed, &shared));
        }
    }
    let expected = &expected;
    let shared = &shared;
    let mismatches: Vec<String> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                scope.spawn(move || {
                    let mut bad = Vec::new();
                    for r in 0..ROUNDS {
                        // Threads start on different works and rotate, so
                        // every kind runs beside every other.
                        let work = WORKS[(t + r) % WORKS.len()];
                        let seed = seeds(t, r);
                        let got = run(work, seed, shared);
                        let want = &expected[&(work as usize, seed)];
                        if got
                            .iter()
                            .map(|v| v.to_bits())
                            .ne(want.iter().map(|v| v.to_bits()))
                        {
                            bad.push(format!("thread {t} round {r} {work:?} seed {seed}"));
                        }
                    }
                    bad
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|h| h.join().expect("a worker panicked"))
            .collect()
    });
    assert!(mismatches.is_empty(), "results differ: {mismatches:?}");
}
