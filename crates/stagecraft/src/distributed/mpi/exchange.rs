//! A collective's exchange: one process's steps of the [`butterfly`]
//! schedule as non-blocking MPI messages, each headed by the check every
//! process compares; with data, the all-reduce itself.

use super::{butterfly, check, count, test, Raw, What};
use crate::{Error, Result};
use mpi::ffi;
use stagecraft_cpu::collective::{distributed_error, Collective};
use stagecraft_ops::Reduction;
use stagecraft_tensor::{Buffer, DType, DenseHostTensor};
use std::os::raw::c_int;

/// Bytes of the check at the head of each exchange message: the sender's
/// fingerprint of the collective, and whether it has seen another.
const CHECK_BYTES: usize = 16;

/// Tags of one collective's exchange messages: each step's tag within it
/// ([`butterfly::Step::tag`]) is below this.
pub(super) const TAGS_PER_COLLECTIVE: c_int = 64;

/// The all-reduce that rides on an exchange.
pub(super) struct Reducing {
    reduction: Reduction,
    dtype: DType,
    /// Start of the output's bytes: doubling rounds send from and receive
    /// into it in place.
    out: Raw<*mut u8>,
    /// The output holds the values reduced so far (before the first
    /// reduction, the input does).
    begun: bool,
}

/// One process's part of a collective's [`butterfly`] schedule on the
/// check communicator: with data, the all-reduce itself; without, the
/// check that every process runs the same collective.
pub(super) struct Exchange {
    steps: Vec<butterfly::Step>,
    rounds: usize,
    /// Tag of this collective's first step.
    tag_base: c_int,
    fingerprint: u64,
    /// This process has seen, or been told of, another fingerprint.
    mismatch: bool,
    /// The step in flight (or next to post).
    next: usize,
    posted: bool,
    send: Option<Raw<ffi::MPI_Request>>,
    recv: Option<Raw<ffi::MPI_Request>>,
    /// The message being sent, kept until MPI is done with it.
    outgoing: Option<Buffer>,
    /// The bytes the message being received should have, and the buffer
    /// it goes to (`None`: straight into the output, in doubling rounds).
    incoming: Option<(usize, Option<Buffer>)>,
    /// Bytes received (`None`: more than expected, so truncated).
    received: Option<Option<usize>>,
    data: Option<Reducing>,
}

/// Where a step's messages go.
struct Route {
    peer: c_int,
    tag: c_int,
    comm: ffi::MPI_Comm,
}

impl Route {
    /// Starts sending `len` bytes from `bytes`; MPI's return code and the
    /// request.
    ///
    /// # Safety
    /// `bytes` stays valid for reads of `len` bytes, and is not written,
    /// until the request completes; called under the transport's lock.
    unsafe fn send(&self, bytes: *const u8, len: c_int) -> (c_int, ffi::MPI_Request) {
        // SAFETY: reading a constant MPI initialized.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller keeps `bytes` alive and unwritten until the
        // request completes; `comm` is a live communicator.
        let rc = unsafe {
            ffi::MPI_Isend(
                bytes.cast(),
                len,
                ffi::RSMPI_UINT8_T,
                self.peer,
                self.tag,
                self.comm,
                &mut request,
            )
        };
        (rc, request)
    }

    /// Starts receiving up to `len` bytes into `bytes`; MPI's return code
    /// and the request.
    ///
    /// # Safety
    /// `bytes` stays valid for writes of `len` bytes, and is neither read
    /// nor written otherwise, until the request completes; called under
    /// the transport's lock.
    unsafe fn recv(&self, bytes: *mut u8, len: c_int) -> (c_int, ffi::MPI_Request) {
        // SAFETY: reading a constant MPI initialized.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller keeps `bytes` alive and to MPI alone until the
        // request completes; `comm` is a live communicator.
        let rc = unsafe {
            ffi::MPI_Irecv(
                bytes.cast(),
                len,
                ffi::RSMPI_UINT8_T,
                self.peer,
                self.tag,
                self.comm,
                &mut request,
            )
        };
        (rc, request)
    }
}

