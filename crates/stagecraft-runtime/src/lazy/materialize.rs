//! Materialization: claim the ops of a trace, take its executable from
//! the cache (or compile it), run it, and store every produced value in
//! its op.
//!
//! Threads materialize at the same time; what keeps a shared op from
//! running twice is its claim (see [`super::op`]). A trace claims its ops
//! in address order and waits for an op another trace holds only while
//! every op it holds comes earlier in that order. Two traces therefore
//! never wait for each other in a cycle, and the one holding the op that
//! comes latest always proceeds. Once the awaited op has run, the waiter
//! collects again: the op is now a leaf whose value it reads.

use super::cache::lookup_or_compile;
use super::collect::{collect, collect_claiming, Collected};
use super::metrics::{
    count_bytes_to_host, count_collection, count_execution, count_materialization, count_step,
    Trigger,
};
use super::op::{ClaimOutcome, LazyOp, Outputs, TraceId};
use super::record::live_roots;
use crate::device::Device;
use crate::handle::TensorHandle;
use crate::profile;
use stagecraft_tensor::{Error, Result};
use std::sync::Arc;
use std::time::Instant;

/// A requested output: an op and the index of one of its outputs.
pub(super) type Root = (Arc<LazyOp>, u32);

/// What [`claim`] achieved.
pub(super) enum Claim {
    /// Every op of the collected trace is claimed by the caller.
    Ready(Collected),
    /// Every root ran in another trace meanwhile.
    NothingToRun,
    /// Collecting failed (an input's trace failed): the caller holds no
    /// claim.
    Failed(Error),
}

fn address(op: &Arc<LazyOp>) -> usize {
    Arc::as_ptr(op) as usize
}

/// Collects the trace computing `roots` and claims all its ops for
/// `trace`, dropping the roots that have run meanwhile.
pub(super) fn claim(roots: &mut Vec<Root>, trace: TraceId) -> Claim {
    // Ops this trace holds, from this attempt and earlier ones.
    let mut held: Vec<Arc<LazyOp>> = Vec::new();
    let release = |held: &mut Vec<Arc<LazyOp>>| {
        for op in held.drain(..) {
            op.unclaim(trace);
        }
    };
    loop {
        roots.retain(|(op, _)| !op.is_done());
        if roots.is_empty() {
            release(&mut held);
            return Claim::NothingToRun;
        }
        // The first attempt claims as it collects, which costs no extra
        // lock per op; if another trace holds one of the ops, it has given
        // its claims back, and the ordered claim below takes over.
        let first_attempt = held.is_empty();
        let collected = if first_attempt {
            collect_claiming(roots, trace)
        } else {
            collect(roots)
        };
        let collected = match collected {
            Ok(c) => c,
            Err(e) => {
                release(&mut held);
                return Claim::Failed(e);
            }
        };
        if collected.ops.is_empty() {
            // The roots ran elsewhere while this trace was being collected.
            continue;
        }
        if collected.claimed_all {
            return Claim::Ready(collected);
        }
        let mut order: Vec<&Arc<LazyOp>> = collected.ops.iter().collect();
        order.sort_unstable_by_key(|op| address(op));
        let mut all_claimed = true;
        for op in order {
            match op.try_claim(trace) {
                ClaimOutcome::Taken => held.push(op.clone()),
                ClaimOutcome::AlreadyHeld => {}
                ClaimOutcome::Done => {
                    // Another trace ran it since it was collected.
                    all_claimed = false;
                    break;
                }
                ClaimOutcome::Busy => {
                    // Holding an op later in the order than the awaited one
                    // could close a cycle of waits: give such claims back.
                    if held.iter().any(|h| address(h) > address(op)) {
                        release(&mut held);
                    }
                    op.wait_while_claimed_by_other(trace);
                    all_claimed = false;
                    break;
                }
            }
        }
        if all_claimed {
            if held.len() > collected.ops.len() {
                // Ops held from an earlier attempt that other traces' work
                // has since cut off from the roots.
                let needed: std::collections::HashSet<usize> =
                    collected.ops.iter().map(address).collect();
                for op in held.iter().filter(|h| !needed.contains(&address(h))) {
                    op.unclaim(trace);
                }
            }
            return Claim::Ready(collected);
        }
    }
}

/// Stores `error` as every output of the ops `trace` may finish.
fn fail(trace: TraceId, ops: &[Arc<LazyOp>], error: &Error) {
    for op in ops {
        let outputs: Outputs = op
            .outputs
            .iter()
            .map(|_| Some(Err(error.clone())))
            .collect();
        op.finish(trace, outputs);
    }
}

