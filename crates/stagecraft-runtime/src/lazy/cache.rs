//! The trace cache: compiled traces keyed by their structure, shared by
//! every thread. Its lock is held to look an entry up or to insert one,
//! never while a trace compiles or runs, so threads running cached traces
//! only ever share it for reading.

use super::collect::{Collected, Leaf, Skeleton, Structure};
use super::metrics::{count_cache_hit, count_cache_miss, count_compile, count_key, count_lookup};
use super::op::LazyOp;
use crate::device::Device;
use crate::executor::{instantiate, DeviceProgram, Executable};
use crate::profile;
use smallvec::SmallVec;
use stagecraft_graph::{Function, Node, NodeOp, Value};
use stagecraft_tensor::FxHasher;
use stagecraft_tensor::{Error, HostTensor, Location, Result, TensorMetadata, TensorValue};
use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// How a trace treats one of its leaves.
#[derive(Clone)]
pub(super) enum Mode {
    /// The leaf is a parameter of the compiled trace.
    Argument,
    /// The leaf is baked in as this constant.
    Baked(HostTensor),
}

/// A trace compiled for its target device.
pub(crate) enum Compiled {
    /// Planned host kernels, for a device holding host tensors.
    Host(Executable),
    /// Node by node through the op handler, for a device that runs ops
    /// itself (a GPU), as one batch of its work.
    Device(DeviceProgram),
}

impl Compiled {
    fn new(function: Function, target: Device) -> Result<Compiled> {
        let handler = target.handler();
        if handler.host_kernels().is_none() && handler.memory().is_some() {
            return Ok(Compiled::Device(DeviceProgram::new(&function, target)));
        }
        Ok(Compiled::Host(instantiate(Arc::new(function), target)?))
    }

    /// Runs the trace on `args`; errors name the entries of `locations`
    /// (see [`Executable::run_recorded`]).
    pub(crate) fn run_recorded(
        &self,
        args: Vec<TensorValue>,
        locations: &[Location],
    ) -> Result<Vec<TensorValue>> {
        match self {
            Compiled::Device(program) => program.run_recorded(args, locations),
            Compiled::Host(exe) => {
                let host = args
                    .into_iter()
                    .map(|v| match v {
                        TensorValue::Host(h) => Ok(h),
                        TensorValue::Device(d) => Err(Error::internal(format!(
                            "a trace for {} got an argument in the memory of {}",
                            exe.device(),
                            d.storage().device_name()
                        ))),
                    })
                    .collect::<Result<Vec<HostTensor>>>()?;
                let results = exe.run_recorded(host, locations)?;
                Ok(results.into_iter().map(TensorValue::Host).collect())
            }
        }
    }
}

struct Entry {
    /// The device the trace was compiled for: one structure recorded on
    /// two lazy devices is two traces (a host executable, a GPU program).
    target: Device,
    structure: Structure,
    /// For explaining later misses.
    skeleton: Skeleton,
    modes: Vec<Mode>,
    executable: Arc<Compiled>,
}

/// Entries by [`fingerprint`]; entries under one fingerprint are told
/// apart by comparing structures in full.
type Cache = HashMap<u64, Vec<Entry>>;

static CACHE: RwLock<Option<Cache>> = RwLock::new(None);

/// Numbers the compiled traces' names.
static TRACE_NUMBER: AtomicUsize = AtomicUsize::new(0);

fn read_cache<R>(f: impl FnOnce(Option<&Cache>) -> R) -> R {
    f(CACHE.read().unwrap_or_else(|p| p.into_inner()).as_ref())
}

fn write_cache<R>(f: impl FnOnce(&mut Cache) -> R) -> R {
    let mut cache = CACHE.write().unwrap_or_else(|p| p.into_inner());
    f(cache.get_or_insert_with(HashMap::new))
}

fn debug_log(message: &str) {
    if std::env::var("STAGECRAFT_LAZY_LOG").is_ok_and(|v| v == "1") {
        eprintln!("[stagecraft lazy] {message}");
    }
}

