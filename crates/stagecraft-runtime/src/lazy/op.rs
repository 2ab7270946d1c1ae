//! A recorded op, its life from pending to done, and the claims that let
//! several threads materialize traces at once while each op runs once.
//!
//! An op is `Pending` when recorded, `Claimed` by the one trace that has
//! promised to run it, and `Done` when that trace stored its outputs (or
//! its error). Only the claiming trace moves a claimed op on: to `Done`,
//! or back to `Pending` if it no longer needs it. A trace that finds an op
//! claimed by another waits for that claim to end (see
//! `materialize::claim`), so an op shared by two threads' traces runs in
//! one of them and the other reads its value.

use crate::device::Device;
use crate::handle::TensorHandle;
use smallvec::SmallVec;
use stagecraft_ops::{FrozenOpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{Location, Result, TensorValue};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One input of a recorded op.
pub(super) enum Input {
    /// Output `index` of another recorded op.
    Op(Arc<LazyOp>, u32),
    /// An available value; `handle` gives it an identity, so one tensor
    /// used twice is one trace argument.
    Concrete { handle: TensorHandle },
}

/// Inputs of an op that has not run.
pub(super) type Inputs = SmallVec<[Input; 4]>;

/// Outputs of an op that ran: each value (`None` for an output nobody
/// could read any more), or the trace's error.
pub(super) type Outputs = SmallVec<[Option<Result<TensorValue>>; 1]>;

/// Identifies one materialization, the owner of the ops it claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TraceId(u64);

impl TraceId {
    /// A fresh id, never equal to another.
    pub(super) fn next() -> TraceId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TraceId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

pub(super) enum State {
    /// Recorded; no trace has claimed it yet.
    Pending(Inputs),
    /// Recorded and claimed: only this trace runs it.
    Claimed(Inputs, TraceId),
    /// Ran in a trace.
    Done(Outputs),
}

impl State {
    /// The inputs of an op that has not run.
    pub(super) fn inputs(&self) -> Option<&Inputs> {
        match self {
            State::Pending(inputs) | State::Claimed(inputs, _) => Some(inputs),
            State::Done(_) => None,
        }
    }
}

/// The state, and whether a thread waits for it to change (so finishing
/// an op nobody waits for makes no wake-up call).
pub(super) struct Slot {
    pub(super) state: State,
    watched: bool,
}

impl Slot {
    /// Claims the op for `trace` if it is pending (the caller holds the
    /// op's lock).
    pub(super) fn claim(&mut self, trace: TraceId) -> ClaimOutcome {
        match &mut self.state {
            State::Pending(inputs) => {
                let inputs = std::mem::take(inputs);
                self.state = State::Claimed(inputs, trace);
                ClaimOutcome::Taken
            }
            State::Claimed(_, owner) if *owner == trace => ClaimOutcome::AlreadyHeld,
            State::Claimed(..) => ClaimOutcome::Busy,
            State::Done(_) => ClaimOutcome::Done,
        }
    }
}

/// What [`LazyOp::try_claim`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ClaimOutcome {
    /// The op was pending and is now claimed by the caller.
    Taken,
    /// The caller already held the claim.
    AlreadyHeld,
    /// Another trace holds the claim.
    Busy,
    /// The op has run.
    Done,
}

thread_local! {
    /// The number the next op recorded on this thread gets.
    static RECORDING_NUMBER: Cell<u64> = const { Cell::new(0) };
}

fn next_recording_number() -> u64 {
    RECORDING_NUMBER.with(|n| {
        let number = n.get();
        n.set(number + 1);
        number
    })
}

/// A recorded op.
pub(crate) struct LazyOp {
    pub(super) def: &'static OpDef,
    pub(super) attrs: FrozenOpAttrs,
    pub(super) location: Location,
    pub(super) outputs: OutputMetas,
    /// The number of (`def`, `attrs`, `outputs`): see `signature`.
    pub(super) signature: u32,
    /// When the op was recorded, counted per recording thread: a trace
    /// runs its ops in this order where their dependencies allow
    /// (`cache::build_function`).
    pub(super) recorded_at: u64,
    pub(super) target: Device,
    /// Set once the op is `Done`, so asking costs a load, not a lock.
    done: AtomicBool,
    /// Live user handles per output.
    pub(super) live: SmallVec<[AtomicU32; 1]>,
    /// Pending recorded ops reading each output.
    pub(super) uses: SmallVec<[AtomicU32; 1]>,
    slot: Mutex<Slot>,
    /// Signalled when a watched op's claim ends.
    settled: Condvar,
}

impl LazyOp {
    /// A pending op; its output counters start at zero.
    pub(super) fn new(
        def: &'static OpDef,
        attrs: FrozenOpAttrs,
        location: Location,
        outputs: OutputMetas,
        target: Device,
        inputs: Inputs,
    ) -> LazyOp {
        let n = outputs.len();
        let signature = super::signature::signature(def, &attrs, &outputs);
        LazyOp {
            def,
            attrs,
            location,
            outputs,
            signature,
            recorded_at: next_recording_number(),
            target,
            done: AtomicBool::new(false),
            live: zeroed_counters(n),
            uses: zeroed_counters(n),
            slot: Mutex::new(Slot {
                state: State::Pending(inputs),
                watched: false,
            }),
            settled: Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True once a trace ran the op. Acquire pairs with the release in
    /// [`finish`](Self::finish): whoever sees the flag sees the outputs.
    pub(super) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Whether a user handle still refers to output `index`. Acquire pairs
    /// with the release in [`LazyRef::release`]: a thread that records a
    /// reader of the output and then drops its handle has its reader's
    /// [`uses`](Self::uses) increment visible to whoever sees the drop, so
    /// a collector never drops an output that some pending op still reads.
    pub(super) fn is_live(&self, index: u32) -> bool {
        self.live[index as usize].load(Ordering::Acquire) > 0
    }

    /// Claims the op for `trace` if it is pending.
    pub(super) fn try_claim(&self, trace: TraceId) -> ClaimOutcome {
        self.lock().claim(trace)
    }

    /// Gives back `trace`'s claim, leaving the op pending (no-op for an op
    /// `trace` does not hold).
    pub(super) fn unclaim(&self, trace: TraceId) {
        let mut slot = self.lock();
        if let State::Claimed(inputs, owner) = &mut slot.state {
            if *owner == trace {
                let inputs = std::mem::take(inputs);
                slot.state = State::Pending(inputs);
                self.wake(&mut slot);
            }
        }
    }

    /// Stores the op's outputs, if it is pending or claimed by `trace`;
    /// an op another trace claimed is left to that trace. Returns whether
    /// the outputs were stored.
    pub(super) fn finish(&self, trace: TraceId, outputs: Outputs) -> bool {
        let mut slot = self.lock();
        match &slot.state {
            State::Pending(inputs) => release_inputs(inputs),
            State::Claimed(inputs, owner) if *owner == trace => release_inputs(inputs),
            State::Claimed(..) | State::Done(_) => return false,
        }
        slot.state = State::Done(outputs);
        self.done.store(true, Ordering::Release);
        self.wake(&mut slot);
        true
    }

    /// Blocks while a trace other than `me` holds the claim.
    pub(super) fn wait_while_claimed_by_other(&self, me: TraceId) {
        self.wait_while_claimed(|owner| owner != me);
    }

    /// Blocks while any trace holds the claim.
    pub(super) fn wait_until_unclaimed(&self) {
        self.wait_while_claimed(|_| true);
    }

    fn wait_while_claimed(&self, by: impl Fn(TraceId) -> bool) {
        let mut slot = self.lock();
        while matches!(slot.state, State::Claimed(_, owner) if by(owner)) {
            slot.watched = true;
            slot = self.settled.wait(slot).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wake(&self, slot: &mut Slot) {
        if std::mem::take(&mut slot.watched) {
            self.settled.notify_all();
        }
    }

    /// The stored value of output `index`, once the op is done.
    pub(super) fn output(&self, index: u32) -> Option<Result<TensorValue>> {
        match &self.lock().state {
            State::Done(values) => Some(
                values
                    .get(index as usize)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| {
                        Err(stagecraft_tensor::Error::internal(
                            "a materialized lazy value was dropped",
                        ))
                    }),
            ),
            _ => None,
        }
    }
}

/// `n` counters at zero. Most ops have one output: that case is built
/// inline, without the iterator and growth checks of a `collect`, which
/// showed up in a profile of recording one op.
fn zeroed_counters(n: usize) -> SmallVec<[AtomicU32; 1]> {
    if n == 1 {
        SmallVec::from_buf([AtomicU32::new(0)])
    } else {
        (0..n).map(|_| AtomicU32::new(0)).collect()
    }
}

/// An op that ran no longer reads its inputs: they may stop being outputs
/// of later traces.
fn release_inputs(inputs: &Inputs) {
    for input in inputs {
        if let Input::Op(op, index) = input {
            op.uses[*index as usize].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for LazyOp {
    fn drop(&mut self) {
        // The last owner: no lock to take.
        let slot = self.slot.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(inputs) = slot.state.inputs() {
            release_inputs(inputs);
        }
    }
}

/// A user handle's link to the recorded op output it stands for.
pub(crate) struct LazyRef {
    pub(super) op: Arc<LazyOp>,
    pub(super) index: u32,
}

impl LazyRef {
    pub(crate) fn retain(&self) {
        self.op.live[self.index as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Release ordering: see [`LazyOp::is_live`].
    pub(crate) fn release(&self) {
        self.op.live[self.index as usize].fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::{DType, TensorMetadata};

    /// A pending `Neg` of a concrete [2] f32, with no user handle.
    fn pending_op() -> Arc<LazyOp> {
        let cpu = Device::cpu();
        let meta = TensorMetadata::new(DType::F32, [2]);
        let value = stagecraft_tensor::DenseHostTensor::from_slice(&[1.0f32, 2.0], [2])
            .unwrap()
            .into();
        let input = Input::Concrete {
            handle: TensorHandle::available(cpu, value),
        };
        Arc::new(LazyOp::new(
            &stagecraft_ops::NEG,
            OpAttrs::new().freeze(),
            Location::caller(),
            smallvec::smallvec![meta],
            cpu,
            smallvec::smallvec![input],
        ))
    }

    #[test]
    fn one_trace_claims_an_op_and_only_it_finishes_it() {
        let op = pending_op();
        let (a, b) = (TraceId::next(), TraceId::next());
        assert_ne!(a, b);
        assert_eq!(op.try_claim(a), ClaimOutcome::Taken);
        assert_eq!(op.try_claim(a), ClaimOutcome::AlreadyHeld);
        assert_eq!(op.try_claim(b), ClaimOutcome::Busy);
        assert!(!op.finish(b, smallvec::smallvec![None]), "b holds no claim");
        op.unclaim(b);
        assert_eq!(
            op.try_claim(b),
            ClaimOutcome::Busy,
            "b cannot unclaim a's op"
        );
        assert!(op.finish(a, smallvec::smallvec![None]));
        assert_eq!(op.try_claim(b), ClaimOutcome::Done);
        assert!(!op.finish(a, smallvec::smallvec![None]), "done once");
    }

    #[test]
    fn an_unclaimed_op_is_pending_again() {
        let op = pending_op();
        let (a, b) = (TraceId::next(), TraceId::next());
        op.try_claim(a);
        op.unclaim(a);
        assert!(matches!(op.lock().state, State::Pending(_)));
        assert_eq!(op.try_claim(b), ClaimOutcome::Taken);
    }

    /// A waiter blocks until the claim ends, and then sees the value.
    #[test]
    fn a_waiter_wakes_when_the_claiming_trace_finishes() {
        let op = pending_op();
        let (owner, waiter) = (TraceId::next(), TraceId::next());
        op.try_claim(owner);
        let value = || {
            Some(Ok(TensorValue::Host(
                stagecraft_tensor::DenseHostTensor::from_slice(&[-1.0f32, -2.0], [2])
                    .unwrap()
                    .into(),
            )))
        };
        std::thread::scope(|s| {
            let waiting = s.spawn(|| {
                op.wait_while_claimed_by_other(waiter);
                op.output(0)
            });
            // Give the waiter time to block; the result is the same either way.
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(!waiting.is_finished(), "the claim is still held");
            op.finish(owner, smallvec::smallvec![value()]);
            let TensorValue::Host(got) = waiting.join().unwrap().expect("done").unwrap() else {
                panic!("a host value was stored");
            };
            assert_eq!(
                got.to_dense().unwrap().to_vec::<f32>().unwrap(),
                [-1.0, -2.0]
            );
        });
    }

    #[test]
    fn running_an_op_stops_counting_it_as_a_reader_of_its_inputs() {
        let producer = pending_op();
        let reader = Arc::new(LazyOp::new(
            &stagecraft_ops::NEG,
            OpAttrs::new().freeze(),
            Location::caller(),
            producer.outputs.clone(),
            Device::cpu(),
            smallvec::smallvec![Input::Op(producer.clone(), 0)],
        ));
        producer.uses[0].fetch_add(1, Ordering::Relaxed);
        let trace = TraceId::next();
        reader.try_claim(trace);
        reader.finish(trace, smallvec::smallvec![None]);
        assert_eq!(producer.uses[0].load(Ordering::Relaxed), 0);
    }
}
