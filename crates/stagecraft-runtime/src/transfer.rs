//! Transfer guards: what an implicit copy between devices does on this
//! thread. A copy is implicit when the runtime makes it for the user:
//! reading a device tensor's values (`to_vec`, `item`, `Display`), and an
//! eager op whose argument lives on another device than the one the op
//! was placed on (the argument is copied there first, as a `CopyToDevice`
//! op). Explicit copies (`to_device`, `to_host`, values handed to host
//! closures) always pass.
//!
//! The guard is thread-local and nests; the counters are process-wide.

use crate::device::{Device, DeviceKind};
use stagecraft_tensor::{Error, ErrorKind, Location, Result, TensorMetadata};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// What an implicit copy does on this thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransferGuard {
    /// Copy (and count) silently.
    #[default]
    Allow,
    /// Copy, and log the copy with its source location to standard error
    /// and to this thread's [`take_transfer_log`].
    Log,
    /// Refuse: the read or op returns an error naming the copy and its
    /// location.
    Disallow,
}

thread_local! {
    static GUARDS: RefCell<Vec<TransferGuard>> = const { RefCell::new(Vec::new()) };
    static LOG: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `guard` deciding what implicit copies do on this thread:
/// reading a device tensor's values with `to_vec`, `item` or `Display`
/// (also inside staged code), and an op's argument copied to the device
/// the op runs on. Explicit copies — `to_host()`, `to_device(&d)`,
/// `host_call` — always pass. Guards nest; the previous one returns
/// afterwards, even if `f` panics.
pub fn transfer_guard<R>(guard: TransferGuard, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            GUARDS.with(|g| g.borrow_mut().pop());
        }
    }
    GUARDS.with(|g| g.borrow_mut().push(guard));
    let _pop = Pop;
    f()
}

/// This thread's current guard.
pub fn current_transfer_guard() -> TransferGuard {
    GUARDS.with(|g| g.borrow().last().copied().unwrap_or_default())
}

/// Takes the lines this thread logged under [`TransferGuard::Log`].
pub fn take_transfer_log() -> Vec<String> {
    LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

/// Implicit and explicit copies since process start, over all threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Implicit copies that happened (allowed or logged).
    pub implicit: u64,
    /// Implicit copies refused by [`TransferGuard::Disallow`].
    pub refused: u64,
    /// Of `implicit`, those logged.
    pub logged: u64,
    /// Explicit copies: `to_host`, `to_device`, and values handed to host
    /// closures by `host_call`.
    pub explicit: u64,
}

struct Counters {
    implicit: AtomicU64,
    refused: AtomicU64,
    logged: AtomicU64,
    explicit: AtomicU64,
}

static TRANSFERS: Counters = Counters {
    implicit: AtomicU64::new(0),
    refused: AtomicU64::new(0),
    logged: AtomicU64::new(0),
    explicit: AtomicU64::new(0),
};

/// The transfer counters.
pub fn transfer_stats() -> TransferStats {
    TransferStats {
        implicit: TRANSFERS.implicit.load(Ordering::Relaxed),
        refused: TRANSFERS.refused.load(Ordering::Relaxed),
        logged: TRANSFERS.logged.load(Ordering::Relaxed),
        explicit: TRANSFERS.explicit.load(Ordering::Relaxed),
    }
}

/// Counts an explicit copy (`to_host`, `to_device`, a host call's values).
pub fn count_explicit_copy() {
    TRANSFERS.explicit.fetch_add(1, Ordering::Relaxed);
}

/// Applies this thread's guard to an implicit device-to-host copy of a
/// `meta` value living on `device`, read by `what` at `location` (`None`
/// where Rust gives no caller, as in `Display`). Values already on the
/// host device are not copies.
pub fn implicit_read(
    what: &str,
    device: Device,
    meta: &TensorMetadata,
    location: Option<Location>,
) -> Result<()> {
    if device.kind() == DeviceKind::Host {
        return Ok(());
    }
    let copy = format!("implicit device-to-host copy of {meta} from {device} by {what}");
    guarded(&copy, what, "copy explicitly with .to_host()", location)
}

/// Applies this thread's guard to an implicit copy of an argument of `op`
/// (a `meta` value) from `from` to `to`, where the op was placed.
pub fn implicit_copy(
    op: &str,
    from: Device,
    to: Device,
    meta: &TensorMetadata,
    location: Location,
) -> Result<()> {
    let copy = format!("implicit copy of {meta} from {from} to {to} for {op}");
    let fix = format!("copy it explicitly with .to_device(&{to})");
    guarded(&copy, op, &fix, Some(location))
}

fn guarded(copy: &str, what: &str, fix: &str, location: Option<Location>) -> Result<()> {
    let place = match location {
        Some(l) => format!(" at {l}"),
        None => String::new(),
    };
    let staged = if crate::tracing::is_tracing() {
        " inside staged code"
    } else {
        ""
    };
    match current_transfer_guard() {
        TransferGuard::Allow => {
            TRANSFERS.implicit.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        TransferGuard::Log => {
            TRANSFERS.implicit.fetch_add(1, Ordering::Relaxed);
            TRANSFERS.logged.fetch_add(1, Ordering::Relaxed);
            let line = format!("{copy}{staged}{place}");
            eprintln!("stagecraft: {line}");
            LOG.with(|l| l.borrow_mut().push(line));
            Ok(())
        }
        TransferGuard::Disallow => {
            TRANSFERS.refused.fetch_add(1, Ordering::Relaxed);
            let err = Error::new(
                ErrorKind::Device,
                format!("{copy}{staged} is disallowed by the transfer guard; {fix}"),
            )
            .with_op(what.to_string());
            Err(match location {
                Some(l) => err.at(l),
                None => err,
            })
        }
    }
}
