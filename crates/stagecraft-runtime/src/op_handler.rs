//! The op handler contract: how the core runtime hands a validated op
//! invocation to whatever executes it (a device, a logger, later a lazy
//! tracer).

use crate::async_value::Chain;
use crate::device::Device;
use crate::handle::TensorHandle;
use smallvec::SmallVec;
use stagecraft_ops::{OpAttrs, OpAttrsRef, OpDef, OutputMetas};
use stagecraft_tensor::{DenseHostTensor, DeviceTensor, Location, Result, TensorMetadata};

/// Op arguments, owned: the runtime takes them so a kernel can reuse the
/// buffer of an argument it holds the last reference to.
pub type Args = SmallVec<[TensorHandle; 4]>;

/// The metadata of an op's arguments.
pub type InputMetas = SmallVec<[TensorMetadata; 4]>;

/// Op results, one handle per output.
pub type Results = SmallVec<[TensorHandle; 1]>;

/// The arguments of [`OpHandler::execute_ready`].
pub enum ReadyArgs<'a> {
    /// Owned: a kernel may reuse the buffer of one that nobody else holds.
    Owned(Args),
    /// Borrowed from the caller, who keeps them: no handle is cloned.
    Borrowed(&'a [&'a TensorHandle]),
}

impl ReadyArgs<'_> {
    /// How many there are.
    pub fn len(&self) -> usize {
        match self {
            ReadyArgs::Owned(args) => args.len(),
            ReadyArgs::Borrowed(args) => args.len(),
        }
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each argument, in order.
    pub fn iter(&self) -> impl Iterator<Item = &TensorHandle> {
        let (owned, borrowed) = match self {
            ReadyArgs::Owned(args) => (&args[..], &[][..]),
            ReadyArgs::Borrowed(args) => (&[][..], *args),
        };
        owned.iter().chain(borrowed.iter().copied())
    }

    /// The arguments as the full path takes them (borrowed ones cloned).
    pub fn into_owned(self) -> Args {
        match self {
            ReadyArgs::Owned(args) => args,
            ReadyArgs::Borrowed(args) => args.iter().map(|&a| a.clone()).collect(),
        }
    }
}

/// Everything an op handler needs to run one op. The core runtime has
/// already checked cancellation, devices and argument errors, and run the
/// op's metadata function.
pub struct OpInvocation<'a> {
    /// The op.
    pub op: &'static OpDef,
    /// The device the op was placed on (whose handler this is, or which it
    /// wraps).
    pub device: Device,
    /// The user's source location of the call.
    pub location: Location,
    /// The arguments, possibly still pending.
    pub args: Args,
    /// The arguments' metadata, as the metadata function saw it.
    pub inputs: InputMetas,
    /// The attributes; freeze them to keep them past `execute`.
    pub attrs: OpAttrsRef<'a>,
    /// The output metadata from the metadata function.
    pub outputs: OutputMetas,
    /// For side-effecting ops: the chain to wait for before running, and
    /// the chain to resolve after running.
    pub chain: Option<(Chain, Chain)>,
}

impl OpInvocation<'_> {
    /// Marks the op's side-effect chain done at once, for handlers that
    /// order side effects themselves (the tracer and the lazy device, whose
    /// functions run them in their own order): the eager chain must not
    /// wait for them.
    pub fn release_chain(&mut self) {
        if let Some((_, done)) = self.chain.take() {
            done.set(Ok(()));
        }
    }
}

/// Executes op invocations. Implementations must be thread-safe: several
/// threads call `execute` at once.
pub trait OpHandler: Send + Sync {
    /// A short name for logs.
    fn name(&self) -> &str;

