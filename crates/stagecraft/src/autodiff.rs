//! Reverse-mode automatic differentiation.
//!
//! A tensor marked with [`Tensor::requires_grad`] (a parameter) keeps the
//! mark for good: ops that read it, and ops that depend on those, are
//! recorded on a per-thread tape. `backward` walks the tape in reverse,
//! calls each op's gradient rule (defined next to the op in
//! `stagecraft-ops`) and accumulates the gradients. Gradient ops are
//! ordinary ops run through the core runtime, so they run eagerly on the
//! CPU, are recorded into the same trace as the forward pass on a lazy
//! device, and are themselves recorded on enclosing tapes, which is what
//! makes [`grad`] compose into higher derivatives.
//!
//! A tape is consumed by `backward`; the next op that reads a parameter
//! starts a new one. Updates run under [`no_grad`] (optimizers do so
//! themselves), and [`Tensor::assign`] / [`Tensor::sub_assign`] put the new
//! value in place with the mark kept, as PyTorch's in-place updates do, so
//! a training loop marks its parameters once.
//!
//! Entries whose outputs nobody holds any more (a forward pass whose loss
//! was dropped without `backward`, an evaluation loop outside `no_grad`)
//! are swept from the tape as it grows, so it never keeps dead
//! activations alive.

use crate::{Error, Tensor};
use smallvec::SmallVec;
use stagecraft_ops::{FrozenOpAttrs, GradBuilder, GradContext, OpAttrs, OpDef, G};
use stagecraft_runtime::{Args, Results, TensorHandle};
use stagecraft_tensor::{
    Element, FloatElement, HostTensor, Location, Result, Scalar, ScalarHostTensor, TensorMetadata,
};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

struct Entry {
    def: &'static OpDef,
    attrs: FrozenOpAttrs,
    location: Location,
    inputs: SmallVec<[TensorHandle; 4]>,
    outputs: SmallVec<[TensorHandle; 1]>,
}

/// A tape is swept for dead entries when it reaches this many entries, and
/// then whenever it has doubled since the last sweep, so sweeping costs
/// O(1) per recorded op.
const FIRST_SWEEP: usize = 4096;

#[derive(Default)]
struct Tape {
    /// Addresses of tracked handles (variables and what depends on them);
    /// `keep` and the entries hold those handles, so addresses stay unique.
    tracked: HashSet<usize>,
    keep: Vec<TensorHandle>,
    entries: Vec<Entry>,
    /// The length at which the next sweep runs (0: [`FIRST_SWEEP`]).
    sweep_at: usize,
}

impl Tape {
    /// Tracks `handle` as a variable of this tape (no-op when tracked).
    fn track(&mut self, handle: &TensorHandle) {
        if self.tracked.insert(handle.addr()) {
            self.keep.push(handle.clone());
        }
    }

    /// Drops the entries no gradient can flow through any more: those
    /// whose outputs only the entry itself holds (no user value, no later
    /// entry reads them). Walking backwards and dropping as it goes frees
    /// a dead entry's inputs before their producers are looked at, so a
    /// whole dead chain goes in one pass. Variables only the tape holds go
    /// too. Addresses leave `tracked` exactly when their handle is freed,
    /// so a new tensor at a reused address is never taken for a tracked
    /// one.
    fn sweep(&mut self) {
        let mut kept = Vec::with_capacity(self.entries.len());
        while let Some(entry) = self.entries.pop() {
            if entry.outputs.iter().all(|o| o.ref_count() == 1) {
                for o in &entry.outputs {
                    self.tracked.remove(&o.addr());
                }
            } else {
                kept.push(entry);
            }
        }
        kept.reverse();
        self.entries = kept;
        let tracked = &mut self.tracked;
        self.keep.retain(|h| {
            let held_elsewhere = h.ref_count() > 1;
            if !held_elsewhere {
                tracked.remove(&h.addr());
            }
            held_elsewhere
        });
        self.sweep_at = (2 * self.entries.len()).max(FIRST_SWEEP);
    }
}

