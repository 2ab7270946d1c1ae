//! Reverse-mode automatic differentiation.
//!
//! Ops on tensors that depend on a tensor marked with
//! [`Tensor::requires_grad`] are recorded on a per-thread tape. `backward`
//! walks the tape in reverse, calls each op's gradient rule (defined next to
//! the op in `stagecraft-ops`) and accumulates the gradients. Gradient ops
//! are ordinary ops run through the core runtime, so they run eagerly on
//! the CPU, are recorded into the same trace as the forward pass on a lazy
//! device, and are themselves recorded on enclosing tapes, which is what
//! makes [`grad`] compose into higher derivatives.
//!
//! A tape is consumed by `backward`: afterwards nothing is tracked, so a
//! parameter update `w - lr * g` is not recorded; mark the new parameters
//! with `requires_grad()` for the next step.

use crate::{Error, Tensor};
use smallvec::SmallVec;
use stagecraft_ops::{FrozenOpAttrs, GradBuilder, GradContext, OpAttrs, OpDef, G};
use stagecraft_runtime::{Args, Results, TensorHandle};
use stagecraft_tensor::{
    FloatElement, HostTensor, Location, Result, Scalar, ScalarHostTensor, TensorMetadata,
};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

struct Entry {
    def: &'static OpDef,
    attrs: FrozenOpAttrs,
    location: Location,
    inputs: SmallVec<[TensorHandle; 4]>,
    outputs: SmallVec<[TensorHandle; 1]>,
}

#[derive(Default)]
struct Tape {
    /// Addresses of tracked handles (variables and what depends on them);
    /// `keep` and the entries hold those handles, so addresses stay unique.
    tracked: HashSet<usize>,
    keep: Vec<TensorHandle>,
    entries: Vec<Entry>,
}

thread_local! {
    static TAPES: RefCell<Vec<Tape>> = RefCell::new(vec![Tape::default()]);
}

/// True when some tape on this thread tracks a tensor (the fast check on
/// every op).
pub(crate) fn is_recording() -> bool {
    TAPES.with(|t| t.borrow().iter().any(|tape| !tape.tracked.is_empty()))
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
        tapes
            .borrow()
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
        op,
        device,
        location,
        full_args.clone(),
        (&form.attrs).into(),
    );
    record(op, &form.attrs, location, &full_args, &results);
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
            }
        }
    });
}

fn track_on_top(handle: &TensorHandle) {
    TAPES.with(|tapes| {
        let mut tapes = tapes.borrow_mut();
        let tape = tapes.last_mut().expect("the base tape always exists");
        if tape.tracked.insert(handle.addr()) {
            tape.keep.push(handle.clone());
        }
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

/// Runs gradient rules by executing their ops through the core runtime.
struct Builder {
    values: Vec<TensorHandle>,
    location: Location,
}

impl Builder {
    fn push(&mut self, h: TensorHandle) -> G {
        self.values.push(h);
        G((self.values.len() - 1) as u32)
    }

    fn handle(&self, g: G) -> &TensorHandle {
        &self.values[g.0 as usize]
    }
}

impl GradBuilder for Builder {
    fn op(&mut self, def: &'static OpDef, inputs: &[G], attrs: &OpAttrs) -> Result<G> {
        let args: Args = inputs.iter().map(|g| self.handle(*g).clone()).collect();
        let out = crate::tensor::run_handle(def, args, attrs, self.location);
        Ok(self.push(out))
    }

    fn op_multi(
        &mut self,
        def: &'static OpDef,
        inputs: &[G],
        attrs: &OpAttrs,
    ) -> Result<SmallVec<[G; 4]>> {
        let args: Args = inputs.iter().map(|g| self.handle(*g).clone()).collect();
        let outs = crate::tensor::run_handles(def, args, attrs, self.location);
        if let Some(e) = outs.first().and_then(|h| h.resolved_error()) {
            return Err(e.clone());
        }
        Ok(outs.into_iter().map(|h| self.push(h)).collect())
    }

    fn meta(&self, value: G) -> TensorMetadata {
        self.handle(value).metadata().clone()
    }

    fn fill(&mut self, value: f64, meta: &TensorMetadata) -> Result<G> {
        let device = self
            .values
            .first()
            .map(|h| h.device())
            .unwrap_or_else(|| stagecraft_runtime::place(&[]));
        let handle = TensorHandle::available(device, HostTensor::filled(Scalar::F64(value), meta));
        Ok(self.push(handle))
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
        let mut b = Builder {
            values: Vec::new(),
            location: entry.location,
        };
        let inputs: SmallVec<[G; 4]> = entry.inputs.iter().map(|h| b.push(h.clone())).collect();
        let outputs: SmallVec<[G; 1]> = entry.outputs.iter().map(|h| b.push(h.clone())).collect();
        let flowing: SmallVec<[Option<G>; 1]> =
            incoming.into_iter().map(|g| g.map(|h| b.push(h))).collect();
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
            let g = b.handle(g).clone();
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
    /// Marks this tensor as a variable: ops that depend on it are recorded,
    /// and `backward` computes the gradient with respect to it. Returns the
    /// same tensor.
    pub fn requires_grad(&self) -> Tensor<T> {
        track_on_top(&self.handle);
        self.clone()
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
            let x_var = x_var.requires_grad();
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
