//! The core runtime of stagecraft.
//!
//! [`execute`]`(op, device, location, args, attrs)` is the one entry point
//! for running an op: it validates through the op's metadata function,
//! propagates argument errors without running anything, honours
//! cancellation, and hands the op to the device's [`OpHandler`]. Results are
//! [`TensorHandle`]s whose metadata is known at once and whose values may
//! still be computing.

pub mod async_value;
pub mod context;
pub mod cpu_handler;
mod device;
pub mod executor;
pub mod format;
#[cfg(feature = "wgpu")]
mod gpu_handler;
mod handle;
pub mod kernels;
pub mod lazy;
pub mod logging;
mod op_handler;
pub mod profile;
mod runtime;
pub mod tracing;
mod transfer;

pub use async_value::{AsyncValue, Chain};
pub use context::{
    default_device, execution_mode, place, place_borrowed, scoped_device, set_default_device,
    set_execution_mode, sync_effects, with_device, with_execution_mode, ExecutionMode,
};
pub use cpu_handler::{CpuOpHandler, KernelCache, KernelCacheStats};
pub use device::{Device, DeviceKind};
#[cfg(feature = "wgpu")]
pub use gpu_handler::cpu_fallbacks;
pub use handle::{MetadataState, TensorHandle, TracedValue};
pub use logging::{LogSink, LoggingOpHandler};
pub use op_handler::{Args, DeviceMemory, InputMetas, OpHandler, OpInvocation, ReadyArgs, Results};
pub use runtime::{
    cancel_execution, copy_to_device, count_host_read, execute, execute_borrowed, is_cancelled,
    read_to_host, report_error, restart, set_diagnostic_handler, stats, DiagnosticHandler,
    RuntimeStats,
};
pub use stagecraft_tensor::FxHasher;
/// The GPU device crate, for what the runtime does not wrap (the adapter's
/// name, submission counts).
#[cfg(feature = "wgpu")]
pub use stagecraft_wgpu;
pub use transfer::{
    count_explicit_copy, current_transfer_guard, implicit_copy, implicit_read, take_transfer_log,
    transfer_guard, transfer_stats, TransferGuard, TransferStats,
};
