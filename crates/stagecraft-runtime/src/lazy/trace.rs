//! Recording, trace collection, the trace cache and materialization.

use crate::device::Device;
use crate::executor::{instantiate, Executable};
use crate::fxhash::{FxBuild, FxHasher};
use crate::handle::TensorHandle;
use crate::op_handler::{OpInvocation, Results};
use crate::profile;
use smallvec::SmallVec;
use stagecraft_graph::{text, Function, Node, NodeOp, Value};
use stagecraft_ops::{FrozenOpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{Error, HostTensor, Location, Result, TensorMetadata};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Constants with at most this many elements are baked into traces (until
/// widening promotes them); larger ones are always arguments: comparing
/// their values on every lookup would cost more than baking gains.
const BAKE_LIMIT: usize = 16;

/// One input of a recorded op.
enum Input {
    /// Output `index` of another recorded op.
    Op(Arc<LazyOp>, u32),
    /// An available value; `handle` gives it an identity, so one tensor
    /// used twice is one trace argument.
    Concrete { handle: TensorHandle },
}

enum State {
    Pending(SmallVec<[Input; 4]>),
    /// The op ran in a trace: the outputs the trace produced (`None` for an
    /// output nobody could read any more), or the trace's error.
    Done(SmallVec<[Option<Result<HostTensor>>; 1]>),
}

/// A recorded op.
pub(crate) struct LazyOp {
    def: &'static OpDef,
    attrs: FrozenOpAttrs,
    location: Location,
    outputs: OutputMetas,
    target: Device,
    /// The thread that recorded it: `mark_step` runs the calling thread's
    /// work only.
    thread: std::thread::ThreadId,
    /// Live user handles per output.
    live: SmallVec<[AtomicU32; 1]>,
    /// Pending recorded ops reading each output.
    uses: SmallVec<[AtomicU32; 1]>,
    state: Mutex<State>,
}

impl LazyOp {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_pending(&self) -> bool {
        matches!(*self.lock(), State::Pending(_))
    }

    fn release_inputs(inputs: &SmallVec<[Input; 4]>) {
        for input in inputs {
            if let Input::Op(op, index) = input {
                op.uses[*index as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for LazyOp {
    fn drop(&mut self) {
        if let State::Pending(inputs) = &*self.lock() {
            LazyOp::release_inputs(inputs);
        }
    }
}

/// A user handle's link to the recorded op output it stands for.
pub(crate) struct LazyRef {
    op: Arc<LazyOp>,
    index: u32,
}

impl LazyRef {
    pub(crate) fn retain(&self) {
        self.op.live[self.index as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn release(&self) {
        self.op.live[self.index as usize].fetch_sub(1, Ordering::Relaxed);
    }
}

/// What made a trace run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// The user read a value (`to_vec`, `item`, `Display`).
    ValueRead,
    /// The host branched on a value (`item()` of a bool tensor).
    HostControlFlow,
    /// [`mark_step`].
    MarkStep,
    /// The pending work reached the trace-length cap.
    TraceLimit,
}

/// Counters of the lazy runtime since the last [`reset_metrics`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LazyMetrics {
    /// Ops recorded on lazy devices.
    pub ops_recorded: u64,
    /// Traces compiled (cache misses, including widenings).
    pub traces_compiled: u64,
    /// Trace-cache lookups that found a compiled trace.
    pub cache_hits: u64,
    /// Lookups that had to compile.
    pub cache_misses: u64,
    /// Traces run.
    pub materializations: u64,
    /// Time spent building and compiling traces.
    pub compile_time: Duration,
    /// Time spent running traces.
    pub execute_time: Duration,
    /// Bytes of values handed to the host by reads.
    pub bytes_to_host: u64,
    /// Materializations caused by value reads.
    pub by_value_read: u64,
    /// Materializations caused by host decisions on values.
    pub by_host_control_flow: u64,
    /// Materializations caused by `mark_step`.
    pub by_mark_step: u64,
    /// Materializations caused by the trace-length cap.
    pub by_trace_limit: u64,
    /// Why the last cache miss missed (which part of the key changed).
    pub last_miss_reason: Option<String>,
    /// Buffers allocated fresh from the system (pool misses) since the
    /// last reset. Buffers are process-wide, so eager work counts too.
    pub buffer_allocations: u64,
    /// Buffer requests the pool served since the last reset.
    pub buffer_pool_hits: u64,
    /// Fresh buffer allocations between the last two `mark_step`s: 0 in a
    /// steady-state training loop.
    pub allocations_last_step: u64,
    /// Bytes held by live buffers now.
    pub live_bytes: u64,
    /// The most bytes live at once, over the process's life.
    pub peak_bytes: u64,
}

/// Allocator counters at a point in time, to take differences from.
#[derive(Clone, Copy, Default)]
struct AllocMark {
    allocations: u64,
    pool_hits: u64,
}

impl AllocMark {
    fn now() -> AllocMark {
        let stats = stagecraft_tensor::Buffer::stats();
        AllocMark {
            allocations: stats.allocations,
            pool_hits: stats.pool_hits,
        }
    }
}

struct Runtime {
    pending: Vec<Weak<LazyOp>>,
    recorded_since_step: usize,
    limit: usize,
    cache: HashMap<u64, Vec<Entry>>,
    metrics: LazyMetrics,
    /// The allocator at the last reset, and at the last `mark_step`.
    at_reset: AllocMark,
    at_step: AllocMark,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);
static OPS_RECORDED: AtomicU64 = AtomicU64::new(0);
static TRACE_NUMBER: AtomicUsize = AtomicUsize::new(0);
/// One trace runs at a time: materializations from several threads would
/// otherwise race to run overlapping pending ops.
static MATERIALIZE: Mutex<()> = Mutex::new(());

fn with_runtime<R>(f: impl FnOnce(&mut Runtime) -> R) -> R {
    let mut guard = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = guard.get_or_insert_with(|| Runtime {
        pending: Vec::new(),
        recorded_since_step: 0,
        limit: 10_000,
        cache: HashMap::new(),
        metrics: LazyMetrics::default(),
        at_reset: AllocMark::now(),
        at_step: AllocMark::now(),
    });
    f(rt)
}

/// The current counters.
pub fn metrics() -> LazyMetrics {
    let (mut m, base) = with_runtime(|rt| (rt.metrics.clone(), rt.at_reset));
    m.ops_recorded = OPS_RECORDED.load(Ordering::Relaxed);
    let stats = stagecraft_tensor::Buffer::stats();
    m.buffer_allocations = stats.allocations.saturating_sub(base.allocations);
    m.buffer_pool_hits = stats.pool_hits.saturating_sub(base.pool_hits);
    m.live_bytes = stats.live_bytes;
    m.peak_bytes = stats.peak_bytes;
    m
}

/// Zeroes the counters (the trace cache is kept).
pub fn reset_metrics() {
    OPS_RECORDED.store(0, Ordering::Relaxed);
    with_runtime(|rt| {
        rt.metrics = LazyMetrics::default();
        rt.at_reset = AllocMark::now();
        rt.at_step = rt.at_reset;
    });
}

/// Sets how many ops may be pending before the lazy runtime materializes
/// them on its own (so a loop that never calls [`mark_step`] stays bounded).
pub fn set_trace_limit(ops: usize) {
    with_runtime(|rt| rt.limit = ops.max(1));
}

fn debug_log(message: &str) {
    if std::env::var("STAGECRAFT_LAZY_LOG").is_ok_and(|v| v == "1") {
        eprintln!("[stagecraft lazy] {message}");
    }
}

// ---------------------------------------------------------------------------
// Recording.

pub(super) fn record(target: Device, mut inv: OpInvocation<'_>) -> Results {
    // The trace orders side effects by its own execution order.
    inv.release_chain();
    let OpInvocation {
        op,
        device,
        location,
        args,
        attrs,
        outputs,
        ..
    } = inv;
    let inputs: SmallVec<[Input; 4]> = args
        .into_iter()
        .map(|arg| match arg.lazy_ref() {
            Some(r) => {
                r.op.uses[r.index as usize].fetch_add(1, Ordering::Relaxed);
                Input::Op(r.op.clone(), r.index)
            }
            None => Input::Concrete { handle: arg },
        })
        .collect();
    let n = outputs.len();
    let lazy_op = Arc::new(LazyOp {
        def: op,
        attrs: attrs.freeze(),
        location,
        outputs: outputs.clone(),
        target,
        thread: std::thread::current().id(),
        live: (0..n).map(|_| AtomicU32::new(0)).collect(),
        uses: (0..n).map(|_| AtomicU32::new(0)).collect(),
        state: Mutex::new(State::Pending(inputs)),
    });
    OPS_RECORDED.fetch_add(1, Ordering::Relaxed);
    let over_limit = with_runtime(|rt| {
        rt.pending.push(Arc::downgrade(&lazy_op));
        rt.recorded_since_step += 1;
        rt.recorded_since_step >= rt.limit
    });
    let results: Results = outputs
        .iter()
        .enumerate()
        .map(|(i, meta)| {
            TensorHandle::lazy(
                device,
                meta.clone(),
                LazyRef {
                    op: lazy_op.clone(),
                    index: i as u32,
                },
            )
        })
        .collect();
    if over_limit {
        materialize_live(Trigger::TraceLimit);
    }
    results
}

/// `STAGECRAFT_LAZY_EAGER=1`: run each op on the target at once and keep
/// the results as concrete lazy tensors.
pub(super) fn execute_eagerly(target: Device, mut inv: OpInvocation<'_>) -> Results {
    inv.release_chain();
    let OpInvocation {
        op,
        device,
        location,
        args,
        attrs,
        ..
    } = inv;
    let moved: crate::Args = args
        .iter()
        .map(|a| match a.wait() {
            Ok(v) => TensorHandle::available(target, v.clone()),
            Err(e) => TensorHandle::error(target, a.metadata().clone(), e),
        })
        .collect();
    crate::runtime::execute(op, target, location, moved, attrs)
        .into_iter()
        .map(|h| match h.wait() {
            Ok(v) => TensorHandle::available(device, v.clone()),
            Err(e) => TensorHandle::error(device, h.metadata().clone(), e),
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Collecting a trace.

/// A trace argument before the cache decides whether it is baked.
struct Leaf {
    value: HostTensor,
    /// False for values a trace computed (always arguments) and for large
    /// values.
    bakeable: bool,
}

/// The structure of a trace: what the cache key hashes. Every leaf is a
/// parameter here, whatever it will become.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Skeleton {
    params: Vec<TensorMetadata>,
    nodes: Vec<SkeletonNode>,
    results: Vec<Value>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct SkeletonNode {
    op: usize,
    attrs: FrozenOpAttrs,
    inputs: SmallVec<[Value; 4]>,
    outputs: OutputMetas,
}

struct Collected {
    skeleton: Skeleton,
    ops: Vec<Arc<LazyOp>>,
    locations: Vec<Location>,
    leaves: Vec<Leaf>,
    /// (op position, output index) of each result.
    outputs: Vec<(usize, u32)>,
    requested: Vec<usize>,
    target: Device,
}

fn key_of(p: &Arc<LazyOp>) -> usize {
    Arc::as_ptr(p) as usize
}

/// Ops and leaves of the last trace collected (capacity hints).
static LAST_TRACE_OPS: AtomicUsize = AtomicUsize::new(0);
static LAST_TRACE_LEAVES: AtomicUsize = AtomicUsize::new(0);

/// Collects the pending ops that `roots` depend on, in DFS post-order.
fn collect(roots: &[(Arc<LazyOp>, u32)]) -> Result<Collected> {
    let target = roots
        .first()
        .map(|(op, _)| op.target)
        .ok_or_else(|| Error::internal("an empty trace"))?;
    // A training loop records the same trace every step: sizing for the
    // last one spares the growth of every vector and map (4–5 µs of the
    // MLP step's 47-op trace).
    let (size, leaf_count) = (
        LAST_TRACE_OPS.load(Ordering::Relaxed).min(1 << 16),
        LAST_TRACE_LEAVES.load(Ordering::Relaxed).min(1 << 16),
    );
    let mut position: HashMap<usize, usize, FxBuild> =
        HashMap::with_capacity_and_hasher(size, FxBuild::default());
    let mut ops: Vec<Arc<LazyOp>> = Vec::with_capacity(size);
    let mut nodes: Vec<SkeletonNode> = Vec::with_capacity(size);
    let mut locations = Vec::with_capacity(size);
    let mut leaves: Vec<Leaf> = Vec::with_capacity(leaf_count);
    let mut params: Vec<TensorMetadata> = Vec::with_capacity(leaf_count);
    let mut leaf_ids: HashMap<(usize, u32), u32, FxBuild> =
        HashMap::with_capacity_and_hasher(leaf_count, FxBuild::default());
    let mut inside_uses: HashMap<(usize, u32), u32, FxBuild> =
        HashMap::with_capacity_and_hasher(size * 2, FxBuild::default());

    // Iterative DFS: (op, visited-children?).
    let mut stack: Vec<(Arc<LazyOp>, bool)> = roots
        .iter()
        .rev()
        .map(|(op, _)| (op.clone(), false))
        .collect();
    while let Some((op, expanded)) = stack.pop() {
        let key = key_of(&op);
        if position.contains_key(&key) {
            continue;
        }
        let state = op.lock();
        let State::Pending(inputs) = &*state else {
            continue;
        };
        if !expanded {
            let children: Vec<Arc<LazyOp>> = inputs
                .iter()
                .filter_map(|i| match i {
                    Input::Op(child, _)
                        if child.is_pending() && !position.contains_key(&key_of(child)) =>
                    {
                        Some(child.clone())
                    }
                    _ => None,
                })
                .collect();
            drop(state);
            stack.push((op.clone(), true));
            for child in children.into_iter().rev() {
                stack.push((child, false));
            }
            continue;
        }
        let mut values: SmallVec<[Value; 4]> = SmallVec::new();
        for input in inputs.iter() {
            let value = match input {
                Input::Op(child, index) => {
                    if let Some(&pos) = position.get(&key_of(child)) {
                        *inside_uses.entry((pos, *index)).or_default() += 1;
                        Value::Output {
                            node: pos as u32,
                            output: *index,
                        }
                    } else {
                        // A materialized output: an argument.
                        let leaf_key = (key_of(child), *index);
                        let id = match leaf_ids.get(&leaf_key) {
                            Some(id) => *id,
                            None => {
                                let value = match &*child.lock() {
                                    State::Done(values) => values
                                        .get(*index as usize)
                                        .cloned()
                                        .flatten()
                                        .unwrap_or_else(|| {
                                            Err(Error::internal("a materialized value was dropped"))
                                        }),
                                    State::Pending(_) => {
                                        Err(Error::internal("a pending input escaped the trace"))
                                    }
                                };
                                // The producing trace failed: this one fails the same way.
                                let value = value?;
                                params.push(child.outputs[*index as usize].clone());
                                leaves.push(Leaf {
                                    value,
                                    bakeable: false,
                                });
                                let id = (leaves.len() - 1) as u32;
                                leaf_ids.insert(leaf_key, id);
                                id
                            }
                        };
                        Value::Param(id)
                    }
                }
                Input::Concrete { handle } => {
                    let leaf_key = (handle.addr(), u32::MAX);
                    let id = match leaf_ids.get(&leaf_key) {
                        Some(id) => *id,
                        None => {
                            let value = handle.wait()?.clone();
                            let bakeable = value.metadata().shape.numel() <= BAKE_LIMIT;
                            params.push(handle.metadata().clone());
                            leaves.push(Leaf { value, bakeable });
                            let id = (leaves.len() - 1) as u32;
                            leaf_ids.insert(leaf_key, id);
                            id
                        }
                    };
                    Value::Param(id)
                }
            };
            values.push(value);
        }
        drop(state);
        position.insert(key, ops.len());
        nodes.push(SkeletonNode {
            op: op.def as *const OpDef as usize,
            attrs: op.attrs.clone(),
            inputs: values,
            outputs: op.outputs.clone(),
        });
        locations.push(op.location);
        ops.push(op);
    }
    // Outputs: requested roots, then every op output still referenced from
    // outside the trace (live user tensors or pending ops not in it).
    let mut outputs: Vec<(usize, u32)> = Vec::new();
    let mut requested = Vec::new();
    for (op, index) in roots {
        if let Some(&pos) = position.get(&key_of(op)) {
            let out = (pos, *index);
            let at = outputs.iter().position(|o| *o == out).unwrap_or_else(|| {
                outputs.push(out);
                outputs.len() - 1
            });
            requested.push(at);
        }
    }
    for (pos, op) in ops.iter().enumerate() {
        for index in 0..op.outputs.len() as u32 {
            let live = op.live[index as usize].load(Ordering::Relaxed) > 0;
            let uses = op.uses[index as usize].load(Ordering::Relaxed);
            let inside = inside_uses.get(&(pos, index)).copied().unwrap_or(0);
            if (live || uses > inside) && !outputs.contains(&(pos, index)) {
                outputs.push((pos, index));
            }
        }
    }
    let results = outputs
        .iter()
        .map(|&(node, output)| Value::Output {
            node: node as u32,
            output,
        })
        .collect();
    LAST_TRACE_OPS.store(ops.len(), Ordering::Relaxed);
    LAST_TRACE_LEAVES.store(leaves.len(), Ordering::Relaxed);
    Ok(Collected {
        skeleton: Skeleton {
            params,
            nodes,
            results,
        },
        ops,
        locations,
        leaves,
        outputs,
        requested,
        target,
    })
}

// ---------------------------------------------------------------------------
// The trace cache.

#[derive(Clone)]
enum Mode {
    /// The leaf is a parameter of the compiled trace.
    Argument,
    /// The leaf is baked in as this constant.
    Baked(HostTensor),
}

struct Entry {
    skeleton: Skeleton,
    modes: Vec<Mode>,
    executable: Arc<Executable>,
}

fn fingerprint(skeleton: &Skeleton) -> u64 {
    // Entries under one fingerprint are compared in full, so a fast hash
    // is enough.
    let mut h = FxHasher::default();
    skeleton.hash(&mut h);
    h.finish()
}

/// Explains a miss against the cached trace most like this one.
fn miss_reason(skeleton: &Skeleton, cache: &HashMap<u64, Vec<Entry>>) -> String {
    let nearest = cache
        .values()
        .flatten()
        .filter(|e| e.skeleton.nodes.len() == skeleton.nodes.len())
        .map(|e| &e.skeleton)
        .next();
    let Some(old) = nearest else {
        return format!("no cached trace has {} ops", skeleton.nodes.len());
    };
    for (i, (a, b)) in skeleton.nodes.iter().zip(&old.nodes).enumerate() {
        if a.op != b.op {
            return format!("op {i} changed");
        }
        if a.attrs != b.attrs {
            return format!(
                "an attribute of op {i} changed ({} vs {})",
                &*a.attrs, &*b.attrs
            );
        }
        if a.inputs != b.inputs {
            return format!("the inputs of op {i} are wired differently");
        }
        if a.outputs != b.outputs {
            return format!("the output shape or dtype of op {i} changed");
        }
    }
    for (i, (a, b)) in skeleton.params.iter().zip(&old.params).enumerate() {
        if a.dtype != b.dtype {
            return format!("argument {i} changed dtype ({} vs {})", a.dtype, b.dtype);
        }
        if a.shape != b.shape {
            return format!("argument {i} changed shape ({} vs {})", a.shape, b.shape);
        }
    }
    if skeleton.params.len() != old.params.len() {
        return "the number of arguments changed".into();
    }
    "the set of live outputs changed".into()
}

/// Builds the graph function for `skeleton` with baked leaves as constants.
///
/// Every node's origin is the trace entry it stands for (baked constants
/// go with the first entry, whose location they take): a cached compile
/// of this function runs for later recordings too, which pass their own
/// `locations` to [`Executable::run_recorded`] so that errors name their
/// lines rather than these.
fn build_function(
    name: String,
    skeleton: &Skeleton,
    modes: &[Mode],
    collected_ops: &[Arc<LazyOp>],
    locations: &[Location],
) -> Function {
    let args: Vec<TensorMetadata> = skeleton
        .params
        .iter()
        .zip(modes)
        .filter(|(_, m)| matches!(m, Mode::Argument))
        .map(|(p, _)| p.clone())
        .collect();
    let mut f = Function::new(name, args);
    // Leaf i becomes parameter k (arguments) or a constant node.
    let mut leaf_value = Vec::with_capacity(modes.len());
    let mut next_arg = 0u32;
    let first_location = locations.first().copied().unwrap_or_else(Location::caller);
    let first_origin = (!locations.is_empty()).then_some(0);
    for mode in modes {
        match mode {
            Mode::Argument => {
                leaf_value.push(Value::Param(next_arg));
                next_arg += 1;
            }
            Mode::Baked(v) => {
                let node = f.add_const(v.clone(), first_location);
                f.nodes[node].origin = first_origin;
                leaf_value.push(Value::node(node));
            }
        }
    }
    let base = f.nodes.len() as u32;
    let remap = |v: Value| match v {
        Value::Param(i) => leaf_value[i as usize],
        Value::Output { node, output } => Value::Output {
            node: node + base,
            output,
        },
    };
    for (i, node) in skeleton.nodes.iter().enumerate() {
        let op = &collected_ops[i];
        f.push(Node {
            op: NodeOp::Op(op.def, node.attrs.clone()),
            inputs: node.inputs.iter().map(|v| remap(*v)).collect(),
            outputs: node.outputs.clone(),
            device: None,
            location: locations[i],
            origin: u32::try_from(i).ok(),
        });
    }
    f.results = skeleton.results.iter().map(|v| remap(*v)).collect();
    f
}

/// The compiled trace for `collected`, from the cache or compiled now,
/// with the arguments to pass.
fn lookup_or_compile(collected: &Collected) -> Result<(Arc<Executable>, Vec<HostTensor>)> {
    let key = fingerprint(&collected.skeleton);
    let leaves = &collected.leaves;
    let found = with_runtime(|rt| {
        let entries = rt.cache.get(&key)?;
        let entry = entries.iter().find(|e| e.skeleton == collected.skeleton)?;
        let mut widened = Vec::new();
        for (i, (mode, leaf)) in entry.modes.iter().zip(leaves).enumerate() {
            if let Mode::Baked(v) = mode {
                if !(leaf.bakeable && v.same_value(&leaf.value)) {
                    widened.push(i);
                }
            }
        }
        Some((entry.modes.clone(), entry.executable.clone(), widened))
    });
    let modes = match found {
        Some((modes, exe, widened)) if widened.is_empty() => {
            with_runtime(|rt| rt.metrics.cache_hits += 1);
            profile::instant(
                profile::CACHE,
                "cache hit",
                vec![("ops", collected.ops.len().to_string())],
            );
            return Ok((exe.clone(), arguments(&modes, leaves)));
        }
        Some((mut modes, _, widened)) => {
            let reason =
                format!("the values of constants {widened:?} changed: promoting them to arguments");
            debug_log(&format!("trace cache miss: {reason}"));
            profile::instant(
                profile::CACHE,
                "cache miss",
                vec![("reason", reason.clone())],
            );
            with_runtime(|rt| rt.metrics.last_miss_reason = Some(reason));
            for i in widened {
                modes[i] = Mode::Argument;
            }
            modes
        }
        None => {
            let reason = with_runtime(|rt| miss_reason(&collected.skeleton, &rt.cache));
            debug_log(&format!("trace cache miss: {reason}"));
            profile::instant(
                profile::CACHE,
                "cache miss",
                vec![("reason", reason.clone())],
            );
            with_runtime(|rt| rt.metrics.last_miss_reason = Some(reason));
            first_modes(leaves)
        }
    };
    let start = Instant::now();
    let span = profile::begin();
    let name = format!("lazyTrace_{}", TRACE_NUMBER.fetch_add(1, Ordering::Relaxed));
    let function = build_function(
        name.clone(),
        &collected.skeleton,
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let exe = Arc::new(instantiate(Arc::new(function), collected.target)?);
    if let Some(span) = span {
        let ops = collected.ops.len().to_string();
        span.end(profile::COMPILE, name, vec![("ops", ops)]);
    }
    let args = arguments(&modes, leaves);
    with_runtime(|rt| {
        rt.metrics.cache_misses += 1;
        rt.metrics.traces_compiled += 1;
        rt.metrics.compile_time += start.elapsed();
        let entries = rt.cache.entry(key).or_default();
        entries.retain(|e| e.skeleton != collected.skeleton);
        entries.push(Entry {
            skeleton: collected.skeleton.clone(),
            modes,
            executable: exe.clone(),
        });
    });
    Ok((exe, args))
}

/// How a trace seen for the first time treats its leaves: small constants
/// are baked in (until widening promotes them), everything else is an
/// argument.
fn first_modes(leaves: &[Leaf]) -> Vec<Mode> {
    leaves
        .iter()
        .map(|l| {
            if l.bakeable {
                Mode::Baked(l.value.clone())
            } else {
                Mode::Argument
            }
        })
        .collect()
}

fn arguments(modes: &[Mode], leaves: &[Leaf]) -> Vec<HostTensor> {
    modes
        .iter()
        .zip(leaves)
        .filter(|(m, _)| matches!(m, Mode::Argument))
        .map(|(_, l)| l.value.clone())
        .collect()
}

// ---------------------------------------------------------------------------
// Materialization.

fn count_trigger(rt: &mut Runtime, trigger: Trigger) {
    match trigger {
        Trigger::ValueRead => rt.metrics.by_value_read += 1,
        Trigger::HostControlFlow => rt.metrics.by_host_control_flow += 1,
        Trigger::MarkStep => rt.metrics.by_mark_step += 1,
        Trigger::TraceLimit => rt.metrics.by_trace_limit += 1,
    }
}

/// Marks every op of a trace done with `error`.
fn fail(ops: &[Arc<LazyOp>], error: &Error) {
    for op in ops {
        let mut state = op.lock();
        if let State::Pending(inputs) = &*state {
            LazyOp::release_inputs(inputs);
            *state = State::Done(
                op.outputs
                    .iter()
                    .map(|_| Some(Err(error.clone())))
                    .collect(),
            );
        }
    }
}

/// Runs the trace that computes `roots` (plus live outputs) and memoizes
/// every produced value in its op.
fn run_trace(roots: &[(Arc<LazyOp>, u32)], trigger: Trigger) {
    let pending: Vec<(Arc<LazyOp>, u32)> = roots
        .iter()
        .filter(|(op, _)| op.is_pending())
        .cloned()
        .collect();
    if pending.is_empty() {
        return;
    }
    let span = profile::begin();
    run_collected(&pending, trigger);
    if let Some(span) = span {
        span.end(
            profile::MATERIALIZE,
            "materialize",
            vec![("trigger", format!("{trigger:?}"))],
        );
    }
}

/// [`run_trace`] for roots known to be pending.
fn run_collected(pending: &[(Arc<LazyOp>, u32)], trigger: Trigger) {
    let start = Instant::now();
    let collected = match collect(pending) {
        Ok(c) => c,
        Err(e) => {
            let ops: Vec<Arc<LazyOp>> = pending.iter().map(|(op, _)| op.clone()).collect();
            fail(&ops, &e);
            return;
        }
    };
    let compiled = lookup_or_compile(&collected);
    with_runtime(|rt| {
        rt.metrics.materializations += 1;
        count_trigger(rt, trigger);
        // Building the trace counts as compile time even on a hit.
        rt.metrics.compile_time += start.elapsed();
    });
    let (exe, args) = match compiled {
        Ok(c) => c,
        Err(e) => return fail(&collected.ops, &e),
    };
    let start = Instant::now();
    // The executable may come from the cache, compiled for a recording made
    // from other source lines: errors must name this recording's.
    let results = exe.run_recorded(args, &collected.locations);
    with_runtime(|rt| rt.metrics.execute_time += start.elapsed());
    let results = match results {
        Ok(r) => r,
        Err(e) => return fail(&collected.ops, &e),
    };
    let mut produced: Vec<SmallVec<[Option<Result<HostTensor>>; 1]>> = collected
        .ops
        .iter()
        .map(|op| op.outputs.iter().map(|_| None).collect())
        .collect();
    for (&(pos, index), value) in collected.outputs.iter().zip(results) {
        produced[pos][index as usize] = Some(Ok(value));
    }
    for (op, values) in collected.ops.iter().zip(produced) {
        let mut state = op.lock();
        if let State::Pending(inputs) = &*state {
            LazyOp::release_inputs(inputs);
        }
        *state = State::Done(values);
    }
}

/// Gives a lazy handle its value, running a trace if its op has not run.
pub(crate) fn materialize_handle(handle: &TensorHandle, trigger: Trigger) {
    let Some(lazy) = handle.lazy_ref() else {
        return;
    };
    let root = (lazy.op.clone(), lazy.index);
    {
        let _one_at_a_time = MATERIALIZE.lock().unwrap_or_else(|p| p.into_inner());
        run_trace(std::slice::from_ref(&root), trigger);
    }
    let value = match &*root.0.lock() {
        State::Done(values) => values
            .get(root.1 as usize)
            .cloned()
            .flatten()
            .unwrap_or_else(|| Err(Error::internal("a lazy value was not materialized"))),
        State::Pending(_) => Err(Error::internal("a trace did not run its requested op")),
    };
    if let Ok(v) = &value {
        if matches!(trigger, Trigger::ValueRead | Trigger::HostControlFlow) {
            let bytes = v.metadata().shape.numel() * v.metadata().dtype.size_in_bytes();
            with_runtime(|rt| rt.metrics.bytes_to_host += bytes as u64);
        }
    }
    handle.fill_lazy(value);
}

/// The live outputs of pending ops this thread recorded: what its
/// `mark_step` materializes (with whatever they depend on, from any thread).
///
/// Only this thread's: the step barrier belongs to the thread's program. A
/// trace fails as a whole, so running every thread's pending work in one
/// trace let one thread's kernel error (say, an integer division by zero)
/// fail another thread's independent tensors, naming a line that thread
/// never ran.
fn live_roots() -> Vec<(Arc<LazyOp>, u32)> {
    let me = std::thread::current().id();
    with_runtime(|rt| {
        rt.recorded_since_step = 0;
        let mut roots = Vec::new();
        rt.pending.retain(|weak| {
            let Some(op) = weak.upgrade() else {
                return false;
            };
            if !op.is_pending() {
                return false;
            }
            if op.thread == me {
                push_live_outputs(&op, &mut roots);
            }
            true
        });
        roots
    })
}

fn push_live_outputs(op: &Arc<LazyOp>, roots: &mut Vec<(Arc<LazyOp>, u32)>) {
    for (i, live) in op.live.iter().enumerate() {
        if live.load(Ordering::Relaxed) > 0 {
            roots.push((op.clone(), i as u32));
        }
    }
}

fn materialize_live(trigger: Trigger) {
    let _one_at_a_time = MATERIALIZE.lock().unwrap_or_else(|p| p.into_inner());
    let roots = live_roots();
    // One trace per target device.
    let mut targets: Vec<Device> = roots.iter().map(|(op, _)| op.target).collect();
    targets.dedup();
    for target in targets {
        let for_target: Vec<_> = roots
            .iter()
            .filter(|(op, _)| op.target == target)
            .cloned()
            .collect();
        run_trace(&for_target, trigger);
    }
}

/// The end-of-step barrier: materializes every live lazy tensor this thread
/// recorded with one trace (per target device), together with the pending
/// work of any thread they depend on. Call it once per training step, so
/// each step is the same trace and hits the cache. Other threads' pending
/// tensors wait for their own `mark_step` (or a read), so one thread's
/// failing step cannot fail another's.
pub fn mark_step() {
    materialize_live(Trigger::MarkStep);
    let now = AllocMark::now();
    with_runtime(|rt| {
        rt.metrics.allocations_last_step = now.allocations.saturating_sub(rt.at_step.allocations);
        rt.at_step = now;
    });
}

fn describe(handle: &TensorHandle) -> Result<(Collected, Vec<Mode>)> {
    let lazy = handle
        .lazy_ref()
        .ok_or_else(|| Error::invalid("the tensor is not a pending lazy tensor"))?;
    if !lazy.op.is_pending() {
        return Err(Error::invalid(
            "the tensor is already materialized: its trace has run",
        ));
    }
    let collected = collect(&[(lazy.op.clone(), lazy.index)])?;
    let modes = cached_modes(&collected);
    Ok((collected, modes))
}

/// How the trace cache would treat `collected`'s leaves: as its cached
/// entry does, else as a first trace.
fn cached_modes(collected: &Collected) -> Vec<Mode> {
    let key = fingerprint(&collected.skeleton);
    with_runtime(|rt| {
        rt.cache
            .get(&key)
            .and_then(|es| es.iter().find(|e| e.skeleton == collected.skeleton))
            .map(|e| e.modes.clone())
    })
    .unwrap_or_else(|| first_modes(&collected.leaves))
}

/// The trace [`mark_step`] would run now, as a graph function, before and
/// after the optimization passes that compiling it runs.
#[derive(Clone, Debug)]
pub struct StepTrace {
    /// The trace as recorded (what [`trace_text`] prints for one tensor).
    pub recorded: Function,
    /// The same function after `stagecraft_graph::passes::optimize`: what
    /// the executor instantiates.
    pub optimized: Function,
}

/// The trace that [`mark_step`] would run now for this thread's live
/// tensors on the first target device holding pending work, without running
/// it (the
/// pending ops stay pending and the next `mark_step` runs them as usual).
/// An error when nothing is pending.
pub fn step_trace() -> Result<StepTrace> {
    let me = std::thread::current().id();
    let mut roots: Vec<(Arc<LazyOp>, u32)> = with_runtime(|rt| {
        let mut roots = Vec::new();
        for op in rt.pending.iter().filter_map(Weak::upgrade) {
            if op.is_pending() && op.thread == me {
                push_live_outputs(&op, &mut roots);
            }
        }
        roots
    });
    let target = roots
        .first()
        .map(|(op, _)| op.target)
        .ok_or_else(|| Error::invalid("no live lazy tensor is pending: there is no step trace"))?;
    roots.retain(|(op, _)| op.target == target);
    let collected = collect(&roots)?;
    let modes = cached_modes(&collected);
    let recorded = build_function(
        "lazyTrace_step".to_string(),
        &collected.skeleton,
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let optimized = stagecraft_graph::passes::optimize(&recorded);
    Ok(StepTrace {
        recorded,
        optimized,
    })
}

/// The trace that materializing `handle` now would run, in the lazy-tensor
/// text form, with its live outputs listed after `return`.
pub fn trace_text(handle: &TensorHandle) -> Result<String> {
    let (collected, modes) = describe(handle)?;
    let name = format!("lazyTrace_{}", collected.ops.len());
    let f = build_function(
        name,
        &collected.skeleton,
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let printed = text::print(&f);
    let mut out = String::new();
    for line in printed.lines() {
        let line = line.strip_prefix('@').unwrap_or(line);
        // The seed's form: no per-node metadata or locations.
        let line = match line.find(") : ") {
            Some(cut) if line.trim_start().starts_with('%') => &line[..=cut],
            _ => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    let requested: Vec<String> = collected
        .requested
        .iter()
        .map(|&i| text::value_name(&f, f.results[i]))
        .collect();
    let live: Vec<String> = (0..f.results.len())
        .filter(|i| !collected.requested.contains(i))
        .map(|i| text::value_name(&f, f.results[i]))
        .collect();
    out.push_str(&format!(
        "// requested: {}; live: {}\n",
        requested.join(", "),
        if live.is_empty() {
            "none".to_string()
        } else {
            live.join(", ")
        }
    ));
    Ok(out)
}

/// The same trace as [`trace_text`], as Graphviz DOT.
pub fn trace_dot(handle: &TensorHandle) -> Result<String> {
    let (collected, modes) = describe(handle)?;
    let name = format!("lazyTrace_{}", collected.ops.len());
    let f = build_function(
        name,
        &collected.skeleton,
        &modes,
        &collected.ops,
        &collected.locations,
    );
    Ok(stagecraft_graph::dot::to_dot(&f))
}