thread_local! {
    static TAPES: RefCell<Vec<Tape>> = RefCell::new(vec![Tape::default()]);
    /// How many [`no_grad`] scopes this thread is inside.
    static NO_GRAD_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// How many `backward`s this thread is inside: their gradient ops are
    /// recorded on the tapes that already track an argument (what higher
    /// derivatives need), but a parameter they read joins no tape, or
    /// every step would leave its backward pass on the next step's tape.
    static BACKWARD_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Counts one more scope in `depth` until dropped (also on panic).
struct Scope(&'static std::thread::LocalKey<Cell<u32>>);

impl Scope {
    fn enter(depth: &'static std::thread::LocalKey<Cell<u32>>) -> Scope {
        depth.with(|d| d.set(d.get() + 1));
        Scope(depth)
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        self.0.with(|d| d.set(d.get() - 1));
    }
}

/// Runs `f` with gradient recording off on this thread: ops inside are
/// not recorded, even on parameters, so their results have no history.
/// This is where parameter updates belong (optimizers use it), and where
/// evaluation runs without paying for a tape. Scopes nest; recording
/// resumes when the outermost one ends, also when `f` panics.
///
/// ```
/// use stagecraft::{no_grad, Device, Tensor};
/// let cpu = Device::cpu();
/// let mut w = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &cpu)?.requires_grad();
/// for _ in 0..3 {
///     let loss = (&w * &w).sum(&[0], false);
///     let g = loss.backward()?.get(&w).expect("w is a parameter");
///     no_grad(|| w.sub_assign(&(&g * 0.25)))?;
/// }
/// // Each step halves w (w - 0.25 * 2w), and w stays a parameter.
/// assert_eq!(w.to_vec()?, vec![0.125, 0.25]);
/// assert!(w.is_requires_grad());
/// # Ok::<(), stagecraft::Error>(())
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _scope = Scope::enter(&NO_GRAD_DEPTH);
    f()
}

/// False inside [`no_grad`]: whether ops on this thread are recorded for
/// autodiff.
pub fn is_grad_enabled() -> bool {
    NO_GRAD_DEPTH.with(|d| d.get() == 0)
}

/// True when an op on `args` must go through [`execute_recorded`]: grad
/// mode is on and an argument is a parameter or some tape tracks a tensor
/// (the fast check on every op).
pub(crate) fn is_recording(args: &[TensorHandle]) -> bool {
    recording_with(args.iter().any(TensorHandle::requires_grad))
}

/// [`is_recording`] for borrowed arguments.
pub(crate) fn is_recording_borrowed(args: &[&TensorHandle]) -> bool {
    recording_with(args.iter().any(|a| a.requires_grad()))
}

fn recording_with(parameter_among_args: bool) -> bool {
    is_grad_enabled()
        && (parameter_among_args
            || TAPES.with(|t| t.borrow().iter().any(|tape| !tape.tracked.is_empty())))
}

/// True when a tape on this thread tracks `handle`.
pub(crate) fn is_tracked(handle: &TensorHandle) -> bool {
    TAPES.with(|t| {
        t.borrow()
            .iter()
            .any(|tape| tape.tracked.contains(&handle.addr()))
    })
}

/// Executes `op` while some tape records: when a tape tracks one of its
/// arguments, it runs in its residual form if it has one (an `If` or
/// `While` that also returns what its gradient needs), is recorded, and
/// the caller gets the op's own outputs.
pub(crate) fn execute_recorded(
    op: &'static OpDef,
    device: stagecraft_runtime::Device,
    location: Location,
    args: Args,
    attrs: &OpAttrs,
) -> Results {
    let tracked = TAPES.with(|tapes| {
        let mut tapes = tapes.borrow_mut();
        // A parameter joins every tape, so a gradient taken inside `grad`
        // can itself be differentiated with respect to it.
        let joining = BACKWARD_DEPTH.with(|d| d.get() == 0);
        for param in args.iter().filter(|a| joining && a.requires_grad()) {
            for tape in tapes.iter_mut() {
                tape.track(param);
            }
        }
        tapes
            .iter()
            .any(|tape| args.iter().any(|a| tape.tracked.contains(&a.addr())))
    });
    if !tracked {
        return stagecraft_runtime::execute(op, device, location, args, attrs.into());
    }
    // An op whose residual form cannot be built (a branch with an op that
    // has no gradient rule) runs as it is; its gradient then reports the
    // problem, naming the op, if it is ever asked for.
    let form = stagecraft_ops::grad::residual_form(op, attrs)
        .ok()
        .flatten();
    let Some(form) = form else {
        let results = stagecraft_runtime::execute(op, device, location, args.clone(), attrs.into());
        record(op, attrs, location, &args, &results);
        return results;
    };
    let mut full_args = args;
    for meta in &form.extra_inputs {
        let zero = HostTensor::filled(Scalar::F64(0.0), meta);
        full_args.push(TensorHandle::available(device, zero));
    }
    let mut results = stagecraft_runtime::execute(
        form.op,
        device,
        location,
        full_args.clone(),
        (&form.attrs).into(),
    );
    record(form.op, &form.attrs, location, &full_args, &results);
    results.truncate(form.results);
    results
}

/// Records an op on every tape that tracks one of its arguments.
fn record(
    def: &'static OpDef,
    attrs: &OpAttrs,
    location: Location,
    args: &Args,
    results: &Results,
) {
    TAPES.with(|tapes| {
        for tape in tapes.borrow_mut().iter_mut() {
            if args.iter().any(|a| tape.tracked.contains(&a.addr())) {
                tape.tracked.extend(results.iter().map(|r| r.addr()));
                tape.entries.push(Entry {
                    def,
                    attrs: attrs.freeze(),
                    location,
                    inputs: args.iter().cloned().collect(),
                    outputs: results.iter().cloned().collect(),
                });
                if tape.entries.len() >= tape.sweep_at.max(FIRST_SWEEP) {
                    tape.sweep();
                }
            }
        }
    });
}

fn track_on_top(handle: &TensorHandle) {
    TAPES.with(|tapes| {
        let mut tapes = tapes.borrow_mut();
        let tape = tapes.last_mut().expect("the base tape always exists");
        tape.track(handle);
    });
}

/// Gradients computed by `backward`, looked up by the tensors they are
/// gradients of.
#[derive(Default)]
pub struct Gradients {
    by_tensor: HashMap<usize, TensorHandle>,
}

impl std::fmt::Debug for Gradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gradients({} tensors)", self.by_tensor.len())
    }
}

