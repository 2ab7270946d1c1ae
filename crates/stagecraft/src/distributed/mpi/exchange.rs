//! A collective's exchange: one process's steps of the [`butterfly`]
//! schedule as non-blocking MPI messages, each opened by a fragment headed
//! by the check every process compares; with data, the all-reduce itself.

use super::{butterfly, check, count, Raw, What};
use crate::{Error, Result};
use mpi::ffi;
use smallvec::SmallVec;
use stagecraft_cpu::collective::{distributed_error, Collective};
use stagecraft_ops::Reduction;
use stagecraft_tensor::{Buffer, DType, DenseHostTensor};
use std::os::raw::c_int;

/// Bytes of the check at the head of each exchange message: the sender's
/// fingerprint of the collective, and whether it has seen another.
const CHECK_BYTES: usize = 16;

/// All-reduces of at most this many bytes exchange every value in each
/// round ([`butterfly::Split::Whole`]): half the rounds of the split
/// schedule, each moving twice as much. On 2 processes over shared memory
/// this wins up to 16 KiB (`experiments/allreduce-p2p`), where a round's
/// latency outweighs its bytes.
const WHOLE_MAX_BYTES: usize = 16 << 10;

/// Open MPI's shared-memory transport sends a message of up to 4 KiB (its
/// own header included) at once, and MPI copies it into the receive
/// buffer no further than that buffer's end. A longer message waits for
/// the receiver (a rendezvous, one more round trip), and Open MPI 4.1
/// copies it whole even into a shorter receive buffer, past its end. So
/// the first fragment of every checked message stays under this size:
/// a process running another collective can send nothing longer into a
/// receive posted before the checks agree.
const FRAGMENT_BYTES: usize = 4000;

/// Tags of one collective's exchange messages: each step's tag within it
/// ([`butterfly::Step::tag`]) is below this.
pub(super) const TAGS_PER_COLLECTIVE: c_int = 64;

/// How an all-reduce of `bytes` splits its values.
pub(super) fn split_for(bytes: usize) -> butterfly::Split {
    if bytes <= WHOLE_MAX_BYTES {
        butterfly::Split::Whole
    } else {
        butterfly::Split::Halves
    }
}

/// How a checked message is cut into fragments, laid out one after the
/// other in a buffer. The first fragment is headed by the check and
/// carries at most [`FRAGMENT_BYTES`]; the rest are received once its
/// check agrees. A payload of at most [`WHOLE_MAX_BYTES`] is cut into
/// fragments of that size, each headed by the check, which travel without
/// a rendezvous; the rest of a longer one travels as one message without
/// a check, straight from the values (no copy) into the buffer. Both ends
/// of a message compute the same cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cut {
    payload: usize,
    /// Payload bytes of the first fragment.
    first: usize,
    /// Payload bytes of each later fragment (the last may have fewer).
    rest: usize,
    fragments: usize,
    /// Later fragments are headed by the check too.
    headed: bool,
}

impl Cut {
    /// The cut of `payload` bytes of values `element` bytes wide.
    fn new(payload: usize, element: usize) -> Cut {
        let element = element.max(1);
        let chunk = (FRAGMENT_BYTES - CHECK_BYTES) / element * element;
        let (rest, headed) = if payload <= chunk {
            (0, true)
        } else if payload <= WHOLE_MAX_BYTES {
            (chunk, true)
        } else {
            (payload - chunk, false)
        };
        let first = payload.min(chunk);
        let fragments = match rest {
            0 => 1,
            rest => 1 + (payload - first).div_ceil(rest),
        };
        Cut {
            payload,
            first,
            rest,
            fragments,
            headed,
        }
    }

    /// The payload bytes fragment `f` carries.
    fn carries(&self, f: usize) -> std::ops::Range<usize> {
        if f == 0 {
            return 0..self.first;
        }
        let start = self.first + (f - 1) * self.rest;
        start..(start + self.rest).min(self.payload)
    }

    /// Bytes of fragment `f`'s check: none for the unheaded rest.
    fn head(&self, f: usize) -> usize {
        if f == 0 || self.headed {
            CHECK_BYTES
        } else {
            0
        }
    }

    /// Where fragment `f` starts in the buffer, and its length, check
    /// included.
    fn place(&self, f: usize) -> (usize, usize) {
        let carries = self.carries(f);
        let heads = if self.headed { f } else { f.min(1) };
        (
            heads * CHECK_BYTES + carries.start,
            self.head(f) + carries.len(),
        )
    }

