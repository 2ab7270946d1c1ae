//! The rayon pool as the CPU device uses it: keeping its threads awake
//! while an in-order run goes on and for a moment after it, and splitting
//! a kernel's work from outside the pool with the calling thread taking a
//! share.
//!
//! An idle rayon worker sleeps after a few rounds of finding nothing to do,
//! and waking it costs tens of microseconds on a virtual machine. A run of
//! in-order steps whose kernels split their work (a GEMM into row bands,
//! a large elementwise kernel into chunks) would pay that at every split:
//! by the time the sleeper wakes, the splitting thread has often done much
//! of the other half itself. So while such a run goes on, the other pool
//! threads stay awake looking for work, as OpenMP runtimes do with an
//! active wait policy ([`run_with_pool_awake`]); they stop when the run
//! ends, or after [`IDLE_LIMIT`] without finding work.
//!
//! After the run, one pool thread lingers: it goes on looking for work
//! until none has turned up for [`LINGER`]. A training loop's next step
//! arrives within that time (its trace is recorded in the meantime), and
//! the lingering thread helps it from its start instead of being woken.
//! Measured on the MLP training step (784-256-256-10, batch 128, 2
//! threads): 1.12 ms with sleeping workers, 1.07 ms awake during runs,
//! 0.98 ms lingering as well.
//!
//! A kernel called from outside the pool (an eager op) that splits its
//! work would hand all of it to the pool and sleep until woken: two thread
//! switches. [`split_with_caller`] instead keeps the first part on the
//! calling thread and spawns the rest, which a lingering thread takes at
//! once, and leaves a thread lingering for the next op.
//!
//! A helper may not hold up work below it on its thread's stack: on a
//! thread that runs steps, or already helps, it returns at once (in-order
//! runs have nothing else that waits). A lingering job picked up by a
//! thread waiting inside some other split delays that wait by at most
//! [`LINGER`]; on a thread that runs steps, helps or lingers, it returns at
//! once.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a helper goes on looking for work after it last found some.
/// Long enough to span the gaps between split kernels of a step (a few
/// small kernels), short enough that a run doing serial work for long
/// does not keep a core busy for nothing.
pub const IDLE_LIMIT: Duration = Duration::from_millis(2);

/// How long a lingering thread goes on looking for work after it last
/// found some.
pub const LINGER: Duration = Duration::from_micros(500);

/// How long a caller that split its work spins for the other parts to end
/// before it sleeps until they do.
const CALLER_SPIN: Duration = Duration::from_millis(1);

/// Lingering jobs spawned and not yet finished: one is enough to start the
/// next run or take the next split's share, and more would take cores from
/// the thread recording the next step.
static LINGERING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set on a thread while it runs a run's steps or helps one.
    static BUSY: Cell<bool> = const { Cell::new(false) };
    /// Set on a thread while it lingers.
    static LINGERS: Cell<bool> = const { Cell::new(false) };
}

/// Sets a thread-local flag for the guard's life, restoring the previous
/// value.
struct Flag {
    flag: &'static std::thread::LocalKey<Cell<bool>>,
    outer: bool,
}

impl Flag {
    fn set(flag: &'static std::thread::LocalKey<Cell<bool>>) -> Flag {
        Flag {
            flag,
            outer: flag.with(|f| f.replace(true)),
        }
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        self.flag.with(|f| f.set(self.outer));
    }
}

/// Runs `run` on the calling thread while the pool's other threads look for
/// the work its kernels split off, then leaves a pool thread lingering.
///
/// From outside the pool, `run` stays on the caller rather than moving to
/// a pool thread: the caller would sleep until the run ended, and waking it
/// costs as much as starting a sleeping worker, twice per run counting the
/// hand-over (the MLP training step on 2 threads: 0.85 ms handed over, 0.78
/// on the caller). Its kernels split with [`split_with_caller`], so they
/// keep a share of their work too.
pub fn run_with_pool_awake<R: Send>(run: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    let helping = AtomicUsize::new(0);
    let helpers = rayon::current_num_threads().saturating_sub(1);
    let out = rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            helping.fetch_add(1, Ordering::AcqRel);
            let (done, helping) = (&done, &helping);
            scope.spawn(move |_| {
                help_until(done);
                helping.fetch_sub(1, Ordering::AcqRel);
            });
        }
        /// Marks the run finished even if it panics, so helpers stop.
        struct Finish<'a>(&'a AtomicBool);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let out = {
            let _finish = Finish(&done);
            let _busy = Flag::set(&BUSY);
            run()
        };
        // The scope waits for its helpers on a condition variable, as
        // `split_with_caller` does for its parts; they leave as soon as
        // they see `done`, so spin first.
        spin_until(|| helping.load(Ordering::Acquire) == 0);
        out
    });
    linger_for_next_job();
    out
}

