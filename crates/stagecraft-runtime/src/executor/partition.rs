//! Placement and partitioning of a function over several devices.
//!
//! Placement follows the eager rules: a node's explicit device, else the
//! device of its first input's producer (unless that is the host device:
//! host placement never spreads), else (for nodes without inputs)
//! the explicit device of a consumer, else the function's device. There are
//! no resource (variable) handles yet, so resource affinity has nothing to
//! pin. Each device gets a partition; every edge between devices becomes a
//! `Send` in the producer's partition and a `Recv` in the consumer's, which
//! meet at run time in a [`Rendezvous`]. Parameters and results live in the
//! partition of the function's device.
//!
//! A function that places nodes on devices of other processes
//! (`/rank:R/cpu:N`) is partitioned the same way by every process of the
//! group, which all call it (single program, multiple data): each process
//! runs its own rank's partitions, and an edge between ranks is a
//! `Send`/`Recv` pair over the group's point-to-point transport (MPI).
//! Nodes placed without a rank run on rank 0; every process holds the
//! arguments it passed and gets every result.
//!
//! Each partition runs on its device's own worker thread. An error in any
//! partition aborts the rendezvous, which releases every blocked `Recv`, so
//! no partition waits forever; the run returns the original error. The
//! abort also raises a stop flag that every partition's thread (and the
//! loops and nested runs under it) checks between steps and loop
//! iterations, so long work elsewhere is abandoned instead of running to
//! its end only for its result to be dropped.

use super::device_program::DeviceProgram;
use super::{instantiate_on, Executable};
use crate::device::{Device, DeviceKind};
use crate::runtime::{count_device_copy, is_cancelled};
use smallvec::SmallVec;
use stagecraft_cpu::collective::{communicator, Edge, PendingCollective};
use stagecraft_graph::{Function, Node, Value};
use stagecraft_ops::{OpAttrs, RECV, SEND};
use stagecraft_tensor::{Error, ErrorKind, HostTensor, Location, Result, TensorMetadata};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// Where each node of `function` runs.
pub(crate) fn place(function: &Function, default: Device) -> Result<Vec<Device>> {
    let explicit: Vec<Option<Device>> = function
        .nodes
        .iter()
        .map(|n| n.device.as_deref().map(Device::parse).transpose())
        .collect::<Result<_>>()?;
    let mut placed: Vec<Device> = Vec::with_capacity(function.nodes.len());
    for (i, node) in function.nodes.iter().enumerate() {
        let device = explicit[i]
            .or_else(|| match node.inputs.first() {
                // Host placement never spreads: what consumes a host
                // closure's result is graph work again, on the function's
                // device, so it can overlap with the next host call.
                Some(Value::Output { node, .. }) => Some(placed[*node as usize])
                    .filter(|d| d.kind() != DeviceKind::Host)
                    .or(Some(default)),
                Some(Value::Param(_)) => Some(default),
                None => None,
            })
            .unwrap_or(default);
        placed.push(device);
    }
    // A constant or a creation op goes next to its first consumer, however
    // that was placed, so its value is not shipped across. (A consumer
    // that took its device from this node is on it already.)
    let mut first_consumer: Vec<Option<usize>> = vec![None; function.nodes.len()];
    for (c, node) in function.nodes.iter().enumerate().rev() {
        for v in &node.inputs {
            if let Value::Output { node, .. } = v {
                first_consumer[*node as usize] = Some(c);
            }
        }
    }
    for (i, node) in function.nodes.iter().enumerate() {
        if let (true, None, Some(c)) = (node.inputs.is_empty(), explicit[i], first_consumer[i]) {
            placed[i] = placed[c];
        }
    }
    Ok(placed)
}

/// The worker thread pool of a virtual CPU device (`cpu:N`, N ≥ 1); the
/// machine's device `cpu:0` uses the global pool.
pub(crate) fn device_pool(device: Device) -> Option<&'static rayon::ThreadPool> {
    if device.kind() != DeviceKind::Cpu || device.index() == 0 {
        return None;
    }
    static POOLS: OnceLock<Mutex<HashMap<usize, &'static rayon::ThreadPool>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let index = device.index();
    let pool = pools.entry(index).or_insert_with(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(move |_| format!("stagecraft-cpu:{index}"))
            .build()
            .expect("a worker thread can be started");
        // Devices live for the whole process, and so do their workers.
        Box::leak(Box::new(pool))
    });
    Some(*pool)
}

