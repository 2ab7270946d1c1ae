//! Runs graph functions: [`instantiate`] turns a [`Function`] into an
//! [`Executable`] for one device (optimization passes, then a plan of
//! kernel steps over value slots), and [`Executable::run`] executes it on
//! host tensors.
//!
//! The executor knows nothing about control flow: `If`, `While` and `Call`
//! are ordinary kernels (see [`control`]) that run the executables of the
//! functions their attributes name.

pub mod control;

use crate::device::Device;
use crate::runtime::{count_kernel_launch, is_cancelled, report_error};
use smallvec::SmallVec;
use stagecraft_cpu::{Inputs, Kernel, KernelContext};
use stagecraft_graph::{Function, NodeOp, Value};
use stagecraft_ops::{Attrs, FrozenOpAttrs, FuncId, OpDef, OutputMetas, ShapeKind};
use stagecraft_tensor::{Error, ErrorKind, HostTensor, Location, Result};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

type Slot = u32;

enum StepKind {
    Kernel {
        def: &'static OpDef,
        attrs: FrozenOpAttrs,
        kernel: Kernel,
    },
    Const(HostTensor),
}

struct Step {
    kind: StepKind,
    inputs: SmallVec<[Slot; 4]>,
    /// For each input: true when this is the slot's last use, so the value
    /// moves into the kernel (which may then write into its buffer).
    last_use: SmallVec<[bool; 4]>,
    outputs: SmallVec<[Slot; 1]>,
    metas: OutputMetas,
    location: Location,
}

/// A function instantiated for one device: kernels resolved, dead nodes
/// pruned, and value slots assigned.
pub struct Executable {
    function: Arc<Function>,
    device: Device,
    steps: Vec<Step>,
    slots: usize,
    results: Vec<Slot>,
}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Executable(@{} on {}, {} steps)",
            self.function.name,
            self.device,
            self.steps.len()
        )
    }
}

fn slot_of(value: Value, node_base: &[Slot]) -> Slot {
    match value {
        Value::Param(i) => i,
        Value::Output { node, output } => node_base[node as usize] + output,
    }
}

/// Instantiates `function` for `device`: runs the optimization passes and
/// resolves every node's kernel on the device's kernel cache.
pub fn instantiate(function: Arc<Function>, device: Device) -> Result<Executable> {
    let kernels = device.handler().host_kernels().ok_or_else(|| {
        Error::new(
            ErrorKind::Device,
            format!("{device} cannot run graph functions (it has no host kernels)"),
        )
    })?;
    // Slots: parameters first, then every node output in order.
    let mut node_base = Vec::with_capacity(function.nodes.len());
    let mut next = function.params.len() as Slot;
    for node in &function.nodes {
        node_base.push(next);
        next += node.outputs.len() as Slot;
    }
    // Only nodes that a result depends on run.
    let mut needed = vec![false; function.nodes.len()];
    let mut stack: Vec<Value> = function.results.clone();
    while let Some(v) = stack.pop() {
        if let Value::Output { node, .. } = v {
            if !std::mem::replace(&mut needed[node as usize], true) {
                stack.extend(function.nodes[node as usize].inputs.iter().copied());
            }
        }
    }
    let mut steps = Vec::new();
    for (index, node) in function.nodes.iter().enumerate() {
        if !needed[index] {
            continue;
        }
        let kind = match &node.op {
            NodeOp::Const(value) => StepKind::Const(value.clone()),
            NodeOp::Op(def, attrs) => {
                let metas: SmallVec<[_; 4]> = node
                    .inputs
                    .iter()
                    .map(|v| function.meta(*v).clone())
                    .collect();
                let kernel = kernels
                    .get(def, attrs, &metas)
                    .map_err(|e| e.with_op(def.name).at(node.location))?;
                StepKind::Kernel {
                    def,
                    attrs: attrs.clone(),
                    kernel,
                }
            }
        };
        steps.push(Step {
            kind,
            inputs: node
                .inputs
                .iter()
                .map(|v| slot_of(*v, &node_base))
                .collect(),
            last_use: SmallVec::new(),
            outputs: (0..node.outputs.len() as Slot)
                .map(|o| node_base[index] + o)
                .collect(),
            metas: node.outputs.clone(),
            location: node.location,
        });
    }
    let results: Vec<Slot> = function
        .results
        .iter()
        .map(|v| slot_of(*v, &node_base))
        .collect();
    // A value moves into the step that uses it last, unless it is a result
    // (results are read after every step).
    let mut last_reader: HashMap<Slot, (usize, usize)> = HashMap::new();
    for (s, step) in steps.iter().enumerate() {
        for (i, slot) in step.inputs.iter().enumerate() {
            last_reader.insert(*slot, (s, i));
        }
    }
    for slot in &results {
        last_reader.remove(slot);
    }
    for step in &mut steps {
        step.last_use = SmallVec::from_elem(false, step.inputs.len());
    }
    for (s, i) in last_reader.into_values() {
        steps[s].last_use[i] = true;
    }
    Ok(Executable {
        function,
        device,
        steps,
        slots: next as usize,
        results,
    })
}