impl Reducing {
    /// An all-reduce of `dtype` values into the output at `out`.
    pub(super) fn new(reduction: Reduction, dtype: DType, out: *mut u8) -> Reducing {
        Reducing {
            reduction,
            dtype,
            out: Raw(out),
            begun: false,
        }
    }
}

impl Exchange {
    /// An exchange of `steps` (of a group with `rounds` halving rounds)
    /// whose messages carry tags from `tag_base` and the check
    /// `fingerprint`; `data` when it is an all-reduce.
    pub(super) fn new(
        steps: Vec<butterfly::Step>,
        rounds: usize,
        tag_base: c_int,
        fingerprint: u64,
        data: Option<Reducing>,
    ) -> Exchange {
        Exchange {
            steps,
            rounds,
            tag_base,
            fingerprint,
            mismatch: false,
            next: 0,
            posted: false,
            send: None,
            recv: None,
            outgoing: None,
            incoming: None,
            received: None,
            data,
        }
    }

    /// Some process ran another collective.
    pub(super) fn mismatched(&self) -> bool {
        self.mismatch
    }

    /// No request of this exchange is in flight.
    pub(super) fn idle(&self) -> bool {
        self.send.is_none() && self.recv.is_none()
    }

    /// Every step has run.
    pub(super) fn done(&self) -> bool {
        self.next == self.steps.len()
    }

    /// Whether every process is known to have run this collective: no
    /// step left receives a check.
    pub(super) fn agreement_known(&self) -> bool {
        self.steps[self.next..].iter().all(|s| {
            matches!(
                s,
                butterfly::Step::Double { .. } | butterfly::Step::UnfoldOut { .. }
            )
        })
    }

