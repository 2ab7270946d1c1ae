//! The core runtime: `execute`, fine-grained error propagation,
//! cancellation, the diagnostic handler and runtime statistics.

use crate::async_value::AsyncValue;
use crate::context;
use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{Args, InputMetas, OpInvocation, ReadyArgs, Results};
use stagecraft_ops::{Effect, OpAttrs, OpAttrsRef, OpDef};
use stagecraft_tensor::{
    DType, DenseHostTensor, Error, HostTensor, Location, Result, Shape, TensorMetadata, TensorValue,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A callback told about every error an op raises (not about errors that
/// merely propagate through later ops).
pub type DiagnosticHandler = Arc<dyn Fn(&Error) + Send + Sync>;

/// Read by every op: alone on its cache line, so the counters' writes
/// never evict it from another core's cache.
static CANCELLED: CacheLine<AtomicBool> = CacheLine(AtomicBool::new(false));
static DIAGNOSTIC_HANDLER: RwLock<Option<DiagnosticHandler>> = RwLock::new(None);

static OPS_EXECUTED: PerThreadCounter = PerThreadCounter::new();
static KERNEL_LAUNCHES: PerThreadCounter = PerThreadCounter::new();
static INLINE_RUNS: PerThreadCounter = PerThreadCounter::new();
static ERRORS_RAISED: AtomicU64 = AtomicU64::new(0);
static DEVICE_COPIES: AtomicU64 = AtomicU64::new(0);
static DEVICE_COPY_BYTES: AtomicU64 = AtomicU64::new(0);
static HOST_READS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static OPS_EXECUTED_HERE: CounterSlot = OPS_EXECUTED.slot();
    static KERNEL_LAUNCHES_HERE: CounterSlot = KERNEL_LAUNCHES.slot();
    static INLINE_RUNS_HERE: CounterSlot = INLINE_RUNS.slot();
}

/// A value alone on its cache line (128 bytes: adjacent-line prefetchers
/// pair 64-byte lines).
#[repr(align(128))]
struct CacheLine<T>(T);

/// A count that every thread adds to, each in a slot only it writes, so an
/// add is a plain load and store. An atomic read-modify-write instead
/// costs 10 ns on a virtual x86-64 host (measured by the `dispatch`
/// bench), and a small op bumps several counters; a single shared counter
/// would also move its cache line between the cores on every bump.
pub(crate) struct PerThreadCounter {
    slots: Mutex<Vec<Arc<CacheLine<AtomicU64>>>>,
    /// The counts of threads that have exited.
    retired: AtomicU64,
}

/// A thread's slot of a [`PerThreadCounter`]; the thread keeps it (in a
/// thread-local or a structure of its own) and adds through it. A clone
/// is the same slot, for the same thread.
#[derive(Clone)]
pub(crate) struct CounterSlot(Arc<CacheLine<AtomicU64>>);

impl PerThreadCounter {
    pub(crate) const fn new() -> PerThreadCounter {
        PerThreadCounter {
            slots: Mutex::new(Vec::new()),
            retired: AtomicU64::new(0),
        }
    }

    /// A new slot for the calling thread.
    pub(crate) fn slot(&self) -> CounterSlot {
        let slot = Arc::new(CacheLine(AtomicU64::new(0)));
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        // A slot only this list still holds belongs to a thread that has
        // exited: fold it in, so the list does not grow with every thread.
        slots.retain(|s| {
            let live = Arc::strong_count(s) > 1;
            if !live {
                self.retired
                    .fetch_add(s.0.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            live
        });
        slots.push(slot.clone());
        CounterSlot(slot)
    }

    /// Every thread's count.
    pub(crate) fn sum(&self) -> u64 {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        self.retired.load(Ordering::Relaxed)
            + slots
                .iter()
                .map(|s| s.0.load(Ordering::Relaxed))
                .sum::<u64>()
    }
}

impl CounterSlot {
    /// Adds `n`. Only the owning thread writes the slot, so no increment
    /// is lost without a locked instruction.
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        let count = &self.0 .0;
        count.store(count.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }
}

/// Adds one to `counter` through this thread's slot, kept in the
/// thread-local `slot`.
#[inline]
pub(crate) fn bump(counter: &PerThreadCounter, slot: &'static std::thread::LocalKey<CounterSlot>) {
    if slot.try_with(|s| s.add(1)).is_err() {
        // The thread-local is gone (an op run by a thread-local
        // destructor): count in a slot of its own.
        counter.slot().add(1);
    }
}

/// Counters since process start; compare two snapshots to measure a span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuntimeStats {
    /// Calls to [`execute`].
    pub ops_executed: u64,
    /// Kernels actually run (ops skipped by error propagation or
    /// cancellation run none).
    pub kernel_launches: u64,
    /// Ops run on the synchronous fast path: an op whose inputs were all
    /// available (and, for a side effect, every earlier one had run), run before `execute` returned with the output
    /// metadata and kernel its thread had prepared for the same op,
    /// attributes, dtypes and shapes (see [`crate::OpHandler::execute_ready`]).
    pub inline_runs: u64,
    /// Errors raised by metadata functions or kernels.
    pub errors_raised: u64,
    /// Explicit copies between devices.
    pub device_copies: u64,
    /// Bytes moved by those copies.
    pub device_copy_bytes: u64,
    /// Values read back by the user (`to_vec`, `item`, `Display`).
    pub host_reads: u64,
}

/// The current counters.
pub fn stats() -> RuntimeStats {
    RuntimeStats {
        ops_executed: OPS_EXECUTED.sum(),
        kernel_launches: KERNEL_LAUNCHES.sum(),
        inline_runs: INLINE_RUNS.sum(),
        errors_raised: ERRORS_RAISED.load(Ordering::Relaxed),
        device_copies: DEVICE_COPIES.load(Ordering::Relaxed),
        device_copy_bytes: DEVICE_COPY_BYTES.load(Ordering::Relaxed),
        host_reads: HOST_READS.load(Ordering::Relaxed),
    }
}

pub(crate) fn count_kernel_launch() {
    bump(&KERNEL_LAUNCHES, &KERNEL_LAUNCHES_HERE);
}

pub(crate) fn count_inline_run() {
    bump(&INLINE_RUNS, &INLINE_RUNS_HERE);
}

pub(crate) fn count_device_copy(bytes: usize) {
    DEVICE_COPIES.fetch_add(1, Ordering::Relaxed);
    DEVICE_COPY_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// Counts a read of a value by the user.
pub fn count_host_read() {
    HOST_READS.fetch_add(1, Ordering::Relaxed);
}

/// Installs (or with `None`, removes) the diagnostic handler.
pub fn set_diagnostic_handler(handler: Option<DiagnosticHandler>) {
    *DIAGNOSTIC_HANDLER
        .write()
        .unwrap_or_else(|p| p.into_inner()) = handler;
}

/// Records an error raised by an op and tells the diagnostic handler.
pub fn report_error(error: &Error) {
    ERRORS_RAISED.fetch_add(1, Ordering::Relaxed);
    let handler = DIAGNOSTIC_HANDLER
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    if let Some(handler) = handler {
        handler(error);
    }
}

/// Cancels execution: every pending op, and every op issued until
/// [`restart`], produces a cancellation error instead of running.
pub fn cancel_execution() {
    CANCELLED.0.store(true, Ordering::SeqCst);
}

/// Ends a cancellation: ops run normally again.
pub fn restart() {
    CANCELLED.0.store(false, Ordering::SeqCst);
}

/// True between [`cancel_execution`] and [`restart`].
#[inline]
pub fn is_cancelled() -> bool {
    CANCELLED.0.load(Ordering::Relaxed)
}

fn error_results(
    op: &OpDef,
    device: Device,
    metas: Option<&[TensorMetadata]>,
    error: &Error,
) -> Results {
    // A control-flow op whose metadata is unknown still yields one handle,
    // so the error is not lost; the typed layer pads to the expected count.
    let count = metas.map_or(op.outputs.max(1), |m| m.len());
    (0..count)
        .map(|i| {
            let meta: TensorMetadata = metas
                .and_then(|m| m.get(i).cloned())
                .unwrap_or_else(|| TensorMetadata::new(DType::F32, Shape::scalar()));
            TensorHandle::error(device, meta, error.clone())
        })
        .collect()
}

/// Executes `op` on `device` (through the device's op handler) and returns
/// one handle per output at once. Thread-safe.
///
/// In order: a cancelled runtime gives cancellation errors; an argument on
/// another device is copied to the op's (a `CopyToDevice` op, counted,
/// under this thread's [`crate::TransferGuard`], which may log or refuse
/// it); an argument that is
/// already an error is propagated to every output without running anything;
/// the op's metadata function validates inputs and attributes and computes
/// the output metadata (its error is tagged with the op and `location`,
/// reported to the diagnostic handler, and returned as error handles); then
/// the handler runs or schedules the kernel.
pub fn execute(
    op: &'static OpDef,
    device: Device,
    location: Location,
    args: Args,
    attrs: OpAttrsRef<'_>,
) -> Results {
    execute_ready_first(op, device, location, ReadyArgs::Owned(args), attrs)
}

/// [`execute`] on borrowed arguments: an op the device runs on its fast
/// path clones no argument handle; any other takes the full path on
/// clones.
pub fn execute_borrowed(
    op: &'static OpDef,
    device: Device,
    location: Location,
    args: &[&TensorHandle],
    attrs: &OpAttrs,
) -> Results {
    execute_ready_first(
        op,
        device,
        location,
        ReadyArgs::Borrowed(args),
        attrs.into(),
    )
}

/// Counts the op and checks cancellation, then offers the op to the
/// device's fast path, and runs the full path if the device declines.
fn execute_ready_first(
    op: &'static OpDef,
    device: Device,
    location: Location,
    args: ReadyArgs<'_>,
    attrs: OpAttrsRef<'_>,
) -> Results {
    bump(&OPS_EXECUTED, &OPS_EXECUTED_HERE);
    if is_cancelled() {
        let err = Error::cancelled().with_op(op.name).at(location);
        return error_results(op, device, None, &err);
    }
    // A side effect skips the chain only once every earlier one has run
    // (as the full path would run it then); until then it waits its turn.
    if op.effect == Effect::SideEffecting && !context::chain_resolved() {
        return execute_full(op, device, location, args.into_owned(), attrs);
    }
    match device
        .handler()
        .execute_ready(op, device, location, args, &attrs)
    {
        Ok(results) => results,
        Err(args) => execute_full(op, device, location, args.into_owned(), attrs),
    }
}

/// [`execute`] after the cancellation check, for an op the device did not
/// run on its fast path.
fn execute_full(
    op: &'static OpDef,
    device: Device,
    location: Location,
    mut args: Args,
    attrs: OpAttrsRef<'_>,
) -> Results {
    let foreign_ok = device.handler().captures_foreign_args();
    for k in 0..args.len() {
        let from = args[k].device();
        if from != device && !foreign_ok && args[k].resolved_error().is_none() {
            let meta = args[k].metadata().clone();
            if let Err(err) = crate::transfer::implicit_copy(op.name, from, device, &meta, location)
            {
                report_error(&err);
                return error_results(op, device, None, &err);
            }
            // The copy is the runtime's, not the user's: its error names
            // the op that needed it.
            args[k] = copy_for(&args[k], device, location, op.name);
        }
    }
    for arg in &args {
        if let Some(err) = arg.resolved_error() {
            let err = err.clone();
            let metas = op.infer(&input_metas(&args), &attrs).ok();
            return error_results(op, device, metas.as_deref(), &err);
        }
    }
    let inputs = input_metas(&args);
    let outputs = match op.infer(&inputs, &attrs) {
        Ok(metas) => metas,
        Err(err) => {
            let err = err.with_op(op.name).at(location);
            report_error(&err);
            return error_results(op, device, None, &err);
        }
    };
    let chain = match op.effect {
        // Run now, after every earlier side effect has: in order without
        // a chain (which costs an allocation and a lock per op).
        Effect::SideEffecting if device.handler().runs_inline() && context::chain_resolved() => {
            None
        }
        Effect::SideEffecting => {
            let next = Arc::new(AsyncValue::unavailable());
            Some((context::swap_chain(next.clone()), next))
        }
        Effect::Pure => None,
    };
    device.handler().execute(OpInvocation {
        op,
        device,
        location,
        args,
        inputs,
        attrs,
        outputs,
        chain,
    })
}

fn input_metas(args: &Args) -> InputMetas {
    args.iter().map(|a| a.metadata().clone()).collect()
}

/// Copies a tensor to another device (a new buffer on the target), counting
/// the copy. The only way values move between devices: host to host, into
/// a device's own memory (upload), out of it (download), or between two
/// devices through the host.
pub fn copy_to_device(handle: &TensorHandle, target: Device, location: Location) -> TensorHandle {
    copy_for(handle, target, location, "CopyToDevice")
}

/// [`copy_to_device`], with its error naming `op`.
fn copy_for(
    handle: &TensorHandle,
    target: Device,
    location: Location,
    op: &'static str,
) -> TensorHandle {
    if handle.device() == target {
        return handle.clone();
    }
    let meta = handle.metadata().clone();
    let copied = target.ensure_in_this_process().and_then(|()| {
        // A fill stays one value between host devices: densifying it could
        // need more memory than any machine has, and nothing is gained.
        if let (TensorValue::Host(HostTensor::Scalar(fill)), None) =
            (handle.wait_value()?, target.handler().memory())
        {
            count_device_copy(fill.metadata().dtype.size_in_bytes());
            return Ok(TensorHandle::available(target, fill.clone().into()));
        }
        let (host, fresh) = host_copy_of(handle)?;
        count_device_copy(host.buffer().len());
        match target.handler().memory() {
            Some(memory) => Ok(TensorHandle::available_on_device(
                target,
                memory.upload(&host)?,
            )),
            // A fresh download is already a copy of its own.
            None if fresh => Ok(TensorHandle::available(target, host.into())),
            None => Ok(TensorHandle::available(target, host.deep_copy().into())),
        }
    });
    match copied {
        Ok(handle) => handle,
        Err(e) => TensorHandle::error(target, meta, e.with_op(op).at(location)),
    }
}

/// The dense host value of `handle`, waiting for it (and copying it out of
/// device memory, counted as a copy); `true` when that made a new buffer.
pub(crate) fn host_copy_of(handle: &TensorHandle) -> Result<(DenseHostTensor, bool)> {
    match handle.wait_value()? {
        TensorValue::Host(host) => Ok((host.to_dense()?, false)),
        TensorValue::Device(value) => {
            let memory = handle.device().handler().memory().ok_or_else(|| {
                Error::internal(format!(
                    "{} holds a value in device memory but has no device memory",
                    handle.device()
                ))
            })?;
            Ok((memory.download(value)?, true))
        }
    }
}

/// The value of `handle` in host memory, for the user reading it: the
/// value itself on a host device, a download from a device's memory
/// (waiting for the kernels computing it) on a GPU.
pub fn read_to_host(handle: &TensorHandle) -> Result<HostTensor> {
    match handle.wait_value()? {
        TensorValue::Host(host) => Ok(host.clone()),
        TensorValue::Device(_) => {
            let (host, _) = host_copy_of(handle)?;
            count_device_copy(host.buffer().len());
            Ok(host.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_per_thread_counter_sums_every_threads_adds_and_keeps_exited_ones() {
        static COUNTER: PerThreadCounter = PerThreadCounter::new();
        std::thread::scope(|scope| {
            for t in 0..8u64 {
                scope.spawn(move || {
                    let slot = COUNTER.slot();
                    for _ in 0..1000 {
                        slot.add(t + 1);
                    }
                });
            }
        });
        assert_eq!(COUNTER.sum(), 1000 * 8 * 9 / 2);
        // A new slot folds the exited threads' slots in, losing nothing.
        let slot = COUNTER.slot();
        slot.add(5);
        assert_eq!(COUNTER.slots.lock().unwrap().len(), 1);
        assert_eq!(COUNTER.sum(), 1000 * 8 * 9 / 2 + 5);
    }

    #[test]
    fn the_cancel_flag_and_counter_slots_sit_on_their_own_lines() {
        assert_eq!(std::mem::align_of::<CacheLine<AtomicBool>>(), 128);
        assert_eq!(std::mem::align_of::<CacheLine<AtomicU64>>(), 128);
    }
}
