//! A value that becomes available later, or becomes an error.
//!
//! States and their only legal transitions:
//! `Unavailable → Available(T)` or `Unavailable → Error(e)`; a resolved
//! value never changes again. Waiters registered with [`AsyncValue::and_then`]
//! run exactly once, on the thread that resolves the value (or at once if it
//! is already resolved). Blocking is only for the user-facing reads
//! ([`AsyncValue::wait`]); the runtime itself never blocks on a value.

use stagecraft_tensor::{Error, Result};
use std::sync::{Mutex, OnceLock};

type Waiter = Box<dyn FnOnce() + Send>;

/// A write-once slot with callbacks.
pub struct AsyncValue<T> {
    /// A value resolved when it was created: most eager outputs. Filling
    /// `slot` instead would run `OnceLock`'s one-time initialization (two
    /// atomic operations and a call) on every op.
    ready: Option<Result<T>>,
    /// A value resolved later, by [`AsyncValue::set`].
    slot: OnceLock<Result<T>>,
    waiters: Mutex<Vec<Waiter>>,
}

impl<T> AsyncValue<T> {
    /// An unavailable value.
    pub fn unavailable() -> AsyncValue<T> {
        AsyncValue {
            ready: None,
            slot: OnceLock::new(),
            waiters: Mutex::new(Vec::new()),
        }
    }

    /// An already available value.
    pub fn available(value: T) -> AsyncValue<T> {
        AsyncValue::resolved(Ok(value))
    }

    /// An already failed value.
    pub fn error(error: Error) -> AsyncValue<T> {
        AsyncValue::resolved(Err(error))
    }

    fn resolved(result: Result<T>) -> AsyncValue<T> {
        AsyncValue {
            ready: Some(result),
            slot: OnceLock::new(),
            waiters: Mutex::new(Vec::new()),
        }
    }

    /// True once the value or an error is set.
    #[inline]
    pub fn is_resolved(&self) -> bool {
        self.try_get().is_some()
    }

    /// The value or error, if resolved.
    #[inline]
    pub fn try_get(&self) -> Option<&Result<T>> {
        match &self.ready {
            Some(result) => Some(result),
            None => self.slot.get(),
        }
    }

    /// Resolves the value and runs the waiters.
    ///
    /// # Panics
    /// If the value was already resolved: a runtime bug (each output has
    /// exactly one producer).
    pub fn set(&self, result: Result<T>) {
        if self.ready.is_some() || self.slot.set(result).is_err() {
            panic!("an async value was resolved twice");
        }
        // Take the waiters under the lock, run them outside it: a waiter may
        // register further waiters on other values.
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
        for waiter in waiters {
            waiter();
        }
    }

    /// Runs `f` once the value is resolved: now, if it already is.
    pub fn and_then(&self, f: impl FnOnce() + Send + 'static) {
        if self.is_resolved() {
            return f();
        }
        let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        // Re-check under the lock: `set` stores the value before taking the
        // lock, so either we see it here or `set` sees our waiter.
        if self.is_resolved() {
            drop(waiters);
            return f();
        }
        waiters.push(Box::new(f));
    }

    /// Blocks the calling thread until the value is resolved.
    pub fn wait(&self) -> &Result<T> {
        if let Some(result) = self.try_get() {
            return result;
        }
        let thread = std::thread::current();
        self.and_then(move || thread.unpark());
        loop {
            if let Some(result) = self.slot.get() {
                return result;
            }
            std::thread::park();
        }
    }

    /// The resolved result, consuming the slot (for stealing a buffer from
    /// the last reference).
    pub fn into_inner(self) -> Option<Result<T>> {
        self.ready.or_else(|| self.slot.into_inner())
    }
}

/// The value of a chain: ordering only, no data. Side-effecting ops take
/// the previous chain as a dependency and produce the next one.
pub type Chain = std::sync::Arc<AsyncValue<()>>;

/// A chain that is already satisfied.
pub fn ready_chain() -> Chain {
    std::sync::Arc::new(AsyncValue::available(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn waiters_run_once_on_resolution() {
        let v = Arc::new(AsyncValue::<i32>::unavailable());
        let hits = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let hits = hits.clone();
            v.and_then(move || {
                hits.fetch_add(1, Ordering::SeqCst);
            });
        }
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        v.set(Ok(5));
        assert_eq!(hits.load(Ordering::SeqCst), 3);
        let h = hits.clone();
        v.and_then(move || {
            h.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 4);
        assert_eq!(*v.wait().as_ref().unwrap(), 5);
    }

    #[test]
    fn a_value_resolved_at_creation_reads_runs_waiters_and_moves_out() {
        let v = AsyncValue::available(7u32);
        assert!(v.is_resolved());
        assert_eq!(*v.wait().as_ref().unwrap(), 7);
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        v.and_then(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(v.into_inner().unwrap().unwrap(), 7);
        let failed = AsyncValue::<u32>::error(Error::invalid("no"));
        assert!(failed.try_get().unwrap().is_err());
    }

    #[test]
    #[should_panic(expected = "resolved twice")]
    fn a_value_resolved_at_creation_cannot_be_set_again() {
        AsyncValue::available(1u8).set(Ok(2));
    }

    #[test]
    fn wait_blocks_until_another_thread_sets() {
        let v = Arc::new(AsyncValue::<String>::unavailable());
        let setter = {
            let v = v.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                v.set(Err(Error::invalid("boom")));
            })
        };
        assert!(v.wait().is_err());
        setter.join().unwrap();
    }

    #[test]
    fn racing_set_and_and_then_never_lose_a_waiter() {
        // Fewer rounds under Miri, which explores interleavings itself.
        let rounds = if cfg!(miri) { 20 } else { 200 };
        for _ in 0..rounds {
            let v = Arc::new(AsyncValue::<u8>::unavailable());
            let hit = Arc::new(AtomicUsize::new(0));
            let t = {
                let v = v.clone();
                std::thread::spawn(move || v.set(Ok(1)))
            };
            let h = hit.clone();
            v.and_then(move || {
                h.fetch_add(1, Ordering::SeqCst);
            });
            t.join().unwrap();
            assert_eq!(hit.load(Ordering::SeqCst), 1);
        }
    }

    #[test]
    fn many_threads_wait_register_and_one_resolves() {
        let v = Arc::new(AsyncValue::<Vec<u32>>::unavailable());
        let hits = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (v, hits) = (v.clone(), hits.clone());
                std::thread::spawn(move || {
                    let h = hits.clone();
                    v.and_then(move || {
                        h.fetch_add(1, Ordering::SeqCst);
                    });
                    // Half the threads block in wait, the others poll.
                    if i % 2 == 0 {
                        v.wait().as_ref().unwrap().len()
                    } else {
                        loop {
                            if let Some(r) = v.try_get() {
                                break r.as_ref().unwrap().len();
                            }
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        v.set(Ok(vec![1, 2, 3]));
        for t in threads {
            assert_eq!(t.join().unwrap(), 3);
        }
        assert_eq!(hits.load(Ordering::SeqCst), 4);
        // The last reference takes the value out.
        let v = Arc::try_unwrap(v).ok().expect("unique");
        assert_eq!(v.into_inner().unwrap().unwrap(), vec![1, 2, 3]);
    }
}