    fn element_bytes(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.dtype.size_in_bytes())
    }

    /// Runs steps until one waits for MPI; `Ok(true)` once all have run.
    pub(super) fn advance(
        &mut self,
        comm: ffi::MPI_Comm,
        input: &DenseHostTensor,
        mut out: Option<&mut Buffer>,
        what: &What,
    ) -> Result<bool> {
        loop {
            let Some(step) = self.steps.get(self.next).cloned() else {
                return Ok(true);
            };
            if !self.posted {
                if self.mismatch && matches!(step, butterfly::Step::Double { .. }) {
                    // Every process knows: nobody gathers.
                    self.next += 1;
                    continue;
                }
                self.post(&step, comm, input, out.as_deref(), what)?;
                self.posted = true;
            }
            if !self.test_recv(what)? || !test(&mut self.send, what)? {
                return Ok(false);
            }
            self.outgoing = None;
            let received = self.received.take().flatten();
            match self.incoming.take() {
                Some((expected, Some(message))) => {
                    self.read_check(&message, received, expected);
                    if let (false, Some(out)) = (self.mismatch, out.as_deref_mut()) {
                        self.reduce(&step, input, out, &message)?;
                    }
                }
                // Doubling rounds run only once the group agreed, so the
                // sizes match.
                Some((expected, None)) if received != Some(expected) => {
                    return Err(distributed_error(format!(
                        "{what}: rank {} sent {received:?} bytes where {expected} were due",
                        step.peer()
                    )));
                }
                _ => {}
            }
            self.next += 1;
            self.posted = false;
        }
    }

    /// Issues `step`'s send and receive.
    fn post(
        &mut self,
        step: &butterfly::Step,
        comm: ffi::MPI_Comm,
        input: &DenseHostTensor,
        out: Option<&Buffer>,
        what: &What,
    ) -> Result<()> {
        use butterfly::Step;
        let size = self.element_bytes();
        let current = match (&self.data, out) {
            (Some(d), Some(out)) if d.begun => out.bytes(),
            _ => input.buffer().bytes(),
        };
        // A check without data carries no values.
        let whole = 0..self.data.as_ref().map_or(0, |_| input.numel());
        let bytes = |r: &std::ops::Range<usize>| r.start * size..r.end * size;
        let route = Route {
            peer: step.peer() as c_int,
            tag: self.tag_base + step.tag(self.rounds) as c_int,
            comm,
        };
        match step {
            Step::FoldOut { .. } | Step::UnfoldOut { .. } => {
                self.send_checked(&current[bytes(&whole)], &route, what)
            }
            Step::FoldIn { .. } | Step::UnfoldIn { .. } => {
                self.recv_checked(whole.len() * size, &route, what)
            }
            Step::Halve { keep, give, .. } => {
                self.recv_checked(keep.len() * size, &route, what)?;
                self.send_checked(&current[bytes(give)], &route, what)
            }
            Step::Double { mine, theirs, .. } => {
                let base = self
                    .data
                    .as_ref()
                    .ok_or_else(|| Error::internal("a doubling round without data"))?
                    .out
                    .0;
                let (mine, theirs) = (bytes(mine), bytes(theirs));
                let (mine_len, theirs_len) = (count(mine.len(), what)?, count(theirs.len(), what)?);
                // SAFETY: `base` points at the output buffer's bytes, which
                // the flight keeps (in its wreckage after a failure) until
                // these requests complete; `mine` and `theirs` are disjoint
                // byte ranges inside it, and no Rust reference to the
                // buffer is held while they are in flight (the next step
                // is posted only once both complete).
                let (rc, request) = unsafe { route.recv(base.add(theirs.start), theirs_len) };
                self.incoming = Some((theirs.len(), None));
                check(rc, what)?;
                self.recv = Some(Raw(request));
                // SAFETY: as for the receive.
                let (rc, request) = unsafe { route.send(base.add(mine.start), mine_len) };
                check(rc, what)?;
                self.send = Some(Raw(request));
                Ok(())
            }
        }
    }

    /// Sends the check followed by `payload`.
    fn send_checked(&mut self, payload: &[u8], route: &Route, what: &What) -> Result<()> {
        let mut message = Buffer::for_overwrite(CHECK_BYTES + payload.len());
        {
            let bytes = message.typed_mut::<u8>()?;
            bytes[..8].copy_from_slice(&self.fingerprint.to_le_bytes());
            bytes[8..16].copy_from_slice(&u64::from(self.mismatch).to_le_bytes());
            bytes[CHECK_BYTES..].copy_from_slice(payload);
        }
        let len = count(message.len(), what)?;
        // SAFETY: `message` is kept in `outgoing` (its heap block does not
        // move with the handle) until the request completes, and only read
        // meanwhile; `len` is its length in bytes.
        let (rc, request) = unsafe { route.send(message.bytes().as_ptr(), len) };
        self.outgoing = Some(message);
        check(rc, what)?;
        self.send = Some(Raw(request));
        Ok(())
    }

    /// Receives a check followed by `payload_bytes`.
    fn recv_checked(&mut self, payload_bytes: usize, route: &Route, what: &What) -> Result<()> {
        let expected = CHECK_BYTES + payload_bytes;
        let mut buffer = Buffer::for_overwrite(expected);
        let len = count(expected, what)?;
        let target = buffer.typed_mut::<u8>()?.as_mut_ptr();
        // SAFETY: `buffer` has room for `len` bytes and is kept in
        // `incoming`, untouched, until the request completes.
        let (rc, request) = unsafe { route.recv(target, len) };
        self.incoming = Some((expected, Some(buffer)));
        check(rc, what)?;
        self.recv = Some(Raw(request));
        Ok(())
    }

    /// Tests the receive; `Ok(true)` once it has completed. A message
    /// longer than the receive buffer (a process running another
    /// collective) completes it as truncated.
    fn test_recv(&mut self, what: &What) -> Result<bool> {
        let Some(Raw(mut raw)) = self.recv else {
            return Ok(true);
        };
        let mut flag: c_int = 0;
        // SAFETY: an all-zero MPI_Status is a valid value to be overwritten.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is an active request whose buffer the exchange
        // keeps; tested under the state lock.
        let rc = unsafe { ffi::MPI_Test(&mut raw, &mut flag, &mut status) };
        if rc != 0 {
            let mut class: c_int = 0;
            // SAFETY: `rc` is an error code MPI returned.
            unsafe { ffi::MPI_Error_class(rc, &mut class) };
            if class == ffi::MPI_ERR_TRUNCATE as c_int {
                // A failed request is freed as it completes.
                self.recv = None;
                self.received = Some(None);
                return Ok(true);
            }
            return check(rc, what).map(|_| false);
        }
        if flag == 0 {
            self.recv = Some(Raw(raw));
            return Ok(false);
        }
        self.recv = None;
        let mut bytes: c_int = 0;
        // SAFETY: `status` describes the completed receive.
        let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut bytes) };
        check(rc, what)?;
        self.received = Some(usize::try_from(bytes).ok());
        Ok(true)
    }

    /// Reads the check at the head of a received message.
    fn read_check(&mut self, message: &Buffer, received: Option<usize>, expected: usize) {
        let bytes = message.bytes();
        let word = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8"));
        let agrees = received == Some(expected) && word(0) == self.fingerprint && word(1) == 0;
        self.mismatch |= !agrees;
    }

    /// Reduces (or, from the process that finished the reduction, takes)
    /// the values received in `step`.
    fn reduce(
        &mut self,
        step: &butterfly::Step,
        input: &DenseHostTensor,
        out: &mut Buffer,
        message: &Buffer,
    ) -> Result<()> {
        let Some(data) = &mut self.data else {
            return Ok(());
        };
        match data.dtype {
            DType::F32 => reduce_step::<f32>(data, step, input, out, message),
            DType::F64 => reduce_step::<f64>(data, step, input, out, message),
            DType::I32 => reduce_step::<i32>(data, step, input, out, message),
            DType::I64 => reduce_step::<i64>(data, step, input, out, message),
            other => Err(Error::internal(format!(
                "the exchange cannot reduce {other} values"
            ))),
        }
    }
}

