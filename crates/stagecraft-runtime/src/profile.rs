//! Profiling hooks: when enabled, kernels, trace compiles, trace-cache
//! lookups, materializations and host reads record timed events that a
//! tool drains at the end (the `stagecraft` command writes them as a
//! Chrome trace-event file).
//!
//! Off by default. The hot path pays one relaxed atomic load per hook while
//! profiling is off ([`begin`] returns `None`). Events go to a per-thread
//! buffer (an uncontended lock), registered once per thread, so threads of
//! the worker pool never contend with each other; [`take_events`] drains
//! every buffer.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// Every thread's buffer, so that [`take_events`] can drain them all.
static BUFFERS: Mutex<Vec<Arc<Mutex<Vec<Event>>>>> = Mutex::new(Vec::new());

thread_local! {
    static LOCAL: OnceCell<(u64, Arc<Mutex<Vec<Event>>>)> = const { OnceCell::new() };
}

/// The instant event times are measured from (the first use of this module).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// One timed event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// What ran: an op name, a trace name, `cache hit`, ...
    pub name: Cow<'static, str>,
    /// The kind of event: [`OP`], [`KERNEL`], [`COMPILE`], [`CACHE`],
    /// [`MATERIALIZE`], [`TRANSFER`], or a caller's own category.
    pub category: &'static str,
    /// Start, in microseconds since profiling's epoch.
    pub start_us: f64,
    /// Duration in microseconds (0 for instants such as cache hits).
    pub duration_us: f64,
    /// A small per-thread number (1 for the first thread that recorded).
    pub thread: u64,
    /// Extra facts: bytes moved, ops in a trace, why a lookup missed.
    pub args: Vec<(&'static str, String)>,
}

/// An op's kernel run eagerly by the CPU op handler.
pub const OP: &str = "op";
/// A kernel run by the executor inside a compiled trace or function.
pub const KERNEL: &str = "kernel";
/// A lazy trace compiled (built, optimized, instantiated).
pub const COMPILE: &str = "compile";
/// A trace-cache lookup (`cache hit` or `cache miss`).
pub const CACHE: &str = "cache";
/// A lazy materialization: collecting, looking up and running one trace.
pub const MATERIALIZE: &str = "materialize";
/// A value handed to the host (`to_vec`, `item`, `Display`).
pub const TRANSFER: &str = "transfer";

/// Starts (or with `false`, stops) recording events.
pub fn set_enabled(on: bool) {
    epoch();
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether events are being recorded.
#[inline]
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A started event; [`Span::end`] records it.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    start: Instant,
}

/// Starts a span when profiling is on (else `None`, at the cost of one
/// relaxed load).
#[inline]
pub fn begin() -> Option<Span> {
    if is_enabled() {
        Some(Span {
            start: Instant::now(),
        })
    } else {
        None
    }
}

impl Span {
    /// Records the span as an event ending now.
    pub fn end(
        self,
        category: &'static str,
        name: impl Into<Cow<'static, str>>,
        args: Vec<(&'static str, String)>,
    ) {
        let start_us = self.start.saturating_duration_since(epoch()).as_secs_f64() * 1e6;
        let duration_us = self.start.elapsed().as_secs_f64() * 1e6;
        push(Event {
            name: name.into(),
            category,
            start_us,
            duration_us,
            thread: 0,
            args,
        });
    }
}

/// Runs `f` and records it as a span. Out of line and cold: callers test
/// [`is_enabled`] first, so the code on their hot path stays as it was.
#[cold]
#[inline(never)]
pub fn timed<R>(category: &'static str, name: &'static str, f: impl FnOnce() -> R) -> R {
    let start = Instant::now();
    let result = f();
    Span { start }.end(category, name, Vec::new());
    result
}

/// Records an instant event (a cache hit, say; duration 0) when profiling
/// is on.
pub fn instant(
    category: &'static str,
    name: impl Into<Cow<'static, str>>,
    args: Vec<(&'static str, String)>,
) {
    if is_enabled() {
        push(Event {
            name: name.into(),
            category,
            start_us: epoch().elapsed().as_secs_f64() * 1e6,
            duration_us: 0.0,
            thread: 0,
            args,
        });
    }
}

fn push(mut event: Event) {
    LOCAL.with(|cell| {
        let (thread, buffer) = cell.get_or_init(|| {
            let buffer = Arc::new(Mutex::new(Vec::new()));
            BUFFERS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(buffer.clone());
            (NEXT_THREAD.fetch_add(1, Ordering::Relaxed), buffer)
        });
        event.thread = *thread;
        buffer.lock().unwrap_or_else(|p| p.into_inner()).push(event);
    });
}

/// Drains the events every thread recorded, ordered by start time.
pub fn take_events() -> Vec<Event> {
    let buffers = BUFFERS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut events: Vec<Event> = buffers
        .iter()
        .flat_map(|b| std::mem::take(&mut *b.lock().unwrap_or_else(|p| p.into_inner())))
        .collect();
    events.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_recorded_only_while_enabled() {
        // The only test in this crate that turns profiling on, so the
        // events drained here are its own.
        assert!(begin().is_none());
        set_enabled(true);
        let span = begin().expect("enabled");
        span.end(CACHE, "cache hit", vec![("trace", "t".into())]);
        let other = std::thread::spawn(|| instant(TRANSFER, "to host", vec![]));
        other.join().unwrap();
        set_enabled(false);
        instant(OP, "ignored", vec![]);
        // Tests running beside this one may add kernel events: look at
        // this test's own.
        let events: Vec<Event> = take_events()
            .into_iter()
            .filter(|e| matches!(&*e.name, "cache hit" | "to host" | "ignored"))
            .collect();
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(events
            .iter()
            .any(|e| e.category == CACHE && e.name == "cache hit"));
        assert!(events.iter().any(|e| e.category == TRANSFER));
        assert_ne!(events[0].thread, events[1].thread);
    }
}