/// Runs a claimed trace and stores what it produced (or its error) in its
/// ops, which ends their claims.
fn run_claimed(trace: TraceId, collected: Collected, trigger: Trigger, start: Instant) {
    let compiled = lookup_or_compile(&collected);
    // Building the trace counts as compile time even on a hit.
    count_materialization(trigger, start.elapsed());
    let (exe, args) = match compiled {
        Ok(c) => c,
        Err(e) => return fail(trace, &collected.ops, &e),
    };
    let start = Instant::now();
    // The executable may come from the cache, compiled for a recording made
    // from other source lines: errors must name this recording's.
    let results = exe.run_recorded(args, &collected.locations);
    count_execution(start.elapsed());
    let results = match results {
        Ok(r) => r,
        Err(e) => return fail(trace, &collected.ops, &e),
    };
    // One output per op is the common case: built inline, without a
    // `collect` per op (a profile of a cached 1,000-op step).
    let mut produced: Vec<Outputs> = collected
        .ops
        .iter()
        .map(|op| match op.outputs.len() {
            1 => smallvec::smallvec![None],
            n => (0..n).map(|_| None).collect(),
        })
        .collect();
    for (&(pos, index), value) in collected.outputs.iter().zip(results) {
        produced[pos][index as usize] = Some(Ok(value));
    }
    // Readers before the ops they read (reverse post-order): an output
    // the trace did not return (`None`) belongs to an op whose readers in
    // the trace are all done by then, so a thread collecting at this
    // moment never takes it for a leaf.
    for (op, values) in collected.ops.iter().zip(produced).rev() {
        op.finish(trace, values);
    }
}

/// Runs the trace computing `roots` (all on one target device), unless
/// other traces ran them meanwhile. Afterwards every root has run, except
/// one another trace holds when this trace's collection failed.
fn materialize(mut roots: Vec<Root>, trigger: Trigger) {
    let trace = TraceId::next();
    let start = Instant::now();
    let span = profile::begin();
    let claimed = claim(&mut roots, trace);
    count_collection(start.elapsed());
    match claimed {
        Claim::NothingToRun => return,
        Claim::Failed(error) => {
            let ops: Vec<Arc<LazyOp>> = roots.iter().map(|(op, _)| op.clone()).collect();
            fail(trace, &ops, &error);
        }
        Claim::Ready(collected) => run_claimed(trace, collected, trigger, start),
    }
    if let Some(span) = span {
        span.end(
            profile::MATERIALIZE,
            "materialize",
            vec![("trigger", format!("{trigger:?}"))],
        );
    }
}

/// Gives a lazy handle its value, running a trace if its op has not run
/// (or waiting for the trace of another thread that is running it).
pub(crate) fn materialize_handle(handle: &TensorHandle, trigger: Trigger) {
    let Some(lazy) = handle.lazy_ref() else {
        return;
    };
    let (op, index) = (lazy.op.clone(), lazy.index);
    let value: Result<_> = loop {
        if let Some(value) = op.output(index) {
            break value;
        }
        materialize(vec![(op.clone(), index)], trigger);
        // Still claimed only if this thread's collection failed while
        // another thread's trace held the op: that trace decides.
        op.wait_until_unclaimed();
    };
    if let Ok(v) = &value {
        if matches!(trigger, Trigger::ValueRead | Trigger::HostControlFlow) {
            let bytes = v.metadata().shape.numel() * v.metadata().dtype.size_in_bytes();
            count_bytes_to_host(bytes as u64);
        }
    }
    handle.fill_lazy(value);
}

/// Materializes this thread's live pending tensors: one trace per target
/// device.
pub(super) fn materialize_live(trigger: Trigger) {
    let roots = live_roots(true);
    let mut targets: Vec<Device> = Vec::new();
    for (op, _) in &roots {
        if !targets.contains(&op.target) {
            targets.push(op.target);
        }
    }
    for target in targets {
        let for_target: Vec<Root> = roots
            .iter()
            .filter(|(op, _)| op.target == target)
            .cloned()
            .collect();
        materialize(for_target, trigger);
    }
}

/// The end-of-step barrier: materializes every live lazy tensor this thread
/// recorded with one trace (per target device), together with the pending
/// work of any thread they depend on. Call it once per training step, so
/// each step is the same trace and hits the cache. Other threads' pending
/// tensors wait for their own `mark_step` (or a read), so one thread's
/// failing step cannot fail another's; threads' steps run at the same
/// time, and work two of them share runs once.
pub fn mark_step() {
    materialize_live(Trigger::MarkStep);
    count_step();
}