thread_local! {
    /// The stop flags of the partitioned runs this thread is working for
    /// (innermost last): a partition run inside another partition's loop
    /// must stop when either run aborts.
    static STOP_FLAGS: RefCell<Vec<Arc<AtomicBool>>> = const { RefCell::new(Vec::new()) };
}

/// True when this thread's work should stop: execution was cancelled, or a
/// partitioned run it works for has failed on another device.
#[inline]
pub(crate) fn should_stop() -> bool {
    is_cancelled()
        || STOP_FLAGS.with(|flags| flags.borrow().iter().any(|f| f.load(Ordering::Relaxed)))
}

/// The stop flags this thread works under, for handing to helper threads.
pub(crate) fn current_stop_flags() -> Vec<Arc<AtomicBool>> {
    STOP_FLAGS.with(|flags| flags.borrow().clone())
}

/// Runs `f` with this thread's stop flags set to `flags`, then restores
/// them. Replacing (not extending) matters on pool threads: a thread that
/// waits inside one run may execute a stolen task of an unrelated run,
/// which must see only its own run's flags.
pub(crate) fn with_stop_flags<R>(flags: &[Arc<AtomicBool>], f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Vec<Arc<AtomicBool>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // Also when `f` unwinds.
            if let Some(previous) = self.0.take() {
                STOP_FLAGS.with(|s| *s.borrow_mut() = previous);
            }
        }
    }
    let previous = STOP_FLAGS.with(|s| std::mem::replace(&mut *s.borrow_mut(), flags.to_vec()));
    let _restore = Restore(Some(previous));
    f()
}

/// Where `Send` and `Recv` of one run meet.
pub struct Rendezvous {
    state: Mutex<RendezvousState>,
    arrived: Condvar,
    /// Raised by [`Rendezvous::abort`]: the partitions' threads stop at
    /// their next step or loop iteration.
    stop: Arc<AtomicBool>,
    /// For a function partitioned across ranks: its edges to other
    /// processes and this run's number.
    remote: Option<(Arc<RemoteEdges>, u64)>,
}

#[derive(Default)]
struct RendezvousState {
    values: HashMap<String, HostTensor>,
    /// The first error of any partition; every waiting `Recv` returns it.
    aborted: Option<Error>,
    /// Keys of the edges to other processes sent so far in this run.
    sent_remote: HashSet<String>,
    /// Sends to other processes still leaving this one.
    pending_sends: Vec<Box<dyn PendingCollective>>,
}

/// The edges between this process and others of a function partitioned
/// across ranks.
#[derive(Default)]
pub(crate) struct RemoteEdges {
    /// By key: the rank that receives, and the edge's tag.
    sends: HashMap<String, (usize, u32)>,
    /// By key: the rank that sends, the edge's tag, and the value's
    /// metadata.
    recvs: HashMap<String, (usize, u32, TensorMetadata)>,
}

impl Rendezvous {
    fn new(remote: Option<(Arc<RemoteEdges>, u64)>) -> Rendezvous {
        Rendezvous {
            state: Mutex::new(RendezvousState::default()),
            arrived: Condvar::new(),
            stop: Arc::new(AtomicBool::new(false)),
            remote,
        }
    }