/// Spins until `ready()`, for at most [`CALLER_SPIN`].
fn spin_until(ready: impl Fn() -> bool) {
    let started = Instant::now();
    let mut rounds = 0u32;
    while !ready() {
        std::hint::spin_loop();
        rounds += 1;
        if rounds.is_multiple_of(64) && started.elapsed() > CALLER_SPIN {
            return;
        }
    }
}

/// Runs `parts` in parallel from outside the pool, the first on the
/// calling thread and the others on pool threads, then leaves a pool
/// thread lingering for the next split. From inside the pool, a plain
/// parallel iteration.
pub(crate) fn split_with_caller<P: Send>(parts: Vec<P>, run: impl Fn(P) + Sync) {
    if parts.len() <= 1 {
        // Nothing to share: no scope, and no thread left lingering.
        return parts.into_iter().for_each(run);
    }
    // The forking is compiled once, for an index and a `dyn` callback,
    // rather than once per caller's closure: compiled per closure (over a
    // thousand of them, a kernel's per dtype and shape case), the rayon
    // scope and job code behind it was over half of this crate's LLVM IR
    // and of its build time. Each part is taken once, by its index.
    let parts: Vec<Mutex<Option<P>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    split_indices_with_caller(parts.len(), &|index| {
        let part = parts[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(part) = part {
            run(part);
        }
    });
}

/// [`split_with_caller`] over the indices `0..count` (at least 2).
fn split_indices_with_caller(count: usize, run: &(dyn Fn(usize) + Sync)) {
    use rayon::prelude::*;
    if rayon::current_thread_index().is_some() {
        return (0..count).into_par_iter().for_each(run);
    }
    let pending = &AtomicUsize::new(count - 1);
    rayon::in_place_scope(|scope| {
        for index in 1..count {
            scope.spawn(move |_| {
                run(index);
                pending.fetch_sub(1, Ordering::AcqRel);
            });
        }
        run(0);
        // The scope waits for the other parts on a condition variable,
        // and waking from it costs as much as starting a sleeping worker;
        // parts of equal size end at about the same time, so spin first.
        spin_until(|| pending.load(Ordering::Acquire) == 0);
    });
    linger_for_next_job();
}

/// `f(state, index, chunk)` over `data` cut into chunks of `chunk_len`
/// (`index` counting chunks), on the calling thread and the pool's other
/// threads, each taking the next chunk when it has finished one, with one
/// `init()` state per thread that takes any.
///
/// `par_chunks_mut(chunk_len).enumerate().for_each_init(init, f)` would do
/// the same inside the pool; from outside it, rayon hands all of the work
/// to pool threads and the caller sleeps until they are done, then takes
/// tens of microseconds to wake (see [`split_with_caller`]). Taking chunks
/// one at a time keeps a core slowed by a busy neighbour from holding up
/// the rest, as rayon's stealing does.
pub(crate) fn for_each_chunk_init<T: Send, S>(
    data: &mut [T],
    chunk_len: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize, &mut [T]) + Sync,
) {
    let chunk_len = chunk_len.max(1);
    let count = data.len().div_ceil(chunk_len);
    for_each_item_init(
        data.chunks_mut(chunk_len).enumerate(),
        count,
        init,
        |state, (index, chunk)| f(state, index, chunk),
    );
}

/// [`for_each_chunk_init`] with no per-thread state.
///
/// Most kernels split this way (over a thousand callers, per op, dtype and
/// shape case), so `f` is called through a pointer, once per chunk: the
/// loop taking chunks is compiled once per element type, not per caller.
pub(crate) fn for_each_chunk<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    each_chunk(data, chunk_len, &f);
}

/// [`for_each_chunk`] with `f` behind a pointer.
fn each_chunk<T: Send>(data: &mut [T], chunk_len: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let chunk_len = chunk_len.max(1);
    let count = data.len().div_ceil(chunk_len);
    let chunks = Mutex::new(data.chunks_mut(chunk_len).enumerate());
    run_workers(rayon::current_num_threads().min(count), &|| {
        while let Some((index, chunk)) = next_item(&chunks) {
            f(index, chunk);
        }
    });
}

/// `f(state, item)` for each of the `count` items of `items`, shared out
/// as [`for_each_chunk_init`] shares chunks: each thread takes the next
/// item when it has finished one, with one `init()` state per thread that
/// takes any. The items are taken in order, one at a time under a lock, so
/// they should be coarse (a block of rows, a tile), not elements.
///
/// What is compiled per caller is only the loop taking items; the forking
/// behind it is compiled once ([`run_workers`]). Over a thousand kernels
/// (per dtype and shape case) call this, and with the forking compiled per
/// caller it made up about a fifth of this crate's LLVM IR.
pub(crate) fn for_each_item_init<I, S>(
    items: I,
    count: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, I::Item) + Sync,
) where
    I: Iterator + Send,
{
    let items = Mutex::new(items);
    run_workers(rayon::current_num_threads().min(count), &|| {
        let Some(first) = next_item(&items) else {
            return;
        };
        let mut state = init();
        f(&mut state, first);
        while let Some(item) = next_item(&items) {
            f(&mut state, item);
        }
    });
}