impl Gradients {
    /// The gradient of the loss with respect to `t`, if `t` was tracked and
    /// the loss depends on it.
    pub fn get<T: FloatElement>(&self, t: &Tensor<T>) -> Option<Tensor<T>> {
        self.by_tensor
            .get(&t.handle.addr())
            .and_then(|h| Tensor::try_from_handle(h.clone()).ok())
    }

    /// Sets the gradient of `t` to `grad`, replacing any it had: how
    /// gradients changed after `backward` (clipped by
    /// [`crate::clip_grad_norm`], accumulated over micro-batches) go back
    /// to an optimizer. Start from `Gradients::default()` to build a set
    /// by hand.
    pub fn insert<T: FloatElement>(&mut self, t: &Tensor<T>, grad: Tensor<T>) {
        self.by_tensor.insert(t.handle.addr(), grad.handle);
    }
}

/// Runs gradient rules by executing their ops through the core runtime,
/// each op when a gradient that is used needs it.
///
/// A rule builds the gradient of every input, but reverse mode keeps only
/// those of tracked inputs: the first layer's input gradient (a data batch,
/// often the largest product of a step), a frozen weight's, an index's.
/// Executed as the rule asked for them, those ops would run and be thrown
/// away; deferred, they never run. Lazy and staged modes drop them as dead
/// code; this is the same for eager mode.
struct Builder {
    values: RefCell<Vec<Value>>,
    location: Location,
}

/// A value of a rule: run, or an op to run when something needs it.
enum Value {
    Ready(TensorHandle),
    Deferred(Box<DeferredOp>),
}

/// An op of a rule, not run yet.
struct DeferredOp {
    def: &'static OpDef,
    inputs: SmallVec<[G; 4]>,
    attrs: OpAttrs,
}

impl Builder {
    fn new(location: Location) -> Builder {
        Builder {
            values: RefCell::new(Vec::new()),
            location,
        }
    }