    /// Publishes a value under `key`: to the partitions of this process,
    /// or to the process that receives it.
    pub fn send(&self, key: &str, value: HostTensor, location: Location) -> Result<()> {
        let bytes = value.metadata().shape.numel() * value.metadata().dtype.size_in_bytes();
        count_device_copy(bytes);
        if let Some((edges, run)) = &self.remote {
            if let Some(&(to, tag)) = edges.sends.get(key) {
                let group = communicator();
                let transport = point_to_point(&*group, location)?;
                let edge = Edge {
                    key,
                    tag,
                    run: *run,
                };
                let pending = transport
                    .send(to, edge, value.into_dense()?)
                    .map_err(|e| e.with_op("Send").at(location))?;
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                state.sent_remote.insert(key.to_string());
                state.pending_sends.push(pending);
                return Ok(());
            }
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.values.insert(key.to_string(), value);
        self.arrived.notify_all();
        Ok(())
    }

    /// Waits for the value under `key`; returns early with the abort error,
    /// or a cancellation error.
    pub fn recv(&self, key: &str, location: Location) -> Result<HostTensor> {
        if let Some((edges, run)) = &self.remote {
            if let Some((from, tag, meta)) = edges.recvs.get(key) {
                let group = communicator();
                let transport = point_to_point(&*group, location)?;
                let edge = Edge {
                    key,
                    tag: *tag,
                    run: *run,
                };
                let stop = || should_stop() || self.first_error().is_some();
                return match transport.recv(*from, edge, meta, &stop) {
                    Ok(value) => Ok(value.into()),
                    // Released by a failure of this process: that is the
                    // cause to report.
                    Err(_) if self.first_error().is_some() => {
                        Err(self.first_error().expect("checked"))
                    }
                    Err(e) => Err(e.with_op("Recv").at(location)),
                };
            }
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = &state.aborted {
                return Err(e.clone());
            }
            if let Some(v) = state.values.remove(key) {
                return Ok(v);
            }
            if should_stop() {
                return Err(Error::cancelled().with_op("Recv").at(location));
            }
            // Wake up now and then to notice cancellation.
            state = self
                .arrived
                .wait_timeout(state, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Stops the run: every waiting and later `Recv` fails with `error`
    /// (the first abort wins).
    pub fn abort(&self, error: Error) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.aborted.is_none() {
            state.aborted = Some(error);
        }
        self.stop.store(true, Ordering::Relaxed);
        self.arrived.notify_all();
    }

    /// Ends the run's traffic with other processes: on success, waits
    /// until every send has left; after a failure, tells each process
    /// still waiting for a value of this one why it will not come.
    fn finish_remote(&self, failure: Option<&Error>) -> Result<()> {
        let Some((edges, run)) = &self.remote else {
            return Ok(());
        };
        let (sent, pending) = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            (
                std::mem::take(&mut state.sent_remote),
                std::mem::take(&mut state.pending_sends),
            )
        };
        if edges.sends.is_empty() {
            return Ok(());
        }
        let group = communicator();
        let transport = point_to_point(&*group, Location::caller())?;
        if let Some(error) = failure {
            let mut unsent: Vec<(&String, &(usize, u32))> = edges
                .sends
                .iter()
                .filter(|(key, _)| !sent.contains(*key))
                .collect();
            unsent.sort_by_key(|(_, (_, tag))| *tag);
            for (key, &(to, tag)) in unsent {
                let edge = Edge {
                    key,
                    tag,
                    run: *run,
                };
                transport.send_failure(to, edge, error);
            }
            // Sends already under way finish (or fail) in the transport,
            // which keeps their buffers until then.
            return Ok(());
        }
        for send in pending {
            send.wait()?;
        }
        Ok(())
    }

    fn first_error(&self) -> Option<Error> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .aborted
            .clone()
    }
}

fn point_to_point(
    group: &dyn stagecraft_cpu::collective::Communicator,
    location: Location,
) -> Result<&dyn stagecraft_cpu::collective::PointToPoint> {
    group.point_to_point().ok_or_else(|| {
        Error::new(
            ErrorKind::Distributed,
            format!(
                "a function spread over ranks needs a transport between processes, and {} has \
                 none: launch with mpirun and call stagecraft::distributed::init first",
                group.describe()
            ),
        )
        .at(location)
    })
}

pub(super) fn rendezvous(r: Option<&Rendezvous>) -> Result<&Rendezvous> {
    r.ok_or_else(|| {
        Error::new(
            ErrorKind::Internal,
            "a Send or Recv outside a partitioned run",
        )
    })
}

/// A function split into one executable per device.
pub(crate) struct Partitioned {
    /// The partition of the function's own device (parameters and results).
    main: Executable,
    others: Vec<Part>,
    /// For a function partitioned across ranks: its edges to other
    /// processes, and how many times this process has run it.
    remote: Option<(Arc<RemoteEdges>, AtomicU64)>,
}

/// A partition besides the main one: planned host kernels on a host
/// device, or a program of ops for a device that runs ops itself (a GPU).
pub(super) enum Part {
    Host(Executable),
    Device(DeviceProgram),
}

impl Part {
    fn device(&self) -> Device {
        match self {
            Part::Host(exe) => exe.device,
            Part::Device(program) => program.device(),
        }
    }