type CacheKey = (FuncId, Device);

fn library_cache() -> &'static RwLock<HashMap<CacheKey, Arc<Executable>>> {
    static CACHE: std::sync::OnceLock<RwLock<HashMap<CacheKey, Arc<Executable>>>> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The executable of library function `id` on `device`, instantiated once.
pub fn instantiate_library(id: FuncId, device: Device) -> Result<Arc<Executable>> {
    if let Some(hit) = library_cache()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(id, device))
    {
        return Ok(hit.clone());
    }
    let function = Function::lookup(id).ok_or_else(|| {
        Error::internal(format!("function {} is not a graph function of the library", id.0))
    })?;
    let exe = Arc::new(instantiate(function, device)?);
    library_cache()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .entry((id, device))
        .or_insert(exe.clone());
    Ok(exe)
}

impl Executable {
    /// The function this executes.
    pub fn function(&self) -> &Arc<Function> {
        &self.function
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The number of kernel and constant steps after pruning.
    pub fn step_count(&self) -> usize {
        self.steps.len()
    }

    /// Runs the function on `args` (one per parameter, with the parameters'
    /// metadata) and returns its results.
    ///
    /// An error in any step stops the run; it names the failing node's op
    /// and source location. Cancellation is checked before every step.
    pub fn run(&self, args: Vec<HostTensor>) -> Result<Vec<HostTensor>> {
        if args.len() != self.function.params.len() {
            return Err(Error::internal(format!(
                "@{} takes {} arguments, got {}",
                self.function.name,
                self.function.params.len(),
                args.len()
            )));
        }
        let mut slots: Vec<Option<HostTensor>> = Vec::with_capacity(self.slots);
        slots.extend(args.into_iter().map(Some));
        slots.resize_with(self.slots, || None);
        for step in &self.steps {
            if is_cancelled() {
                return Err(Error::cancelled().at(step.location));
            }
            self.run_step(step, &mut slots)?;
        }
        self.results
            .iter()
            .map(|slot| {
                slots[*slot as usize]
                    .clone()
                    .ok_or_else(|| Error::internal("a result was never computed"))
            })
            .collect()
    }

    fn run_step(&self, step: &Step, slots: &mut [Option<HostTensor>]) -> Result<()> {
        let (def, attrs, kernel) = match &step.kind {
            StepKind::Const(value) => {
                slots[step.outputs[0] as usize] = Some(value.clone());
                return Ok(());
            }
            StepKind::Kernel { def, attrs, kernel } => (*def, attrs, kernel),
        };
        let mut inputs = Inputs::new();
        for (slot, last) in step.inputs.iter().zip(&step.last_use) {
            let value = if *last {
                slots[*slot as usize].take()
            } else {
                slots[*slot as usize].clone()
            };
            let value = value.ok_or_else(|| Error::internal("an input was never computed"))?;
            inputs.push(value.into_dense()?);
        }
        count_kernel_launch();
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &step.metas,
        };
        let produced = kernel(inputs, &ctx).map_err(|e| {
            // An error from inside a nested function already names its op
            // and was reported there.
            let raised_here = e.op().is_none();
            let e = e.with_op(def.name).at(step.location);
            if raised_here && e.kind() != ErrorKind::Cancelled {
                report_error(&e);
            }
            e
        })?;
        if produced.len() != step.outputs.len() {
            return Err(Error::internal(format!(
                "{} returned {} outputs, expected {}",
                def.name,
                produced.len(),
                step.outputs.len()
            ))
            .at(step.location));
        }
        for ((slot, value), meta) in step.outputs.iter().zip(produced).zip(&step.metas) {
            if def.shape_kind == ShapeKind::Static && value.metadata() != meta {
                return Err(Error::internal(format!(
                    "{} produced {} where its metadata function promised {meta}",
                    def.name,
                    value.metadata()
                ))
                .at(step.location));
            }
            slots[*slot as usize] = Some(value.into());
        }
        Ok(())
    }
}
