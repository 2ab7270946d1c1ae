//! The GPU op handler (`gpu:N`, cargo feature `wgpu`): runs an op with the
//! GPU kernel `stagecraft-wgpu` has for it, or else on the CPU with its
//! arguments downloaded and its results uploaded, saying so once per op
//! and dtypes (never silently).
//!
//! Launches are submitted to the device's queue and not waited for: a
//! result handle is available at once, later kernels read it in queue
//! order, and the host waits only when it reads a value (a download).

use crate::device::Device;
use crate::executor::device_program::interpret;
use crate::handle::TensorHandle;
use crate::op_handler::{Args, DeviceMemory, OpHandler, OpInvocation, Results};
use smallvec::SmallVec;
use stagecraft_graph::Function;
use stagecraft_ops::{Attrs, ControlOp, OpKind};
use stagecraft_tensor::{
    DType, DenseHostTensor, DeviceTensor, Error, Result, TensorMetadata, TensorValue,
};
use stagecraft_wgpu::Gpu;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct GpuOpHandler {
    index: usize,
    name: String,
}

impl GpuOpHandler {
    pub(crate) fn new(index: usize) -> GpuOpHandler {
        GpuOpHandler {
            index,
            name: format!("gpu:{index}"),
        }
    }

    fn gpu(&self) -> Result<&'static Gpu> {
        Gpu::get(self.index)
    }

    fn run(&self, invocation: OpInvocation<'_>) -> Result<Results> {
        let gpu = self.gpu()?;
        if let OpKind::Control(kind) = invocation.op.kind {
            return self.control(kind, invocation);
        }
        let mut values: SmallVec<[DeviceTensor; 4]> = SmallVec::new();
        for arg in &invocation.args {
            match arg.wait_value()? {
                TensorValue::Device(value) => values.push(value.clone()),
                // A tensor list lives in host memory on every device (its
                // items are values of their own): list ops run on the CPU.
                TensorValue::Host(_) => return self.on_cpu(gpu, invocation),
            }
        }
        let attrs = Attrs::new(&invocation.attrs, invocation.op);
        let inputs: SmallVec<[&DeviceTensor; 4]> = values.iter().collect();
        if let Some(produced) =
            stagecraft_wgpu::run(gpu, invocation.op, &attrs, &inputs, &invocation.outputs)?
        {
            // Side effects order through the chain even on the GPU: none
            // of the ops with kernels has one, but the chain must advance.
            let mut invocation = invocation;
            if let Some((after, done)) = invocation.chain.take() {
                let _ = after.wait();
                done.set(Ok(()));
            }
            return Ok(produced
                .into_iter()
                .map(|value| TensorHandle::available_on_device(invocation.device, value))
                .collect());
        }
        self.on_cpu(gpu, invocation)
    }

    /// Runs the op with the CPU's kernel: downloads, the CPU handler (with
    /// the op's own chain), uploads.
    fn on_cpu(&self, gpu: &'static Gpu, invocation: OpInvocation<'_>) -> Result<Results> {
        warn_once(invocation.op, &invocation.inputs, &self.name);
        let cpu = Device::cpu();
        let mut host_args = Args::new();
        for arg in &invocation.args {
            let host = match arg.wait_value()? {
                TensorValue::Device(value) => {
                    let host = gpu.download(value)?;
                    crate::runtime::count_device_copy(host.buffer().len());
                    host.into()
                }
                // A tensor list, kept in host memory.
                TensorValue::Host(list) => list.clone(),
            };
            host_args.push(TensorHandle::available(cpu, host));
        }
        let device = invocation.device;
        let results = cpu.handler().execute(OpInvocation {
            op: invocation.op,
            device: cpu,
            location: invocation.location,
            args: host_args,
            inputs: invocation.inputs,
            attrs: invocation.attrs,
            outputs: invocation.outputs,
            chain: invocation.chain,
        });
        let mut uploaded = Results::new();
        for result in results {
            let meta = result.metadata().clone();
            let handle = match result.wait() {
                // A tensor list stays in host memory.
                Ok(list) if meta.dtype == DType::List => {
                    TensorHandle::available_value(device, TensorValue::Host(list.clone()))
                }
                Ok(value) => match value.to_dense() {
                    Ok(host) => {
                        crate::runtime::count_device_copy(host.buffer().len());
                        TensorHandle::available_on_device(device, gpu.upload(&host)?)
                    }
                    Err(e) => TensorHandle::error(device, meta, e),
                },
                // The CPU kernel's error already names the op and line.
                Err(e) => TensorHandle::error(device, meta, e.clone()),
            };
            uploaded.push(handle);
        }
        Ok(uploaded)
    }
}

