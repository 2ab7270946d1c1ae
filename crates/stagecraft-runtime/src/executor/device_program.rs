//! Functions on a device whose op handler runs ops itself (a GPU): no
//! host kernels to plan, so a function's nodes run one by one through
//! [`crate::runtime::execute`] on the device, their values staying in its
//! memory. The lazy device runs its traces for such a device this way
//! ([`DeviceProgram`]), and the GPU handler runs the functions of `Call`,
//! `If` and `While` so ([`interpret`]).
//!
//! A program runs inside one batch of the device's work: a GPU records
//! the whole trace into one command buffer and submits it once.
//!
//! A function placed partly on such a device is partitioned like any
//! other (`partition.rs`): the device's partition is a [`DeviceProgram`]
//! whose `Send` downloads a value and publishes it in the run's
//! rendezvous, and whose `Recv` uploads what another partition sent.

use super::partition::{should_stop, Rendezvous};
use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{Args, Batch};
use smallvec::SmallVec;
use stagecraft_graph::{Function, NodeOp, Value};
use stagecraft_ops::{AttrValue, OpAttrs, OpKind};
use stagecraft_tensor::{DeviceTensor, Error, HostTensor, Location, Result, TensorValue};
use std::sync::{Arc, Mutex};

/// A function optimized for a device that runs ops itself.
pub struct DeviceProgram {
    function: Arc<Function>,
    device: Device,
    /// The device copies of the last run's host arguments, by position.
    /// Data made on a lazy device from host values stays a host value,
    /// and a trace gets it again step after step (a model's input, a
    /// dataset in memory): passed again, it is not copied again.
    uploads: Mutex<Vec<Option<(HostTensor, DeviceTensor)>>>,
}

impl DeviceProgram {
    /// `function` for `device`: inlined, folded, deduplicated and pruned,
    /// then fused only as far as the device's kernels run fused ops
    /// ([`crate::OpHandler::fusions`]): an unfused op on the device beats
    /// a fused one sent to the host.
    pub fn new(function: &Function, device: Device) -> DeviceProgram {
        use stagecraft_graph::passes::{optimize_fusing, simplify_with_stats};
        // Constants fold on the CPU: a trace's constants are host values
        // until it runs, and the CPU's kernels are the reference.
        let cpu = &stagecraft_cpu::CONSTANT_KERNELS;
        let (optimized, _) = match device.handler().fusions() {
            Some(fusions) => optimize_fusing(function, cpu, &fusions),
            None => simplify_with_stats(function, cpu),
        };
        DeviceProgram {
            function: Arc::new(optimized),
            device,
            uploads: Mutex::new(Vec::new()),
        }
    }

    /// A partition of a function already optimized whole: run as it is.
    pub(crate) fn partition(function: Function, device: Device) -> DeviceProgram {
        DeviceProgram {
            function: Arc::new(function),
            device,
            uploads: Mutex::new(Vec::new()),
        }
    }

    /// The ops a run executes (constants and transfers aside).
    pub fn op_count(&self) -> usize {
        self.function
            .nodes
            .iter()
            .filter(|n| match &n.op {
                NodeOp::Op(def, _) => def.kind != OpKind::Transfer,
                NodeOp::Const(_) => false,
            })
            .count()
    }

    /// Runs a partition of a partitioned function: host arguments are
    /// uploaded, `Send` and `Recv` meet the other partitions in
    /// `rendezvous`, and results are downloaded.
    pub(crate) fn run_partition(
        &self,
        args: Vec<HostTensor>,
        rendezvous: &Rendezvous,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        let args = args
            .into_iter()
            .map(|v| TensorHandle::available(self.device, v))
            .collect();
        self.run_batched(args, locations, Some(rendezvous))?
            .iter()
            .map(crate::runtime::read_to_host)
            .collect()
    }

    /// Interprets the program inside one batch of the device's work.
    fn run_batched(
        &self,
        args: Vec<TensorHandle>,
        locations: &[Location],
        rendezvous: Option<&Rendezvous>,
    ) -> Result<Vec<TensorHandle>> {
        let batch = Batch::begin(self.device);
        let results = interpret_with(&self.function, &args, self.device, locations, rendezvous);
        batch.end()?;
        results
    }