    /// Runs (or schedules) the op and returns one handle per output at once;
    /// the handles may still be pending. Failures become error handles, never
    /// panics.
    fn execute(&self, invocation: OpInvocation<'_>) -> Results;

    /// Runs an op whose arguments are all available values on `device`
    /// before returning, when the handler can do so more cheaply than
    /// through [`OpHandler::execute`] (TFRT's synchronous fast path: no
    /// pending handles, no invocation to build). The runtime has checked
    /// cancellation, and offers a side-effecting op only once every
    /// earlier side effect has run; the handler checks the rest, or gives
    /// the arguments back and the runtime takes the full path. The default
    /// always gives them back.
    fn execute_ready<'a>(
        &self,
        op: &'static OpDef,
        device: Device,
        location: Location,
        args: ReadyArgs<'a>,
        attrs: &OpAttrs,
    ) -> std::result::Result<Results, ReadyArgs<'a>> {
        let _ = (op, device, location, attrs);
        Err(args)
    }

    /// True when the op [`OpHandler::execute`] is given now will have run
    /// by the time it returns: a side-effecting op then needs no chain to
    /// order it after the ones before it, once those have run.
    fn runs_inline(&self) -> bool {
        false
    }

    /// True when the handler takes arguments from other devices (a tracer
    /// captures them as function inputs) instead of requiring explicit
    /// copies.
    fn captures_foreign_args(&self) -> bool {
        false
    }

    /// The host kernel cache of a handler that runs CPU kernels, for the
    /// graph executor.
    fn host_kernels(&self) -> Option<&crate::cpu_handler::KernelCache> {
        None
    }

    /// Hits and misses of the handler's kernel cache, if it has one.
    fn kernel_cache_stats(&self) -> Option<crate::cpu_handler::KernelCacheStats> {
        None
    }

    /// The device's own memory, for a device whose tensors live outside
    /// host memory (a GPU); `None` for devices that hold host tensors.
    fn memory(&self) -> Option<&dyn DeviceMemory> {
        None
    }

    /// The fused forms this device's kernels run, for a device that runs
    /// graph functions node by node (a GPU); `None` when it runs no fused
    /// op (the graph passes then leave the function unfused).
    fn fusions(&self) -> Option<stagecraft_graph::passes::fuse::Fusions> {
        None
    }

    /// Starts a batch: until [`OpHandler::end_batch`], the device may hold
    /// back the work of the ops it runs and submit it together (a GPU
    /// records one command buffer). Batches nest. A no-op for handlers
    /// that run work as it comes.
    fn begin_batch(&self) {}

    /// Ends a batch, submitting what it held back; an error the device
    /// reports for that work as a whole.
    fn end_batch(&self) -> Result<()> {
        Ok(())
    }

    /// Waits until the work submitted to the device has finished. A no-op
    /// for handlers whose values are done when they are ready.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// A batch of a device's work (see [`OpHandler::begin_batch`]), ended when
/// dropped if [`Batch::end`] was not called.
pub(crate) struct Batch {
    handler: Option<&'static dyn OpHandler>,
}

impl Batch {
    pub(crate) fn begin(device: Device) -> Batch {
        let handler = device.handler();
        handler.begin_batch();
        Batch {
            handler: Some(handler),
        }
    }

    /// Ends the batch, with the device's verdict on the work it submitted.
    pub(crate) fn end(mut self) -> Result<()> {
        match self.handler.take() {
            Some(handler) => handler.end_batch(),
            None => Ok(()),
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(handler) = self.handler.take() {
            // An early return (an error) ends the batch; the error that
            // caused it is the one reported.
            let _ = handler.end_batch();
        }
    }
}

/// Moves values between host memory and a device's own memory: how
/// [`crate::copy_to_device`] reaches a GPU.
pub trait DeviceMemory: Send + Sync {
    /// A copy of `host` in the device's memory.
    fn upload(&self, host: &DenseHostTensor) -> Result<DeviceTensor>;
    /// A copy of `value` in host memory, waiting for the work computing it.
    fn download(&self, value: &DeviceTensor) -> Result<DenseHostTensor>;
}