fn fingerprint(structure: &Structure) -> u64 {
    // Entries under one fingerprint are compared in full, so a fast hash
    // is enough.
    let mut h = FxHasher::default();
    for &word in structure.words() {
        h.write_u64(word);
    }
    h.finish()
}

/// Explains a miss against the cached trace most like this one.
fn miss_reason(skeleton: &Skeleton, cache: &Cache) -> String {
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
/// Every node's origin is the trace entry it stands for (a baked constant
/// goes with the first entry that reads it, whose location it takes: the
/// line where the user's value met the op that promoted it): a cached compile
/// of this function runs for later recordings too, which pass their own
/// `locations` to [`Executable::run_recorded`] so that errors name their
/// lines rather than these.
pub(super) fn build_function(
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
    let mut first_reader: Vec<Option<usize>> = vec![None; modes.len()];
    for (i, node) in skeleton.nodes.iter().enumerate() {
        for input in &node.inputs {
            if let Value::Param(leaf) = input {
                first_reader[*leaf as usize].get_or_insert(i);
            }
        }
    }
    for (leaf, mode) in modes.iter().enumerate() {
        match mode {
            Mode::Argument => {
                leaf_value.push(Value::Param(next_arg));
                next_arg += 1;
            }
            Mode::Baked(v) => {
                // A leaf no op reads (a result only) takes the first entry.
                let reader = first_reader[leaf].unwrap_or(0);
                let location = locations
                    .get(reader)
                    .copied()
                    .unwrap_or_else(Location::caller);
                let node = f.add_const(v.clone(), location);
                f.nodes[node].origin = (reader < locations.len()).then_some(reader as u32);
                leaf_value.push(Value::node(node));
            }
        }
    }
    let base = f.nodes.len() as u32;
    let order = recording_order(skeleton, collected_ops);
    // Where each trace entry's node lands in `f`.
    let mut placed = vec![0u32; order.len()];
    for (k, &i) in order.iter().enumerate() {
        placed[i] = base + k as u32;
    }
    let remap = |v: Value| match v {
        Value::Param(i) => leaf_value[i as usize],
        Value::Output { node, output } => Value::Output {
            node: placed[node as usize],
            output,
        },
    };
    for i in order {
        let (node, op) = (&skeleton.nodes[i], &collected_ops[i]);
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

/// The trace's entries in the order they were recorded, wherever their
/// inputs allow (entries recorded on several threads may number an input
/// after its reader): the order the user's program ran them in, which
/// the walk that collected them from their outputs does not keep. The
/// walk reaches a weight's gradient product only from the optimizer's
/// update of that weight, so a GPT's weight gradients all ran after the
/// whole backward pass, when the activations and gradients they read had
/// left the core's caches; in recording order each runs right after its
/// layer's input gradient, which reads the same gradient (measured in
/// docs/performance.md, "A lazy trace runs in recording order").
fn recording_order(skeleton: &Skeleton, ops: &[Arc<LazyOp>]) -> Vec<usize> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let count = skeleton.nodes.len();
    let mut waiting_on = vec![0u32; count];
    let mut readers: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); count];
    for (i, node) in skeleton.nodes.iter().enumerate() {
        for input in &node.inputs {
            if let Value::Output { node: source, .. } = input {
                readers[*source as usize].push(i as u32);
                waiting_on[i] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<(u64, usize)>> = (0..count)
        .filter(|&i| waiting_on[i] == 0)
        .map(|i| Reverse((ops[i].recorded_at, i)))
        .collect();
    let mut order = Vec::with_capacity(count);
    while let Some(Reverse((_, i))) = ready.pop() {
        order.push(i);
        for &reader in &readers[i] {
            let reader = reader as usize;
            waiting_on[reader] -= 1;
            if waiting_on[reader] == 0 {
                ready.push(Reverse((ops[reader].recorded_at, reader)));
            }
        }
    }
    debug_assert_eq!(order.len(), count, "a trace's entries form a DAG");
    order
}

/// The compiled trace for `collected`, from the cache or compiled now,
/// with the arguments to pass.
///
/// Two threads that miss on the same structure at once both compile it
/// and the later insert replaces the earlier: a rare extra compile, in
/// exchange for never holding the cache while compiling.
pub(super) fn lookup_or_compile(
    collected: &Collected,
) -> Result<(Arc<Compiled>, Vec<TensorValue>)> {
    let start = Instant::now();
    let key = fingerprint(&collected.structure);
    // One clock read ends the hashing and starts the lookup.
    let hashed = Instant::now();
    count_key(hashed - start);
    let leaves = &collected.leaves;
    let found = read_cache(|cache| {
        let entries = cache?.get(&key)?;
        let entry = entries
            .iter()
            .find(|e| e.target == collected.target && e.structure == collected.structure)?;
        let mut widened = Vec::new();
        for (i, (mode, leaf)) in entry.modes.iter().zip(leaves).enumerate() {
            if let Mode::Baked(v) = mode {
                let same = match &leaf.value {
                    TensorValue::Host(value) => leaf.bakeable && v.same_value(value),
                    TensorValue::Device(_) => false,
                };
                if !same {
                    widened.push(i);
                }
            }
        }
        if widened.is_empty() {
            // A hit needs only the arguments, not a copy of the modes.
            let args = arguments(&entry.modes, leaves);
            return Some(Ok((entry.executable.clone(), args)));
        }
        Some(Err((entry.modes.clone(), widened)))
    });
    count_lookup(hashed.elapsed());
    // A miss builds the skeleton: it explains the miss and becomes the
    // function.
    let (skeleton, modes) = match found {
        Some(Ok(hit)) => {
            count_cache_hit();
            profile::instant(
                profile::CACHE,
                "cache hit",
                vec![("ops", collected.ops.len().to_string())],
            );
            return Ok(hit);
        }
        Some(Err((mut modes, widened))) => {
            let reason =
                format!("the values of constants {widened:?} changed: promoting them to arguments");
            note_miss(reason);
            for i in widened {
                modes[i] = Mode::Argument;
            }
            (collected.skeleton(), modes)
        }
        None => {
            let skeleton = collected.skeleton();
            let reason = read_cache(|cache| match cache {
                Some(cache) => miss_reason(&skeleton, cache),
                None => miss_reason(&skeleton, &HashMap::new()),
            });
            note_miss(reason);
            (skeleton, first_modes(leaves))
        }
    };
    let start = Instant::now();
    let span = profile::begin();
    let name = format!("lazyTrace_{}", TRACE_NUMBER.fetch_add(1, Ordering::Relaxed));
    let function = build_function(
        name.clone(),
        &skeleton,
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let exe = Arc::new(Compiled::new(function, collected.target)?);
    if let Some(span) = span {
        let ops = collected.ops.len().to_string();
        span.end(profile::COMPILE, name, vec![("ops", ops)]);
    }
    let args = arguments(&modes, leaves);
    count_compile(start.elapsed());
    write_cache(|cache| {
        let entries = cache.entry(key).or_default();
        entries.retain(|e| !(e.target == collected.target && e.structure == collected.structure));
        entries.push(Entry {
            target: collected.target,
            structure: collected.structure.clone(),
            skeleton,
            modes,
            executable: exe.clone(),
        });
    });
    Ok((exe, args))
}

fn note_miss(reason: String) {
    debug_log(&format!("trace cache miss: {reason}"));
    profile::instant(
        profile::CACHE,
        "cache miss",
        vec![("reason", reason.clone())],
    );
    count_cache_miss(reason);
}

/// How the trace cache would treat `collected`'s leaves: as its cached
/// entry does, else as a first trace.
pub(super) fn cached_modes(collected: &Collected) -> Vec<Mode> {
    let key = fingerprint(&collected.structure);
    read_cache(|cache| {
        cache?
            .get(&key)?
            .iter()
            .find(|e| e.target == collected.target && e.structure == collected.structure)
            .map(|e| e.modes.clone())
    })
    .unwrap_or_else(|| first_modes(&collected.leaves))
}

/// How a trace seen for the first time treats its leaves: small constants
/// are baked in (until widening promotes them), everything else is an
/// argument.
fn first_modes(leaves: &[Leaf]) -> Vec<Mode> {
    leaves
        .iter()
        .map(|l| match &l.value {
            TensorValue::Host(value) if l.bakeable => Mode::Baked(value.clone()),
            _ => Mode::Argument,
        })
        .collect()
}

fn arguments(modes: &[Mode], leaves: &[Leaf]) -> Vec<TensorValue> {
    modes
        .iter()
        .zip(leaves)
        .filter(|(m, _)| matches!(m, Mode::Argument))
        .map(|(_, l)| l.value.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::collect::collect;
    use super::super::tests::{binary, lazy_device, vector};
    use super::*;

    /// The trace of `x * k` for two small (bakeable) vectors. Each test
    /// uses its own length, so other tests' traces never share its entry.
    fn trace(x: &[f32], k: &[f32]) -> Collected {
        let d = lazy_device();
        let y = binary(&stagecraft_ops::MUL, &vector(x, d), &vector(k, d));
        let r = y.lazy_ref().unwrap();
        collect(&[(r.op.clone(), r.index)]).unwrap()
    }

    #[test]
    fn the_same_structure_hits_and_new_constants_widen_once() {
        let (exe, args) =
            lookup_or_compile(&trace(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[2.0; 7])).unwrap();
        assert!(args.is_empty(), "both leaves are small: baked");
        let (again, _) =
            lookup_or_compile(&trace(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[2.0; 7])).unwrap();
        assert!(Arc::ptr_eq(&exe, &again), "a hit");
        // Other values: both constants become arguments, in a new compile...
        let other = trace(&[7.0; 7], &[3.0; 7]);
        let (widened, args) = lookup_or_compile(&other).unwrap();
        assert!(!Arc::ptr_eq(&exe, &widened));
        assert_eq!(args.len(), 2);
        assert!(cached_modes(&other)
            .iter()
            .all(|m| matches!(m, Mode::Argument)));
        // ...which then serves any values.
        let (hit, args) = lookup_or_compile(&trace(&[0.5; 7], &[9.0; 7])).unwrap();
        assert!(Arc::ptr_eq(&widened, &hit));
        let out = hit.run_recorded(args, &[]).unwrap();
        let TensorValue::Host(out) = &out[0] else {
            panic!("a CPU trace gives host values");
        };
        assert_eq!(out.to_dense().unwrap().to_vec::<f32>().unwrap(), [4.5; 7]);
    }

    #[test]
    fn a_miss_names_what_changed() {
        let seen = trace(&[1.0; 11], &[1.0; 11]);
        let (executable, _) = lookup_or_compile(&seen).unwrap();
        let mut cache = Cache::new();
        cache.insert(
            0,
            vec![Entry {
                target: seen.target,
                structure: seen.structure.clone(),
                skeleton: seen.skeleton(),
                modes: Vec::new(),
                executable,
            }],
        );
        let d = lazy_device();
        let reason_for = |y: crate::handle::TensorHandle| {
            let r = y.lazy_ref().unwrap();
            let c = collect(&[(r.op.clone(), r.index)]).unwrap();
            miss_reason(&c.skeleton(), &cache)
        };
        let add = binary(
            &stagecraft_ops::ADD,
            &vector(&[1.0; 11], d),
            &vector(&[1.0; 11], d),
        );
        assert_eq!(reason_for(add), "op 0 changed");
        let longer = binary(
            &stagecraft_ops::MUL,
            &vector(&[1.0; 12], d),
            &vector(&[1.0; 12], d),
        );
        assert_eq!(
            reason_for(longer),
            "the output shape or dtype of op 0 changed"
        );
        let two = binary(&stagecraft_ops::ADD, &add_pair(d), &vector(&[1.0; 11], d));
        assert_eq!(reason_for(two), "no cached trace has 2 ops");
    }

    fn add_pair(d: crate::device::Device) -> crate::handle::TensorHandle {
        binary(
            &stagecraft_ops::ADD,
            &vector(&[1.0; 11], d),
            &vector(&[2.0; 11], d),
        )
    }

    /// Baked constants become constant nodes, arguments parameters; nodes
    /// keep the recording's locations and their position as origin.
    #[test]
    fn build_function_bakes_and_numbers_origins() {
        let c = trace(&[1.0; 5], &[2.0; 5]);
        let TensorValue::Host(baked) = &c.leaves[1].value else {
            panic!("a CPU leaf is a host value");
        };
        let modes = vec![Mode::Argument, Mode::Baked(baked.clone())];
        let f = build_function("t".into(), &c.skeleton(), &modes, &c.ops, &c.locations);
        assert_eq!(f.params.len(), 1);
        let last = f.nodes.last().unwrap();
        assert_eq!(last.origin, Some(0));
        assert_eq!(last.location, c.locations[0]);
        assert_eq!(f.results.len(), 1);
    }

    /// The function runs the ops in the order they were recorded, which
    /// the walk from the trace's output does not keep: it reaches the op
    /// read first (recorded second) first. The compiled trace computes
    /// the same value.
    #[test]
    fn build_function_keeps_the_recording_order() {
        let d = lazy_device();
        let x = vector(&[3.0; 13], d);
        let sum = binary(&stagecraft_ops::ADD, &x, &x);
        let square = binary(&stagecraft_ops::MUL, &x, &x);
        let out = binary(&stagecraft_ops::SUB, &square, &sum);
        let r = out.lazy_ref().unwrap();
        let c = collect(&[(r.op.clone(), r.index)]).unwrap();
        let collected: Vec<&str> = c.ops.iter().map(|op| op.def.name).collect();
        assert_eq!(collected, ["Mul", "Add", "Sub"], "the walk's order");
        let modes = vec![Mode::Argument; c.leaves.len()];
        let f = build_function("t".into(), &c.skeleton(), &modes, &c.ops, &c.locations);
        let ran: Vec<(&str, Option<u32>)> = f
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                NodeOp::Op(def, _) => Some((def.name, n.origin)),
                NodeOp::Const(_) => None,
            })
            .collect();
        assert_eq!(ran, [("Add", Some(1)), ("Mul", Some(0)), ("Sub", Some(2))]);
        let (exe, args) = lookup_or_compile(&c).unwrap();
        let out = exe.run_recorded(args, &c.locations).unwrap();
        let TensorValue::Host(out) = &out[0] else {
            panic!("a CPU trace gives host values");
        };
        assert_eq!(out.to_dense().unwrap().to_vec::<f32>().unwrap(), [3.0; 13]);
    }

    /// Recording numbers count per thread, so an op recorded on a new
    /// thread can number below the op it reads: the op still runs after
    /// its input.
    #[test]
    fn an_op_numbered_before_its_input_runs_after_it() {
        let d = lazy_device();
        let mut x = vector(&[1.0; 17], d);
        for _ in 0..50 {
            x = binary(&stagecraft_ops::ADD, &x, &x);
        }
        let doubled = std::thread::spawn(move || {
            let two = vector(&[2.0; 17], d);
            let y = binary(&stagecraft_ops::MUL, &x, &two);
            let r = y.lazy_ref().unwrap();
            (r.op.recorded_at, r.op.clone(), r.index)
        });
        let (number, op, index) = doubled.join().unwrap();
        assert!(number < 50, "numbered {number} on its own thread");
        let c = collect(&[(op, index)]).unwrap();
        let modes = vec![Mode::Argument; c.leaves.len()];
        let f = build_function("t".into(), &c.skeleton(), &modes, &c.ops, &c.locations);
        let NodeOp::Op(last, _) = &f.nodes.last().unwrap().op else {
            panic!("the trace ends with an op");
        };
        assert_eq!(last.name, "Mul");
        let (exe, args) = lookup_or_compile(&c).unwrap();
        let out = exe.run_recorded(args, &c.locations).unwrap();
        let TensorValue::Host(out) = &out[0] else {
            panic!("a CPU trace gives host values");
        };
        assert_eq!(
            out.to_dense().unwrap().to_vec::<f32>().unwrap(),
            [2f32.powi(51); 17]
        );
    }
}
