//! The MPI transport: collectives on non-blocking MPI calls with a
//! watchdog, and a progress thread that drives them while the caller
//! computes.
//!
//! MPI runs in `MPI_THREAD_SERIALIZED` mode: any thread may call it, one
//! at a time, so every call happens under the `state` lock. Collectives
//! are issued by the thread that starts them (no hand-off), in the order
//! they are started, which is the program order chains give
//! side-effecting ops. Open MPI only moves a non-blocking transfer forward
//! inside MPI calls: a caller waiting for a collective tests it back to
//! back, and the progress thread tests those started in the background
//! ([`PendingCollective::continue_in_background`]: gradient buckets that
//! travel while backward runs).
//!
//! Every collective runs an *exchange* on a second communicator: the
//! [`butterfly`] schedule's messages between pairs of processes, each
//! opened by a fragment headed by the sender's fingerprint of (sequence
//! number, op, dtype, shape) and by whether it has seen a different one.
//! After the halving rounds every process knows whether all ran the same
//! collective. An all-reduce of f32, f64, i32 or i64 values is that
//! exchange itself (up to 16 KiB, whole-tensor rounds; above,
//! reduce-scatter by halving and all-gather by doubling); the other
//! collectives run MPI's non-blocking ones on a first communicator beside
//! a data-less exchange. A mismatch or a watchdog timeout fails the group:
//! the failing collective returns an error naming the ranks at fault, and
//! every later one fails at once with the same error.
//!
//! Point-to-point transfers (the `Send`/`Recv` pairs of a function spread
//! over ranks) travel on a fourth communicator, one message per edge and
//! run, tagged with the edge's number: a header (kind, a fingerprint of
//! the edge's key and run, the payload's length) and the tensor's bytes,
//! or the sender's error in place of the tensor. The receiver probes for
//! the message, so it learns its size before taking it and can tell a
//! failure, a stale run or a mismatched edge from the value it waits for.

mod exchange;

use super::butterfly;
use crate::{Error, Result};
use exchange::{exchange_reduces, split_for, Exchange, Reducing, TAGS_PER_COLLECTIVE};
use mpi::ffi;
use stagecraft_cpu::collective::{
    distributed_error, Collective, Communicator, Edge, PendingCollective, PointToPoint,
};
use stagecraft_ops::Reduction;
use stagecraft_tensor::{Buffer, DType, DenseHostTensor, TensorMetadata};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long live processes listen for each other after a timeout before
/// naming the silent ones.
const GRACE: Duration = Duration::from_secs(2);

/// The default watchdog: a process that has not joined a collective
/// within this is reported (with [`GRACE`], under the 10 s the others may
/// wait in all).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(6);

/// Message tag of the "I am waiting at collective #n" notes exchanged
/// after a timeout.
const WAITING_TAG: c_int = 17;

/// Bytes of each process's description of a collective in a mismatch
/// report.
const DESCRIPTION_BYTES: usize = 160;

/// True when this process was started by an MPI launcher.
pub(super) fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// An MPI handle (communicator, request), which Open MPI represents as a
/// pointer.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Raw<T>(T);

// SAFETY: MPI handles are plain identifiers that any thread may pass to
// MPI; this module only does so under the `state` lock, which is what
// MPI_THREAD_SERIALIZED requires.
unsafe impl<T> Send for Raw<T> {}

struct Comms {
    /// The data of MPI's own collectives.
    data: Raw<ffi::MPI_Comm>,
    /// The exchanges, apart from MPI's collectives, so that their messages
    /// pair up in order even when a mismatched collective's data does not.
    check: Raw<ffi::MPI_Comm>,
    /// Point-to-point notes and reports after a failure.
    control: Raw<ffi::MPI_Comm>,
    /// The Send/Recv pairs of functions spread over ranks.
    transfers: Raw<ffi::MPI_Comm>,
}

/// The kinds of point-to-point message: a tensor, or the sender's error.
const VALUE_MESSAGE: u64 = 0x5354_4743_5641_4c55;
const FAILURE_MESSAGE: u64 = 0x5354_4743_4641_494c;

/// Bytes of a point-to-point message's header: kind, fingerprint, run,
/// payload length.
const TRANSFER_HEADER_BYTES: usize = 32;

/// A point-to-point send in flight; owns the message until MPI is done
/// with it.
struct SendFlight {
    what: String,
    to: usize,
    started: Instant,
    request: Option<Raw<ffi::MPI_Request>>,
    _message: Vec<u8>,
    value: Option<DenseHostTensor>,
    /// Nobody waits for it any more: dropped once MPI completes it.
    abandoned: bool,
}

/// One collective in flight. It owns every buffer MPI reads or writes
/// until its requests complete.
struct Flight {
    seq: u64,
    what: What,
    /// When the watchdog first looked at it: the waiting caller does
    /// within its first round of polls, the progress thread within 100
    /// µs. Not read at the start: most small collectives end before the
    /// watchdog first looks.
    watched_since: Option<Instant>,
    timeout: Duration,
    /// The check, and the all-reduce's data when the schedule carries it.
    exchange: Exchange,
    /// MPI's own collective, for the data the schedule does not carry.
    data_request: Option<Raw<ffi::MPI_Request>>,
    input: DenseHostTensor,
    output: Option<(TensorMetadata, Buffer)>,
    divide_by: Option<usize>,
    outcome: Option<Result<DenseHostTensor>>,
}

impl Flight {
    fn complete(&self) -> bool {
        self.exchange.idle() && self.data_request.is_none()
    }

    /// Moves the exchange on; `Ok(true)` once it has run every step.
    fn advance(&mut self, comm: ffi::MPI_Comm) -> Result<bool> {
        let out = self.output.as_mut().map(|(_, buffer)| buffer);
        self.exchange.advance(comm, &self.input, out, &self.what)
    }
}