    fn run(&self, rendezvous: &Rendezvous, locations: &[Location]) -> Result<Vec<HostTensor>> {
        match self {
            Part::Host(exe) => exe.run_with(Vec::new(), Some(rendezvous), locations),
            Part::Device(program) => program.run_partition(Vec::new(), rendezvous, locations),
        }
    }

    fn kernel_count(&self) -> usize {
        match self {
            Part::Host(exe) => exe.kernel_count(),
            Part::Device(program) => program.op_count(),
        }
    }
}

impl Partitioned {
    pub(super) fn run(
        &self,
        args: Vec<HostTensor>,
        locations: &[Location],
    ) -> Result<Vec<HostTensor>> {
        let rdv = Rendezvous::new(
            self.remote
                .as_ref()
                .map(|(edges, runs)| (Arc::clone(edges), runs.fetch_add(1, Ordering::Relaxed))),
        );
        // Every partition stops when this run aborts, and also when a run
        // that this one is nested in aborts.
        let mut flags = current_stop_flags();
        flags.push(rdv.stop.clone());
        let outcome = std::thread::scope(|scope| {
            let rdv = &rdv;
            let flags = &flags;
            let workers: Vec<_> = self
                .others
                .iter()
                .map(|part| {
                    scope.spawn(move || {
                        let run = || with_stop_flags(flags, || part.run(rdv, locations));
                        let result = match device_pool(part.device()) {
                            Some(pool) => pool.install(run),
                            None => run(),
                        };
                        if let Err(e) = &result {
                            rdv.abort(e.clone());
                        }
                    })
                })
                .collect();
            let main = with_stop_flags(flags, || self.main.run_with(args, Some(rdv), locations));
            if let Err(e) = &main {
                rdv.abort(e.clone());
            }
            for w in workers {
                if w.join().is_err() {
                    rdv.abort(Error::internal("a device partition panicked"));
                }
            }
            main
        });
        // The first failure is the cause; later ones were released by it.
        let outcome = match rdv.first_error() {
            Some(e) => Err(e),
            None => outcome,
        };
        rdv.finish_remote(outcome.as_ref().err())?;
        outcome
    }
}

/// The partitions of a function: their devices, and where its
/// parameters and results live.
struct Layout {
    /// One device per partition; partition 0 is this process's main one.
    devices: Vec<Device>,
    /// Each node's device, as an entry of `devices`.
    placement: Vec<usize>,
    /// Per rank, its partition holding the parameters and results (one
    /// entry, partition 0, when the function stays in this process).
    mains: Vec<usize>,
    /// This process's rank, when the function is spread over ranks.
    own_rank: Option<usize>,
}

impl Layout {
    fn rank_of(&self, partition: usize) -> usize {
        self.devices[partition].rank().unwrap_or(0)
    }

    /// The main partition that a parameter comes from for `partition`:
    /// the one of its own process.
    fn param_home(&self, partition: usize) -> usize {
        match self.own_rank {
            None => 0,
            Some(_) => self.mains[self.rank_of(partition)],
        }
    }

    fn in_this_process(&self, partition: usize) -> bool {
        self.own_rank
            .is_none_or(|own| self.rank_of(partition) == own)
    }

    fn local(main: Device, placement: &[Device]) -> Layout {
        let mut devices: Vec<Device> = vec![main];
        for d in placement {
            if !devices.contains(d) {
                devices.push(*d);
            }
        }
        let placement = placement
            .iter()
            .map(|d| devices.iter().position(|x| x == d).unwrap_or(0))
            .collect();
        Layout {
            devices,
            placement,
            mains: vec![0],
            own_rank: None,
        }
    }

