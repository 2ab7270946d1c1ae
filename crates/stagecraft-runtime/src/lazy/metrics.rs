//! The lazy runtime's counters, kept so that no thread waits for another
//! to count: ops recorded are counted per thread (summed when read), the
//! per-trace counters are process-wide atomics.

use crate::runtime::{bump, CounterSlot, PerThreadCounter};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// What made a trace run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// The user read a value (`to_vec`, `item`, `Display`).
    ValueRead,
    /// The host branched on a value (`item()` of a bool tensor).
    HostControlFlow,
    /// [`mark_step`](super::mark_step).
    MarkStep,
    /// The pending work reached the trace-length cap.
    TraceLimit,
}

/// Counters of the lazy runtime since the last [`reset_metrics`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LazyMetrics {
    /// Ops recorded on lazy devices.
    pub ops_recorded: u64,
    /// Traces compiled (cache misses, including widenings).
    pub traces_compiled: u64,
    /// Trace-cache lookups that found a compiled trace.
    pub cache_hits: u64,
    /// Lookups that had to compile.
    pub cache_misses: u64,
    /// Traces run.
    pub materializations: u64,
    /// Time spent building and compiling traces.
    pub compile_time: Duration,
    /// Time spent running traces.
    pub execute_time: Duration,
    /// Time spent collecting traces: walking the recorded ops, claiming
    /// them and writing each trace's structure as the words of its key.
    pub collect_time: Duration,
    /// Time spent hashing those words into trace-cache keys.
    pub key_time: Duration,
    /// Time spent looking keys up in the trace cache (comparing the
    /// structure, checking baked constants, gathering the arguments), on
    /// hits and misses alike; compiling a miss is in `compile_time`.
    pub lookup_time: Duration,
    /// Bytes of values handed to the host by reads.
    pub bytes_to_host: u64,
    /// Materializations caused by value reads.
    pub by_value_read: u64,
    /// Materializations caused by host decisions on values.
    pub by_host_control_flow: u64,
    /// Materializations caused by `mark_step`.
    pub by_mark_step: u64,
    /// Materializations caused by the trace-length cap.
    pub by_trace_limit: u64,
    /// Why the last cache miss missed (which part of the key changed).
    pub last_miss_reason: Option<String>,
    /// Buffers allocated fresh from the system (pool misses) since the
    /// last reset. Buffers are process-wide, so eager work counts too.
    pub buffer_allocations: u64,
    /// Buffer requests the pool served since the last reset.
    pub buffer_pool_hits: u64,
    /// Fresh buffer allocations between the last two `mark_step`s: 0 in a
    /// steady-state training loop.
    pub allocations_last_step: u64,
    /// Bytes held by live buffers now.
    pub live_bytes: u64,
    /// The most bytes live at once, over the process's life.
    pub peak_bytes: u64,
}

/// Per-trace counters: bumped a few times per materialization, never per
/// op, so threads sharing them cost each other nothing measurable.
struct Counters {
    traces_compiled: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    materializations: AtomicU64,
    compile_nanos: AtomicU64,
    execute_nanos: AtomicU64,
    collect_nanos: AtomicU64,
    key_nanos: AtomicU64,
    lookup_nanos: AtomicU64,
    bytes_to_host: AtomicU64,
    by_value_read: AtomicU64,
    by_host_control_flow: AtomicU64,
    by_mark_step: AtomicU64,
    by_trace_limit: AtomicU64,
    /// [`OPS_RECORDED`]'s sum at the last reset.
    ops_recorded_at_reset: AtomicU64,
    /// The allocator's counters at the last reset and the last `mark_step`.
    allocations_at_reset: AtomicU64,
    pool_hits_at_reset: AtomicU64,
    allocations_at_step: AtomicU64,
    allocations_last_step: AtomicU64,
}

static COUNTERS: Counters = Counters {
    traces_compiled: AtomicU64::new(0),
    cache_hits: AtomicU64::new(0),
    cache_misses: AtomicU64::new(0),
    materializations: AtomicU64::new(0),
    compile_nanos: AtomicU64::new(0),
    execute_nanos: AtomicU64::new(0),
    collect_nanos: AtomicU64::new(0),
    key_nanos: AtomicU64::new(0),
    lookup_nanos: AtomicU64::new(0),
    bytes_to_host: AtomicU64::new(0),
    by_value_read: AtomicU64::new(0),
    by_host_control_flow: AtomicU64::new(0),
    by_mark_step: AtomicU64::new(0),
    by_trace_limit: AtomicU64::new(0),
    ops_recorded_at_reset: AtomicU64::new(0),
    allocations_at_reset: AtomicU64::new(0),
    pool_hits_at_reset: AtomicU64::new(0),
    allocations_at_step: AtomicU64::new(0),
    allocations_last_step: AtomicU64::new(0),
};

/// Written on cache misses only.
static LAST_MISS_REASON: Mutex<Option<String>> = Mutex::new(None);

/// Ops recorded, counted by each thread in its own slot (so recording
/// never writes memory another thread uses). A reset remembers the sum
/// instead of zeroing other threads' slots.
static OPS_RECORDED: PerThreadCounter = PerThreadCounter::new();

thread_local! {
    static OPS_RECORDED_HERE: CounterSlot = OPS_RECORDED.slot();
}

/// Counts one recorded op.
pub(super) fn count_recorded_op() {
    bump(&OPS_RECORDED, &OPS_RECORDED_HERE);
}

pub(super) fn count_materialization(trigger: Trigger, build_time: Duration) {
    COUNTERS.materializations.fetch_add(1, Relaxed);
    let by = match trigger {
        Trigger::ValueRead => &COUNTERS.by_value_read,
        Trigger::HostControlFlow => &COUNTERS.by_host_control_flow,
        Trigger::MarkStep => &COUNTERS.by_mark_step,
        Trigger::TraceLimit => &COUNTERS.by_trace_limit,
    };
    by.fetch_add(1, Relaxed);
    add_nanos(&COUNTERS.compile_nanos, build_time);
}