/// The collectives in flight, in the order they started (so that they
/// progress in that order). A handful at most (a step's gradient
/// buckets), so a search beats a map; and the vector keeps its capacity,
/// where a map would allocate a node for a lone collective and free it as
/// it ends.
#[derive(Default)]
struct Flights(Vec<Flight>);

impl Flights {
    fn position(&self, seq: u64) -> Option<usize> {
        self.0.iter().position(|f| f.seq == seq)
    }

    fn get(&self, seq: u64) -> Option<&Flight> {
        self.position(seq).map(|i| &self.0[i])
    }

    fn get_mut(&mut self, seq: u64) -> Option<&mut Flight> {
        self.position(seq).map(|i| &mut self.0[i])
    }

    /// Adds the newest flight (sequence numbers only grow).
    fn push(&mut self, flight: Flight) {
        debug_assert!(self.0.last().is_none_or(|last| last.seq < flight.seq));
        self.0.push(flight);
    }

    fn remove(&mut self, seq: u64) -> Option<Flight> {
        self.position(seq).map(|i| self.0.remove(i))
    }

    fn iter(&self) -> std::slice::Iter<'_, Flight> {
        self.0.iter()
    }

    fn iter_mut(&mut self) -> std::slice::IterMut<'_, Flight> {
        self.0.iter_mut()
    }
}

struct State {
    comms: Comms,
    next_seq: u64,
    flights: Flights,
    /// Set by the first failure: the group cannot go on.
    failed: Option<Error>,
    /// Point-to-point sends in flight, by number.
    sends: HashMap<u64, SendFlight>,
    next_send: u64,
    /// Flights abandoned with requests MPI may still complete: their
    /// buffers must outlive the process's use of MPI.
    wreckage: Vec<Flight>,
    stop: bool,
}

struct Shared {
    rank: usize,
    size: usize,
    library: String,
    /// How many collectives' exchanges have tags of their own: the
    /// collective numbered `seq` uses block `seq % collective_tags`.
    collective_tags: u64,
    timeout_ms: AtomicU64,
    state: Mutex<State>,
    work: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
}

/// Membership in the MPI job: the universe (finalized on drop), the
/// communicator installed for collective ops, and the progress thread.
pub(super) struct MpiGroup {
    shared: Arc<Shared>,
    progress: Option<JoinHandle<()>>,
    universe: Option<mpi::environment::Universe>,
}

/// Turns an MPI return code into an error.
fn check(rc: c_int, what: impl fmt::Display) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut text = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: `text` has room for MPI_MAX_ERROR_STRING (256 in Open MPI)
    // characters and `len` receives how many were written.
    unsafe { ffi::MPI_Error_string(rc, text.as_mut_ptr().cast(), &mut len) };
    text.truncate(len.clamp(0, 512) as usize);
    Err(distributed_error(format!(
        "{what} failed in MPI: {} (error code {rc})",
        String::from_utf8_lossy(&text)
    )))
}

fn datatype(dtype: DType) -> Result<ffi::MPI_Datatype> {
    // SAFETY: the RSMPI_* datatype handles are constants MPI initialized.
    let t = unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I16 => ffi::RSMPI_INT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 | DType::Bool => ffi::RSMPI_UINT8_T,
            DType::U16 | DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::U32 => ffi::RSMPI_UINT32_T,
            DType::U64 => ffi::RSMPI_UINT64_T,
            other => {
                return Err(Error::dtype(format!(
                    "collectives cannot carry {other} tensors"
                )))
            }
        }
    };
    Ok(t)
}

fn mpi_op(reduction: Reduction) -> ffi::MPI_Op {
    // SAFETY: the RSMPI_* op handles are constants MPI initialized.
    unsafe {
        match reduction {
            Reduction::Sum | Reduction::Mean => ffi::RSMPI_SUM,
            Reduction::Max => ffi::RSMPI_MAX,
            Reduction::Min => ffi::RSMPI_MIN,
        }
    }
}

fn count(n: usize, what: impl fmt::Display) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::invalid(format!(
            "{what} of {n} elements is more than one MPI call carries (2^31 - 1); split it"
        ))
    })
}

/// The fingerprint every process must agree on. `FxHasher` has no random
/// keys, so every process computes the same one; SipHash's rounds cost a
/// small all-reduce more, and guard against adversaries that a
/// collective's fields (small numbers, short names) do not have.
fn fingerprint(seq: u64, what: &What) -> u64 {
    let mut h = stagecraft_runtime::FxHasher::default();
    (
        seq,
        what.label,
        what.op,
        what.meta.dtype,
        what.meta.shape.dims(),
    )
        .hash(&mut h);
    h.finish()
}

/// What a collective is, for its fingerprint and for errors: formatted
/// only when an error needs it.
#[derive(Clone)]
struct What {
    label: &'static str,
    op: Collective,
    meta: TensorMetadata,
}

impl fmt::Display for What {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.label, self.op, self.meta)
    }
}