    /// The optimized function.
    pub fn function(&self) -> &Arc<Function> {
        &self.function
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Runs the program on `args` (host values are copied to the device);
    /// errors name the entry of `locations` a failing node came from (see
    /// [`stagecraft_graph::Node::origin`]), else the node's own line.
    pub fn run_recorded(
        &self,
        args: Vec<TensorValue>,
        locations: &[Location],
    ) -> Result<Vec<TensorValue>> {
        let args = self
            .uploaded(args)?
            .into_iter()
            .map(|v| TensorHandle::placed(self.device, v))
            .collect();
        self.run_batched(args, locations, None)?
            .into_iter()
            .map(|h| h.into_tensor_value())
            .collect()
    }
}

impl DeviceProgram {
    /// `args` with each host value in the device's memory: the copy made
    /// for the last run when the value is the same (the same host buffer,
    /// or the same fill), else a new copy, kept for the next run.
    fn uploaded(&self, args: Vec<TensorValue>) -> Result<Vec<TensorValue>> {
        let Some(memory) = self.device.handler().memory() else {
            return Ok(args);
        };
        let mut uploads = self.uploads.lock().unwrap_or_else(|p| p.into_inner());
        uploads.resize(args.len(), None);
        args.into_iter()
            .zip(uploads.iter_mut())
            .map(|(value, slot)| {
                let TensorValue::Host(host) = value else {
                    return Ok(value);
                };
                if matches!(host, HostTensor::List(_)) {
                    return Ok(TensorValue::Host(host));
                }
                if let Some((before, copy)) = slot.as_ref() {
                    if same_host_value(before, &host) {
                        return Ok(TensorValue::Device(copy.clone()));
                    }
                }
                let copy = memory.upload(&host.to_dense()?)?;
                *slot = Some((host, copy.clone()));
                Ok(TensorValue::Device(copy))
            })
            .collect()
    }
}

/// Whether `a` and `b` are one value without comparing their bytes: one
/// host buffer (a buffer held here is never written again, as only a
/// buffer with one owner is reused in place), or equal fills.
fn same_host_value(a: &HostTensor, b: &HostTensor) -> bool {
    match (a, b) {
        (HostTensor::Dense(x), HostTensor::Dense(y)) => {
            x.metadata() == y.metadata()
                && std::ptr::eq(x.buffer().bytes().as_ptr(), y.buffer().bytes().as_ptr())
                && x.buffer().bytes().len() == y.buffer().bytes().len()
        }
        (HostTensor::Scalar(_), HostTensor::Scalar(_)) => a.same_value(b),
        _ => false,
    }
}

/// Runs `function`'s nodes in order on `device` through `execute`, as
/// eager ops; constants are copied to the device. Errors stay in the
/// handles, as they would eagerly; the first one in a result is returned.
/// (The GPU's handler runs control flow's functions this way.)
#[cfg(feature = "wgpu")]
pub(crate) fn interpret(
    function: &Function,
    args: &[TensorHandle],
    device: Device,
    locations: &[Location],
) -> Result<Vec<TensorHandle>> {
    interpret_with(function, args, device, locations, None)
}

/// The key a `Send` or `Recv` node meets its other half under.
fn transfer_key(attrs: &OpAttrs) -> Result<String> {
    match attrs.get("key") {
        Some(AttrValue::Str(key)) => Ok(key.to_string()),
        _ => Err(Error::internal("a transfer without a key")),
    }
}

/// [`interpret`], with `rendezvous` serving the `Send` and `Recv` nodes
/// of a partition. A run stops between nodes when a partitioned run it
/// works for has failed elsewhere.
///
/// Outside a partition, a node placed on another device (a `with_device`
/// scope in a function that runs on the GPU) runs there, by the placement
/// rules of partitioned functions; its inputs are copied over and its
/// results back as eager ops copy them (counted).
fn interpret_with(
    function: &Function,
    args: &[TensorHandle],
    device: Device,
    locations: &[Location],
    rendezvous: Option<&Rendezvous>,
) -> Result<Vec<TensorHandle>> {
    if args.len() != function.params.len() {
        return Err(Error::internal(format!(
            "@{} takes {} arguments, got {}",
            function.name,
            function.params.len(),
            args.len()
        )));
    }
    let placement = match rendezvous {
        None if function.nodes.iter().any(|n| n.device.is_some()) => {
            Some(super::partition::place(function, device)?)
        }
        _ => None,
    };
    let mut outputs: Vec<SmallVec<[TensorHandle; 1]>> = Vec::with_capacity(function.nodes.len());
    let value = |v: &Value, outputs: &[SmallVec<[TensorHandle; 1]>]| -> TensorHandle {
        match *v {
            Value::Param(i) => args[i as usize].clone(),
            Value::Output { node, output } => outputs[node as usize][output as usize].clone(),
        }
    };
    let moved = |h: TensorHandle, to: Device, location: Location| match h.device() == to {
        true => h,
        false => crate::runtime::copy_to_device(&h, to, location),
    };
    for (index, node) in function.nodes.iter().enumerate() {
        let here = placement.as_ref().map_or(device, |p| p[index]);
        let produced: SmallVec<[TensorHandle; 1]> = match &node.op {
            NodeOp::Const(constant) => {
                smallvec::smallvec![TensorHandle::available(here, constant.clone())]
            }
            NodeOp::Op(def, attrs) => {
                let location = node
                    .origin
                    .and_then(|i| locations.get(i as usize))
                    .copied()
                    .unwrap_or(node.location);
                let inputs: Args = node
                    .inputs
                    .iter()
                    .map(|v| moved(value(v, &outputs), here, location))
                    .collect();
                if def.kind == OpKind::Transfer {
                    let rendezvous = super::partition::rendezvous(rendezvous)?;
                    let key = transfer_key(attrs)?;
                    match inputs.first() {
                        // Send: the value leaves device memory for the
                        // rendezvous, which counts the transfer.
                        Some(sent) => {
                            let (host, _) = crate::runtime::host_copy_of(sent)?;
                            rendezvous.send(&key, host.into(), location)?;
                            SmallVec::new()
                        }
                        // Recv: what another partition sent, uploaded.
                        None => {
                            let got = rendezvous.recv(&key, location)?;
                            smallvec::smallvec![TensorHandle::available(device, got)]
                        }
                    }
                } else {
                    if rendezvous.is_some() && should_stop() {
                        return Err(Error::cancelled().with_op(def.name).at(location));
                    }
                    crate::runtime::execute(def, here, location, inputs, attrs.clone().into())
                }
            }
        };
        outputs.push(produced);
    }
    let location = function
        .nodes
        .first()
        .map_or_else(Location::caller, |n| n.location);
    let results: Vec<TensorHandle> = function
        .results
        .iter()
        .map(|v| moved(value(v, &outputs), device, location))
        .collect();
    for result in &results {
        if let Some(e) = result.resolved_error() {
            return Err(e.clone());
        }
    }
    Ok(results)
}