pub(super) fn count_cache_hit() {
    COUNTERS.cache_hits.fetch_add(1, Relaxed);
}

/// A miss, whose reason stays readable until the next one.
pub(super) fn count_cache_miss(reason: String) {
    *LAST_MISS_REASON.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
}

pub(super) fn count_compile(time: Duration) {
    COUNTERS.cache_misses.fetch_add(1, Relaxed);
    COUNTERS.traces_compiled.fetch_add(1, Relaxed);
    add_nanos(&COUNTERS.compile_nanos, time);
}

pub(super) fn count_execution(time: Duration) {
    add_nanos(&COUNTERS.execute_nanos, time);
}

// A trace's collection, key hashing and cache lookup times.

pub(super) fn count_collection(time: Duration) {
    add_nanos(&COUNTERS.collect_nanos, time);
}

pub(super) fn count_key(time: Duration) {
    add_nanos(&COUNTERS.key_nanos, time);
}

pub(super) fn count_lookup(time: Duration) {
    add_nanos(&COUNTERS.lookup_nanos, time);
}

pub(super) fn count_bytes_to_host(bytes: u64) {
    COUNTERS.bytes_to_host.fetch_add(bytes, Relaxed);
}

/// Notes a `mark_step`: the allocations since the previous one become
/// `allocations_last_step`.
pub(super) fn count_step() {
    let now = stagecraft_tensor::Buffer::stats().allocations;
    let previous = COUNTERS.allocations_at_step.swap(now, Relaxed);
    COUNTERS
        .allocations_last_step
        .store(now.saturating_sub(previous), Relaxed);
}

fn add_nanos(counter: &AtomicU64, time: Duration) {
    counter.fetch_add(u64::try_from(time.as_nanos()).unwrap_or(u64::MAX), Relaxed);
}

/// The current counters.
pub fn metrics() -> LazyMetrics {
    let c = &COUNTERS;
    let recorded = OPS_RECORDED
        .sum()
        .saturating_sub(c.ops_recorded_at_reset.load(Relaxed));
    let stats = stagecraft_tensor::Buffer::stats();
    let allocations_at_reset = c.allocations_at_reset.load(Relaxed);
    LazyMetrics {
        ops_recorded: recorded,
        traces_compiled: c.traces_compiled.load(Relaxed),
        cache_hits: c.cache_hits.load(Relaxed),
        cache_misses: c.cache_misses.load(Relaxed),
        materializations: c.materializations.load(Relaxed),
        compile_time: Duration::from_nanos(c.compile_nanos.load(Relaxed)),
        execute_time: Duration::from_nanos(c.execute_nanos.load(Relaxed)),
        collect_time: Duration::from_nanos(c.collect_nanos.load(Relaxed)),
        key_time: Duration::from_nanos(c.key_nanos.load(Relaxed)),
        lookup_time: Duration::from_nanos(c.lookup_nanos.load(Relaxed)),
        bytes_to_host: c.bytes_to_host.load(Relaxed),
        by_value_read: c.by_value_read.load(Relaxed),
        by_host_control_flow: c.by_host_control_flow.load(Relaxed),
        by_mark_step: c.by_mark_step.load(Relaxed),
        by_trace_limit: c.by_trace_limit.load(Relaxed),
        last_miss_reason: LAST_MISS_REASON
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
        buffer_allocations: stats.allocations.saturating_sub(allocations_at_reset),
        buffer_pool_hits: stats
            .pool_hits
            .saturating_sub(c.pool_hits_at_reset.load(Relaxed)),
        allocations_last_step: c.allocations_last_step.load(Relaxed),
        live_bytes: stats.live_bytes,
        peak_bytes: stats.peak_bytes,
    }
}

/// Zeroes the counters (the trace cache is kept).
pub fn reset_metrics() {
    let c = &COUNTERS;
    for counter in [
        &c.traces_compiled,
        &c.cache_hits,
        &c.cache_misses,
        &c.materializations,
        &c.compile_nanos,
        &c.execute_nanos,
        &c.collect_nanos,
        &c.key_nanos,
        &c.lookup_nanos,
        &c.bytes_to_host,
        &c.by_value_read,
        &c.by_host_control_flow,
        &c.by_mark_step,
        &c.by_trace_limit,
        &c.allocations_last_step,
    ] {
        counter.store(0, Relaxed);
    }
    c.ops_recorded_at_reset.store(OPS_RECORDED.sum(), Relaxed);
    *LAST_MISS_REASON.lock().unwrap_or_else(|p| p.into_inner()) = None;
    let stats = stagecraft_tensor::Buffer::stats();
    c.allocations_at_reset.store(stats.allocations, Relaxed);
    c.pool_hits_at_reset.store(stats.pool_hits, Relaxed);
    c.allocations_at_step.store(stats.allocations, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's count stays in the total after the thread ends, so no
    /// recording is lost.
    #[test]
    fn an_exited_threads_recordings_stay_counted() {
        let before = OPS_RECORDED.sum();
        std::thread::spawn(|| {
            for _ in 0..5 {
                count_recorded_op();
            }
        })
        .join()
        .unwrap();
        // Other tests may record at the same time: at least these five.
        assert!(OPS_RECORDED.sum() >= before + 5);
        // A new thread's slot folds the exited one in, keeping its count.
        let after_exit = OPS_RECORDED.sum();
        std::thread::spawn(count_recorded_op).join().unwrap();
        assert!(OPS_RECORDED.sum() > after_exit);
    }
}