/// The next of the shared `items`. A panic in a worker on another thread
/// poisons nothing this relies on: the iterator only hands out items.
fn next_item<I: Iterator>(items: &Mutex<I>) -> Option<I::Item> {
    items.lock().unwrap_or_else(PoisonError::into_inner).next()
}

/// `rayon::join` of two callbacks, compiled once rather than once per
/// caller's pair of closures (rayon's job code is large).
pub(crate) fn join(a: &mut (dyn FnMut() + Send), b: &mut (dyn FnMut() + Send)) {
    rayon::join(a, b);
}

/// Runs `worker` once on each of `workers` threads, the calling thread
/// among them (see [`split_with_caller`]); with one worker, on the calling
/// thread alone, with no scope and no thread left lingering.
fn run_workers(workers: usize, worker: &(dyn Fn() + Sync)) {
    match workers {
        0 => {}
        1 => worker(),
        _ => split_indices_with_caller(workers, &|_| worker()),
    }
}

/// Helps a run: runs pending pool work until `done`, or until none turned
/// up for [`IDLE_LIMIT`].
fn help_until(done: &AtomicBool) {
    if BUSY.with(|b| b.get()) {
        // Picked up by the running thread while it waits inside a split
        // of its own: staying would keep it from returning to the run.
        return;
    }
    let _busy = Flag::set(&BUSY);
    look_for_work(IDLE_LIMIT, Idle::Spin, || done.load(Ordering::Acquire));
}