#[cfg(test)]
mod tests {
    use super::super::op::State;
    use super::super::tests::{binary, lazy_device, scalar, unary, values};
    use super::*;

    fn root(h: &TensorHandle) -> Root {
        let r = h.lazy_ref().unwrap();
        (r.op.clone(), r.index)
    }

    #[test]
    fn claiming_takes_every_op_of_the_trace() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let y = binary(&stagecraft_ops::ADD, &w, &w);
        let trace = TraceId::next();
        let Claim::Ready(collected) = claim(&mut vec![root(&y)], trace) else {
            panic!("nothing else holds these ops");
        };
        assert_eq!(collected.ops.len(), 2);
        for op in &collected.ops {
            assert!(matches!(op.lock().state, State::Claimed(_, t) if t == trace));
        }
        run_claimed(trace, collected, Trigger::ValueRead, Instant::now());
        assert_eq!(values(&y), [-2.0]);
        assert_eq!(values(&w), [-1.0]);
    }

    /// Another trace holds an op this one needs: this one waits, and once
    /// that trace has run, reads the op's value instead of running it
    /// again (the op's output is a leaf of the second trace).
    #[test]
    fn a_trace_waits_for_a_shared_op_and_reads_its_value() {
        let d = lazy_device();
        let shared = unary(&stagecraft_ops::NEG, &scalar(3.0, d));
        let mine = unary(&stagecraft_ops::EXP, &shared);
        let other = TraceId::next();
        assert_eq!(root(&shared).0.try_claim(other), ClaimOutcome::Taken);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| values(&mine));
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(!waiting.is_finished(), "waits for the claim");
            // The other trace runs `shared` alone.
            let Claim::Ready(collected) = claim(&mut vec![root(&shared)], other) else {
                panic!("the other trace holds its op");
            };
            assert_eq!(collected.ops.len(), 1);
            run_claimed(other, collected, Trigger::ValueRead, Instant::now());
            assert_eq!(waiting.join().unwrap(), [(-3.0f32).exp()]);
        });
        // `mine`'s trace had `shared` as a leaf: it did not run it again.
        assert!(matches!(root(&shared).0.lock().state, State::Done(_)));
    }

    /// When the trace holding a shared op fails, a trace waiting for it
    /// gets the same error instead of running the op again.
    #[test]
    fn a_waiting_trace_sees_the_failure_of_the_trace_it_waited_for() {
        let d = lazy_device();
        let shared = unary(&stagecraft_ops::NEG, &scalar(3.0, d));
        let mine = unary(&stagecraft_ops::EXP, &shared);
        let other = TraceId::next();
        root(&shared).0.try_claim(other);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| mine.wait().err().map(|e| e.to_string()));
            std::thread::sleep(std::time::Duration::from_millis(20));
            fail(
                other,
                &[root(&shared).0],
                &Error::invalid("the other trace failed"),
            );
            let err = waiting.join().unwrap().expect("an error");
            assert!(err.contains("the other trace failed"), "{err}");
        });
    }

    /// Roots on two threads, each depending on both of two shared ops in
    /// opposite orders: however the claims interleave, both finish.
    #[test]
    fn crossing_traces_do_not_deadlock() {
        for _ in 0..20 {
            let d = lazy_device();
            let a = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
            let b = unary(&stagecraft_ops::EXP, &scalar(0.0, d));
            let ab = binary(&stagecraft_ops::SUB, &a, &b);
            let ba = binary(&stagecraft_ops::SUB, &b, &a);
            drop((a, b));
            let barrier = std::sync::Barrier::new(2);
            std::thread::scope(|s| {
                let t1 = s.spawn(|| {
                    barrier.wait();
                    values(&ab)
                });
                let t2 = s.spawn(|| {
                    barrier.wait();
                    values(&ba)
                });
                assert_eq!(t1.join().unwrap(), [-2.0]);
                assert_eq!(t2.join().unwrap(), [2.0]);
            });
        }
    }

    #[test]
    fn mark_step_runs_this_threads_live_tensors() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let y = unary(&stagecraft_ops::EXP, &w);
        mark_step();
        assert!(root(&w).0.is_done() && root(&y).0.is_done());
        assert_eq!(values(&w), [-1.0]);
        assert_eq!(values(&y), [(-1.0f32).exp()]);
    }
}