    /// Where fragment `f`'s values lie in the buffer.
    fn values(&self, f: usize) -> std::ops::Range<usize> {
        let (at, len) = self.place(f);
        at + self.head(f)..at + len
    }

    /// Bytes of the buffer that holds every fragment.
    fn buffer_bytes(&self) -> usize {
        let (at, len) = self.place(self.fragments - 1);
        at + len
    }
}

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

/// One receive of a step: a fragment of a checked message, or a doubling
/// round's values.
struct Receive {
    /// Where the fragment starts in the step's incoming buffer.
    offset: usize,
    /// It starts with a check.
    checked: bool,
    /// The bytes it should have, check included.
    expected: usize,
    state: Receiving,
}

enum Receiving {
    /// Posted once the first fragment's check agrees.
    Later,
    Posted(Raw<ffi::MPI_Request>),
    /// Complete, with the bytes received (`None`: more than expected, so
    /// truncated).
    Done(Option<usize>),
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
    /// The step's sends still in flight.
    sends: SmallVec<[Raw<ffi::MPI_Request>; 4]>,
    /// The step's receives.
    receives: SmallVec<[Receive; 4]>,
    /// The step's outgoing fragments, kept until MPI is done with them.
    outgoing: Option<Buffer>,
    /// The buffer the step's fragments arrive in (`None`: straight into
    /// the output, in doubling rounds).
    incoming: Option<Buffer>,
    /// Where the step's later fragments come from.
    route: Option<Raw<Route>>,
    /// Requests given up once the group is known to disagree, and the
    /// buffers they use: kept until the process ends (a failed group
    /// aborts rather than finalize).
    abandoned: Vec<Raw<ffi::MPI_Request>>,
    kept: Vec<Buffer>,
    data: Option<Reducing>,
}

/// Where a step's messages go.
#[derive(Clone, Copy)]
struct Route {
    peer: c_int,
    tag: c_int,
    comm: ffi::MPI_Comm,
}