impl MpiGroup {
    /// Initializes MPI, duplicates the world communicator three times with
    /// errors set to return, and starts the progress thread.
    pub(super) fn init() -> Result<MpiGroup> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| distributed_error("MPI was already initialized in this process"))?;
        if threading < mpi::Threading::Serialized {
            return Err(distributed_error(format!(
                "this MPI library provides thread support {threading:?}; stagecraft needs \
                 MPI_THREAD_SERIALIZED"
            )));
        }
        let mut rank: c_int = 0;
        let mut size: c_int = 0;
        let dup = |what: &str| -> Result<Raw<ffi::MPI_Comm>> {
            // SAFETY: MPI is initialized; `comm` receives a new handle.
            unsafe {
                let mut comm: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
                check(ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm), what)?;
                check(
                    ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
                    what,
                )?;
                Ok(Raw(comm))
            }
        };
        // SAFETY: MPI is initialized; the out-parameters are valid ints.
        unsafe {
            check(
                ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN),
                "setting MPI errors to return",
            )?;
            check(
                ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank),
                "MPI_Comm_rank",
            )?;
            check(
                ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size),
                "MPI_Comm_size",
            )?;
        }
        let comms = Comms {
            data: dup("duplicating the data communicator")?,
            check: dup("duplicating the exchange communicator")?,
            control: dup("duplicating the control communicator")?,
            transfers: dup("duplicating the point-to-point communicator")?,
        };
        let timeout = std::env::var("STAGECRAFT_COLLECTIVE_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let shared = Arc::new(Shared {
            rank: rank as usize,
            size: size as usize,
            library: library_version(),
            collective_tags: tag_upper_bound() / TAGS_PER_COLLECTIVE as u64,
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            state: Mutex::new(State {
                comms,
                next_seq: 0,
                flights: Flights::default(),
                failed: None,
                sends: HashMap::new(),
                next_send: 0,
                wreckage: Vec::new(),
                stop: false,
            }),
            work: Condvar::new(),
        });
        let for_thread = Arc::clone(&shared);
        let progress = std::thread::Builder::new()
            .name("stagecraft-mpi-progress".into())
            .spawn(move || progress_loop(&for_thread))
            .map_err(|e| distributed_error(format!("cannot start the MPI progress thread: {e}")))?;
        Ok(MpiGroup {
            shared,
            progress: Some(progress),
            universe: Some(universe),
        })
    }

    /// The communicator collective ops use.
    pub(super) fn communicator(&self) -> Arc<dyn Communicator> {
        Arc::new(MpiCommunicator(Arc::clone(&self.shared)))
    }

    pub(super) fn set_timeout(&self, timeout: Duration) {
        self.shared
            .timeout_ms
            .store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    pub(super) fn barrier(&self, timeout: Duration) -> Result<()> {
        let empty = DenseHostTensor::zeros(TensorMetadata::new(
            DType::F32,
            stagecraft_tensor::Shape::new(&[0]),
        ))?;
        let meta = empty.metadata().clone();
        let pending = start(
            &self.shared,
            Collective::AllReduce(Reduction::Sum),
            empty,
            &meta,
            Some(timeout),
            "Barrier",
        )?;
        pending.wait().map(|_| ())
    }

    pub(super) fn abort(&self, code: i32) -> ! {
        // Another thread may be inside MPI; aborting is the one call that
        // may not wait for it.
        // SAFETY: MPI is initialized; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        let failed = {
            let mut state = self.shared.lock();
            state.stop = true;
            state.failed.is_some()
        };
        self.shared.work.notify_all();
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
        // Sends to a process that never takes them would hang finalize
        // too; those under way get the grace period to finish.
        let deadline = Instant::now() + GRACE;
        let stuck_sends = loop {
            let mut state = self.shared.lock();
            progress_sends(&mut state);
            if state.sends.is_empty() {
                break false;
            }
            if Instant::now() > deadline {
                break true;
            }
            drop(state);
            std::thread::sleep(Duration::from_millis(1));
        };
        if failed || stuck_sends {
            // Collectives that will never complete would hang finalize:
            // end the whole job instead, as MPI programs do on error.
            self.abort(1);
        }
        let mut state = self.shared.lock();
        let comms = &mut state.comms;
        for comm in [
            &mut comms.data,
            &mut comms.check,
            &mut comms.control,
            &mut comms.transfers,
        ] {
            // SAFETY: each was duplicated in `init`, no request on it is in
            // flight (the group did not fail), and it is freed once.
            unsafe { ffi::MPI_Comm_free(&mut comm.0) };
        }
        drop(state);
        // Finalizes MPI.
        drop(self.universe.take());
    }
}

/// The largest tag plus one: MPI_TAG_UB, which MPI guarantees is at
/// least 32767 (Open MPI's is 2^31 - 1).
fn tag_upper_bound() -> u64 {
    let mut value: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: MPI is initialized; for MPI_TAG_UB it stores a pointer to an
    // int it owns into `value`, and sets `flag` when it did.
    let rc = unsafe {
        ffi::MPI_Comm_get_attr(
            ffi::RSMPI_COMM_WORLD,
            ffi::MPI_TAG_UB as c_int,
            (&mut value as *mut *mut c_int).cast(),
            &mut flag,
        )
    };
    let bound = if rc == 0 && flag != 0 && !value.is_null() {
        // SAFETY: MPI set `value` to its attribute, an int it keeps alive.
        unsafe { *value }
    } else {
        32767
    };
    u64::try_from(bound).unwrap_or(32767).max(32767) + 1
}

fn library_version() -> String {
    let mut text = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_LIBRARY_VERSION_STRING (256 in Open
    // MPI) characters, and `len` receives how many were written.
    unsafe { ffi::MPI_Get_library_version(text.as_mut_ptr().cast(), &mut len) };
    text.truncate(len.clamp(0, 8192) as usize);
    let text = String::from_utf8_lossy(&text);
    text.split(',').next().unwrap_or("MPI").trim().to_string()
}

struct MpiCommunicator(Arc<Shared>);

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.0.rank
    }
    fn size(&self) -> usize {
        self.0.size
    }
    fn describe(&self) -> String {
        format!("MPI: {}, {} processes", self.0.library, self.0.size)
    }
    fn start(
        &self,
        op: Collective,
        input: DenseHostTensor,
        output: &TensorMetadata,
    ) -> Result<Box<dyn PendingCollective>> {
        start(&self.0, op, input, output, None, op.name())
    }
    fn point_to_point(&self) -> Option<&dyn PointToPoint> {
        Some(self)
    }
}