/// Spawns a lingering job unless one is already there.
fn linger_for_next_job() {
    if rayon::current_num_threads() < 2 {
        // The one pool thread would take the core of the thread that
        // records the next step.
        return;
    }
    if LINGERING.fetch_add(1, Ordering::AcqRel) > 0 {
        LINGERING.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    rayon::spawn(|| {
        linger();
        LINGERING.fetch_sub(1, Ordering::AcqRel);
    });
}

/// Runs pending pool work until none has turned up for [`LINGER`].
fn linger() {
    if BUSY.with(|b| b.get()) || LINGERS.with(|l| l.get()) {
        return;
    }
    let _lingers = Flag::set(&LINGERS);
    // Yielding after a while: while the caller and another pool thread
    // run a long split, a spinning third thread would take a core from
    // one of them (B4's 1024³ product: 274 GFLOP/s spinning, 288
    // yielding). Spinning first answers the next run a little sooner
    // (the MLP step: 0.96 against 0.99 ms).
    look_for_work(LINGER, Idle::Yield, || false);
}

/// What a thread looking for work does between looks.
#[derive(Clone, Copy)]
enum Idle {
    /// Keeps its core: a run's helper, whose core is the run's.
    Spin,
    /// Spins for [`SPIN_BEFORE_YIELD`], then offers its core to the
    /// scheduler: a lingering thread, which may share a core with working
    /// ones.
    Yield,
}

/// How long a lingering thread spins before it yields between looks.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(100);

/// Runs pending pool work until `stop()`, or until none turned up for
/// `idle_limit`.
fn look_for_work(idle_limit: Duration, idle: Idle, stop: impl Fn() -> bool) {
    let mut last_work = Instant::now();
    let mut rounds = 0u32;
    let mut yielding = false;
    while !stop() {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                last_work = Instant::now();
                rounds = 0;
                yielding = false;
            }
            Some(rayon::Yield::Idle) => {
                if yielding {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                rounds += 1;
                // Reading the clock every round would cost more than the
                // round itself.
                if rounds.is_multiple_of(64) {
                    let idle_for = last_work.elapsed();
                    if idle_for > idle_limit {
                        return;
                    }
                    yielding = matches!(idle, Idle::Yield) && idle_for > SPIN_BEFORE_YIELD;
                }
            }
            None => return,
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

    /// A helper picked up by a thread that runs steps, or a lingering job
    /// picked up by one that runs steps or lingers, leaves the pool's work
    /// alone and returns: staying, it would keep the thread from what it
    /// was doing.
    #[test]
    fn jobs_picked_up_by_a_busy_thread_leave_the_work_alone() {
        // One pool thread: nobody else can take the spawned job.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let cases: [(&'static std::thread::LocalKey<Cell<bool>>, bool); 3] =
            [(&BUSY, true), (&BUSY, false), (&LINGERS, false)];
        for (flag, helper) in cases {
            let ran_early = pool.install(|| {
                let ran = AtomicBool::new(false);
                let done = AtomicBool::new(false);
                rayon::scope(|scope| {
                    scope.spawn(|_| ran.store(true, Ordering::Release));
                    let set = Flag::set(flag);
                    if helper {
                        help_until(&done)
                    } else {
                        linger()
                    }
                    drop(set);
                    ran.load(Ordering::Acquire)
                })
            });
            assert!(!ran_early, "helper {helper}");
        }
    }

    /// An idle lingering thread runs the jobs that turn up, then stops.
    #[test]
    fn a_lingering_thread_takes_the_next_jobs() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let ran = pool.install(|| {
            let ran = AtomicUsize::new(0);
            rayon::scope(|scope| {
                scope.spawn(|_| {
                    ran.fetch_add(1, Ordering::AcqRel);
                });
                scope.spawn(|_| {
                    ran.fetch_add(1, Ordering::AcqRel);
                });
                linger();
                ran.load(Ordering::Acquire)
            })
        });
        assert_eq!(ran, 2);
    }

    /// The caller takes the first part; every part runs once, in or out
    /// of the pool.
    #[test]
    fn a_split_runs_every_part_once() {
        for in_pool in [false, true] {
            let seen: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
            let caller = std::thread::current().id();
            let first_on_caller = AtomicBool::new(false);
            let split = || {
                split_with_caller((0..5).collect(), |p: usize| {
                    seen[p].fetch_add(1, Ordering::AcqRel);
                    if p == 0 && std::thread::current().id() == caller {
                        first_on_caller.store(true, Ordering::Release);
                    }
                })
            };
            if in_pool {
                rayon::scope(|_| split());
            } else {
                split();
                assert!(first_on_caller.load(Ordering::Acquire));
            }
            assert!(seen.iter().all(|s| s.load(Ordering::Acquire) == 1));
        }
    }

    /// Every item is visited once, in or out of the pool, with a state
    /// made on the thread that visits it; no items, no state.
    #[test]
    fn items_are_each_visited_once_with_a_state_per_thread() {
        for in_pool in [false, true] {
            let seen: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
            let states = AtomicUsize::new(0);
            let visit = || {
                for_each_item_init(
                    (0..100).map(|i| i * 3),
                    100,
                    || {
                        states.fetch_add(1, Ordering::AcqRel);
                        std::thread::current().id()
                    },
                    |owner, item| {
                        assert_eq!(*owner, std::thread::current().id());
                        seen[item / 3].fetch_add(1, Ordering::AcqRel);
                    },
                )
            };
            if in_pool {
                rayon::scope(|_| visit());
            } else {
                visit();
            }
            assert!(seen.iter().all(|s| s.load(Ordering::Acquire) == 1));
            let made = states.load(Ordering::Acquire);
            assert!((1..=rayon::current_num_threads()).contains(&made), "{made}");
            for_each_item_init(0..0, 0, || panic!("no items, no state"), |(), _: i32| {});
        }
    }

    /// Both halves of a join run and leave their results.
    #[test]
    fn a_join_runs_both_sides() {
        let (mut a, mut b) = (0, 0);
        join(&mut || a = 1, &mut || b = 2);
        assert_eq!((a, b), (1, 2));
    }

    /// Every chunk is visited once, with its index, its length and a state
    /// made on the thread that visits it, from outside the pool and inside
    /// it, with the last chunk short; an empty slice visits nothing.
    #[test]
    fn chunks_are_each_visited_once() {
        for in_pool in [false, true] {
            let mut data: Vec<usize> = vec![0; 1000];
            let states = AtomicUsize::new(0);
            let visit = |data: &mut [usize]| {
                for_each_chunk_init(
                    data,
                    64,
                    || {
                        states.fetch_add(1, Ordering::AcqRel);
                        std::thread::current().id()
                    },
                    |owner, index, chunk| {
                        assert_eq!(*owner, std::thread::current().id());
                        assert_eq!(chunk.len(), if index == 15 { 1000 - 15 * 64 } else { 64 });
                        for (i, v) in chunk.iter_mut().enumerate() {
                            *v += index * 64 + i + 1;
                        }
                    },
                )
            };
            if in_pool {
                rayon::scope(|_| visit(&mut data));
            } else {
                visit(&mut data);
            }
            assert!(data.iter().enumerate().all(|(i, &v)| v == i + 1));
            let made = states.load(Ordering::Acquire);
            assert!((1..=rayon::current_num_threads()).contains(&made), "{made}");
            for_each_chunk(&mut data[..0], 64, |_, _| {
                panic!("an empty slice has no chunks")
            });
        }
    }
}