    fn push(&self, value: Value) -> G {
        let mut values = self.values.borrow_mut();
        values.push(value);
        G((values.len() - 1) as u32)
    }

    fn ready(&self, h: TensorHandle) -> G {
        self.push(Value::Ready(h))
    }

    /// The handle of `g`, running the deferred ops it needs (each once,
    /// inputs before the ops that read them).
    fn handle(&self, g: G) -> TensorHandle {
        let index = g.0 as usize;
        let inputs = match &self.values.borrow()[index] {
            Value::Ready(h) => return h.clone(),
            Value::Deferred(op) => op.inputs.clone(),
        };
        let args: Args = inputs.iter().map(|g| self.handle(*g)).collect();
        // The inputs are ready now; the op's attributes are read in place.
        let out = match &self.values.borrow()[index] {
            Value::Ready(h) => h.clone(),
            Value::Deferred(op) => {
                crate::tensor::run_handle(op.def, args, &op.attrs, self.location)
            }
        };
        self.values.borrow_mut()[index] = Value::Ready(out.clone());
        out
    }

    /// The metadata of a deferred value from its op's shape function,
    /// without running it: rules read shapes of values they may not keep
    /// (to reduce a broadcast gradient to its input's shape). `None` for
    /// a value that is ready, a data-dependent shape, or a shape error,
    /// which running the op reports as it would have.
    fn deferred_meta(&self, value: G) -> Option<TensorMetadata> {
        let inputs = match &self.values.borrow()[value.0 as usize] {
            Value::Deferred(op) if op.def.shape_kind == stagecraft_ops::ShapeKind::Static => {
                op.inputs.clone()
            }
            _ => return None,
        };
        let metas: Vec<TensorMetadata> = inputs.iter().map(|g| self.meta(*g)).collect();
        match &self.values.borrow()[value.0 as usize] {
            Value::Deferred(op) => op.def.infer(&metas, &op.attrs).ok()?.into_iter().next(),
            Value::Ready(h) => Some(h.metadata().clone()),
        }
    }
}

impl GradBuilder for Builder {
    fn op(&mut self, def: &'static OpDef, inputs: &[G], attrs: &OpAttrs) -> Result<G> {
        Ok(self.push(Value::Deferred(Box::new(DeferredOp {
            def,
            inputs: inputs.iter().copied().collect(),
            attrs: attrs.clone(),
        }))))
    }

    fn op_multi(
        &mut self,
        def: &'static OpDef,
        inputs: &[G],
        attrs: &OpAttrs,
    ) -> Result<SmallVec<[G; 4]>> {
        // Control flow, run at once: its outputs are usually all needed.
        let args: Args = inputs.iter().map(|g| self.handle(*g)).collect();
        let outs = crate::tensor::run_handles(def, args, attrs, self.location);
        if let Some(e) = outs.first().and_then(|h| h.resolved_error()) {
            return Err(e.clone());
        }
        Ok(outs.into_iter().map(|h| self.ready(h)).collect())
    }

    fn meta(&self, value: G) -> TensorMetadata {
        self.deferred_meta(value)
            .unwrap_or_else(|| self.handle(value).metadata().clone())
    }

    fn fill(&mut self, value: f64, meta: &TensorMetadata) -> Result<G> {
        let device = match self.values.borrow().first() {
            Some(Value::Ready(h)) => h.device(),
            _ => stagecraft_runtime::place(&[]),
        };
        let handle = TensorHandle::available(device, HostTensor::filled(Scalar::F64(value), meta));
        Ok(self.ready(handle))
    }
}

fn add(a: &TensorHandle, b: &TensorHandle, location: Location) -> TensorHandle {
    let args: Args = [a.clone(), b.clone()].into_iter().collect();
    crate::tensor::run_handle(&stagecraft_ops::ADD, args, &OpAttrs::new(), location)
}

/// Called by [`Tensor::backward_watching`] with the index of a watched
/// tensor and its gradient, as soon as that gradient is final.
type OnFinal<'a> = &'a mut dyn FnMut(usize, &TensorHandle) -> Result<()>;