/// The fingerprint both ends of an edge agree on.
fn edge_fingerprint(edge: Edge<'_>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (edge.key, edge.run).hash(&mut h);
    h.finish()
}

fn message(kind: u64, edge: Edge<'_>, payload: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(TRANSFER_HEADER_BYTES + payload.len());
    for word in [kind, edge_fingerprint(edge), edge.run, payload.len() as u64] {
        message.extend_from_slice(&word.to_le_bytes());
    }
    message.extend_from_slice(payload);
    message
}

impl MpiCommunicator {
    /// Issues the send of `message` and records its flight.
    fn post(
        &self,
        to: usize,
        edge: Edge<'_>,
        message: Vec<u8>,
        value: Option<DenseHostTensor>,
    ) -> Result<u64> {
        // A failure note has no waiter: MPI's completion alone retires it.
        let abandoned = value.is_none();
        let shared = &self.0;
        let what = format!("{} (run {})", edge.key, edge.run);
        if to >= shared.size {
            return Err(distributed_error(format!(
                "{what} goes to rank {to}, but the group has {} processes",
                shared.size
            )));
        }
        let len = count(message.len(), &what)?;
        let mut state = shared.lock();
        // SAFETY: reading a constant MPI initialized.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `message` moves into the flight below (its heap block
        // stays put), which keeps it until MPI completes the request; `len`
        // is its length in bytes. Called under the state lock.
        let rc = unsafe {
            ffi::MPI_Isend(
                message.as_ptr().cast(),
                len,
                ffi::RSMPI_UINT8_T,
                to as c_int,
                edge.tag as c_int,
                state.comms.transfers.0,
                &mut request,
            )
        };
        check(rc, &what)?;
        let id = state.next_send;
        state.next_send += 1;
        state.sends.insert(
            id,
            SendFlight {
                what,
                to,
                started: Instant::now(),
                request: Some(Raw(request)),
                _message: message,
                value,
                abandoned,
            },
        );
        drop(state);
        shared.work.notify_one();
        Ok(id)
    }
}

impl PointToPoint for MpiCommunicator {
    fn send(
        &self,
        to: usize,
        edge: Edge<'_>,
        value: DenseHostTensor,
    ) -> Result<Box<dyn PendingCollective>> {
        let message = message(VALUE_MESSAGE, edge, value.buffer().bytes());
        let id = self.post(to, edge, message, Some(value))?;
        Ok(Box::new(MpiSend {
            shared: Arc::clone(&self.0),
            id,
        }))
    }

    fn send_failure(&self, to: usize, edge: Edge<'_>, error: &Error) {
        let text = format!("{error}");
        let message = message(FAILURE_MESSAGE, edge, text.as_bytes());
        // Best effort: this process is failing already.
        let _ = self.post(to, edge, message, None);
    }

    fn recv(
        &self,
        from: usize,
        edge: Edge<'_>,
        meta: &TensorMetadata,
        stop: &dyn Fn() -> bool,
    ) -> Result<DenseHostTensor> {
        let shared = &self.0;
        let what = format!("{} (run {})", edge.key, edge.run);
        if from >= shared.size {
            return Err(distributed_error(format!(
                "{what} comes from rank {from}, but the group has {} processes",
                shared.size
            )));
        }
        let timeout = shared.timeout();
        let started = Instant::now();
        let late = || {
            distributed_error(format!(
                "rank {from} did not send {what} to rank {} within {:.1} s: it hung, died, or \
                 runs a different program (every process must call a function spread over ranks \
                 alike)",
                shared.rank,
                timeout.as_secs_f64()
            ))
        };
        // Probe until the message is there, then take it; messages of an
        // earlier, failed run of the function are dropped on the way.
        'message: loop {
            let (mut buffer, mut request) = loop {
                {
                    let state = shared.lock();
                    let mut flag: c_int = 0;
                    // SAFETY: reading a constant MPI initialized.
                    let mut handle: ffi::MPI_Message = unsafe { ffi::RSMPI_MESSAGE_NULL };
                    // SAFETY: an all-zero MPI_Status is a valid value to be
                    // overwritten.
                    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
                    // SAFETY: a live communicator; the out-parameters are
                    // writable. Called under the state lock.
                    let rc = unsafe {
                        ffi::MPI_Improbe(
                            from as c_int,
                            edge.tag as c_int,
                            state.comms.transfers.0,
                            &mut flag,
                            &mut handle,
                            &mut status,
                        )
                    };
                    check(rc, &what)?;
                    if flag != 0 {
                        let mut bytes: c_int = 0;
                        // SAFETY: `status` describes the probed message.
                        let rc =
                            unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut bytes) };
                        check(rc, &what)?;
                        let mut buffer = vec![0u8; bytes.max(0) as usize];
                        // SAFETY: reading a constant MPI initialized.
                        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
                        // SAFETY: `buffer` has room for the probed message's
                        // `bytes` bytes and is kept (or leaked) until the
                        // request completes. Called under the state lock.
                        let rc = unsafe {
                            ffi::MPI_Imrecv(
                                buffer.as_mut_ptr().cast(),
                                bytes,
                                ffi::RSMPI_UINT8_T,
                                &mut handle,
                                &mut request,
                            )
                        };
                        check(rc, &what)?;
                        break (buffer, Some(Raw(request)));
                    }
                }
                if stop() {
                    return Err(Error::cancelled());
                }
                if started.elapsed() > timeout {
                    return Err(late());
                }
                back_off(started);
            };
            loop {
                let done = {
                    let _state = shared.lock();
                    test(&mut request, &what)?
                };
                if done {
                    break;
                }
                if stop() || started.elapsed() > timeout {
                    // MPI may still write into the buffer.
                    std::mem::forget(std::mem::take(&mut buffer));
                    return Err(if stop() { Error::cancelled() } else { late() });
                }
                back_off(started);
            }
            let run = buffer
                .get(16..24)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes);
            if run.is_some_and(|run| run < edge.run) {
                continue 'message;
            }
            return read_message(&buffer, from, edge, &what, meta);
        }
    }
}

