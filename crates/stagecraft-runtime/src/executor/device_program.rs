//! Functions on a device whose op handler runs ops itself (a GPU): no
//! host kernels to plan, so a function's nodes run one by one through
//! [`crate::runtime::execute`] on the device, their values staying in its
//! memory. The lazy device runs its traces for such a device this way
//! ([`DeviceProgram`]), and the GPU handler runs the functions of `Call`,
//! `If` and `While` so ([`interpret`]).
//!
//! A program runs inside one batch of the device's work: a GPU records
//! the whole trace into one command buffer and submits it once.

use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{Args, Batch};
use smallvec::SmallVec;
use stagecraft_graph::{Function, NodeOp, Value};
use stagecraft_tensor::{Error, Location, Result, TensorValue};
use std::sync::Arc;

/// A function optimized for a device that runs ops itself.
pub struct DeviceProgram {
    function: Arc<Function>,
    device: Device,
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
        }
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
        let args: Vec<TensorHandle> = args
            .into_iter()
            .map(|v| TensorHandle::placed(self.device, v))
            .collect();
        let batch = Batch::begin(self.device);
        let results = interpret(&self.function, &args, self.device, locations);
        batch.end()?;
        results?
            .into_iter()
            .map(|h| h.into_tensor_value())
            .collect()
    }
}

/// Runs `function`'s nodes in order on `device` through `execute`, as
/// eager ops; constants are copied to the device. Errors stay in the
/// handles, as they would eagerly; the first one in a result is returned.
pub(crate) fn interpret(
    function: &Function,
    args: &[TensorHandle],
    device: Device,
    locations: &[Location],
) -> Result<Vec<TensorHandle>> {
    if args.len() != function.params.len() {
        return Err(Error::internal(format!(
            "@{} takes {} arguments, got {}",
            function.name,
            function.params.len(),
            args.len()
        )));
    }
    let mut outputs: Vec<SmallVec<[TensorHandle; 1]>> = Vec::with_capacity(function.nodes.len());
    let value = |v: &Value, outputs: &[SmallVec<[TensorHandle; 1]>]| -> TensorHandle {
        match *v {
            Value::Param(i) => args[i as usize].clone(),
            Value::Output { node, output } => outputs[node as usize][output as usize].clone(),
        }
    };
    for node in &function.nodes {
        let produced: SmallVec<[TensorHandle; 1]> = match &node.op {
            NodeOp::Const(constant) => {
                smallvec::smallvec![TensorHandle::available(device, constant.clone())]
            }
            NodeOp::Op(def, attrs) => {
                let inputs: Args = node.inputs.iter().map(|v| value(v, &outputs)).collect();
                let location = node
                    .origin
                    .and_then(|i| locations.get(i as usize))
                    .copied()
                    .unwrap_or(node.location);
                crate::runtime::execute(def, device, location, inputs, attrs.clone().into())
            }
        };
        outputs.push(produced);
    }
    let results: Vec<TensorHandle> = function
        .results
        .iter()
        .map(|v| value(v, &outputs))
        .collect();
    for result in &results {
        if let Some(e) = result.resolved_error() {
            return Err(e.clone());
        }
    }
    Ok(results)
}