/// Reverse mode over the innermost tape that tracks `loss`; consumes it.
/// `watch` lists tensors whose final gradients go to `on_final` as soon
/// as reverse mode has passed every use of them.
fn backward_handle(
    loss: &TensorHandle,
    location: Location,
    watch: &[&TensorHandle],
    on_final: OnFinal<'_>,
) -> Result<Gradients> {
    if !loss.dtype().is_float() {
        return Err(Error::dtype(format!(
            "cannot differentiate a {} tensor: gradients need a floating-point loss",
            loss.dtype()
        ))
        .with_op("backward")
        .at(location));
    }
    loss.resolved_error().map_or(Ok(()), |e| Err(e.clone()))?;
    let tape = TAPES.with(|tapes| {
        let mut tapes = tapes.borrow_mut();
        let index = tapes
            .iter()
            .rposition(|t| t.tracked.contains(&loss.addr()))?;
        Some(std::mem::take(&mut tapes[index]))
    });
    let tape = tape.ok_or_else(|| {
        Error::invalid(
            "the loss does not depend on any tensor marked with requires_grad(): nothing to differentiate",
        )
        .with_op("backward")
        .at(location)
    })?;
    let _in_backward = Scope::enter(&BACKWARD_DEPTH);
    let mut grads: HashMap<usize, TensorHandle> = HashMap::new();
    let seed = ScalarHostTensor::new(
        Scalar::F64(1.0).cast(loss.dtype()),
        loss.metadata().shape.clone(),
    );
    grads.insert(
        loss.addr(),
        TensorHandle::available(loss.device(), HostTensor::Scalar(seed)),
    );
    // A tensor's gradient is final once reverse mode has run the rule of
    // the earliest entry that reads it: every contribution comes from an
    // entry that reads it. Watched tensors are announced right then.
    let mut finals_at: HashMap<usize, SmallVec<[usize; 2]>> = HashMap::new();
    if !watch.is_empty() {
        let wanted: HashMap<usize, usize> = watch
            .iter()
            .enumerate()
            .map(|(i, h)| (h.addr(), i))
            .collect();
        let mut seen = vec![false; watch.len()];
        for (at, entry) in tape.entries.iter().enumerate() {
            for input in &entry.inputs {
                if let Some(&i) = wanted.get(&input.addr()) {
                    if !std::mem::replace(&mut seen[i], true) {
                        finals_at.entry(at).or_default().push(i);
                    }
                }
            }
        }
    }
    for (at, entry) in tape.entries.iter().enumerate().rev() {
        let incoming: SmallVec<[Option<TensorHandle>; 1]> = entry
            .outputs
            .iter()
            .map(|o| grads.get(&o.addr()).cloned())
            .collect();
        if incoming.iter().all(Option::is_none) {
            announce(finals_at.get(&at), watch, &grads, on_final)?;
            continue;
        }
        let rule = entry.def.grad.ok_or_else(|| {
            Error::invalid(format!("{} has no gradient rule", entry.def.name))
                .with_op(entry.def.name)
                .at(entry.location)
        })?;
        let mut b = Builder::new(entry.location);
        let inputs: SmallVec<[G; 4]> = entry.inputs.iter().map(|h| b.ready(h.clone())).collect();
        let outputs: SmallVec<[G; 1]> = entry.outputs.iter().map(|h| b.ready(h.clone())).collect();
        let flowing: SmallVec<[Option<G>; 1]> = incoming
            .into_iter()
            .map(|g| g.map(|h| b.ready(h)))
            .collect();
        let ctx = GradContext {
            inputs: &inputs,
            outputs: &outputs,
            grads: &flowing,
            attrs: stagecraft_ops::Attrs::new(&entry.attrs, entry.def),
        };
        let input_grads =
            rule(&mut b, &ctx).map_err(|e| e.with_op(entry.def.name).at(entry.location))?;
        for (input, g) in entry.inputs.iter().zip(input_grads) {
            let Some(g) = g else { continue };
            if !tape.tracked.contains(&input.addr()) {
                continue;
            }
            let g = b.handle(g);
            let total = match grads.remove(&input.addr()) {
                Some(prev) => add(&prev, &g, entry.location),
                None => g,
            };
            grads.insert(input.addr(), total);
        }
        announce(finals_at.get(&at), watch, &grads, on_final)?;
    }
    for g in grads.values() {
        if let Some(e) = g.resolved_error() {
            return Err(e.clone());
        }
    }
    Ok(Gradients { by_tensor: grads })
}