impl Route {
    /// Starts sending `len` bytes from `bytes`.
    ///
    /// # Safety
    /// `bytes` stays valid for reads of `len` bytes, and is not written,
    /// until the request completes; called under the transport's lock.
    unsafe fn send(
        &self,
        bytes: *const u8,
        len: usize,
        what: &What,
    ) -> Result<Raw<ffi::MPI_Request>> {
        self.start(len, what, |len, request| {
            // SAFETY: the caller keeps `bytes` alive and unwritten until
            // the request completes; `comm` is a live communicator.
            unsafe {
                ffi::MPI_Isend(
                    bytes.cast(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    self.peer,
                    self.tag,
                    self.comm,
                    request,
                )
            }
        })
    }

    /// Starts receiving up to `len` bytes into `bytes`.
    ///
    /// # Safety
    /// `bytes` stays valid for writes of `len` bytes, and is neither read
    /// nor written otherwise, until the request completes; called under
    /// the transport's lock.
    unsafe fn recv(
        &self,
        bytes: *mut u8,
        len: usize,
        what: &What,
    ) -> Result<Raw<ffi::MPI_Request>> {
        self.start(len, what, |len, request| {
            // SAFETY: the caller keeps `bytes` alive and to MPI alone until
            // the request completes; `comm` is a live communicator.
            unsafe {
                ffi::MPI_Irecv(
                    bytes.cast(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    self.peer,
                    self.tag,
                    self.comm,
                    request,
                )
            }
        })
    }

    /// Starts a transfer of `len` bytes with `post` (MPI's call, given the
    /// count and where to put the request), checking MPI's return code.
    fn start(
        &self,
        len: usize,
        what: &What,
        post: impl FnOnce(c_int, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<Raw<ffi::MPI_Request>> {
        let len = count(len, what)?;
        // SAFETY: reading a constant MPI initialized.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        check(post(len, &mut request), what).map(|()| Raw(request))
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
            sends: SmallVec::new(),
            receives: SmallVec::new(),
            outgoing: None,
            incoming: None,
            route: None,
            abandoned: Vec::new(),
            kept: Vec::new(),
            data,
        }
    }

    /// Some process ran another collective.
    pub(super) fn mismatched(&self) -> bool {
        self.mismatch
    }

    /// No request of this exchange is in flight.
    pub(super) fn idle(&self) -> bool {
        let posted = |r: &Receive| matches!(r.state, Receiving::Posted(_));
        self.sends.is_empty() && !self.receives.iter().any(posted) && self.abandoned.is_empty()
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
            let received = self.test_receives(what)?;
            if self.mismatch {
                // This step's checks went out when it was posted, and this
                // process knows the group disagrees: what is still to come
                // is of no use, and may never come (a process running
                // another collective can send fewer fragments).
                self.abandon();
            } else if !received || !self.test_sends(what)? {
                return Ok(false);
            } else if let Some(message) = self.incoming.take() {
                if let Some(out) = out.as_deref_mut() {
                    self.reduce(&step, input, out, &message)?;
                }
            } else {
                // A doubling round: it runs only once the group agreed, so
                // the sizes match.
                for r in &self.receives {
                    if !matches!(r.state, Receiving::Done(Some(n)) if n == r.expected) {
                        return Err(distributed_error(format!(
                            "{what}: rank {} sent another number of bytes than the {} due",
                            step.peer(),
                            r.expected
                        )));
                    }
                }
            }
            self.outgoing = None;
            self.incoming = None;
            self.receives.clear();
            self.next += 1;
            self.posted = false;
        }
    }

    /// Gives up the step's requests still in flight: they and the step's
    /// buffers are kept, untouched, for good.
    fn abandon(&mut self) {
        let before = self.abandoned.len();
        self.abandoned.extend(self.sends.drain(..));
        for r in &mut self.receives {
            if let Receiving::Posted(request) = std::mem::replace(&mut r.state, Receiving::Later) {
                self.abandoned.push(request);
            }
        }
        if self.abandoned.len() > before {
            self.kept.extend(self.outgoing.take());
            self.kept.extend(self.incoming.take());
        }
    }

    /// Issues `step`'s sends and receives.
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
                // SAFETY: `current` is the flight's input or output, which
                // the flight keeps (in its wreckage after a failure) until
                // these requests complete; the step is done, and the output
                // written again, only once they have, and an abandoned
                // step's output is never written again.
                unsafe { self.send_checked(&current[bytes(&whole)], &route, what) }
            }
            Step::FoldIn { .. } | Step::UnfoldIn { .. } => {
                self.recv_checked(whole.len() * size, &route, what)
            }
            Step::Halve { keep, give, .. } => {
                self.recv_checked(keep.len() * size, &route, what)?;
                // SAFETY: as above.
                unsafe { self.send_checked(&current[bytes(give)], &route, what) }
            }
            Step::Double { mine, theirs, .. } => {
                let base = self
                    .data
                    .as_ref()
                    .ok_or_else(|| Error::internal("a doubling round without data"))?
                    .out
                    .0;
                let (mine, theirs) = (bytes(mine), bytes(theirs));
                // SAFETY: `base` points at the output buffer's bytes, which
                // the flight keeps (in its wreckage after a failure) until
                // these requests complete; `mine` and `theirs` are disjoint
                // byte ranges inside it, and no Rust reference to the
                // buffer is held while they are in flight (the next step
                // is posted only once both complete).
                let request = unsafe { route.recv(base.add(theirs.start), theirs.len(), what)? };
                self.receives.push(Receive {
                    offset: theirs.start,
                    checked: false,
                    expected: theirs.len(),
                    state: Receiving::Posted(request),
                });
                // SAFETY: as for the receive.
                let request = unsafe { route.send(base.add(mine.start), mine.len(), what)? };
                self.sends.push(request);
                Ok(())
            }
        }
    }

    /// Sends `payload` in fragments ([`Cut`]): those headed by the check
    /// from a copy, an unheaded rest from `payload` itself.
    ///
    /// # Safety
    /// `payload` stays valid, and is not written, until the step's sends
    /// complete or the flight is abandoned for good (it lies in the
    /// flight's input or output).
    unsafe fn send_checked(&mut self, payload: &[u8], route: &Route, what: &What) -> Result<()> {
        let cut = Cut::new(payload.len(), self.element_bytes());
        let copied = if cut.headed { cut.fragments } else { 1 };
        let (last_at, last_len) = cut.place(copied - 1);
        let mut message = Buffer::for_overwrite(last_at + last_len);
        {
            let bytes = message.typed_mut::<u8>()?;
            for f in 0..copied {
                let (at, len) = cut.place(f);
                let fragment = &mut bytes[at..at + len];
                fragment[..8].copy_from_slice(&self.fingerprint.to_le_bytes());
                fragment[8..16].copy_from_slice(&u64::from(self.mismatch).to_le_bytes());
                fragment[CHECK_BYTES..].copy_from_slice(&payload[cut.carries(f)]);
            }
        }
        // Kept before any send starts, so that a failing one leaves those
        // already under way their bytes.
        let base = self.outgoing.insert(message).bytes().as_ptr();
        for f in 0..cut.fragments {
            let (at, len) = cut.place(f);
            let from = if f < copied {
                base.wrapping_add(at)
            } else {
                payload[cut.carries(f)].as_ptr()
            };
            // SAFETY: the message is kept in `outgoing` (its heap block
            // does not move with the handle), or among the abandoned, and
            // the caller keeps `payload` unwritten, until the request
            // completes; `len` bytes from `from` lie inside either.
            self.sends.push(unsafe { route.send(from, len, what)? });
        }
        Ok(())
    }

    /// Receives a checked message of `payload_bytes` in fragments
    /// ([`Cut`]): the first now, the others once its check agrees.
    fn recv_checked(&mut self, payload_bytes: usize, route: &Route, what: &What) -> Result<()> {
        let cut = Cut::new(payload_bytes, self.element_bytes());
        self.incoming = Some(Buffer::for_overwrite(cut.buffer_bytes()));
        self.route = Some(Raw(*route));
        self.receives.extend((0..cut.fragments).map(|f| {
            let (offset, expected) = cut.place(f);
            Receive {
                offset,
                checked: cut.head(f) > 0,
                expected,
                state: Receiving::Later,
            }
        }));
        self.post_receive(0, what)
    }

    /// Posts receive `i` of a checked message into its place in the
    /// incoming buffer.
    fn post_receive(&mut self, i: usize, what: &What) -> Result<()> {
        let route = self.route.as_ref().map(|r| r.0);
        let (Some(buffer), Some(route)) = (self.incoming.as_mut(), route) else {
            return Err(Error::internal("a fragment without its message"));
        };
        let receive = &mut self.receives[i];
        let target = buffer.typed_mut::<u8>()?[receive.offset..].as_mut_ptr();
        // SAFETY: the fragment's place lies inside the buffer, which is
        // kept in `incoming` (or among the abandoned), untouched, until the
        // request completes; no other request writes that place.
        let request = unsafe { route.recv(target, receive.expected, what)? };
        receive.state = Receiving::Posted(request);
        Ok(())
    }

    /// Tests the step's receives, reading the check of each that
    /// completes and posting the later fragments once the first agrees;
    /// `Ok(true)` once all have completed. A message longer than its
    /// receive (a process running another collective) completes it as
    /// truncated.
    fn test_receives(&mut self, what: &What) -> Result<bool> {
        let mut all = true;
        for i in 0..self.receives.len() {
            let Receiving::Posted(Raw(mut raw)) = self.receives[i].state else {
                all &= matches!(self.receives[i].state, Receiving::Done(_));
                continue;
            };
            let mut flag: c_int = 0;
            // SAFETY: an all-zero MPI_Status is a valid value to be
            // overwritten.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: `raw` is an active request whose buffer the exchange
            // keeps; tested under the state lock.
            let rc = unsafe { ffi::MPI_Test(&mut raw, &mut flag, &mut status) };
            let received = if rc != 0 {
                let mut class: c_int = 0;
                // SAFETY: `rc` is an error code MPI returned.
                unsafe { ffi::MPI_Error_class(rc, &mut class) };
                if class != ffi::MPI_ERR_TRUNCATE as c_int {
                    return check(rc, what).map(|_| false);
                }
                // A failed request is freed as it completes.
                None
            } else if flag == 0 {
                // Fragments of one message arrive in order (MPI does not
                // let messages of one sender and tag overtake each other),
                // so the later ones need no test yet.
                return Ok(false);
            } else {
                let mut bytes: c_int = 0;
                // SAFETY: `status` describes the completed receive.
                let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut bytes) };
                check(rc, what)?;
                usize::try_from(bytes).ok()
            };
            let receive = &mut self.receives[i];
            receive.state = Receiving::Done(received);
            let Some(message) = &self.incoming else {
                continue;
            };
            let bytes = &message.bytes()[receive.offset..];
            let word =
                |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8"));
            let agrees = received == Some(receive.expected)
                && (!receive.checked || (word(0) == self.fingerprint && word(1) == 0));
            self.mismatch |= !agrees;
            if i == 0 && agrees {
                // Tested in this same pass, below.
                for later in 1..self.receives.len() {
                    self.post_receive(later, what)?;
                }
            }
        }
        Ok(all)
    }

    /// Tests the step's sends; `Ok(true)` once all have completed.
    fn test_sends(&mut self, what: &What) -> Result<bool> {
        if self.sends.is_empty() {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        let count = c_int::try_from(self.sends.len()).expect("a step sends a few fragments");
        // SAFETY: `Raw` is a transparent wrapper of one request, so the
        // sends are `count` consecutive active requests; their buffers are
        // kept until they complete; called under the state lock. MPI sets
        // completed ones to MPI_REQUEST_NULL, which the vector then drops.
        let rc = unsafe {
            ffi::MPI_Testall(
                count,
                self.sends.as_mut_ptr().cast(),
                &mut flag,
                ffi::RSMPI_STATUSES_IGNORE,
            )
        };
        check(rc, what)?;
        if flag == 0 {
            return Ok(false);
        }
        self.sends.clear();
        Ok(true)
    }

    /// Reduces (or, from the process that finished the reduction, takes)
    /// the values received in `step`, fragment by fragment.
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
    let size = std::mem::size_of::<T>();
    let received = message.typed::<T>()?;
    let out = out.typed_mut::<T>()?;
    let input = input.as_slice::<T>()?;
    let r = data.reduction;
    // The step's values start at element `base` of the tensor.
    let (base, n) = match step {
        Step::FoldIn { .. } | Step::UnfoldIn { .. } => (0, input.len()),
        Step::Halve { keep, .. } => (keep.start, keep.len()),
        Step::FoldOut { .. } | Step::UnfoldOut { .. } | Step::Double { .. } => return Ok(()),
    };
    let cut = Cut::new(n * size, size);
    for f in 0..cut.fragments {
        let values = cut.values(f);
        let theirs = &received[values.start / size..values.end / size];
        let at = base + cut.carries(f).start / size;
        let range = at..at + theirs.len();
        match step {
            // Always the first step: the input holds this process's values.
            Step::FoldIn { .. } => {
                butterfly::reduce(r, &input[range.clone()], theirs, &mut out[range])
            }
            Step::Halve { first, .. } => {
                let acc = &mut out[range.clone()];
                if data.begun {
                    butterfly::reduce_in_place(r, acc, theirs, *first);
                } else if *first {
                    butterfly::reduce(r, &input[range], theirs, acc);
                } else {
                    butterfly::reduce(r, theirs, &input[range], acc);
                }
            }
            _ => out[range].copy_from_slice(theirs),
        }
    }
    data.begun = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_tile_the_payload_and_the_first_never_needs_a_rendezvous() {
        for element in [0, 1, 4, 8] {
            for payload in [
                0,
                8,
                3984,
                3992,
                4000,
                7968,
                12_000,
                16 << 10,
                (16 << 10) + 8,
                1 << 20,
            ] {
                let cut = Cut::new(payload, element);
                let mut next_payload = 0;
                let mut next_place = 0;
                for f in 0..cut.fragments {
                    let carries = cut.carries(f);
                    assert_eq!(carries.start, next_payload, "{cut:?}: fragment {f}");
                    assert!(!carries.is_empty() || payload == 0, "{cut:?}: fragment {f}");
                    assert_eq!(carries.start % element.max(1), 0, "{cut:?}: fragment {f}");
                    let (at, len) = cut.place(f);
                    assert_eq!((at, len), (next_place, cut.head(f) + carries.len()));
                    assert_eq!(cut.values(f), at + cut.head(f)..at + len);
                    next_payload = carries.end;
                    next_place = at + len;
                }
                assert_eq!(next_payload, payload, "{cut:?}");
                assert_eq!(next_place, cut.buffer_bytes(), "{cut:?}");
                assert!(cut.place(0).1 <= FRAGMENT_BYTES, "{cut:?}");
                if payload <= WHOLE_MAX_BYTES {
                    assert!(
                        (0..cut.fragments).all(|f| cut.place(f).1 <= FRAGMENT_BYTES),
                        "{cut:?}"
                    );
                } else {
                    // The rest travels unchecked, straight from the values.
                    assert_eq!(cut.fragments, 2, "{cut:?}");
                    assert_eq!((cut.head(0), cut.head(1)), (CHECK_BYTES, 0), "{cut:?}");
                }
            }
        }
    }
}