    /// Every process of the group builds the same layout: one main
    /// partition per rank (`/rank:R/` + the function's device), then the
    /// other devices in order of first use, nodes placed without a rank
    /// going to rank 0.
    fn across_ranks(function: &Function, main: Device, placement: &[Device]) -> Result<Layout> {
        let group = communicator();
        let (own, size) = (group.rank(), group.size());
        let cpu_only = |d: Device, location: Location| -> Result<Device> {
            if d.kind() != DeviceKind::Cpu {
                return Err(Error::new(
                    ErrorKind::Device,
                    format!(
                        "a function spread over ranks runs on CPU devices (`/rank:R/cpu:N`), \
                         not on `{d}`"
                    ),
                )
                .at(location));
            }
            Ok(d)
        };
        let location = function
            .nodes
            .first()
            .map_or_else(Location::caller, |n| n.location);
        let main = cpu_only(main, location)?;
        let mut devices: Vec<Device> = (0..size)
            .map(|r| Device::on_rank(r, main.index()))
            .collect();
        // This process's main partition comes first.
        devices.swap(0, own);
        let mut mains: Vec<usize> = (0..size).collect();
        mains.swap(0, own);
        let mut indices = Vec::with_capacity(placement.len());
        for (node, d) in function.nodes.iter().zip(placement) {
            let d = cpu_only(*d, node.location)?;
            let global = match d.rank() {
                Some(rank) if rank >= size => {
                    return Err(Error::new(
                        ErrorKind::Device,
                        format!(
                            "a node is placed on {d}, but the group has {size} process{} ({}): \
                             launch as many processes as the ranks the function names",
                            if size == 1 { "" } else { "es" },
                            group.describe()
                        ),
                    )
                    .at(node.location));
                }
                Some(_) => d,
                None => Device::on_rank(0, d.index()),
            };
            let index = match devices.iter().position(|x| *x == global) {
                Some(i) => i,
                None => {
                    devices.push(global);
                    devices.len() - 1
                }
            };
            indices.push(index);
        }
        Ok(Layout {
            devices,
            placement: indices,
            mains,
            own_rank: Some(own),
        })
    }
}

/// Splits `function` by `placement` and instantiates the partitions of
/// this process.
pub(super) fn instantiate_partitioned(
    function: Arc<Function>,
    main: Device,
    placement: &[Device],
) -> Result<Executable> {
    let layout = if placement.iter().any(|d| d.rank().is_some()) {
        Layout::across_ranks(&function, main, placement)?
    } else {
        Layout::local(main, placement)
    };
    let devices = &layout.devices;
    let mut parts: Vec<Function> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let params = if layout.mains.contains(&i) {
                function.params.clone()
            } else {
                Vec::new()
            };
            Function::new(format!("{}@{}", function.name, d), params)
        })
        .collect();
    // The value of an original value in each partition, created on demand.
    let mut local: HashMap<(Value, usize), Value> = HashMap::new();
    for &m in &layout.mains {
        for (i, _) in function.params.iter().enumerate() {
            local.insert((Value::Param(i as u32), m), Value::Param(i as u32));
        }
    }
    // Where each node output was computed.
    let mut home: HashMap<Value, usize> = HashMap::new();
    let mut remote = RemoteEdges::default();
    let mut next_key = 0usize;
    let mut fetch = |parts: &mut Vec<Function>,
                     local: &mut HashMap<(Value, usize), Value>,
                     home: &HashMap<Value, usize>,
                     v: Value,
                     to: usize,
                     (location, origin): (Location, Option<u32>)|
     -> Result<Value> {
        if let Some(found) = local.get(&(v, to)) {
            return Ok(*found);
        }
        let from = match v {
            Value::Param(_) => layout.param_home(to),
            Value::Output { .. } => home[&v],
        };
        let source = local[&(v, from)];
        let meta = function.meta(v).clone();
        let key = format!(
            "{}#edge{next_key}:{}->{}",
            function.name, devices[from], devices[to]
        );
        // MPI guarantees tags up to 32767.
        let tag = (next_key % 32768) as u32;
        next_key += 1;
        let (sender, receiver) = (layout.rank_of(from), layout.rank_of(to));
        if layout.own_rank.is_some() && sender != receiver {
            if layout.in_this_process(from) {
                remote.sends.insert(key.clone(), (receiver, tag));
            }
            if layout.in_this_process(to) {
                remote
                    .recvs
                    .insert(key.clone(), (sender, tag, meta.clone()));
            }
        }
        let mut send = OpAttrs::new();
        send.set_str("key", &key);
        // The transfer fails (is cancelled) on behalf of the node it
        // serves, so it names that node's line, resolved like the node's.
        let sent = parts[from].add_op(&SEND, &send, &[source], location)?;
        parts[from].nodes[sent].origin = origin;
        let mut recv = OpAttrs::new();
        let dims: SmallVec<[usize; 4]> = meta.shape.dims().iter().copied().collect();
        recv.set_str("key", &key)
            .set_dtype("dtype", meta.dtype)
            .set_dims("shape", &dims);
        let got = parts[to].add_op(&RECV, &recv, &[], location)?;
        parts[to].nodes[got].origin = origin;
        let got = Value::node(got);
        local.insert((v, to), got);
        Ok(got)
    };
    for (index, node) in function.nodes.iter().enumerate() {
        let p = layout.placement[index];
        let inputs = node
            .inputs
            .iter()
            .map(|v| {
                let at = (node.location, node.origin);
                fetch(&mut parts, &mut local, &home, *v, p, at)
            })
            .collect::<Result<SmallVec<[Value; 4]>>>()?;
        let new = parts[p].push(Node {
            op: node.op.clone(),
            inputs,
            outputs: node.outputs.clone(),
            device: None,
            location: node.location,
            origin: node.origin,
        });
        for o in 0..node.outputs.len() as u32 {
            let v = Value::Output {
                node: index as u32,
                output: o,
            };
            home.insert(v, p);
            local.insert(
                (v, p),
                Value::Output {
                    node: new as u32,
                    output: o,
                },
            );
        }
    }
    let location = function
        .nodes
        .first()
        .map_or_else(|| (Location::caller(), None), |n| (n.location, n.origin));
    // Every process gets every result.
    for &m in &layout.mains {
        let results = function
            .results
            .iter()
            .map(|v| fetch(&mut parts, &mut local, &home, *v, m, location))
            .collect::<Result<Vec<_>>>()?;
        parts[m].results = results;
    }
    let mut executables = Vec::new();
    for (i, (f, d)) in parts.into_iter().zip(devices).enumerate() {
        if !layout.in_this_process(i) {
            continue;
        }
        let d = d.without_rank();
        let (f, _, _) = stagecraft_graph::passes::lower(&f, &super::fusions_of(d));
        // The main partition holds the parameters and results on a host
        // device; another may be a device that runs ops itself.
        let part = match d.handler().host_kernels() {
            None if i > 0 => Part::Device(DeviceProgram::partition(f, d)),
            _ => Part::Host(instantiate_on(Arc::new(f), d)?),
        };
        executables.push(part);
    }
    let Part::Host(main_exe) = executables.remove(0) else {
        return Err(Error::internal("the main partition is not a host program"));
    };
    let partitions = Partitioned {
        main: main_exe,
        others: executables,
        remote: layout
            .own_rank
            .map(|_| (Arc::new(remote), AtomicU64::new(0))),
    };
    let mut shell = instantiate_on(
        Arc::new(Function::new(
            function.name.clone(),
            function.params.clone(),
        )),
        main,
    )?;
    shell.function = function;
    shell.partitions = Some(Box::new(partitions));
    Ok(shell)
}

impl Partitioned {
    /// The number of partitions (devices).
    pub fn partition_count(&self) -> usize {
        1 + self.others.len()
    }

    /// Kernels launched per run, over all partitions.
    pub fn kernel_count(&self) -> usize {
        self.main.kernel_count() + self.others.iter().map(Part::kernel_count).sum::<usize>()
    }
}