/// Hands the watched tensors whose gradients just became final (those
/// with one) to `on_final`.
fn announce(
    indices: Option<&SmallVec<[usize; 2]>>,
    watch: &[&TensorHandle],
    grads: &HashMap<usize, TensorHandle>,
    on_final: OnFinal<'_>,
) -> Result<()> {
    for &i in indices.into_iter().flatten() {
        if let Some(g) = grads.get(&watch[i].addr()) {
            on_final(i, g)?;
        }
    }
    Ok(())
}

impl<T: FloatElement> Tensor<T> {
    /// Marks this tensor (and every clone of it) as a parameter: ops that
    /// depend on it are recorded, and `backward` computes the gradient with
    /// respect to it. The mark stays through `backward` and through
    /// [`Tensor::assign`], so it is set once, before training. Returns the
    /// same tensor.
    pub fn requires_grad(&self) -> Tensor<T> {
        self.handle.set_requires_grad(true);
        track_on_top(&self.handle);
        self.clone()
    }

    /// True when this tensor is marked with [`Tensor::requires_grad`].
    pub fn is_requires_grad(&self) -> bool {
        self.handle.requires_grad()
    }

    /// Clears the [`Tensor::requires_grad`] mark: ops on the tensor from
    /// now on are not recorded for it (freezing a parameter).
    pub fn clear_requires_grad(&self) {
        self.handle.set_requires_grad(false);
        TAPES.with(|tapes| {
            for tape in tapes.borrow_mut().iter_mut() {
                let before = tape.keep.len();
                tape.keep.retain(|h| !h.ptr_eq(&self.handle));
                if tape.keep.len() < before {
                    tape.tracked.remove(&self.handle.addr());
                }
            }
        });
    }

    /// `self -= rhs` in place: [`Tensor::assign`] of `self - rhs`, with the
    /// same rules (run it under [`no_grad`] on a parameter).
    #[track_caller]
    pub fn sub_assign(&mut self, rhs: &Tensor<T>) -> Result<()> {
        let location = Location::caller();
        let updated = self.binary::<T>(&stagecraft_ops::SUB, rhs, location);
        self.assign_at(updated, "sub_assign", location)
    }

    /// The gradients of this tensor (usually a scalar loss; otherwise the
    /// gradient of the sum of its elements) with respect to every tracked
    /// tensor it depends on. Consumes the tape.
    #[track_caller]
    pub fn backward(&self) -> Result<Gradients> {
        backward_handle(&self.handle, Location::caller(), &[], &mut |_, _| Ok(()))
    }

    /// [`backward`](Tensor::backward), calling `on_final(i, grad)` for
    /// `watch[i]` as soon as its gradient is final, while reverse mode goes
    /// on with the rest: what data-parallel training uses to start
    /// reducing a bucket of gradients before backward has finished. Each
    /// watched tensor with a gradient is announced once, in the order
    /// reverse mode completes them; an error from `on_final` stops
    /// backward and is returned.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let w1 = Tensor::<f32>::from_vec(vec![2.0], &[1], &cpu).unwrap().requires_grad();
    /// let w2 = Tensor::<f32>::from_vec(vec![3.0], &[1], &cpu).unwrap().requires_grad();
    /// let loss = (&(&w1 * &w1) * &w2).sum(&[], false);
    /// let mut order = Vec::new();
    /// loss.backward_watching(&[&w1, &w2], |i, g| {
    ///     order.push((i, g.to_vec().unwrap()[0]));
    ///     Ok(())
    /// })
    /// .unwrap();
    /// // w2 is read last, so its gradient (w1² = 4) is final first.
    /// assert_eq!(order, vec![(1, 4.0), (0, 12.0)]);
    /// ```
    #[track_caller]
    pub fn backward_watching(
        &self,
        watch: &[&Tensor<T>],
        mut on_final: impl FnMut(usize, Tensor<T>) -> Result<()>,
    ) -> Result<Gradients> {
        let handles: Vec<&TensorHandle> = watch.iter().map(|t| &t.handle).collect();
        backward_handle(&self.handle, Location::caller(), &handles, &mut |i, g| {
            on_final(i, Tensor::try_from_handle(g.clone())?)
        })
    }
}