impl GpuOpHandler {
    /// `Call`, `If` and `While` on the GPU: the functions they name run
    /// node by node on this device (each node an op like any other, its
    /// values staying in device memory); a predicate or loop condition is
    /// read back to the host to choose what runs next.
    fn control(&self, kind: ControlOp, mut invocation: OpInvocation<'_>) -> Result<Results> {
        invocation.release_chain();
        let attrs = Attrs::new(&invocation.attrs, invocation.op);
        let (device, location) = (invocation.device, invocation.location);
        let function = |name: &str| -> Result<Arc<Function>> {
            let id = attrs.func(name)?;
            Function::lookup(id).ok_or_else(|| {
                Error::internal(format!("function {id:?} of `{name}` is not in the library"))
            })
        };
        let args: Vec<TensorHandle> = invocation.args.into_iter().collect();
        // One submission for the whole function, up to a predicate read.
        let batch = crate::op_handler::Batch::begin(device);
        let results = match kind {
            ControlOp::Call => interpret(&*function("f")?, &args, device, &[])?,
            ControlOp::If => {
                let (pred, rest) = args
                    .split_first()
                    .ok_or_else(|| Error::internal("If without a predicate"))?;
                let branch = if truth(pred)? {
                    "then_branch"
                } else {
                    "else_branch"
                };
                interpret(&*function(branch)?, rest, device, &[])?
            }
            ControlOp::While => {
                let (cond, body) = (function("cond")?, function("body")?);
                let limit = attrs.int("max_iterations")?;
                let mut state = args;
                let mut iterations: i64 = 0;
                loop {
                    if crate::runtime::is_cancelled() {
                        return Err(Error::cancelled());
                    }
                    if limit >= 0 && iterations >= limit {
                        break;
                    }
                    let verdict = interpret(&cond, &state, device, &[])?;
                    match verdict.as_slice() {
                        [flag] if truth(flag)? => {}
                        [_] => break,
                        _ => {
                            return Err(Error::internal(
                                "a loop condition returned no single value",
                            ))
                        }
                    }
                    state = interpret(&body, &state, device, &[])?;
                    iterations += 1;
                }
                state
            }
        };
        batch.end()?;
        // New handles for the op's outputs: a result may be one of the
        // arguments (an identity branch), and an output must be a tensor
        // of its own.
        results
            .into_iter()
            .map(|h| {
                let value = h.wait_value().map_err(|e| e.clone())?;
                Ok(TensorHandle::available_value(device, value.clone()))
            })
            .collect::<Result<Results>>()
            .map_err(|e: Error| {
                if e.location().is_some() {
                    e
                } else {
                    e.at(location)
                }
            })
    }
}

/// The value of a one-element bool predicate, read to the host.
fn truth(pred: &TensorHandle) -> Result<bool> {
    let host = crate::runtime::read_to_host(pred)?.to_dense()?;
    match host.as_slice::<bool>()? {
        [flag] => Ok(*flag),
        _ => Err(Error::shape(format!(
            "a predicate must have one element, got {}",
            host.metadata()
        ))),
    }
}

fn fallbacks() -> &'static Mutex<HashSet<String>> {
    static FALLBACKS: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    FALLBACKS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Says once per op and input dtypes that the op ran on the CPU.
fn warn_once(op: &'static stagecraft_ops::OpDef, inputs: &[TensorMetadata], device: &str) {
    let dtypes: Vec<DType> = inputs.iter().map(|m| m.dtype).collect();
    let name = op.name;
    let key = format!("{name}{dtypes:?}");
    let first = fallbacks()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key);
    if !first {
        return;
    }
    let why = match crate::kernels::kernel_for(op, crate::DeviceKind::Gpu, &dtypes) {
        // The kernel exists but declined these inputs (a size past 2^32
        // elements, an attribute or layout it does not cover).
        Some(_) => {
            let shapes: Vec<String> = inputs.iter().map(ToString::to_string).collect();
            format!(
                "{device}'s kernel for `{name}` does not cover inputs {}",
                shapes.join(", ")
            )
        }
        None => format!("`{name}` has no {device} kernel for {dtypes:?}"),
    };
    eprintln!(
        "stagecraft: warning: {why}; it runs on the CPU, its inputs and outputs copied \
         (said once per op and dtypes)"
    );
}

/// The ops (with their input dtypes, as `Op[F32, ...]`) that ran on the
/// CPU for want of a GPU kernel, in no order.
pub fn cpu_fallbacks() -> Vec<String> {
    fallbacks()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect()
}

impl OpHandler for GpuOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(&self, invocation: OpInvocation<'_>) -> Results {
        let (op, device, location) = (invocation.op, invocation.device, invocation.location);
        let outputs = invocation.outputs.clone();
        // A chain an error leaves behind is released, so later effects
        // do not wait for it forever.
        let done = invocation.chain.as_ref().map(|(_, done)| done.clone());
        match self.run(invocation) {
            Ok(results) => results,
            Err(e) => {
                if let Some(done) = done {
                    if !done.is_resolved() {
                        done.set(Ok(()));
                    }
                }
                let e = e.with_op(op.name).at(location);
                crate::runtime::report_error(&e);
                outputs
                    .into_iter()
                    .map(|meta| TensorHandle::error(device, meta, e.clone()))
                    .collect()
            }
        }
    }

    fn memory(&self) -> Option<&dyn DeviceMemory> {
        Some(self)
    }

    /// Elementwise groups of ops with WGSL expressions: the GPU has no
    /// fused reduction or matmul epilogue.
    fn fusions(&self) -> Option<stagecraft_graph::passes::fuse::Fusions> {
        Some(stagecraft_graph::passes::fuse::Fusions {
            reductions: false,
            matmul_epilogues: false,
            accepts: stagecraft_wgpu::fuses,
            max_inputs: self.gpu().map_or(0, |gpu| gpu.max_fused_inputs()),
        })
    }

    fn begin_batch(&self) {
        if let Ok(gpu) = self.gpu() {
            gpu.begin_batch();
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu()?.synchronize()
    }

    fn end_batch(&self) -> Result<()> {
        match self.gpu() {
            Ok(gpu) => gpu.end_batch(),
            // A device that never opened began no batch; its error is
            // every op's already.
            Err(_) => Ok(()),
        }
    }
}

impl DeviceMemory for GpuOpHandler {
    fn upload(&self, host: &DenseHostTensor) -> Result<DeviceTensor> {
        self.gpu()?.upload(host)
    }

    fn download(&self, value: &DeviceTensor) -> Result<DenseHostTensor> {
        self.gpu()?.download(value)
    }
}
