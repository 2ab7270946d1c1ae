//! The per-thread context: device scope, execution mode and the chain that
//! orders side-effecting ops. Two threads never see each other's settings.

use crate::async_value::{ready_chain, Chain};
use crate::device::Device;
use crate::handle::TensorHandle;
use std::cell::RefCell;
use std::sync::RwLock;

/// How the CPU op handler runs kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ExecutionMode {
    /// `execute` runs the kernel before returning.
    #[default]
    Sync,
    /// `execute` returns pending handles at once; kernels run on a worker
    /// pool as soon as their inputs are ready.
    Async,
}

#[derive(Default)]
struct Context {
    devices: Vec<Device>,
    mode: ExecutionMode,
    chain: Option<Chain>,
}

thread_local! {
    static CONTEXT: RefCell<Context> = RefCell::new(Context::default());
}

static DEFAULT_DEVICE: RwLock<Option<Device>> = RwLock::new(None);

/// Runs `f` with `device` as this thread's device scope; ops created inside
/// are placed on it. Scopes nest; the previous scope returns afterwards,
/// even if `f` panics.
pub fn with_device<R>(device: &Device, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            CONTEXT.with(|c| c.borrow_mut().devices.pop());
        }
    }
    CONTEXT.with(|c| c.borrow_mut().devices.push(*device));
    let _pop = Pop;
    f()
}

/// The innermost device scope of this thread, if any.
pub fn scoped_device() -> Option<Device> {
    CONTEXT.with(|c| c.borrow().devices.last().copied())
}

/// The process-wide default device (`cpu:0` unless changed).
pub fn default_device() -> Device {
    DEFAULT_DEVICE
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_else(Device::cpu)
}

/// Changes the process-wide default device.
pub fn set_default_device(device: Device) {
    *DEFAULT_DEVICE.write().unwrap_or_else(|p| p.into_inner()) = Some(device);
}

/// Eager placement: the explicit scope, else the first input's device,
/// else the default device (while tracing a function: the tracer).
pub fn place(args: &[TensorHandle]) -> Device {
    place_after(args.first())
}

/// [`place`] for borrowed arguments.
pub fn place_borrowed(args: &[&TensorHandle]) -> Device {
    place_after(args.first().copied())
}

fn place_after(first: Option<&TensorHandle>) -> Device {
    if crate::tracing::is_tracing() {
        // Inside a traced closure every op is recorded; an explicit scope
        // becomes the node's requested device.
        return crate::tracing::tracer_device();
    }
    scoped_device()
        .or_else(|| first.map(|a| a.device()))
        .unwrap_or_else(default_device)
}

/// This thread's execution mode.
pub fn execution_mode() -> ExecutionMode {
    CONTEXT.with(|c| c.borrow().mode)
}

/// Sets this thread's execution mode.
pub fn set_execution_mode(mode: ExecutionMode) {
    CONTEXT.with(|c| c.borrow_mut().mode = mode);
}

/// Runs `f` in `mode`, restoring the previous mode afterwards.
pub fn with_execution_mode<R>(mode: ExecutionMode, f: impl FnOnce() -> R) -> R {
    struct Restore(ExecutionMode);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_execution_mode(self.0);
        }
    }
    let _restore = Restore(execution_mode());
    set_execution_mode(mode);
    f()
}

/// Replaces this thread's chain with `next`, returning the previous one
/// (which a side-effecting op waits for).
pub(crate) fn swap_chain(next: Chain) -> Chain {
    CONTEXT
        .with(|c| c.borrow_mut().chain.replace(next))
        .unwrap_or_else(ready_chain)
}

/// True when every side-effecting op this thread issued has run.
pub(crate) fn chain_resolved() -> bool {
    CONTEXT.with(|c| {
        c.borrow()
            .chain
            .as_ref()
            .is_none_or(|chain| chain.is_resolved())
    })
}

/// Waits until every side-effecting op this thread issued has run.
pub fn sync_effects() {
    let chain = CONTEXT.with(|c| c.borrow().chain.clone());
    if let Some(chain) = chain {
        let _ = chain.wait();
    }
}