/// Pushes a fresh tape for the duration of `f`, popping it even on panic.
fn with_tape<R>(f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            TAPES.with(|t| {
                t.borrow_mut().pop();
            });
        }
    }
    TAPES.with(|t| t.borrow_mut().push(Tape::default()));
    let _pop = Pop;
    f()
}

/// `value_and_grad(f)(x)` is `(f(x), ∇f(x))` for a function with a
/// one-element result. Composes with itself and with [`grad`].
///
/// Errors of ops inside `f` name their own lines; an error of the
/// differentiation itself names the line that called `value_and_grad`.
#[track_caller]
pub fn value_and_grad<T, F>(f: F) -> impl Fn(&Tensor<T>) -> (Tensor<T>, Tensor<T>)
where
    T: FloatElement,
    F: Fn(&Tensor<T>) -> Tensor<T>,
{
    // A closure cannot be `#[track_caller]`: inside it `Location::caller()`
    // would name this file, so the user's line is taken here, where the
    // function is built (in `grad(f)(x)`, the same line as the call).
    let location = Location::caller();
    move |x: &Tensor<T>| {
        with_tape(|| {
            // A fresh handle for x, so this tape tracks exactly this use.
            let x_var = crate::tensor::run::<T>(
                &stagecraft_ops::RESHAPE,
                [x.handle.clone()].into_iter().collect(),
                OpAttrs::new().set_dims("shape", x.dims()),
                location,
            );
            // Tracked here only, not marked: x_var is this call's own
            // variable, not a parameter of the model.
            track_on_top(&x_var.handle);
            let y = f(&x_var);
            let g = match backward_handle(&y.handle, location, &[], &mut |_, _| Ok(())) {
                Ok(grads) => grads
                    .get(&x_var)
                    .unwrap_or_else(|| Tensor::zeros(x.dims(), &x.device())),
                Err(e) => Tensor::error_at("grad", location, x.device(), x.dims(), e),
            };
            (y, g)
        })
    }
}

/// `grad(f)` is the function computing `∇f(x)` for `f` with a one-element
/// result. It composes: `grad(|x| grad(&f)(x).sum(&[0], false))` gives
/// second derivatives.
///
/// ```
/// use stagecraft::{grad, Device, Tensor};
/// let x = Tensor::<f64>::from_vec(vec![0.5, -1.0], &[2], &Device::cpu())?;
/// let d = grad(|x: &Tensor<f64>| (x * x * x).sum(&[0], false));
/// assert_eq!(d(&x).to_vec()?, vec![0.75, 3.0]); // 3x²
/// let dd = grad(|x: &Tensor<f64>| grad(|x: &Tensor<f64>| (x * x * x).sum(&[0], false))(x).sum(&[0], false));
/// assert_eq!(dd(&x).to_vec()?, vec![3.0, -6.0]); // 6x
/// # Ok::<(), stagecraft::Error>(())
/// ```
#[track_caller]
pub fn grad<T, F>(f: F) -> impl Fn(&Tensor<T>) -> Tensor<T>
where
    T: FloatElement,
    F: Fn(&Tensor<T>) -> Tensor<T>,
{
    let vg = value_and_grad(f);
    move |x: &Tensor<T>| vg(x).1
}

impl<T: Element> Tensor<T> {
    /// Puts `value` in place of this tensor, keeping what this tensor is:
    /// a parameter stays a parameter (as after an in-place update in
    /// PyTorch), so an update `w.assign(&w - &step)` under [`no_grad`]
    /// needs no new `requires_grad()`. Afterwards `self` and `value` are
    /// the same tensor.
    ///
    /// Errors, leaving `self` unchanged: `value` has another shape or is on
    /// another device, or `self` is a parameter and `value` carries
    /// recorded history (the update was computed outside `no_grad`, so the
    /// parameter would depend on itself).
    #[track_caller]
    pub fn assign(&mut self, value: Tensor<T>) -> Result<()> {
        self.assign_at(value, "assign", Location::caller())
    }

