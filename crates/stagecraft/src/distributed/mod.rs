//! Many processes: collectives on tensors, the process group, and
//! data-parallel gradients reduced in buckets while backward runs.
//!
//! A program written against this module runs unchanged in one process
//! (a group of one, where every collective returns its input) and under
//! `mpirun` when stagecraft is built with the `mpi` feature, where
//! [`init`] joins the MPI job:
//!
//! ```
//! use stagecraft::distributed::{self, Reduction};
//! use stagecraft::{Device, Tensor};
//! let group = distributed::init().unwrap();
//! let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &Device::cpu()).unwrap();
//! let mean = distributed::all_reduce(&x, Reduction::Mean);
//! // One process here: the mean over the group is the tensor itself.
//! assert_eq!(group.size(), 1);
//! assert_eq!(mean.to_vec().unwrap(), vec![1.0, 2.0]);
//! ```
//!
//! Collectives are ops like any other: eager, recorded into lazy traces,
//! and staged inside `function`s, with gradients (the gradient of a sum
//! all-reduce is a sum all-reduce; of an all-gather, a reduce-scatter).
//! Every process must run the same collectives in the same order; a
//! mismatch, or a process that dies or hangs, fails the collective with an
//! error naming the process instead of deadlocking (see [`init`]).

#[cfg(any(feature = "mpi", test))]
mod butterfly;
mod data_parallel;
#[cfg(feature = "mpi")]
mod mpi;

/// The rsmpi crate stagecraft's MPI transport is built on, for programs
/// that mix their own MPI calls with stagecraft's (and for the benchmark
/// that compares the two).
#[cfg(feature = "mpi")]
pub use ::mpi as rsmpi;
pub use data_parallel::DataParallel;
pub use stagecraft_cpu::collective::{Collective, Communicator, PendingCollective};
pub use stagecraft_ops::Reduction;

use crate::{Error, Result, Tensor};
use stagecraft_ops::{OpAttrs, OpDef};
use stagecraft_tensor::{Element, Location};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// This process's rank in the group (0 without [`init`] or MPI).
pub fn rank() -> usize {
    stagecraft_cpu::collective::communicator().rank()
}

/// The number of processes in the group (1 without [`init`] or MPI).
pub fn world_size() -> usize {
    stagecraft_cpu::collective::world_size()
}

/// The membership of this process in a group: returned by [`init`], it
/// leaves the group when dropped (for MPI, waits for nothing further and
/// finalizes).
pub struct Group {
    rank: usize,
    size: usize,
    description: String,
    #[cfg(feature = "mpi")]
    mpi: Option<mpi::MpiGroup>,
}

static JOINED: AtomicBool = AtomicBool::new(false);

/// Joins the group this process was launched in: the MPI job when built
/// with the `mpi` feature and started by `mpirun` (or another launcher
/// that sets the MPI environment), else a group of one. Installs the group
/// for every collective op; call it once, before the first collective.
///
/// Under MPI, errors return rather than abort, and every collective has a
/// watchdog: if a process has not joined a collective within the timeout
/// (6 s by default, so that with the 2 s the waiting processes then
/// listen for each other the error comes within 10 s;
/// `STAGECRAFT_COLLECTIVE_TIMEOUT=seconds` or [`Group::set_timeout`]),
/// the others fail it with an error that names the missing rank, and a collective whose op, dtype or shape differ
/// between processes fails on all of them with an error that says what
/// each ran. After such an error the group cannot go on: report it and
/// call [`Group::abort`], which ends every process of the job.
pub fn init() -> Result<Group> {
    if JOINED.swap(true, Ordering::SeqCst) {
        return Err(Error::invalid(
            "distributed::init was already called: a process joins its group once",
        ));
    }
    #[cfg(feature = "mpi")]
    if mpi::launched_by_mpi() {
        let group = mpi::MpiGroup::init()?;
        let comm = group.communicator();
        let (rank, size, description) = (comm.rank(), comm.size(), comm.describe());
        stagecraft_cpu::collective::set_communicator(Some(comm));
        return Ok(Group {
            rank,
            size,
            description,
            mpi: Some(group),
        });
    }
    Ok(Group {
        rank: 0,
        size: 1,
        description: single_process_description(),
        #[cfg(feature = "mpi")]
        mpi: None,
    })
}

fn single_process_description() -> String {
    if cfg!(feature = "mpi") {
        "a single process (not launched by mpirun)".to_string()
    } else {
        "a single process (stagecraft was built without the `mpi` feature)".to_string()
    }
}

impl Group {
    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// True on rank 0, the process that prints and writes checkpoints.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// What the group runs on, for logs.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// Sets how long a collective waits for every process to join it
    /// before failing with an error naming the ranks that did not.
    pub fn set_timeout(&self, timeout: Duration) {
        #[cfg(feature = "mpi")]
        if let Some(group) = &self.mpi {
            group.set_timeout(timeout);
        }
        let _ = timeout;
    }

