//! Runs graph functions: [`instantiate`] turns a [`Function`] into an
//! [`Executable`] for one device (optimization passes, then a plan of
//! kernel steps over value slots), and [`Executable::run`] executes it on
//! host tensors.
//!
//! The executor knows nothing about control flow: `If`, `While` and `Call`
//! are ordinary kernels (see [`control`]) that run the executables of the
//! functions their attributes name.

pub mod buffer_plan;
pub mod control;
pub mod device_program;
pub mod partition;

pub use buffer_plan::BufferPlan;
pub use device_program::DeviceProgram;

use crate::device::Device;
use crate::runtime::{count_kernel_launch, report_error};
use partition::{current_stop_flags, should_stop, with_stop_flags};
use smallvec::SmallVec;
use stagecraft_cpu::{settle_by_shape, AnyKernel, Inputs, KernelContext, ValueInputs};
use stagecraft_graph::{Function, NodeOp, Value};
use stagecraft_ops::{Attrs, FrozenOpAttrs, FuncId, OpDef, OutputMetas, ShapeKind};
use stagecraft_tensor::{
    Arena, DenseHostTensor, Error, ErrorKind, HostTensor, Location, Result, TensorMetadata,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

type Slot = u32;

enum StepKind {
    Kernel {
        def: &'static OpDef,
        attrs: FrozenOpAttrs,
        kernel: AnyKernel,
    },
    Const(HostTensor),
    /// Hands the input to the run's rendezvous under this key.
    Send(String),
    /// Waits for the value sent under this key.
    Recv(String),
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
    /// The node's [`origin`](stagecraft_graph::Node::origin): which entry
    /// of a run's location table names this step's source line.
    origin: Option<u32>,
}

impl Step {
    /// The source line an error of this step names: the caller's entry
    /// for the node's origin when the run was given a table (a cached lazy
    /// trace run for a later recording), else the line the node was built
    /// with. A bounds-checked read, so a run with a table costs no more
    /// than one without.
    fn location(&self, locations: &[Location]) -> Location {
        self.origin
            .and_then(|i| locations.get(i as usize))
            .copied()
            .unwrap_or(self.location)
    }
}

/// A function instantiated for one device: kernels resolved, dead nodes
/// pruned, and value slots assigned.
pub struct Executable {
    function: Arc<Function>,
    device: Device,
    steps: Vec<Step>,
    slots: usize,
    results: Vec<Slot>,
    schedule: Schedule,
    /// How many blocks of each size a run can have live at once.
    plan: BufferPlan,
    /// Arenas filled to `plan`, one per run in flight; a run takes one (or
    /// fills a new one) and puts it back when it ends.
    arenas: Mutex<Vec<Arc<Arena>>>,
    /// For a function placed on several devices: its per-device partitions,
    /// which `run` executes instead of `steps`.
    partitions: Option<Box<partition::Partitioned>>,
}

/// Arenas kept per executable for later runs; more runs in flight at once
/// fill arenas that are dropped when they end.
const KEPT_ARENAS: usize = 4;

/// Planned bytes of all executables' kept arenas together. Beyond this an
/// ending run's arena is dropped (its blocks go to the shared pool), so a
/// program with many traces does not hold every trace's buffers idle.
const MAX_KEPT_ARENA_BYTES: usize = 1 << 30;

static KEPT_ARENA_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Executable {
    fn drop(&mut self) {
        let kept = self.arenas.get_mut().unwrap_or_else(|p| p.into_inner());
        let bytes: usize = kept.iter().map(|a| a.planned_bytes()).sum();
        KEPT_ARENA_BYTES.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What the parallel dataflow run needs: who reads each slot, and how many
/// produced inputs each step waits for.
struct Schedule {
    /// Steps reading each slot (once per read).
    consumers: Vec<SmallVec<[u32; 2]>>,
    /// Reads of each slot by steps, plus one if it is a result (a result is
    /// never moved out).
    readers: Vec<u32>,
    /// Inputs of each step that another step produces.
    waits: Vec<u32>,
    /// Worth running in parallel: at least two steps are large enough that
    /// overlapping them beats the cost of handing work between threads,
    /// and too small to split their own work.
    parallel: bool,
    /// Some step is large enough that its kernel splits its work over the
    /// pool (see `run_steps`).
    splits: bool,
}

/// Steps producing fewer elements than this are too small to hand to
/// another thread.
const PARALLEL_STEP_ELEMENTS: usize = 1 << 14;

/// Steps producing at least this many elements split their own work over
/// the pool (the CPU kernels' threshold), so running them side by side
/// gains nothing: measured on the MLP training step, whose every large
/// step is a split GEMM, the dataflow run took 1.22 ms and the in-order
/// run with the pool kept awake 1.07 ms.
const SPLIT_STEP_ELEMENTS: usize = stagecraft_cpu::PARALLEL_THRESHOLD;

impl Schedule {
    fn new(steps: &[Step], slots: usize, results: &[Slot]) -> Schedule {
        let mut consumers: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); slots];
        let mut readers = vec![0u32; slots];
        let mut produced = vec![false; slots];
        for step in steps {
            for out in &step.outputs {
                produced[*out as usize] = true;
            }
        }
        let mut waits = vec![0u32; steps.len()];
        for (s, step) in steps.iter().enumerate() {
            for input in &step.inputs {
                consumers[*input as usize].push(s as u32);
                readers[*input as usize] += 1;
                if produced[*input as usize] {
                    waits[s] += 1;
                }
            }
        }
        for r in results {
            readers[*r as usize] += 1;
        }
        let elements = |s: &Step| {
            let each = s.metas.iter().map(|m| m.shape.numel());
            each.fold(0, usize::saturating_add)
        };
        let big = steps
            .iter()
            .filter(|s| elements(s) >= PARALLEL_STEP_ELEMENTS)
            .count();
        let overlapping = steps
            .iter()
            .filter(|s| (PARALLEL_STEP_ELEMENTS..SPLIT_STEP_ELEMENTS).contains(&elements(s)))
            .count();
        let forced = std::env::var("STAGECRAFT_EXECUTOR").ok();
        // A partition that sends or receives runs its steps in order on
        // its device's thread: transfers need the run's rendezvous.
        let transfers = steps
            .iter()
            .any(|s| matches!(s.kind, StepKind::Send(_) | StepKind::Recv(_)));
        let parallel = !transfers
            && match forced.as_deref() {
                Some("parallel") => true,
                Some("sequential") => false,
                _ => overlapping >= 2 && rayon::current_num_threads() > 1,
            };
        Schedule {
            consumers,
            readers,
            waits,
            parallel,
            // With one pool thread too: a split kernel still hands its
            // work to that thread.
            splits: big >= 1 && !transfers,
        }
    }
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

/// Instantiates `function` for `device`: runs the optimization passes
/// (inlining, constant folding, CSE, dead-code elimination), places and
/// partitions the nodes, and resolves every node's kernel on its device's
/// kernel cache.
pub fn instantiate(function: Arc<Function>, device: Device) -> Result<Executable> {
    use stagecraft_graph::passes::{lower, simplify_with_stats};
    let (function, _) = simplify_with_stats(&function, &stagecraft_cpu::CONSTANT_KERNELS);
    // Placed before fusion: each partition is then fused for its own
    // device's kernels (a GPU runs fewer fused forms than the CPU).
    let placement = partition::place(&function, device)?;
    if placement.iter().any(|d| *d != device) {
        return partition::instantiate_partitioned(Arc::new(function), device, &placement);
    }
    let (function, _, _) = lower(&function, &fusions_of(device));
    instantiate_on(Arc::new(function), device)
}

/// The fused forms `device`'s kernels run: all of them on a host device,
/// what the handler says on a device that runs ops itself.
pub(crate) fn fusions_of(device: Device) -> stagecraft_graph::passes::fuse::Fusions {
    use stagecraft_graph::passes::fuse::Fusions;
    let handler = device.handler();
    match handler.host_kernels() {
        Some(_) => Fusions::ALL,
        None => handler.fusions().unwrap_or(Fusions::NONE),
    }
}

/// Instantiates `function` with every node on `device`.
pub(crate) fn instantiate_on(function: Arc<Function>, device: Device) -> Result<Executable> {
    let kernels = device.handler().host_kernels().ok_or_else(|| {
        // A GPU runs functions node by node (`DeviceProgram`), never
        // through host kernels.
        Error::new(
            ErrorKind::Device,
            format!("{device} cannot run graph functions with host kernels"),
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
    // Side effects (prints, sends) run whether or not a result needs them.
    for (index, node) in function.nodes.iter().enumerate() {
        if node
            .op
            .def()
            .is_some_and(|d| d.effect == stagecraft_ops::Effect::SideEffecting)
        {
            needed[index] = true;
            stack.extend(node.inputs.iter().copied());
        }
    }
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
            NodeOp::Const(value) => StepKind::Const(run_form(value)?),
            NodeOp::Op(def, attrs) if def.kind == stagecraft_ops::OpKind::Transfer => {
                let key = attrs.get("key").and_then(|v| match v {
                    stagecraft_ops::AttrValue::Str(k) => Some(k.to_string()),
                    _ => None,
                });
                let key = key.ok_or_else(|| Error::internal("a transfer without a key"))?;
                if node.outputs.is_empty() {
                    StepKind::Send(key)
                } else {
                    StepKind::Recv(key)
                }
            }
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
            origin: node.origin,
        });
    }
    let mut steps = reductions_overlap(sends_early(steps));
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
    let schedule = Schedule::new(&steps, next as usize, &results);
    let plan = BufferPlan::new(&steps, &schedule.consumers, &results, schedule.parallel);
    Ok(Executable {
        function,
        device,
        steps,
        slots: next as usize,
        results,
        schedule,
        plan,
        arenas: Mutex::new(Vec::new()),
        partitions: None,
    })
}

/// A constant as runs hand it out. A small one-value constant (a scalar
/// operand, say) is made dense once here: dense kernels take dense
/// inputs, and a run would otherwise fill a fresh buffer with it every
/// time, each iteration of a loop.
fn run_form(value: &HostTensor) -> Result<HostTensor> {
    match value {
        HostTensor::Scalar(s)
            if s.metadata()
                .checked_size_in_bytes()
                .is_ok_and(|bytes| bytes < stagecraft_tensor::SMALL_BLOCK) =>
        {
            Ok(HostTensor::Dense(s.to_dense()?))
        }
        other => Ok(other.clone()),
    }
}

/// Moves every `Send` right behind the step producing its value. A
/// partition with transfers runs its steps in order, and partitioning adds
/// a `Send` only where the consumer on the other device appears; sending
/// early lets the other device (a host closure, say) start while this one
/// goes on with work that does not wait for it. `Recv`s already sit right
/// before their first consumer.
fn sends_early(steps: Vec<Step>) -> Vec<Step> {
    if !steps.iter().any(|s| matches!(s.kind, StepKind::Send(_))) {
        return steps;
    }
    let mut producer: HashMap<Slot, usize> = HashMap::new();
    for (i, step) in steps.iter().enumerate() {
        for out in &step.outputs {
            producer.insert(*out, i);
        }
    }
    // For each step, the sends that follow it; `None` for sends of
    // parameters, which go first.
    let mut after: HashMap<Option<usize>, Vec<usize>> = HashMap::new();
    for (i, step) in steps.iter().enumerate() {
        if matches!(step.kind, StepKind::Send(_)) {
            let from = step
                .inputs
                .first()
                .and_then(|slot| producer.get(slot).copied());
            after.entry(from).or_default().push(i);
        }
    }
    let mut order: Vec<usize> = after.remove(&None).unwrap_or_default();
    for (i, step) in steps.iter().enumerate() {
        if matches!(step.kind, StepKind::Send(_)) {
            continue;
        }
        order.push(i);
        order.extend(after.remove(&Some(i)).unwrap_or_default());
    }
    let mut slots: Vec<Option<Step>> = steps.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// Orders the steps so that split all-reduces overlap the work between
/// their start and their wait: each `AllReduceStart` runs as soon as the
/// steps it depends on have (the start with the least work behind it
/// first), and each
/// `AllReduceDone` as late as its readers allow. A lazy trace's node order
/// follows the graph's own passes, not the program's: without this, a
/// data-parallel step started each gradient bucket's reduction after the
/// whole backward and waited for it at once.
///
/// Other side effects (collectives run whole, sends, receives, prints)
/// keep their order among themselves and with the starts, so every
/// process, running the same trace, issues its collectives in the same
/// order; a wait is local and may move past them. Otherwise steps keep
/// their order.
fn reductions_overlap(steps: Vec<Step>) -> Vec<Step> {
    let def_of = |step: &Step| match &step.kind {
        StepKind::Kernel { def, .. } => Some(*def),
        _ => None,
    };
    let is = |step: &Step, op: &'static OpDef| def_of(step).is_some_and(|d| std::ptr::eq(d, op));
    let start = |s: &Step| is(s, &stagecraft_ops::ALL_REDUCE_START);
    if !steps.iter().any(start) {
        return steps;
    }
    let done = |s: &Step| is(s, &stagecraft_ops::ALL_REDUCE_DONE);
    let fence = |s: &Step| {
        !done(s)
            && match &s.kind {
                StepKind::Kernel { def, .. } => def.effect == stagecraft_ops::Effect::SideEffecting,
                StepKind::Send(_) | StepKind::Recv(_) => true,
                StepKind::Const(_) => false,
            }
    };
    let n = steps.len();
    let mut producer: HashMap<Slot, usize> = HashMap::new();
    for (i, step) in steps.iter().enumerate() {
        for out in &step.outputs {
            producer.insert(*out, i);
        }
    }
    // Each step's predecessors: the producers of its inputs and, for a
    // side effect, the side effects before it (starts between two others
    // may run in any order among themselves).
    let mut preds: Vec<SmallVec<[usize; 4]>> = steps
        .iter()
        .map(|s| {
            s.inputs
                .iter()
                .filter_map(|i| producer.get(i).copied())
                .collect()
        })
        .collect();
    let (mut last_fence, mut starts_since) = (None, Vec::new());
    for (i, step) in steps.iter().enumerate() {
        if start(step) {
            preds[i].extend(last_fence);
            starts_since.push(i);
        } else if fence(step) {
            preds[i].extend(last_fence);
            preds[i].extend(starts_since.drain(..));
            last_fence = Some(i);
        }
    }
    // Each start's cone: the steps it depends on. The start with the least
    // work in its cone (counted as elements produced) goes first: the node
    // order of a lazy trace says little about when a value is ready.
    let cone = |s: usize| {
        let mut seen = vec![false; n];
        let mut stack = vec![s];
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut seen[i], true) {
                stack.extend(preds[i].iter().copied());
            }
        }
        seen
    };
    let mut starts: Vec<(usize, usize, Vec<bool>)> = (0..n)
        .filter(|&i| start(&steps[i]))
        .map(|s| {
            let cone = cone(s);
            let work: usize = (0..n)
                .filter(|&i| cone[i])
                .flat_map(|i| steps[i].metas.iter().map(|m| m.shape.numel()))
                .sum();
            (work, s, cone)
        })
        .collect();
    starts.sort_by_key(|&(work, s, _)| (work, s));
    // Urgency: the rank of the first start a step leads to; then
    // everything else; then the waits.
    let mut class = vec![usize::MAX; n];
    for (k, (_, _, cone)) in starts.iter().enumerate() {
        for (i, &inside) in cone.iter().enumerate() {
            if inside && class[i] == usize::MAX {
                class[i] = k;
            }
        }
    }
    for (i, step) in steps.iter().enumerate() {
        if class[i] == usize::MAX {
            class[i] = starts.len() + usize::from(done(step));
        }
    }
    let mut waiting: Vec<usize> = preds.iter().map(SmallVec::len).collect();
    let mut succs: Vec<SmallVec<[usize; 2]>> = vec![SmallVec::new(); n];
    for (i, ps) in preds.iter().enumerate() {
        for &p in ps {
            succs[p].push(i);
        }
    }
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<(usize, usize)>> = (0..n)
        .filter(|&i| waiting[i] == 0)
        .map(|i| std::cmp::Reverse((class[i], i)))
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(std::cmp::Reverse((_, i))) = ready.pop() {
        order.push(i);
        for &next in &succs[i] {
            waiting[next] -= 1;
            if waiting[next] == 0 {
                ready.push(std::cmp::Reverse((class[next], next)));
            }
        }
    }
    if order.len() != n {
        // A cycle, which a function's node order rules out: keep that order.
        debug_assert!(false, "the steps' dependencies form a cycle");
        return steps;
    }
    let mut slots: Vec<Option<Step>> = steps.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| slots[i].take()).collect()
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
        Error::internal(format!(
            "function {} is not a graph function of the library",
            id.0
        ))
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

    /// The number of device partitions (1 unless nodes are placed on other
    /// devices).
    pub fn partition_count(&self) -> usize {
        self.partitions.as_ref().map_or(1, |p| p.partition_count())
    }

    /// The number of kernels a run launches (constants and transfers
    /// excluded), summed over partitions.
    pub fn kernel_count(&self) -> usize {
        match &self.partitions {
            Some(p) => p.kernel_count(),
            None => self
                .steps
                .iter()
                .filter(|s| matches!(s.kind, StepKind::Kernel { .. }))
                .count(),
        }
    }

    /// The buffer plan: blocks per size that a run of this executable (one
    /// partition's, for a partitioned function) draws from its arena.
    pub fn buffer_plan(&self) -> &BufferPlan {
        &self.plan
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
        self.run_recorded(args, &[])
    }

    /// [`run`](Self::run) for one recording of a lazy trace: an error of a
    /// node with an [`origin`](stagecraft_graph::Node::origin) `i` names
    /// `locations[i]`, the source line of that op in this recording.
    ///
    /// The lazy runtime caches an executable by the trace's structure and
    /// runs it for every recording with that structure, made from whatever
    /// source lines; the nodes keep the lines of the recording it was
    /// compiled from. Passing the table per run (rather than rebuilding or
    /// patching the executable) keeps a cached run free of extra work: the
    /// table is only read when a step fails.
    pub fn run_recorded(
        &self,
        args: Vec<HostTensor>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        match &self.partitions {
            Some(parts) => parts.run(args, locations),
            None => self.run_with(args, None, locations),
        }
    }

    /// Runs with `rendezvous` serving this partition's `Send`/`Recv` steps
    /// and `locations` resolving step origins (see
    /// [`run_recorded`](Self::run_recorded)).
    pub(crate) fn run_with(
        &self,
        args: Vec<HostTensor>,
        rendezvous: Option<&partition::Rendezvous>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        if args.len() != self.function.params.len() {
            return Err(Error::internal(format!(
                "@{} takes {} arguments, got {}",
                self.function.name,
                self.function.params.len(),
                args.len()
            )));
        }
        if self.plan.blocks.is_empty() {
            return self.run_steps(args, rendezvous, None, locations);
        }
        use std::sync::atomic::Ordering::Relaxed;
        let bytes = self.plan.bytes();
        let kept = self.arenas.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let arena = match kept {
            Some(arena) => {
                KEPT_ARENA_BYTES.fetch_sub(bytes, Relaxed);
                arena
            }
            None => Arena::new(&self.plan.blocks),
        };
        let outcome = arena.enter(|| self.run_steps(args, rendezvous, Some(&arena), locations));
        let mut kept = self.arenas.lock().unwrap_or_else(|p| p.into_inner());
        let room = KEPT_ARENA_BYTES
            .fetch_update(Relaxed, Relaxed, |total| {
                let total = total.checked_add(bytes)?;
                (total <= MAX_KEPT_ARENA_BYTES).then_some(total)
            })
            .is_ok();
        if room && kept.len() < KEPT_ARENAS {
            kept.push(arena);
        } else if room {
            KEPT_ARENA_BYTES.fetch_sub(bytes, Relaxed);
        }
        outcome
    }

    /// Runs the steps, in order or as a parallel dataflow, inside `arena`.
    fn run_steps(
        &self,
        args: Vec<HostTensor>,
        rendezvous: Option<&partition::Rendezvous>,
        arena: Option<&Arc<Arena>>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        if self.schedule.parallel {
            return self.run_parallel(args, arena, locations);
        }
        if self.schedule.splits && rayon::current_thread_index().is_none() {
            // A kernel that splits its work hands its parts to pool threads,
            // and a sleeping one takes tens of microseconds to wake on a
            // virtual machine (measured: a 128×256×256 matmul with a bias
            // and relu epilogue, 148 µs with the pool asleep, 78 µs awake).
            // While the run goes on, the pool's other threads stay awake to
            // take those parts at once.
            let flags = current_stop_flags();
            let in_pool = || {
                with_stop_flags(&flags, || match arena {
                    Some(arena) => arena.enter(|| self.run_in_order(args, None, locations)),
                    None => self.run_in_order(args, None, locations),
                })
            };
            return stagecraft_cpu::pool::run_with_pool_awake(in_pool);
        }
        self.run_in_order(args, rendezvous, locations)
    }

    /// Runs the steps one after another on this thread.
    fn run_in_order(
        &self,
        args: Vec<HostTensor>,
        rendezvous: Option<&partition::Rendezvous>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        let mut results = Vec::with_capacity(self.results.len());
        self.run_in_order_into(args, rendezvous, locations, &mut results)?;
        Ok(results)
    }

    /// [`run`](Self::run) with the arguments from an iterator and the
    /// results written into `results` (cleared first): a loop that keeps
    /// its state and its condition's verdict in vectors of its own runs
    /// its condition and body every iteration without allocating them.
    pub(crate) fn run_into(
        &self,
        args: impl ExactSizeIterator<Item = HostTensor>,
        results: &mut Vec<HostTensor>,
    ) -> Result<()> {
        let simple = self.partitions.is_none()
            && self.plan.blocks.is_empty()
            && !self.schedule.parallel
            && !self.schedule.splits;
        if !simple || args.len() != self.function.params.len() {
            let produced = self.run(args.collect())?;
            results.clear();
            results.extend(produced);
            return Ok(());
        }
        self.run_in_order_into(args, None, &[], results)
    }

    /// [`run_in_order`](Self::run_in_order) into `results` (cleared
    /// first).
    fn run_in_order_into(
        &self,
        args: impl IntoIterator<Item = HostTensor>,
        rendezvous: Option<&partition::Rendezvous>,
        locations: &[Location],
        results: &mut Vec<HostTensor>,
    ) -> Result<()> {
        // On the stack for a small function (a loop's body or condition,
        // run once per iteration).
        // Built in place: `with_capacity` returned the 1 KiB array by value,
        // and a copy of it cost as much as a small kernel.
        let mut slots: SmallVec<[Option<HostTensor>; 16]> = SmallVec::new();
        slots.reserve(self.slots);
        slots.extend(args.into_iter().map(Some));
        slots.resize_with(self.slots, || None);
        for step in &self.steps {
            if should_stop() {
                return Err(Error::cancelled().at(step.location(locations)));
            }
            match &step.kind {
                StepKind::Send(key) => {
                    let value = slots[step.inputs[0] as usize]
                        .clone()
                        .ok_or_else(|| Error::internal("a sent value was never computed"))?;
                    partition::rendezvous(rendezvous)?.send(
                        key,
                        value,
                        step.location(locations),
                    )?;
                    continue;
                }
                StepKind::Recv(key) => {
                    let value =
                        partition::rendezvous(rendezvous)?.recv(key, step.location(locations))?;
                    slots[step.outputs[0] as usize] = Some(value);
                    continue;
                }
                _ => {}
            }
            let read = |slots: &mut [Option<HostTensor>], slot: Slot, last: bool| {
                let value = if last {
                    slots[slot as usize].take()
                } else {
                    slots[slot as usize].clone()
                };
                value.ok_or_else(|| Error::internal("an input was never computed"))
            };
            // An output nobody reads is dropped now, as the buffer plan
            // assumes.
            let read_later = |slot: Slot| self.schedule.readers[slot as usize] > 0;
            if let StepKind::Const(value) = &step.kind {
                for &slot in &step.outputs {
                    if read_later(slot) {
                        slots[slot as usize] = Some(value.clone());
                    }
                }
                continue;
            }
            if let StepKind::Kernel {
                def,
                attrs,
                kernel: AnyKernel::Dense(kernel),
            } = &step.kind
            {
                // Dense inputs straight from their slots, dense outputs
                // straight into theirs: each value moved once each way
                // (a loop's small body runs this for every iteration).
                let mut inputs = Inputs::new();
                for (&slot, &last) in step.inputs.iter().zip(&step.last_use) {
                    let value = read(&mut slots, slot, last)?;
                    inputs.push(dense_input(def, step, locations, value)?);
                }
                let produced = execute_dense(step, def, attrs, kernel, inputs, locations)?;
                for (&slot, value) in step.outputs.iter().zip(produced) {
                    if read_later(slot) {
                        slots[slot as usize] = Some(HostTensor::Dense(value));
                    }
                }
                continue;
            }
            let mut inputs = ValueInputs::new();
            for (&slot, &last) in step.inputs.iter().zip(&step.last_use) {
                inputs.push(read(&mut slots, slot, last)?);
            }
            let produced = self.execute_step(step, inputs, locations)?;
            for (&slot, value) in step.outputs.iter().zip(produced) {
                if read_later(slot) {
                    slots[slot as usize] = Some(value);
                }
            }
        }
        // The slots go away with this run: results are moved out of them,
        // and only a value returned twice is shared.
        results.clear();
        for (i, slot) in self.results.iter().enumerate() {
            let value = match slots[*slot as usize].take() {
                Some(value) => value,
                None => self.results[..i]
                    .iter()
                    .position(|earlier| earlier == slot)
                    .map(|j| results[j].clone())
                    .ok_or_else(|| Error::internal("a result was never computed"))?,
            };
            results.push(value);
        }
        Ok(())
    }

    /// The greedy dataflow run: each step starts as soon as its last input
    /// is produced, on the rayon pool; a finishing step continues with one
    /// newly ready step on its own thread and hands the others to the pool.
    /// The calling thread takes part in the work while it waits.
    fn run_parallel(
        &self,
        args: Vec<HostTensor>,
        arena: Option<&Arc<Arena>>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
        use std::sync::Mutex;
        struct Run<'a> {
            exe: &'a Executable,
            locations: &'a [Location],
            slots: Vec<Mutex<(Option<HostTensor>, u32)>>,
            waits: Vec<AtomicU32>,
            failed: AtomicBool,
            error: Mutex<Option<Error>>,
            /// The caller's stop flags, set on whichever pool thread runs
            /// a step (see `with_stop_flags`).
            stop_flags: Vec<Arc<AtomicBool>>,
            /// The run's arena, entered on whichever thread runs a step.
            arena: Option<&'a Arc<Arena>>,
        }
        impl Run<'_> {
            /// Runs the steps from `first` on, on this thread, with the
            /// run's stop flags and arena.
            fn start<'s>(&'s self, scope: &rayon::Scope<'s>, first: usize) {
                with_stop_flags(&self.stop_flags, || match self.arena {
                    Some(arena) => arena.enter(|| self.run_from(scope, first)),
                    None => self.run_from(scope, first),
                })
            }

            fn read(&self, slot: Slot) -> Result<HostTensor> {
                let mut guard = self.slots[slot as usize]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let (value, readers) = &mut *guard;
                *readers -= 1;
                // The last reader takes the value, so a kernel can reuse the
                // buffer; earlier readers (in whatever order they run) clone.
                let v = if *readers == 0 {
                    value.take()
                } else {
                    value.clone()
                };
                v.ok_or_else(|| Error::internal("an input was never computed"))
            }

            fn fail(&self, e: Error) {
                if !self.failed.swap(true, Ordering::AcqRel) {
                    *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }

            fn run_from<'s>(&'s self, scope: &rayon::Scope<'s>, first: usize) {
                let mut next = Some(first);
                while let Some(s) = next.take() {
                    if self.failed.load(Ordering::Acquire) {
                        return;
                    }
                    let step = &self.exe.steps[s];
                    if should_stop() {
                        return self.fail(Error::cancelled().at(step.location(self.locations)));
                    }
                    let inputs: Result<ValueInputs> =
                        step.inputs.iter().map(|slot| self.read(*slot)).collect();
                    let produced =
                        match inputs.and_then(|i| self.exe.execute_step(step, i, self.locations)) {
                            Ok(p) => p,
                            Err(e) => return self.fail(e),
                        };
                    for (slot, value) in step.outputs.iter().zip(produced) {
                        let mut guard = self.slots[*slot as usize]
                            .lock()
                            .unwrap_or_else(|p| p.into_inner());
                        // An output nobody reads is dropped now, as the
                        // buffer plan assumes.
                        if guard.1 > 0 {
                            guard.0 = Some(value);
                        }
                        drop(guard);
                        for &c in &self.exe.schedule.consumers[*slot as usize] {
                            if self.waits[c as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
                                match next {
                                    None => next = Some(c as usize),
                                    Some(_) => {
                                        scope.spawn(move |scope| self.start(scope, c as usize))
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        let schedule = &self.schedule;
        let mut slots: Vec<Mutex<(Option<HostTensor>, u32)>> = Vec::with_capacity(self.slots);
        let mut args = args.into_iter();
        for slot in 0..self.slots {
            let value = if slot < self.function.params.len() {
                args.next()
            } else {
                None
            };
            slots.push(Mutex::new((value, schedule.readers[slot])));
        }
        let run = Run {
            exe: self,
            locations,
            slots,
            waits: schedule.waits.iter().map(|&w| AtomicU32::new(w)).collect(),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            stop_flags: current_stop_flags(),
            arena,
        };
        let ready: Vec<usize> = (0..self.steps.len())
            .filter(|&s| schedule.waits[s] == 0)
            .collect();
        rayon::in_place_scope(|scope| {
            let run = &run;
            for s in ready {
                scope.spawn(move |scope| run.start(scope, s));
            }
        });
        if let Some(e) = run.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        self.results
            .iter()
            .map(|slot| {
                run.slots[*slot as usize]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .0
                    .clone()
                    .ok_or_else(|| Error::internal("a result was never computed"))
            })
            .collect()
    }

    /// Runs one step and checks its outputs against the metadata the graph
    /// promised. A dense kernel gets its inputs as dense tensors.
    fn execute_step(
        &self,
        step: &Step,
        inputs: ValueInputs,
        locations: &[Location],
    ) -> Result<SmallVec<[HostTensor; 1]>> {
        let (def, attrs, kernel) = match &step.kind {
            StepKind::Const(value) => return Ok(smallvec::smallvec![value.clone()]),
            StepKind::Kernel { def, attrs, kernel } => (*def, attrs, kernel),
            StepKind::Send(_) | StepKind::Recv(_) => {
                return Err(Error::internal("a transfer step outside a partitioned run"))
            }
        };
        match kernel {
            AnyKernel::Dense(kernel) => {
                // A plain loop: collecting through `Result` costs more than
                // a tiny kernel.
                let mut dense = Inputs::new();
                for value in inputs {
                    dense.push(dense_input(def, step, locations, value)?);
                }
                let produced = execute_dense(step, def, attrs, kernel, dense, locations)?;
                Ok(produced.into_iter().map(HostTensor::Dense).collect())
            }
            AnyKernel::Value(kernel) => {
                launch(step, def, attrs, locations, HostTensor::metadata, |ctx| {
                    kernel(inputs, ctx)
                })
            }
        }
    }
}

/// A value a dense kernel reads, as a dense tensor; a failure names the
/// step's op and line.
fn dense_input(
    def: &OpDef,
    step: &Step,
    locations: &[Location],
    value: HostTensor,
) -> Result<DenseHostTensor> {
    value
        .into_dense()
        .map_err(|e| step_error(def, step, locations, e))
}

/// Runs a step's dense kernel on `inputs` (or settles outputs without
/// elements by their shape).
fn execute_dense(
    step: &Step,
    def: &'static OpDef,
    attrs: &FrozenOpAttrs,
    kernel: &stagecraft_cpu::Kernel,
    inputs: Inputs,
    locations: &[Location],
) -> Result<stagecraft_cpu::Outputs> {
    launch(
        step,
        def,
        attrs,
        locations,
        DenseHostTensor::metadata,
        |ctx| {
            let metas = inputs.iter().map(DenseHostTensor::metadata);
            match settle_by_shape(def, metas, &step.metas)? {
                Some(settled) => Ok(settled),
                None => kernel(inputs, ctx),
            }
        },
    )
}

/// Counts and runs one step's kernel (`run`, given the step's context),
/// timed when the profiler is on; its error names the step's op and line,
/// and its outputs are checked against the metadata the graph promised.
fn launch<T>(
    step: &Step,
    def: &'static OpDef,
    attrs: &FrozenOpAttrs,
    locations: &[Location],
    metadata: impl Fn(&T) -> &TensorMetadata,
    run: impl FnOnce(&KernelContext<'_>) -> Result<SmallVec<[T; 1]>>,
) -> Result<SmallVec<[T; 1]>> {
    count_kernel_launch();
    let ctx = KernelContext {
        attrs: Attrs::new(attrs, def),
        outputs: &step.metas,
    };
    let produced = if crate::profile::is_enabled() {
        crate::profile::timed(crate::profile::KERNEL, def.name, || run(&ctx))
    } else {
        run(&ctx)
    };
    let produced = produced.map_err(|e| step_error(def, step, locations, e))?;
    check_outputs(def, step, locations, produced.iter().map(metadata))?;
    Ok(produced)
}

/// A step's error, naming its op and the step's source line; reported to
/// the diagnostic handler when it was raised here.
fn step_error(def: &OpDef, step: &Step, locations: &[Location], e: Error) -> Error {
    // An error from inside a nested function already names its op and was
    // reported there.
    let raised_here = e.op().is_none();
    let e = e.with_op(def.name).at(step.location(locations));
    if raised_here && e.kind() != ErrorKind::Cancelled {
        report_error(&e);
    }
    e
}

/// Checks a step's outputs, in place, against the metadata the graph
/// promised (their number always; their metadata for a static-shape op).
fn check_outputs<'m>(
    def: &OpDef,
    step: &Step,
    locations: &[Location],
    produced: impl ExactSizeIterator<Item = &'m TensorMetadata>,
) -> Result<()> {
    if produced.len() != step.outputs.len() {
        return Err(Error::internal(format!(
            "{} returned {} outputs, expected {}",
            def.name,
            produced.len(),
            step.outputs.len()
        ))
        .with_op(def.name)
        .at(step.location(locations)));
    }
    if def.shape_kind == ShapeKind::Static {
        for (meta, promised) in produced.zip(&step.metas) {
            if meta != promised {
                return Err(Error::internal(format!(
                    "{} produced {meta} where its metadata function promised {promised}",
                    def.name,
                ))
                .with_op(def.name)
                .at(step.location(locations)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::{OpAttrs, DIV, NEG};
    use stagecraft_tensor::{DType, DenseHostTensor, TensorMetadata};

    fn at(line: u32) -> Location {
        Location::new("recorded.rs", line, 1)
    }

    /// A split all-reduce starts as soon as its gradient is ready, before
    /// work that comes first in the node order, and is waited for only
    /// where its result is read; the collective run whole keeps its place
    /// after the start.
    #[test]
    fn all_reduces_start_early_and_are_waited_for_late() {
        let meta = TensorMetadata::new(DType::F32, [4]);
        let mut f = Function::new("overlap", vec![meta.clone(), meta]);
        let none = OpAttrs::new();
        let mut reduce = OpAttrs::new();
        reduce.set_int("world_size", 1).set_str("reduction", "mean");
        let neg = &stagecraft_ops::NEG;
        let gradient = f.add_op(neg, &none, &[Value::Param(0)], at(1)).unwrap();
        let other = f.add_op(neg, &none, &[Value::Param(1)], at(2)).unwrap();
        let more = f.add_op(neg, &none, &[Value::node(other)], at(3)).unwrap();
        let start = &stagecraft_ops::ALL_REDUCE_START;
        let ticket = f
            .add_op(start, &reduce, &[Value::node(gradient)], at(4))
            .unwrap();
        let done = &stagecraft_ops::ALL_REDUCE_DONE;
        let mut declared = OpAttrs::new();
        declared
            .set_dtype("dtype", DType::F32)
            .set_dims("shape", &[4]);
        let mean = f
            .add_op(done, &declared, &[Value::node(ticket)], at(5))
            .unwrap();
        let whole = &stagecraft_ops::ALL_REDUCE;
        let total = f
            .add_op(whole, &reduce, &[Value::node(more)], at(6))
            .unwrap();
        let sum = f
            .add_op(
                &stagecraft_ops::MUL,
                &none,
                &[Value::node(mean), Value::node(total)],
                at(7),
            )
            .unwrap();
        f.results = vec![Value::node(sum)];
        let exe = instantiate_on(Arc::new(f), Device::cpu()).unwrap();
        let lines: Vec<u32> = exe.steps.iter().map(|s| s.location.line()).collect();
        assert_eq!(lines, vec![1, 4, 2, 3, 6, 5, 7]);
        let x = DenseHostTensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4usize]).unwrap();
        let out = exe
            .run(vec![HostTensor::Dense(x.clone()), HostTensor::Dense(x)])
            .unwrap();
        let HostTensor::Dense(out) = &out[0] else {
            panic!("a dense sum")
        };
        // The mean of -x over one process, times x.
        assert_eq!(out.as_slice::<f32>().unwrap(), &[-1.0, -4.0, -9.0, -16.0]);
    }

    /// Results leave their slots by move: a value returned twice is
    /// still both results (one buffer, shared), and an argument returned
    /// as it is stays the caller's buffer.
    #[test]
    fn results_are_moved_out_and_a_repeated_one_is_shared() {
        let meta = TensorMetadata::new(DType::F32, [2]);
        let mut f = Function::new("twice", vec![meta]);
        let negated = f
            .add_op(&NEG, &OpAttrs::new(), &[Value::Param(0)], at(1))
            .unwrap();
        f.results = vec![Value::node(negated), Value::Param(0), Value::node(negated)];
        let exe = instantiate_on(Arc::new(f), Device::cpu()).unwrap();
        let x = DenseHostTensor::from_slice(&[1.0f32, -2.0], [2usize]).unwrap();
        let out = exe.run(vec![HostTensor::Dense(x.clone())]).unwrap();
        let dense = |v: &HostTensor| match v {
            HostTensor::Dense(d) => d.clone(),
            other => panic!("a dense result, got {other:?}"),
        };
        let (first, arg, again) = (dense(&out[0]), dense(&out[1]), dense(&out[2]));
        assert_eq!(first.as_slice::<f32>().unwrap(), &[-1.0, 2.0]);
        assert_eq!(again.as_slice::<f32>().unwrap(), &[-1.0, 2.0]);
        assert!(first.buffer().ptr_eq(again.buffer()));
        assert!(arg.buffer().ptr_eq(x.buffer()));
    }

    /// A small one-value constant is dense in the step, so a run (each
    /// iteration of a loop) hands it out without filling a buffer; a large
    /// one stays a single value until a kernel needs it.
    #[test]
    fn small_scalar_constants_are_made_dense_once() {
        use stagecraft_tensor::{Scalar, ScalarHostTensor};
        let small = 4;
        let large = stagecraft_tensor::SMALL_BLOCK; // f32: 4 × the bytes
        let mut f = Function::new(
            "scaled",
            vec![
                TensorMetadata::new(DType::F32, [small]),
                TensorMetadata::new(DType::F32, [large]),
            ],
        );
        let constant = |f: &mut Function, n: usize| {
            let value = ScalarHostTensor::new(Scalar::F32(0.5), [n]);
            Value::node(f.add_const(HostTensor::Scalar(value), at(1)))
        };
        let (c_small, c_large) = (constant(&mut f, small), constant(&mut f, large));
        let none = OpAttrs::new();
        let mul = &stagecraft_ops::MUL;
        let a = f
            .add_op(mul, &none, &[Value::Param(0), c_small], at(2))
            .unwrap();
        let b = f
            .add_op(mul, &none, &[Value::Param(1), c_large], at(3))
            .unwrap();
        f.results = vec![Value::node(a), Value::node(b)];
        let exe = instantiate_on(Arc::new(f), Device::cpu()).unwrap();
        let consts: Vec<bool> = exe
            .steps
            .iter()
            .filter_map(|s| match &s.kind {
                StepKind::Const(v) => Some(matches!(v, HostTensor::Dense(_))),
                _ => None,
            })
            .collect();
        assert_eq!(consts, [true, false], "dense: the small one only");
        let arg = |n: usize| {
            HostTensor::Dense(DenseHostTensor::from_slice(&vec![3.0f32; n], [n]).unwrap())
        };
        for _ in 0..2 {
            let out = exe.run(vec![arg(small), arg(large)]).unwrap();
            let values = |i: usize| out[i].to_dense().unwrap().to_vec::<f32>().unwrap();
            assert_eq!(values(0), vec![1.5; small]);
            assert_eq!(values(1), vec![1.5; large]);
        }
    }

    /// `(a / b, -a)` over `n` i32 values, the division built at line 1 as
    /// entry 1 of a recording (on `device`, if given).
    fn division(n: usize, device: Option<&str>) -> Function {
        let meta = TensorMetadata::new(DType::I32, [n]);
        let mut f = Function::new("division", vec![meta.clone(), meta]);
        let none = OpAttrs::new();
        let (a, b) = (Value::Param(0), Value::Param(1));
        let q = f.add_op(&DIV, &none, &[a, b], at(1)).unwrap();
        f.nodes[q].origin = Some(1);
        f.nodes[q].device = device.map(str::to_owned);
        let neg = f.add_op(&NEG, &none, &[a], at(2)).unwrap();
        f.nodes[neg].origin = Some(0);
        f.results = vec![Value::node(q), Value::node(neg)];
        f
    }

    fn args(n: usize) -> Vec<HostTensor> {
        let ones = vec![1i32; n];
        let mut divisors = vec![2i32; n];
        divisors[n - 1] = 0;
        [ones, divisors]
            .iter()
            .map(|v| DenseHostTensor::from_slice(v, [n]).unwrap().into())
            .collect()
    }

    fn failing_line(result: Result<Vec<HostTensor>>) -> u32 {
        let err = result.unwrap_err();
        assert_eq!(err.op(), Some("Div"), "{err}");
        err.location().unwrap().line()
    }

    /// A kernel error names the line the run's table gives the node's
    /// origin, else the line the node was built with: sequential,
    /// parallel (large steps) and in-order-in-the-pool (larger steps)
    /// runs, and a run split over two devices.
    #[test]
    fn errors_name_the_runs_line_for_the_nodes_origin() {
        let cpu = Device::cpu();
        let table = [at(10), at(11)];
        let sizes = [
            (4, None),
            (1 << 14, None),
            (1 << 15, None),
            (4, Some("cpu:1")),
        ];
        for (n, device) in sizes {
            let exe = instantiate(Arc::new(division(n, device)), cpu).unwrap();
            assert_eq!(exe.partition_count(), 1 + usize::from(device.is_some()));
            if std::env::var_os("STAGECRAFT_EXECUTOR").is_none() {
                // Large steps too small to split their own work run side
                // by side; larger ones, in order.
                let overlapping = (PARALLEL_STEP_ELEMENTS..SPLIT_STEP_ELEMENTS).contains(&n);
                let parallel = overlapping && rayon::current_num_threads() > 1;
                assert_eq!(exe.schedule.parallel, parallel);
            }
            assert_eq!(failing_line(exe.run(args(n))), 1);
            assert_eq!(failing_line(exe.run_recorded(args(n), &table)), 11);
            // A table without the entry leaves the node's own line.
            assert_eq!(failing_line(exe.run_recorded(args(n), &table[..1])), 1);
        }
    }
}
