//! The process group that collective kernels talk to.
//!
//! A [`Communicator`] carries collectives between the processes of a
//! group. Kernels see only this trait: the transport (MPI, in the
//! `stagecraft` crate's `distributed` module behind its `mpi` feature) is
//! installed at start-up with [`set_communicator`]. Without one, the
//! process is a group of one ([`SingleProcess`]), where every collective
//! hands its input back, so code written for many processes runs
//! unchanged in one.
//!
//! A collective *starts* and is *waited for* separately: starting hands
//! the input to the transport and returns at once, so the caller can keep
//! computing while it travels (`AllReduceStart`/`AllReduceDone`); the
//! plain collective kernels start and wait in one go.

use stagecraft_ops::Reduction;
use stagecraft_tensor::{DenseHostTensor, Error, ErrorKind, Result, TensorMetadata};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// One collective, with what it needs besides the tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every process gets the reduction.
    AllReduce(Reduction),
    /// The root gets the reduction; the others get zeros.
    ReduceToRoot {
        /// How values combine.
        reduction: Reduction,
        /// The rank that gets the result.
        root: usize,
    },
    /// Every process gets the root's tensor.
    Broadcast {
        /// The rank whose tensor is sent.
        root: usize,
    },
    /// Every process gets all tensors concatenated along axis 0.
    AllGather,
    /// Rank `r` gets part `r` along axis 0 of the reduction.
    ReduceScatter(Reduction),
}

impl Collective {
    /// The op name, for errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "AllReduce",
            Collective::ReduceToRoot { .. } => "ReduceToRoot",
            Collective::Broadcast { .. } => "Broadcast",
            Collective::AllGather => "AllGather",
            Collective::ReduceScatter(_) => "ReduceScatter",
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Collective::AllReduce(r) | Collective::ReduceScatter(r) => {
                write!(f, "{}({})", self.name(), r.name())
            }
            Collective::ReduceToRoot { reduction, root } => {
                write!(f, "ReduceToRoot({}, root {root})", reduction.name())
            }
            Collective::Broadcast { root } => write!(f, "Broadcast(root {root})"),
            Collective::AllGather => f.write_str("AllGather"),
        }
    }
}

/// A collective in flight: [`PendingCollective::wait`] blocks until it has
/// completed (or failed) and returns the result.
pub trait PendingCollective: Send {
    /// The result, once every process has taken part.
    fn wait(self: Box<Self>) -> Result<DenseHostTensor>;

    /// Tells the transport that nobody will wait for this collective for
    /// a while, so it must keep it moving meanwhile. A transport whose
    /// transfers move only while someone waits (as Open MPI's do) hands
    /// them to a thread of its own; a synchronous collective, waited for
    /// at once, saves that thread's wake-up.
    fn continue_in_background(&self) {}
}

/// A collective that completed when it started.
pub struct Completed(pub Result<DenseHostTensor>);

impl PendingCollective for Completed {
    fn wait(self: Box<Self>) -> Result<DenseHostTensor> {
        self.0
    }
}

/// A group of processes that run collectives together.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn size(&self) -> usize;
    /// A short description for logs (`"MPI: Open MPI v4.1.4, 2 processes"`).
    fn describe(&self) -> String;
    /// Starts `op` on `input`; the result will have metadata `output`
    /// (what the op's shape rule computed). Every process must start the
    /// same collectives in the same order.
    fn start(
        &self,
        op: Collective,
        input: DenseHostTensor,
        output: &TensorMetadata,
    ) -> Result<Box<dyn PendingCollective>>;
    /// The group's point-to-point transport, if it has one.
    fn point_to_point(&self) -> Option<&dyn PointToPoint> {
        None
    }
}

/// One edge of a function split across processes: a `Send` on one rank
/// and its `Recv` on another. Both processes partition the same function
/// the same way, so both name the edge alike.
#[derive(Clone, Copy, Debug)]
pub struct Edge<'a> {
    /// The partitioner's name of the edge (function, edge number, devices).
    pub key: &'a str,
    /// The edge's number within its function: the MPI tag, so that edges
    /// between the same two processes never take each other's messages.
    pub tag: u32,
    /// How many times this process has run the function before: both ends
    /// check it, so a message left over from a failed run is never taken
    /// for the next run's.
    pub run: u64,
}