    /// Waits until every process has reached this call (a zero-byte
    /// collective under the group's watchdog, with `timeout` in place of
    /// the usual one: for waits as long as a download on rank 0).
    pub fn barrier(&self, timeout: Duration) -> Result<()> {
        #[cfg(feature = "mpi")]
        if let Some(group) = &self.mpi {
            return group.barrier(timeout);
        }
        let _ = timeout;
        Ok(())
    }

    /// Ends every process of the job with `code` (MPI's abort): after a
    /// distributed error, the way out that leaves no process behind.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Some(group) = &self.mpi {
            group.abort(code);
        }
        std::process::exit(code)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        stagecraft_cpu::collective::set_communicator(None);
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group(rank {} of {}, {})",
            self.rank, self.size, self.description
        )
    }
}

/// Runs collective `def` on `x` over the installed group.
fn collective<T: Element>(
    def: &'static OpDef,
    x: &Tensor<T>,
    reduction: Option<Reduction>,
    root: Option<usize>,
    location: Location,
) -> Tensor<T> {
    let mut attrs = OpAttrs::new();
    attrs.set_int("world_size", world_size() as i64);
    if let Some(r) = reduction {
        attrs.set_str("reduction", r.name());
    }
    if let Some(root) = root {
        attrs.set_int("root", root as i64);
    }
    crate::tensor::run(def, smallvec::smallvec![x.handle.clone()], &attrs, location)
}

/// Every process gets the reduction of all processes' `x`.
#[track_caller]
pub fn all_reduce<T: Element>(x: &Tensor<T>, reduction: Reduction) -> Tensor<T> {
    let location = Location::caller();
    collective(
        &stagecraft_ops::ALL_REDUCE,
        x,
        Some(reduction),
        None,
        location,
    )
}

/// Every process gets `root`'s `x`.
#[track_caller]
pub fn broadcast<T: Element>(x: &Tensor<T>, root: usize) -> Tensor<T> {
    let location = Location::caller();
    collective(&stagecraft_ops::BROADCAST, x, None, Some(root), location)
}

/// `root` gets the reduction of all processes' `x`; the others get zeros.
#[track_caller]
pub fn reduce_to_root<T: Element>(x: &Tensor<T>, reduction: Reduction, root: usize) -> Tensor<T> {
    let location = Location::caller();
    collective(
        &stagecraft_ops::REDUCE_TO_ROOT,
        x,
        Some(reduction),
        Some(root),
        location,
    )
}

/// Every process gets all processes' `x` concatenated along axis 0, in
/// rank order.
#[track_caller]
pub fn all_gather<T: Element>(x: &Tensor<T>) -> Tensor<T> {
    let location = Location::caller();
    collective(&stagecraft_ops::ALL_GATHER, x, None, None, location)
}

/// Rank `r` gets part `r` (of [`world_size`] equal parts along axis 0) of
/// the reduction of all processes' `x`.
#[track_caller]
pub fn reduce_scatter<T: Element>(x: &Tensor<T>, reduction: Reduction) -> Tensor<T> {
    let location = Location::caller();
    collective(
        &stagecraft_ops::REDUCE_SCATTER,
        x,
        Some(reduction),
        None,
        location,
    )
}

/// A reduction started with [`all_reduce_start`]; [`InFlight::wait`]
/// returns its result.
#[derive(Clone)]
pub struct InFlight<T: Element> {
    ticket: Tensor<i64>,
    dims: Vec<usize>,
    _marker: std::marker::PhantomData<T>,
}

/// Starts an all-reduce of `x` and returns at once: ops run between this
/// and [`InFlight::wait`] overlap with the reduction's transfer.
#[track_caller]
pub fn all_reduce_start<T: Element>(x: &Tensor<T>, reduction: Reduction) -> InFlight<T> {
    let location = Location::caller();
    let mut attrs = OpAttrs::new();
    attrs
        .set_int("world_size", world_size() as i64)
        .set_str("reduction", reduction.name());
    let ticket = crate::tensor::run(
        &stagecraft_ops::ALL_REDUCE_START,
        smallvec::smallvec![x.handle.clone()],
        &attrs,
        location,
    );
    InFlight {
        ticket,
        dims: x.dims().to_vec(),
        _marker: std::marker::PhantomData,
    }
}

impl<T: Element> InFlight<T> {
    /// The reduced tensor (on the lazy device, still pending: the wait
    /// happens where the trace runs it).
    #[track_caller]
    pub fn wait(&self) -> Tensor<T> {
        let location = Location::caller();
        let mut attrs = OpAttrs::new();
        attrs
            .set_dtype("dtype", T::DTYPE)
            .set_dims("shape", &self.dims);
        crate::tensor::run(
            &stagecraft_ops::ALL_REDUCE_DONE,
            smallvec::smallvec![self.ticket.handle.clone()],
            &attrs,
            location,
        )
    }
}

/// The group installed for collectives, for code that needs the
/// transport itself (benchmarks comparing it with raw MPI).
pub fn communicator() -> Arc<dyn Communicator> {
    stagecraft_cpu::collective::communicator()
}
