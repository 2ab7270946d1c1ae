//! Cancellation and errors under stress (issue 9, point 4).
//!
//! - `a_thousand_cancellations_from_another_thread`: 1,000 runs, each
//!   cancelled from a second thread after a varying delay (0 to 3 ms, some
//!   before the work starts), cycling through three kinds of work that would
//!   never end on their own: a staged `While` loop on `cpu:0`, a lazy trace
//!   holding such a loop, and a function partitioned over `cpu:0` and
//!   `cpu:1` whose `cpu:1` half loops while `cpu:0` waits for it. Every run
//!   must return a cancellation error promptly; a watchdog thread fails the
//!   test (exits the process) if one hangs. Afterwards the process has no
//!   more threads (`/proc/self/task`) and no more live buffer bytes
//!   (`Buffer::stats`) than after warm-up.
//! - `an_error_on_one_device_abandons_the_other_devices_work`: one partition
//!   fails at once while the other runs a bounded loop of known duration;
//!   the call must return the error well before that loop could have
//!   finished, in both directions (`cpu:1` fails while `cpu:0` loops, and
//!   the reverse).
//!
//! Its own binary: cancellation is process-wide, so the tests here take
//! one lock and nothing else runs beside them.

use stagecraft::layers::tensor::Buffer;
use stagecraft::{
    cancel_execution, function, lazy, restart, while_loop, with_device, Device, ErrorKind, Tensor,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Cancellation is process-wide: the tests of this binary run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A run that takes longer than this is a hang: the watchdog ends the
/// process with a message instead of letting CI wait forever.
const HANG: Duration = Duration::from_secs(20);

/// The ids of this process's threads. Comparing sets (not counts) keeps
/// the test harness's threads, which come and go with the tests, out of
/// the comparison: a thread that appears during the runs and is still there
/// afterwards is a leak.
fn thread_ids() -> BTreeSet<u64> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task is readable")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Ends the process when no run finishes for [`HANG`].
struct Watchdog {
    beats: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start() -> Watchdog {
        let beats = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (beats, stop) = (beats.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut last = (0, Instant::now());
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                    let now = beats.load(Ordering::SeqCst);
                    if now != last.0 {
                        last = (now, Instant::now());
                    } else if last.1.elapsed() > HANG {
                        eprintln!("run {now} hung for {HANG:?} after cancellation");
                        std::process::exit(1);
                    }
                }
            })
        };
        Watchdog {
            beats,
            stop,
            thread: Some(thread),
        }
    }

    fn beat(&self) {
        self.beats.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A thread that calls `cancel_execution` after each requested delay and
/// reports when it did.
struct Canceller {
    requests: Option<mpsc::Sender<Duration>>,
    done: mpsc::Receiver<Instant>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Canceller {
    fn start() -> Canceller {
        let (requests, inbox) = mpsc::channel::<Duration>();
        let (report, done) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            for delay in inbox {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                cancel_execution();
                if report.send(Instant::now()).is_err() {
                    return;
                }
            }
        });
        Canceller {
            requests: Some(requests),
            done,
            thread: Some(thread),
        }
    }

    /// Cancels after `delay`, from the canceller's thread.
    fn cancel_after(&self, delay: Duration) {
        self.requests
            .as_ref()
            .expect("running")
            .send(delay)
            .expect("canceller alive");
    }

    /// When the last requested cancellation happened (waits for it).
    fn cancelled_at(&self) -> Instant {
        self.done.recv().expect("canceller alive")
    }
}