/// How long a waiting thread spins before it yields its core.
const SPIN: Duration = Duration::from_micros(50);

/// Waits between tests of a transfer that started at `since`. Open MPI
/// moves a transfer on only inside MPI calls, so a waiting thread tests
/// back to back: spinning for the first 50 µs, which covers a small
/// message's round trip (a yield is a system call, and costs as much);
/// then yielding its core to any thread with work, as MPI_Wait's busy
/// polling would not, up to 100 ms, which covers every message up to
/// tens of MiB; longer waits sleep between tests.
fn back_off(since: Instant) {
    let waited = since.elapsed();
    if waited < SPIN {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(100) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The tensor in a received point-to-point message, or why there is none.
fn read_message(
    message: &[u8],
    from: usize,
    edge: Edge<'_>,
    what: &str,
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let word = |i: usize| -> Option<u64> {
        let bytes = message.get(8 * i..8 * i + 8)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    };
    let (Some(kind), Some(fingerprint), Some(run), Some(len)) =
        (word(0), word(1), word(2), word(3))
    else {
        return Err(distributed_error(format!(
            "rank {from} sent {} bytes for {what}, less than a message header",
            message.len()
        )));
    };
    let payload = &message[TRANSFER_HEADER_BYTES..];
    if kind == FAILURE_MESSAGE {
        return Err(distributed_error(format!(
            "rank {from} failed, so it never sent {what}: {}",
            String::from_utf8_lossy(payload)
        )));
    }
    if kind != VALUE_MESSAGE || fingerprint != edge_fingerprint(edge) {
        return Err(distributed_error(format!(
            "rank {from} sent another value (of its run {run}) than the {what} this process waits \
             for: every process must call a function spread over ranks alike, the same number of \
             times"
        )));
    }
    let expected = meta.shape.numel() * meta.dtype.size_in_bytes();
    if len as usize != payload.len() || payload.len() != expected {
        return Err(distributed_error(format!(
            "rank {from} sent {} bytes for {what}, which carries {meta} ({expected} bytes)",
            payload.len()
        )));
    }
    DenseHostTensor::from_buffer(meta.clone(), Buffer::copy_of(payload))
}

/// A point-to-point send, waited for by the run that issued it.
struct MpiSend {
    shared: Arc<Shared>,
    id: u64,
}

impl PendingCollective for MpiSend {
    fn wait(self: Box<Self>) -> Result<DenseHostTensor> {
        let waiting = Instant::now();
        loop {
            {
                let mut state = self.shared.lock();
                let timeout = self.shared.timeout();
                let flight = state
                    .sends
                    .get_mut(&self.id)
                    .ok_or_else(|| Error::internal("a send was waited for twice"))?;
                let (what, to) = (flight.what.clone(), flight.to);
                let done = test(&mut flight.request, &what);
                let late = flight.started.elapsed() > timeout;
                match done {
                    Ok(true) => {
                        let flight = state.sends.remove(&self.id).expect("found above");
                        return flight
                            .value
                            .ok_or_else(|| Error::internal("a send without a value"));
                    }
                    Err(e) => {
                        flight.abandoned = true;
                        return Err(e);
                    }
                    Ok(false) if late => {
                        flight.abandoned = true;
                        return Err(distributed_error(format!(
                            "rank {to} did not take {what} from rank {} within {:.1} s: it hung, \
                             died, or runs a different program",
                            self.shared.rank,
                            timeout.as_secs_f64()
                        )));
                    }
                    Ok(false) => {}
                }
            }
            back_off(waiting);
        }
    }
}

impl Drop for MpiSend {
    fn drop(&mut self) {
        if let Some(flight) = self.shared.lock().sends.get_mut(&self.id) {
            flight.abandoned = true;
        }
    }
}

/// Tests every send in flight; forgets the completed ones nobody waits
/// for.
fn progress_sends(state: &mut State) {
    state.sends.retain(|_, flight| {
        let done = matches!(test(&mut flight.request, &flight.what), Ok(true) | Err(_));
        !(done && flight.abandoned)
    });
}

/// Posts `op`'s first exchange step and, for data the exchange does not
/// carry, MPI's own collective; records the flight.
fn start(
    shared: &Arc<Shared>,
    op: Collective,
    input: DenseHostTensor,
    output: &TensorMetadata,
    timeout: Option<Duration>,
    label: &'static str,
) -> Result<Box<dyn PendingCollective>> {
    let n = shared.size;
    let what = What {
        label,
        op,
        meta: input.metadata().clone(),
    };
    let dtype = datatype(input.dtype())?;
    let in_count = count(input.numel(), &what)?;
    let out_count = count(output.shape.numel(), &what)?;
    let non_root_reduce =
        matches!(op, Collective::ReduceToRoot { root, .. } if root != shared.rank);
    let out_bytes = output.shape.numel() * output.dtype.size_in_bytes();
    // A non-root's ReduceToRoot result is zeros MPI never writes.
    let mut buffer = if non_root_reduce {
        Buffer::zeroed(out_bytes)
    } else {
        Buffer::for_overwrite(out_bytes)
    };
    if let Collective::Broadcast { root } = op {
        if root == shared.rank {
            buffer = Buffer::copy_of(input.buffer().bytes());
        }
    }
    let divide_by = match op {
        Collective::AllReduce(Reduction::Mean) | Collective::ReduceScatter(Reduction::Mean) => {
            Some(n)
        }
        Collective::ReduceToRoot {
            reduction: Reduction::Mean,
            root,
        } if root == shared.rank => Some(n),
        _ => None,
    };
    let reduces = exchange_reduces(op, input.dtype());
    if reduces && n == 1 {
        // A group of one: the reduction is the input.
        buffer = Buffer::copy_of(input.buffer().bytes());
    }
    let recv: *mut c_void = buffer
        .typed_mut::<u8>()
        .map_err(|_| Error::internal("a fresh buffer is shared"))?
        .as_mut_ptr()
        .cast();
    let data = match op {
        Collective::AllReduce(reduction) if reduces => {
            Some(Reducing::new(reduction, input.dtype(), recv.cast()))
        }
        _ => None,
    };
    let mut state = shared.lock();
    if let Some(e) = &state.failed {
        return Err(e.clone());
    }
    let seq = state.next_seq;
    state.next_seq += 1;
    let elements = if reduces { input.numel() } else { 0 };
    let mut flight = Flight {
        seq,
        watched_since: None,
        timeout: timeout.unwrap_or_else(|| shared.timeout()),
        exchange: Exchange::new(
            butterfly::schedule(
                shared.rank,
                n,
                elements,
                split_for(elements * input.dtype().size_in_bytes()),
                reduces,
            ),
            butterfly::rounds(n),
            (seq % shared.collective_tags) as c_int * TAGS_PER_COLLECTIVE,
            fingerprint(seq, &what),
            data,
        ),
        what,
        data_request: None,
        input,
        output: None,
        divide_by,
        outcome: None,
    };
    let (data, check_comm) = (state.comms.data.0, state.comms.check.0);
    let send: *const c_void = flight.input.buffer().bytes().as_ptr().cast();
    let posted = if reduces {
        Ok(())
    } else {
        // SAFETY: the input (kept in the flight) and the output buffer
        // (kept in the flight; its heap block does not move when the
        // `Buffer` handle does) outlive the request, which the flight holds
        // until it completes or, after a failure, forever (wreckage).
        // Counts match the buffers: `in_count` elements of the input's
        // dtype; `out_count` of the output's, which the shape rule sized
        // from the input and the group size. Called under the state lock.
        unsafe {
            let mut request: ffi::MPI_Request = ffi::RSMPI_REQUEST_NULL;
            let rc = match op {
                Collective::AllReduce(r) => {
                    ffi::MPI_Iallreduce(send, recv, in_count, dtype, mpi_op(r), data, &mut request)
                }
                Collective::ReduceToRoot { reduction, root } => ffi::MPI_Ireduce(
                    send,
                    recv,
                    in_count,
                    dtype,
                    mpi_op(reduction),
                    root as c_int,
                    data,
                    &mut request,
                ),
                Collective::Broadcast { root } => {
                    ffi::MPI_Ibcast(recv, in_count, dtype, root as c_int, data, &mut request)
                }
                Collective::AllGather => ffi::MPI_Iallgather(
                    send,
                    in_count,
                    dtype,
                    recv,
                    in_count,
                    dtype,
                    data,
                    &mut request,
                ),
                Collective::ReduceScatter(r) => ffi::MPI_Ireduce_scatter_block(
                    send,
                    recv,
                    out_count,
                    dtype,
                    mpi_op(r),
                    data,
                    &mut request,
                ),
            };
            check(rc, &flight.what).map(|()| flight.data_request = Some(Raw(request)))
        }
    };
    flight.output = Some((output.clone(), buffer));
    // The first step goes out now, so a process that computes before
    // waiting does not hold up the others.
    let first = posted.and_then(|()| flight.advance(check_comm).map(|_| ()));
    if let Err(e) = first {
        state.wreckage.push(flight);
        state.failed = Some(e.clone());
        return Err(e);
    }
    state.flights.push(flight);
    Ok(Box::new(MpiPending {
        shared: Arc::clone(shared),
        seq,
    }))
}

struct MpiPending {
    shared: Arc<Shared>,
    seq: u64,
}

impl PendingCollective for MpiPending {
    fn continue_in_background(&self) {
        self.shared.work.notify_one();
    }

    fn wait(self: Box<Self>) -> Result<DenseHostTensor> {
        // Set at the first full round: a small collective completes
        // before, and reads no clock.
        let mut waiting: Option<Instant> = None;
        let mut patient = false;
        for polls in 1u64.. {
            let mut state = self.shared.lock();
            // A small collective completes within a few microseconds, so
            // most polls test this flight alone; every 64th one also runs
            // the watchdog and moves the others on.
            if polls % POLLS_PER_ROUND == 0 {
                progress(&self.shared, &mut state);
            } else if state.failed.is_none() {
                progress_flight(&self.shared, &mut state, self.seq, false);
            }
            match state.flights.get(self.seq).map(|f| f.outcome.is_some()) {
                Some(true) => {
                    let mut flight = state
                        .flights
                        .remove(self.seq)
                        .expect("the flight was just found");
                    let outcome = flight.outcome.take().expect("the outcome was just found");
                    if !flight.complete() {
                        state.wreckage.push(flight);
                    }
                    return outcome;
                }
                Some(false) => {}
                None => {
                    return Err(Error::internal(format!(
                        "collective #{} was waited for twice",
                        self.seq
                    )))
                }
            }
            drop(state);
            // Spinning reads no clock; the clock is read once a round until
            // the wait outlasts a spin, and from then on it backs off at
            // every poll.
            if !patient && polls % POLLS_PER_ROUND == 0 {
                patient = waiting.get_or_insert_with(Instant::now).elapsed() >= SPIN;
            }
            match waiting {
                Some(since) if patient => back_off(since),
                _ => std::hint::spin_loop(),
            }
        }
        unreachable!("a wait polls until its flight has an outcome")
    }
}

/// How many polls of a waiting collective test it alone before one runs
/// the whole [`progress`] (watchdog included).
const POLLS_PER_ROUND: u64 = 64;

fn progress_loop(shared: &Shared) {
    loop {
        let mut state = shared.lock();
        while !state.stop
            && !state.flights.iter().any(|f| f.outcome.is_none())
            && !state.sends.values().any(|f| f.request.is_some())
        {
            state = shared
                .work
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if state.stop {
            return;
        }
        // Not at once: a caller that waits right after starting (a
        // synchronous collective) tests the transfer itself, and taking
        // its core and lock meanwhile only slows it down; what travels
        // while the caller computes is tested every 100 µs.
        drop(state);
        std::thread::sleep(Duration::from_micros(100));
        progress(shared, &mut shared.lock());
    }
}

/// Tests one request; `Ok(true)` once it has completed.
fn test(request: &mut Option<Raw<ffi::MPI_Request>>, what: impl fmt::Display) -> Result<bool> {
    let Some(Raw(mut raw)) = *request else {
        return Ok(true);
    };
    let mut flag: c_int = 0;
    // SAFETY: `raw` is an active request of a live flight, tested under the
    // state lock; MPI sets it to MPI_REQUEST_NULL when it completes.
    let rc = unsafe { ffi::MPI_Test(&mut raw, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    check(rc, &what)?;
    if flag != 0 {
        *request = None;
        Ok(true)
    } else {
        *request = Some(Raw(raw));
        Ok(false)
    }
}

/// Moves every flight forward: completes, checks, enforces the
/// watchdog. A failure fails the group and every flight.
fn progress(shared: &Shared, state: &mut State) {
    progress_sends(state);
    if state.failed.is_some() {
        fail_all(state);
        return;
    }
    // Progressing a flight neither adds nor removes one.
    for i in 0..state.flights.0.len() {
        let seq = state.flights.0[i].seq;
        if !progress_flight(shared, state, seq, true) {
            return;
        }
    }
}

/// Moves flight `seq` forward (and, with `watch`, enforces its watchdog);
/// `false` when that failed the group.
fn progress_flight(shared: &Shared, state: &mut State, seq: u64, watch: bool) -> bool {
    let check_comm = state.comms.check.0;
    let Some(flight) = state.flights.get_mut(seq).filter(|f| f.outcome.is_none()) else {
        return true;
    };
    let exchanged = flight.advance(check_comm);
    let data = test(&mut flight.data_request, &flight.what);
    let mut tested = exchanged.and_then(|e| Ok((e, data.clone()?)));
    if data.is_err() {
        // The data of mismatched collectives can fail (truncated)
        // before their check completes: the check says why.
        let deadline = Instant::now() + GRACE;
        while let Ok(false) = flight.advance(check_comm) {
            if Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if flight.exchange.done() && flight.exchange.mismatched() {
            tested = Ok((true, false));
        }
    }
    let agreed = !flight.exchange.mismatched();
    let late = watch
        && flight
            .watched_since
            .get_or_insert_with(Instant::now)
            .elapsed()
            > flight.timeout;
    let known = flight.exchange.agreement_known();
    let error = match tested {
        Err(e) => Some(e),
        Ok((true, _)) if !agreed => Some(mismatch(shared, state, seq)),
        Ok((true, true)) => {
            let flight = state.flights.get_mut(seq).expect("found above");
            flight.outcome = Some(finish(flight));
            None
        }
        Ok(_) if late => Some(timed_out(shared, state, seq, known)),
        Ok(_) => None,
    };
    match error {
        Some(e) => {
            state.failed = Some(e);
            fail_all(state);
            false
        }
        None => true,
    }
}

fn fail_all(state: &mut State) {
    let error = state.failed.clone().expect("called after a failure");
    for flight in state.flights.iter_mut() {
        if flight.outcome.is_none() {
            flight.outcome = Some(Err(error.clone()));
        }
    }
}

/// The completed flight's result (divided by the group size for a mean).
fn finish(flight: &mut Flight) -> Result<DenseHostTensor> {
    let (meta, buffer) = flight
        .output
        .take()
        .ok_or_else(|| Error::internal("a collective finished twice"))?;
    let mut out = DenseHostTensor::from_buffer(meta, buffer)?;
    if let Some(n) = flight.divide_by {
        match out.dtype() {
            DType::F32 => out
                .as_mut_slice::<f32>()?
                .iter_mut()
                .for_each(|v| *v /= n as f32),
            DType::F64 => out
                .as_mut_slice::<f64>()?
                .iter_mut()
                .for_each(|v| *v /= n as f64),
            DType::I32 => out
                .as_mut_slice::<i32>()?
                .iter_mut()
                .for_each(|v| *v /= n as i32),
            DType::I64 => out
                .as_mut_slice::<i64>()?
                .iter_mut()
                .for_each(|v| *v /= n as i64),
            other => {
                return Err(Error::dtype(format!(
                    "a mean over processes needs f32, f64, i32 or i64, got {other}"
                )))
            }
        }
    }
    Ok(out)
}

/// Every process saw the header disagree at `seq`: gathers what each ran
/// (on the control communicator, with the watchdog's grace as its limit)
/// and reports it.
fn mismatch(shared: &Shared, state: &mut State, seq: u64) -> Error {
    let what = state
        .flights
        .get(seq)
        .expect("a failing flight")
        .what
        .clone();
    let mut mine = vec![0u8; DESCRIPTION_BYTES];
    let what = what.to_string();
    let text = what.as_bytes();
    let len = text.len().min(DESCRIPTION_BYTES);
    mine[..len].copy_from_slice(&text[..len]);
    let mut all = vec![0u8; DESCRIPTION_BYTES * shared.size];
    // SAFETY: reading a constant MPI initialized.
    let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
    // SAFETY: `mine` holds DESCRIPTION_BYTES bytes and `all` one such block
    // per process; both stay alive until the request completes or, if it
    // does not within the grace period, are leaked below.
    let rc = unsafe {
        ffi::MPI_Iallgather(
            mine.as_ptr().cast(),
            DESCRIPTION_BYTES as c_int,
            ffi::RSMPI_UINT8_T,
            all.as_mut_ptr().cast(),
            DESCRIPTION_BYTES as c_int,
            ffi::RSMPI_UINT8_T,
            state.comms.control.0,
            &mut request,
        )
    };
    let mut report = format!(
        "collective #{seq} differs between processes: rank {} ran {what}",
        shared.rank
    );
    let mut request = Some(Raw(request));
    let deadline = Instant::now() + GRACE;
    let gathered = rc == 0
        && loop {
            match test(&mut request, "gathering the mismatch report") {
                Ok(true) => break true,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                _ => break false,
            }
        };
    if gathered {
        report = format!("collective #{seq} differs between processes:");
        for (rank, block) in all.chunks(DESCRIPTION_BYTES).enumerate() {
            let end = block.iter().position(|&b| b == 0).unwrap_or(block.len());
            report.push_str(&format!(
                " rank {rank} ran {};",
                String::from_utf8_lossy(&block[..end])
            ));
        }
        report.pop();
    } else {
        std::mem::forget(mine);
        std::mem::forget(all);
    }
    report.push_str(
        " (every process must run the same collectives, with the same dtypes and shapes, \
         in the same order)",
    );
    distributed_error(report)
}

/// `seq` has waited past its timeout: tells every other process this one
/// is waiting, listens for the others for [`GRACE`], and names those that
/// stayed silent.
fn timed_out(shared: &Shared, state: &mut State, seq: u64, header_done: bool) -> Error {
    let flight = state.flights.get(seq).expect("a failing flight");
    let (what, waited) = (flight.what.clone(), flight.timeout);
    let me = shared.rank;
    let control = state.comms.control.0;
    let note: &'static mut i64 = Box::leak(Box::new(seq as i64));
    for other in (0..shared.size).filter(|&r| r != me) {
        // SAFETY: reading a constant MPI initialized.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `note` is leaked, so it outlives the send, whose request
        // is abandoned (the group is failing).
        unsafe {
            ffi::MPI_Isend(
                (note as *const i64).cast(),
                1,
                ffi::RSMPI_INT64_T,
                other as c_int,
                WAITING_TAG,
                control,
                &mut request,
            );
        }
    }
    let mut heard: BTreeMap<usize, i64> = BTreeMap::new();
    let deadline = Instant::now() + GRACE;
    while heard.len() + 1 < shared.size && Instant::now() < deadline {
        let mut flag: c_int = 0;
        // SAFETY: an all-zero MPI_Status is a valid value to be overwritten.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `control` is a live communicator; `status` is writable.
        let rc = unsafe {
            ffi::MPI_Iprobe(
                ffi::RSMPI_ANY_SOURCE,
                WAITING_TAG,
                control,
                &mut flag,
                &mut status,
            )
        };
        if rc != 0 {
            break;
        }
        if flag == 0 {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let mut their_seq: i64 = -1;
        let source = status.MPI_SOURCE;
        // SAFETY: the probed message is one i64 from `source`.
        unsafe {
            ffi::MPI_Recv(
                (&mut their_seq as *mut i64).cast(),
                1,
                ffi::RSMPI_INT64_T,
                source,
                WAITING_TAG,
                control,
                ffi::RSMPI_STATUS_IGNORE,
            );
        }
        heard.insert(source as usize, their_seq);
    }
    let silent: Vec<String> = (0..shared.size)
        .filter(|r| *r != me && !heard.contains_key(r))
        .map(|r| r.to_string())
        .collect();
    let seconds = waited.as_secs_f64();
    if !silent.is_empty() {
        let plural = if silent.len() == 1 { "" } else { "s" };
        return distributed_error(format!(
            "rank{plural} {} did not reach collective #{seq} ({what}) within {seconds:.1} s: \
             hung, or died (rank {me} waited for it{})",
            silent.join(", "),
            if heard.is_empty() {
                String::new()
            } else {
                format!(
                    "; ranks {} are waiting too",
                    heard
                        .keys()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        ));
    }
    let elsewhere: Vec<String> = heard
        .iter()
        .filter(|(_, s)| **s != seq as i64)
        .map(|(r, s)| format!("rank {r} at #{s}"))
        .collect();
    if !elsewhere.is_empty() {
        return distributed_error(format!(
            "collective #{seq} ({what}) timed out after {seconds:.1} s on rank {me} while other \
             processes wait at other collectives ({}): they ran a different number of collectives",
            elsewhere.join(", ")
        ));
    }
    distributed_error(format!(
        "collective #{seq} ({what}) did not complete within {seconds:.1} s although every \
         process reached it{}",
        if header_done {
            " and agreed on it: the transport stalled"
        } else {
            ""
        }
    ))
}
