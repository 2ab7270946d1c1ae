//! Concurrency (issue 9, point 5): many threads at once execute eager ops
//! (sync and async mode), record and materialize lazy traces, call one
//! shared staged function (its trace cache is shared), and trace their own
//! `while_loop`s and `cond`s, each on its own inputs. Every result must be
//! bit-identical to the answer the same work gave on one thread before.
//!
//! The lazy runtime gets its own tests below: threads that record and
//! materialize their own traces at once, a lazy tensor handed to another
//! thread, and one thread's failing traces beside healthy ones.

use stagecraft::{
    cond, function, lazy, while_loop, with_execution_mode, Device, ExecutionMode, Rng,
    StagedFunction, Tensor,
};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

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

// ---------------------------------------------------------------------------
// Lazy traces across threads: each thread records and materializes its own
// traces at the same time as the others; a lazy tensor can move to another
// thread; one thread's failing trace fails nothing of another's.

/// A thread's lazy step: 40 ops on its own [16] inputs, then a read.
fn lazy_step(x: &Tensor<f32>, y: &Tensor<f32>) -> Vec<f32> {
    let mut t = x.clone();
    for _ in 0..10 {
        t = (&(&t * y) + x).tanh() - y;
    }
    t.to_vec().unwrap()
}

fn lazy_inputs(seed: u64) -> (Tensor<f32>, Tensor<f32>) {
    let d = Device::lazy(&Device::cpu());
    let mut rng = Rng::new(seed);
    (
        Tensor::rand_normal(&[16], 0.0, 1.0, &mut rng, &d),
        Tensor::rand_uniform(&[16], 0.1, 0.9, &mut rng, &d),
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Eight threads start together and each runs 50 lazy steps on its own
/// inputs, ending some with `mark_step` and some with a read; every value
/// equals the one the same step gave on one thread.
#[test]
fn threads_record_and_materialize_their_own_lazy_traces_at_once() {
    const LAZY_THREADS: u64 = 8;
    let expected: Vec<Vec<u32>> = (0..LAZY_THREADS)
        .map(|t| {
            let (x, y) = lazy_inputs(t);
            bits(&lazy_step(&x, &y))
        })
        .collect();
    let start = std::sync::Barrier::new(LAZY_THREADS as usize);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..LAZY_THREADS)
            .map(|t| {
                let (start, want) = (&start, &expected[t as usize]);
                s.spawn(move || {
                    let (x, y) = lazy_inputs(t);
                    start.wait();
                    for round in 0..50 {
                        if round % 2 == 0 {
                            lazy::mark_step();
                        }
                        assert_eq!(&bits(&lazy_step(&x, &y)), want, "thread {t} round {round}");
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a lazy worker panicked");
        }
    });
}

/// The lines `Print` ops wrote, through a sink installed once for every
/// test here. A line labelled `hold` keeps its trace running (inside the
/// `Print` kernel) until [`Hold::release`], for at most 20 seconds.
fn printed() -> &'static Mutex<Vec<String>> {
    static LINES: OnceLock<&'static Mutex<Vec<String>>> = OnceLock::new();
    LINES.get_or_init(|| {
        let lines: &'static Mutex<Vec<String>> = Box::leak(Box::default());
        stagecraft::layers::cpu::set_print_sink(Some(Arc::new(move |l: &str| {
            lines.lock().unwrap().push(l.to_string());
            if l.starts_with("hold: ") {
                HOLD.wait_for_release();
            }
        })));
        lines
    })
}

fn count_printed(label: &str) -> usize {
    let prefix = format!("{label}: ");
    printed()
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with(&prefix))
        .count()
}

/// Whether a `hold` print is running, and whether it may end.
struct Hold {
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

static HOLD: Hold = Hold {
    state: Mutex::new((false, false)),
    changed: Condvar::new(),
};

impl Hold {
    fn wait_for_release(&self) {
        let mut state = self.state.lock().unwrap();
        state.0 = true;
        self.changed.notify_all();
        let timeout = Duration::from_secs(20);
        let _ = self.changed.wait_timeout_while(state, timeout, |s| !s.1);
    }

    /// Waits (at most 20 seconds) until a `hold` print runs.
    fn wait_until_held(&self) -> bool {
        let state = self.state.lock().unwrap();
        let timeout = Duration::from_secs(20);
        let (state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |s| !s.0)
            .unwrap();
        state.0
    }

    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

/// One thread's trace is in the middle of running (held inside its `Print`
/// kernel) while another thread records, materializes and reads a trace of
/// its own: traces of different threads run at the same time. (With one
/// trace at a time, the second thread would wait for the first, which
/// waits for it: the read below would time out.)
#[test]
fn a_thread_materializes_while_another_threads_trace_runs() {
    printed();
    let d = Device::lazy(&Device::cpu());
    std::thread::scope(|s| {
        let held = s.spawn(|| {
            let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &d).unwrap();
            ((&x * 2.0).print("hold") + 1.0).to_vec()
        });
        assert!(HOLD.wait_until_held(), "the first trace started");
        let (sender, receiver) = std::sync::mpsc::channel();
        s.spawn(move || {
            let x = Tensor::<f32>::from_vec(vec![3.0, 4.0], &[2], &d).unwrap();
            let _ = sender.send((x.exp().log() * 10.0).to_vec());
        });
        let second = receiver.recv_timeout(Duration::from_secs(10));
        HOLD.release();
        let second = second.expect("the second trace ran while the first was running");
        assert_eq!(second.unwrap(), vec![30.0, 40.0]);
        assert_eq!(held.join().unwrap().unwrap(), vec![3.0, 5.0]);
    });
}

/// A pending lazy tensor made on one thread is handed to another, and both
/// threads record more work on it and read their results at the same
/// moment. Both traces need the shared op (it prints once per run): it
/// runs exactly once, and both threads get values computed from it.
#[test]
fn a_lazy_tensor_made_on_one_thread_is_read_on_another() {
    printed();
    let d = Device::lazy(&Device::cpu());
    for round in 0..30 {
        let label = format!("shared-{round}");
        let x = Tensor::<f32>::from_vec((0..16).map(|i| i as f32).collect(), &[16], &d).unwrap();
        // Pending: nothing has run.
        let shared = (&x * 2.0).print(&label) + 1.0;
        let both = std::sync::Barrier::new(2);
        let (mine, theirs) = std::thread::scope(|s| {
            let other = s.spawn(|| {
                let t = &shared * 3.0;
                both.wait();
                t.to_vec()
            });
            let here = (&shared - 1.0).sum(&[0], false);
            // Both threads read at once.
            both.wait();
            (here.item(), other.join().unwrap())
        });
        // x * 2 + 1, then * 3 on the other thread; - 1 and summed here.
        let want: Vec<f32> = (0..16).map(|i| (i as f32 * 2.0 + 1.0) * 3.0).collect();
        assert_eq!(theirs.unwrap(), want, "round {round}");
        assert_eq!(mine.unwrap(), 240.0, "round {round}");
        assert_eq!(
            count_printed(&label),
            1,
            "the shared op ran once (round {round})"
        );
        assert_eq!(shared.to_vec().unwrap()[15], 31.0);
        assert_eq!(count_printed(&label), 1, "reading it runs nothing again");
    }
    // Made here, read only there: the other thread's trace runs it, and
    // this thread's step finds nothing left to run.
    let label = "moved";
    let moved = (Tensor::<f32>::ones(&[16], &d) * 5.0).print(label);
    let read = std::thread::scope(|s| s.spawn(|| moved.sum(&[0], false).item()).join());
    assert_eq!(read.unwrap().unwrap(), 80.0);
    lazy::mark_step();
    assert_eq!(count_printed(label), 1);
    assert_eq!(moved.to_vec().unwrap(), vec![5.0; 16]);
}

/// Threads step at once while one of them divides by zero in each of its
/// traces: its errors name its own line, and every other thread's values
/// are right, also when its trace ran while the failing one did.
#[test]
fn an_error_in_one_threads_trace_does_not_reach_another() {
    const HEALTHY: u64 = 3;
    let start = std::sync::Barrier::new(HEALTHY as usize + 1);
    std::thread::scope(|s| {
        let failing = s.spawn(|| {
            let d = Device::lazy(&Device::cpu());
            start.wait();
            let mut lines = Vec::new();
            for round in 0..40 {
                let n = Tensor::<i32>::from_vec(vec![round, 0, 2, 3], &[4], &d).unwrap();
                let line = line!() + 1;
                let q = Tensor::<i32>::ones(&[4], &d) / &n;
                let r = q * 2 + 1;
                if round % 2 == 0 {
                    lazy::mark_step();
                }
                let err = r.to_vec().unwrap_err();
                assert_eq!(err.op(), Some("Div"), "{err}");
                lines.push((err.location().unwrap().line(), line));
            }
            lines
        });
        let healthy: Vec<_> = (0..HEALTHY)
            .map(|t| {
                let start = &start;
                s.spawn(move || {
                    let (x, y) = lazy_inputs(100 + t);
                    let want = bits(&lazy_step(&x, &y));
                    start.wait();
                    for round in 0..40 {
                        if round % 2 == 1 {
                            lazy::mark_step();
                        }
                        assert_eq!(bits(&lazy_step(&x, &y)), want, "thread {t} round {round}");
                    }
                })
            })
            .collect();
        for (got, want) in failing.join().expect("the failing thread panicked") {
            assert_eq!(got, want);
        }
        for h in healthy {
            h.join().expect("a healthy thread panicked");
        }
    });
}