    fn assign_at(&mut self, value: Tensor<T>, op: &'static str, location: Location) -> Result<()> {
        let fail = |e: Error| Err(e.with_op(op).at(location));
        if value.dims() != self.dims() {
            return fail(Error::shape(format!(
                "cannot assign a tensor of shape {:?} to one of shape {:?}",
                value.dims(),
                self.dims()
            )));
        }
        if value.device() != self.device() {
            return fail(Error::invalid(format!(
                "cannot assign a tensor on {} to one on {}",
                value.device(),
                self.device()
            )));
        }
        let parameter = self.handle.requires_grad();
        if parameter && is_grad_enabled() && is_tracked(&value.handle) {
            return fail(Error::invalid(
                "the new value of a parameter was computed with gradients recorded, \
                 so the parameter would depend on its own old value; \
                 compute the update inside no_grad(|| ...)",
            ));
        }
        replace_keeping_mark(self, value);
        Ok(())
    }
}

/// `*slot = new`, with `new` marked [`Tensor::requires_grad`] when `slot`
/// was: how updates inside the crate (optimizer steps, loading weights,
/// broadcasting them) keep parameters parameters, once they have checked
/// shapes themselves.
pub(crate) fn replace_keeping_mark<T: Element>(slot: &mut Tensor<T>, new: Tensor<T>) {
    if slot.handle.requires_grad() {
        new.handle.set_requires_grad(true);
    }
    *slot = new;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn base_tape_len() -> (usize, usize) {
        TAPES.with(|t| {
            let tapes = t.borrow();
            (tapes[0].entries.len(), tapes[0].tracked.len())
        })
    }

    #[test]
    fn dropped_forward_passes_are_swept_from_the_tape() {
        // An evaluation loop on marked parameters outside no_grad records
        // every pass; with the outputs dropped, the sweeps must keep the
        // tape (and the activations it holds) from growing with the loop.
        let cpu = Device::cpu();
        let w = Tensor::<f32>::from_vec(vec![0.5; 64], &[8, 8], &cpu)
            .unwrap()
            .requires_grad();
        let x = Tensor::<f32>::ones(&[4, 8], &cpu);
        let mut longest = 0;
        for _ in 0..20_000 {
            let y = x.matmul(&w).relu().sum(&[], false);
            y.item().unwrap();
            longest = longest.max(base_tape_len().0);
        }
        // Three entries a pass: without sweeping, 60,000.
        assert!(longest <= FIRST_SWEEP, "the tape grew to {longest} entries");
        // What a live loss depends on survives a sweep: backward still
        // reaches the parameter.
        let keep = x.matmul(&w).sum(&[], false);
        for _ in 0..3 * FIRST_SWEEP {
            drop(x.matmul(&w));
        }
        let g = keep.backward().unwrap().get(&w).unwrap();
        assert_eq!(g.to_vec().unwrap(), vec![4.0; 64]);
        assert_eq!(base_tape_len(), (0, 0), "backward consumed the tape");
    }

    #[test]
    fn a_sweep_frees_chains_and_untracks_their_addresses() {
        let cpu = Device::cpu();
        let w = Tensor::<f32>::from_vec(vec![2.0], &[1], &cpu)
            .unwrap()
            .requires_grad();
        let kept = (&w * 3.0).exp();
        drop((&w * 4.0).exp().exp());
        TAPES.with(|t| {
            let mut tapes = t.borrow_mut();
            let tape = &mut tapes[0];
            assert_eq!(tape.entries.len(), 5);
            tape.sweep();
            // The dropped chain (three entries) went; the kept one stays,
            // and only live handles are tracked: w and kept's two values.
            assert_eq!(tape.entries.len(), 2);
            assert_eq!(tape.tracked.len(), 3);
        });
        let g = kept.backward().unwrap().get(&w).unwrap().to_vec().unwrap();
        assert!((g[0] - 3.0 * 6f32.exp()).abs() < 1e-2 * g[0], "{g:?}");
    }
}
