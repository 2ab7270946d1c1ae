//! Keeping the pool's other threads awake while an in-order run goes on,
//! and for a moment after it.
//!
//! An idle rayon worker sleeps after a few rounds of finding nothing to do,
//! and waking it costs tens of microseconds on a virtual machine. A run of
//! in-order steps whose kernels split their work (a GEMM into row bands,
//! a large elementwise kernel into chunks) would pay that at every split:
//! by the time the sleeper wakes, the splitting thread has often done much
//! of the other half itself. So while such a run goes on, the other pool
//! threads stay awake looking for work, as OpenMP runtimes do with an
//! active wait policy; they stop when the run ends, or after
//! [`IDLE_LIMIT`] without finding work.
//!
//! After the run, one pool thread goes on looking for work for
//! [`LINGER`]: a training loop's next step arrives within that time (its
//! trace is recorded in the meantime), and the lingering thread starts it
//! at once instead of being woken. Measured on the MLP training step
//! (784-256-256-10, batch 128, 2 threads): 1.12 ms with sleeping workers,
//! 1.07 ms awake during runs, 0.98 ms lingering as well.
//!
//! Neither kind of job may hold up work below it on its thread's stack:
//! a thread that runs steps, or is already inside such a job, returns from
//! a newly picked-up one at once; in-order runs have nothing else that
//! waits. A lingering job picked up by a thread waiting inside some other
//! split (work outside stagecraft's runs) delays that wait by at most
//! [`LINGER`].

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a helper goes on looking for work after it last found some.
/// Long enough to span the gaps between split kernels of a step (a few
/// small kernels), short enough that a run doing serial work for long
/// does not keep a core busy for nothing.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(2);

/// How long a pool thread waits, awake, for the next run after one ends.
pub(crate) const LINGER: Duration = Duration::from_micros(500);

thread_local! {
    /// Set on a thread while it runs a run's steps, or a helper or
    /// lingering job: a job picked up there must not stay.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Sets [`BUSY`] for the guard's life, restoring the previous value.
struct Busy {
    outer: bool,
}

impl Busy {
    fn enter() -> Busy {
        Busy {
            outer: BUSY.with(|b| b.replace(true)),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.with(|b| b.set(self.outer));
    }
}

/// Runs `run` on a pool thread while the pool's other threads look for the
/// work its kernels split off, then leaves one pool thread awake for
/// [`LINGER`]. Called from outside the pool, or from a pool thread (then
/// `run` stays on it).
pub(crate) fn run_with_pool_awake<R: Send>(run: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    let helpers = rayon::current_num_threads().saturating_sub(1);
    let out = rayon::scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| look_for_work_until(&done));
        }
        /// Marks the run finished even if it panics, so helpers stop.
        struct Finish<'a>(&'a AtomicBool);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let _finish = Finish(&done);
        let _busy = Busy::enter();
        run()
    });
    if helpers > 0 {
        rayon::spawn(linger);
    }
    out
}

/// Runs pending pool work until `done`, or until none turned up for
/// [`IDLE_LIMIT`].
fn look_for_work_until(done: &AtomicBool) {
    if BUSY.with(|b| b.get()) {
        // Picked up by the running thread while it waits inside a split
        // of its own: staying would keep it from returning to the run.
        return;
    }
    let _busy = Busy::enter();
    let mut last_work = Instant::now();
    let mut rounds = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                last_work = Instant::now();
                rounds = 0;
            }
            Some(rayon::Yield::Idle) => {
                std::hint::spin_loop();
                rounds += 1;
                // Reading the clock every round would cost more than the
                // round itself.
                if rounds.is_multiple_of(64) && last_work.elapsed() > IDLE_LIMIT {
                    return;
                }
            }
            None => return,
        }
    }
}

/// Waits awake for pool work for up to [`LINGER`]; runs the first job that
/// turns up (the next run, typically) and returns.
fn linger() {
    if BUSY.with(|b| b.get()) {
        return;
    }
    let _busy = Busy::enter();
    let started = Instant::now();
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Idle) => {
                for _ in 0..32 {
                    std::hint::spin_loop();
                }
                if started.elapsed() > LINGER {
                    return;
                }
            }
            Some(rayon::Yield::Executed) | None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_stop_with_the_run_and_the_run_keeps_its_result() {
        let out = run_with_pool_awake(|| {
            // A split inside the run: its halves may go to a helper.
            let (a, b) = rayon::join(|| (0..1000u64).sum::<u64>(), || 7u64);
            a + b
        });
        assert_eq!(out, 499_507);
    }

    #[test]
    fn a_panicking_run_releases_its_helpers() {
        let caught = std::panic::catch_unwind(|| run_with_pool_awake(|| -> u32 { panic!("boom") }));
        assert!(caught.is_err());
        // The pool is usable afterwards (no helper is stuck), and the
        // thread that ran the steps no longer counts as busy.
        assert_eq!(run_with_pool_awake(|| 3), 3);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let _ = pool.install(|| {
            std::panic::catch_unwind(|| run_with_pool_awake(|| -> u32 { panic!("boom") }))
        });
        assert!(!pool.install(|| BUSY.with(|b| b.get())));
    }

    /// A helper or lingering job picked up by a busy thread leaves the
    /// pool's work alone and returns: run there, it would keep the thread
    /// from the run it is part of.
    #[test]
    fn jobs_picked_up_by_a_busy_thread_leave_the_work_to_the_run() {
        // One pool thread: nobody else can take the spawned job.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        for job in [0, 1] {
            let ran_early = pool.install(|| {
                let ran = AtomicBool::new(false);
                let done = AtomicBool::new(false);
                rayon::scope(|scope| {
                    scope.spawn(|_| ran.store(true, Ordering::Release));
                    let busy = Busy::enter();
                    match job {
                        0 => look_for_work_until(&done),
                        _ => linger(),
                    }
                    drop(busy);
                    ran.load(Ordering::Acquire)
                })
            });
            assert!(!ran_early, "job {job}");
        }
    }

    /// An idle lingering thread runs the next job that turns up.
    #[test]
    fn a_lingering_thread_takes_the_next_job() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let ran = pool.install(|| {
            let ran = AtomicBool::new(false);
            rayon::scope(|scope| {
                scope.spawn(|_| ran.store(true, Ordering::Release));
                linger();
                ran.load(Ordering::Acquire)
            })
        });
        assert!(ran);
    }
}