impl Drop for Canceller {
    fn drop(&mut self) {
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A condition that never turns false (the sum of a tanh state stays above
/// -1e9), so the loop ends only when cancelled.
fn forever(x: &Tensor<f32>) -> Tensor<bool> {
    x.sum(&[0, 1], false)
        .ge(&Tensor::scalar(-1.0e9, &x.device()))
}

fn step(x: Tensor<f32>) -> Tensor<f32> {
    (x.matmul(&x) * 1e-2 + 0.5).tanh()
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A staged `While` on `cpu:0`.
    While,
    /// A lazy trace holding a `While`, materialized by the read.
    Lazy,
    /// `cpu:1` loops, `cpu:0` waits for its result at a `Recv`.
    Partitioned,
}

#[test]
fn a_thousand_cancellations_from_another_thread() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cpu = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    let lazy_dev = Device::lazy(&cpu);
    // One staged function for every partitioned run (its trace is cached).
    let split = function(move |x: Tensor<f32>| {
        let far = with_device(&cpu1, || while_loop(x.clone(), forever, step));
        (&x + 1.0) + far
    });
    let run = |kind: Kind| -> stagecraft::Result<Vec<f32>> {
        match kind {
            Kind::While => while_loop(Tensor::<f32>::ones(&[8, 8], &cpu), forever, step).to_vec(),
            Kind::Lazy => {
                let x = Tensor::<f32>::ones(&[8, 8], &lazy_dev) * 0.5;
                let out = while_loop(x, forever, step) + 1.0;
                let read = out.to_vec();
                // A cancelled materialization leaves nothing pending.
                lazy::mark_step();
                read
            }
            Kind::Partitioned => split.call(Tensor::ones(&[8, 8], &cpu)).to_vec(),
        }
    };
    let kinds = [Kind::While, Kind::Lazy, Kind::Partitioned];

    let watchdog = Watchdog::start();
    let canceller = Canceller::start();
    // Warm-up: pools, device worker threads, caches and traces exist after
    // one cancelled run of each kind.
    for kind in kinds {
        canceller.cancel_after(Duration::from_millis(5));
        let err = run(kind).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{kind:?}: {err}");
        canceller.cancelled_at();
        restart();
    }
    let threads_before = thread_ids();
    let live_before = Buffer::stats().live_bytes;

    let start = Instant::now();
    let mut latencies = [Duration::ZERO; 3];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    const RUNS: usize = 1_000;
    for i in 0..RUNS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // 0 to 3 ms; one run in eight is cancelled before it starts.
        let delay = if seed.is_multiple_of(8) {
            Duration::ZERO
        } else {
            Duration::from_micros(seed % 3_000)
        };
        let kind = kinds[i % kinds.len()];
        canceller.cancel_after(delay);
        let result = run(kind);
        let returned = Instant::now();
        let cancelled_at = canceller.cancelled_at();
        restart();
        watchdog.beat();
        let err = match result {
            Ok(v) => panic!("run {i} ({kind:?}) finished with {} values", v.len()),
            Err(e) => e,
        };
        assert_eq!(
            err.kind(),
            ErrorKind::Cancelled,
            "run {i} ({kind:?}): {err}"
        );
        let latency = returned.saturating_duration_since(cancelled_at);
        let worst = &mut latencies[i % kinds.len()];
        *worst = (*worst).max(latency);
    }
    let elapsed = start.elapsed();

    // The runtime works again after the last restart.
    let ok = (Tensor::<f32>::ones(&[3], &cpu) * 2.0).to_vec().unwrap();
    assert_eq!(ok, vec![2.0; 3]);

    let threads_after = thread_ids();
    let new_threads: Vec<_> = threads_after.difference(&threads_before).collect();
    drop(canceller);
    drop(watchdog);
    let live_after = Buffer::stats().live_bytes;
    eprintln!(
        "{RUNS} cancelled runs in {elapsed:?}; worst latency from cancel to return: \
         while {:?}, lazy {:?}, partitioned {:?}; threads {} -> {}; \
         live buffer bytes {live_before} -> {live_after}",
        latencies[0],
        latencies[1],
        latencies[2],
        threads_before.len(),
        threads_after.len()
    );
    // "Promptly": loops check every iteration, a waiting Recv every 20 ms.
    for (kind, worst) in kinds.iter().zip(latencies) {
        assert!(
            worst < Duration::from_secs(2),
            "{kind:?} took {worst:?} to stop"
        );
    }
    assert!(
        new_threads.is_empty(),
        "threads leaked: {new_threads:?} appeared during {RUNS} runs and are still running"
    );
    assert!(
        live_after <= live_before,
        "buffers leaked: {live_before} live bytes after warm-up, {live_after} after {RUNS} runs"
    );
}

/// Loops `x = step(x)` `n` times (a counter in the state bounds it).
fn bounded(x: Tensor<f32>, n: f32) -> Tensor<f32> {
    let device = x.device();
    let (out, _) = while_loop(
        (x, Tensor::<f32>::scalar(0.0, &device)),
        |(_, i)| i.lt(&Tensor::scalar(n, &i.device())),
        |(x, i)| (step(x), i + 1.0),
    );
    out
}

#[test]
fn an_error_on_one_device_abandons_the_other_devices_work() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cpu = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    const ITERATIONS: f32 = 40_000.0;
    // `fail` on `failing` divides an integer by zero when `divisor` is 0;
    // the other device loops; the result needs both.
    let make = |looping: Device, failing: Device| {
        function(move |(x, divisor): (Tensor<f32>, Tensor<i32>)| {
            let long = with_device(&looping, || bounded(x.clone(), ITERATIONS));
            let quick = with_device(&failing, || (x.cast::<i32>() / &divisor).cast::<f32>());
            long.sum(&[0, 1], false) + quick.sum(&[0, 1], false)
        })
    };
    for (looping, failing) in [(cpu, cpu1), (cpu1, cpu)] {
        let f = make(looping, failing);
        let x = || Tensor::<f32>::ones(&[8, 8], &cpu);
        // The natural duration: the same call without the error.
        f.call((x(), Tensor::scalar(1, &cpu))).to_vec().unwrap();
        let t = Instant::now();
        f.call((x(), Tensor::scalar(1, &cpu))).to_vec().unwrap();
        let natural = t.elapsed();
        let t = Instant::now();
        let err = f.call((x(), Tensor::scalar(0, &cpu))).to_vec().unwrap_err();
        let failed = t.elapsed();
        eprintln!(
            "loop on {looping}, error on {failing}: natural {natural:?}, with the error {failed:?}"
        );
        assert_eq!(err.op(), Some("Div"), "{err}");
        assert!(
            failed * 5 < natural,
            "the loop on {looping} was not abandoned: {failed:?} with the error on {failing}, \
             {natural:?} without"
        );
    }
}