/// Whether the exchange itself reduces `op` on `dtype` (the rest goes to
/// MPI's collectives).
pub(super) fn exchange_reduces(op: Collective, dtype: DType) -> bool {
    matches!(op, Collective::AllReduce(_))
        && matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64)
}

fn reduce_step<T: stagecraft_tensor::Element + butterfly::Reducible>(
    data: &mut Reducing,
    step: &butterfly::Step,
    input: &DenseHostTensor,
    out: &mut Buffer,
    message: &Buffer,
) -> Result<()> {
    use butterfly::Step;
    let theirs = &message.typed::<T>()?[CHECK_BYTES / std::mem::size_of::<T>()..];
    let out = out.typed_mut::<T>()?;
    let input = input.as_slice::<T>()?;
    let r = data.reduction;
    match step {
        // Always the first step: the input holds this process's values.
        Step::FoldIn { .. } => butterfly::reduce(r, input, theirs, out),
        Step::Halve { keep, first, .. } => {
            let acc = &mut out[keep.clone()];
            if data.begun {
                butterfly::reduce_in_place(r, acc, theirs, *first);
            } else if *first {
                butterfly::reduce(r, &input[keep.clone()], theirs, acc);
            } else {
                butterfly::reduce(r, theirs, &input[keep.clone()], acc);
            }
        }
        Step::UnfoldIn { .. } => out.copy_from_slice(theirs),
        Step::FoldOut { .. } | Step::UnfoldOut { .. } | Step::Double { .. } => return Ok(()),
    }
    data.begun = true;
    Ok(())
}