/// A group of processes that exchange tensors point to point: the
/// cross-process `Send`/`Recv` of a partitioned function.
pub trait PointToPoint: Send + Sync {
    /// Starts sending `value` to rank `to` along `edge`; the pending
    /// transfer completes (handing `value` back) once the value has left
    /// this process's buffer.
    fn send(
        &self,
        to: usize,
        edge: Edge<'_>,
        value: DenseHostTensor,
    ) -> Result<Box<dyn PendingCollective>>;
    /// Tells rank `to`, in place of the value it waits for along `edge`,
    /// that this process failed with `error`, so that it stops at once
    /// with the cause instead of timing out.
    fn send_failure(&self, to: usize, edge: Edge<'_>, error: &Error);
    /// Waits for the value of `edge` from rank `from`, which must have
    /// metadata `meta`. Returns early with a cancellation error when
    /// `stop()` turns true, and with an error naming `from` when nothing
    /// arrives within the group's timeout.
    fn recv(
        &self,
        from: usize,
        edge: Edge<'_>,
        meta: &TensorMetadata,
        stop: &dyn Fn() -> bool,
    ) -> Result<DenseHostTensor>;
}

/// A group of one: every collective returns its input.
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn describe(&self) -> String {
        "a single process".to_string()
    }
    fn start(
        &self,
        _: Collective,
        input: DenseHostTensor,
        output: &TensorMetadata,
    ) -> Result<Box<dyn PendingCollective>> {
        // With one process, the sum, mean, max and min of one tensor, its
        // broadcast, gather and scatter are all the tensor itself.
        Ok(Box::new(Completed(input.into_relabelled(output.clone()))))
    }
}

static COMMUNICATOR: RwLock<Option<Arc<dyn Communicator>>> = RwLock::new(None);

/// The installed group's size, kept beside it: every collective op asks
/// for it, and reading an atomic takes no lock and no reference count.
static WORLD_SIZE: AtomicUsize = AtomicUsize::new(1);

/// Installs the group collectives run in (`None`: a single process).
/// Affects every later collective kernel of every thread.
pub fn set_communicator(communicator: Option<Arc<dyn Communicator>>) {
    let mut installed = COMMUNICATOR.write().unwrap_or_else(PoisonError::into_inner);
    WORLD_SIZE.store(
        communicator.as_ref().map_or(1, |c| c.size()),
        Ordering::Relaxed,
    );
    *installed = communicator;
}

/// The number of processes in the installed group.
pub fn world_size() -> usize {
    WORLD_SIZE.load(Ordering::Relaxed)
}

/// Runs `f` with the group collectives run in, without taking a reference
/// to it.
pub fn with_communicator<R>(f: impl FnOnce(&dyn Communicator) -> R) -> R {
    let installed = COMMUNICATOR.read().unwrap_or_else(PoisonError::into_inner);
    match installed.as_deref() {
        Some(communicator) => f(communicator),
        None => f(&SingleProcess),
    }
}

/// The group collectives run in.
pub fn communicator() -> Arc<dyn Communicator> {
    COMMUNICATOR
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .unwrap_or_else(|| Arc::new(SingleProcess))
}

/// Collectives started by `AllReduceStart` and not yet redeemed by
/// `AllReduceDone`, by ticket.
fn in_flight() -> &'static Mutex<HashMap<u64, Box<dyn PendingCollective>>> {
    static IN_FLIGHT: std::sync::OnceLock<Mutex<HashMap<u64, Box<dyn PendingCollective>>>> =
        std::sync::OnceLock::new();
    IN_FLIGHT.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Parks a started collective and returns its ticket.
pub(crate) fn park(pending: Box<dyn PendingCollective>) -> u64 {
    pending.continue_in_background();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
    in_flight()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(ticket, pending);
    ticket
}

/// Takes the collective parked under `ticket`.
pub(crate) fn redeem(ticket: u64) -> Result<Box<dyn PendingCollective>> {
    in_flight()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&ticket)
        .ok_or_else(|| {
            Error::invalid(format!(
                "no all-reduce is in flight under ticket {ticket}: each ticket of \
                 AllReduceStart is redeemed by exactly one AllReduceDone"
            ))
        })
}

/// The error of a collective whose group cannot go on.
pub fn distributed_error(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Distributed, message)
}
