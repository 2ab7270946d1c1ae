//! Staged functions and functional control flow: [`function`], [`cond`] and
//! [`while_loop`]. Each traces Rust closures into graph functions of the
//! library and emits one op (`Call`, `If`, `While`) through the core
//! runtime, so it runs the same way on the eager device (the op executes),
//! on a lazy device (the op is recorded) and inside another traced function
//! (the op becomes a node).

use crate::{Error, Tensor};
use smallvec::SmallVec;
use stagecraft_graph::Function;
use stagecraft_ops::{FuncId, OpAttrs, OpDef};
use stagecraft_runtime::{self as runtime, tracing, Args, TensorHandle};
use stagecraft_tensor::{Element, Location, Result, TensorMetadata};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Mutex;

/// A tensor or a tuple of tensors: what staged closures take and return.
///
/// For a struct of tensors, `#[derive(stagecraft::TensorGroup)]` (with
/// `Clone`) lists its fields in order; it also makes the struct a valid
/// argument and result of `#[stage]` functions.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor or a group of tensors",
    label = "staged control flow (an `if`/`while` on a `Tensor<bool>`) can only carry tensors here",
    note = "every variable a staged `if`/`while` assigns (and the flag of a `break`/`continue` under it) becomes an input and output of an If/While op, so it must be a tensor, a tuple of them or a `#[derive(TensorGroup)]` struct",
    note = "to keep a host value, assign it outside the staged branch, or branch on a `bool` instead"
)]
pub trait TensorGroup: Clone {
    /// Appends the handles, in order.
    fn handles(&self, out: &mut Vec<TensorHandle>);
    /// A value of the same structure built from `handles` (in the order
    /// [`TensorGroup::handles`] lists them).
    fn rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self>;
}

impl<T: Element> TensorGroup for Tensor<T> {
    fn handles(&self, out: &mut Vec<TensorHandle>) {
        out.push(self.handle.clone());
    }

    fn rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
        let handle = handles
            .next()
            .ok_or_else(|| Error::internal("too few values to rebuild a staged result"))?;
        Tensor::try_from_handle(handle)
    }
}

impl<G: TensorGroup> TensorGroup for Vec<G> {
    fn handles(&self, out: &mut Vec<TensorHandle>) {
        self.iter().for_each(|g| g.handles(out));
    }

    fn rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
        self.iter().map(|g| g.rebuild(handles)).collect()
    }
}

/// No tensors: the value of a staged `if` used as a statement.
impl TensorGroup for () {
    fn handles(&self, _: &mut Vec<TensorHandle>) {}

    fn rebuild(&self, _: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
        Ok(())
    }
}

macro_rules! tuple_group {
    ($($name:ident . $index:tt),+) => {
        impl<$($name: TensorGroup),+> TensorGroup for ($($name,)+) {
            fn handles(&self, out: &mut Vec<TensorHandle>) {
                $(self.$index.handles(out);)+
            }

            fn rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
                Ok(($(self.$index.rebuild(handles)?,)+))
            }
        }
    };
}

tuple_group!(A.0);
tuple_group!(A.0, B.1);
tuple_group!(A.0, B.1, C.2);
tuple_group!(A.0, B.1, C.2, D.3);
tuple_group!(A.0, B.1, C.2, D.3, E.4);
tuple_group!(A.0, B.1, C.2, D.3, E.4, F.5);
tuple_group!(A.0, B.1, C.2, D.3, E.4, F.5, G.6);
tuple_group!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7);

fn handles_of<G: TensorGroup>(g: &G) -> Vec<TensorHandle> {
    let mut out = Vec::new();
    g.handles(&mut out);
    out
}

fn metas(handles: &[TensorHandle]) -> Vec<TensorMetadata> {
    handles.iter().map(|h| h.metadata().clone()).collect()
}

/// Closes a trace frame even if the closure panics.
struct FrameGuard(bool);

impl Drop for FrameGuard {
    fn drop(&mut self) {
        if !self.0 {
            tracing::abandon();
        }
    }
}

/// Traces `body` over symbolic parameters of the given metadata.
pub(crate) fn trace(
    name: &str,
    params: &[TensorMetadata],
    location: Location,
    body: impl FnOnce(Vec<TensorHandle>) -> Vec<TensorHandle>,
) -> Result<tracing::Traced> {
    let placeholders = tracing::begin_with(name, params, Some(crate::autodiff::is_tracked));
    let mut guard = FrameGuard(false);
    let results = body(placeholders);
    guard.0 = true;
    tracing::end(&results, location)
}

/// Runs a control-flow op and rebuilds `template`'s structure from its
/// first outputs; an op that failed fills every output with its error.
pub(crate) fn run_control<S: TensorGroup>(
    op: &'static OpDef,
    args: Args,
    attrs: &OpAttrs,
    location: Location,
    template: &S,
) -> S {
    let expected = handles_of(template);
    let device = runtime::place(&args);
    let results = if crate::autodiff::is_recording(&args) {
        crate::autodiff::execute_recorded(op, device, location, args, attrs)
    } else {
        runtime::execute(op, device, location, args, attrs.into())
    };
    let failed = results.first().and_then(|h| h.resolved_error().cloned());
    let handles: Vec<TensorHandle> = match failed {
        Some(err)
            if results.len() < expected.len()
                || results.iter().any(|h| h.resolved_error().is_some()) =>
        {
            expected
                .iter()
                .map(|h| TensorHandle::error(device, h.metadata().clone(), err.clone()))
                .collect()
        }
        _ => results.into_iter().collect(),
    };
    template
        .rebuild(&mut handles.into_iter())
        .unwrap_or_else(|e| error_group(template, device, e))
}

fn error_group<S: TensorGroup>(template: &S, device: runtime::Device, err: Error) -> S {
    let handles: Vec<TensorHandle> = handles_of(template)
        .iter()
        .map(|h| TensorHandle::error(device, h.metadata().clone(), err.clone()))
        .collect();
    template
        .rebuild(&mut handles.into_iter())
        .expect("an error group has the template's structure")
}

fn error_like<S: TensorGroup>(template: &S, err: Error, location: Location) -> S {
    let err = err.at(location);
    runtime::report_error(&err);
    error_group(template, runtime::place(&[]), err)
}

/// `cond(&pred, || a, || b)`: one `If` op whose branches are the two
/// closures traced into functions. Only the taken branch runs. Tensors the
/// closures capture become inputs of the op; the branches must return the
/// same number, dtypes and shapes of tensors, else the result holds an
/// error naming both branches' types and this call's source line.
///
/// ```
/// use stagecraft::{cond, Device, Tensor};
/// let cpu = Device::cpu();
/// let x = Tensor::<f32>::from_vec(vec![1.0, -2.0], &[2], &cpu)?;
/// let positive = x.sum(&[0], false).gt(&Tensor::scalar(0.0, &cpu));
/// let y = cond(&positive, || &x * 2.0, || -&x);
/// assert_eq!(y.to_vec()?, vec![-1.0, 2.0]);
/// # Ok::<(), stagecraft::Error>(())
/// ```
#[track_caller]
pub fn cond<S: TensorGroup>(
    pred: &Tensor<bool>,
    then_branch: impl FnOnce() -> S,
    else_branch: impl FnOnce() -> S,
) -> S {
    let location = Location::caller();
    let mut then_template = None;
    let then_traced = trace("then", &[], location, |_| {
        let s = then_branch();
        let h = handles_of(&s);
        then_template = Some(s);
        h
    });
    let mut else_template = None;
    let else_traced = trace("else", &[], location, |_| {
        let s = else_branch();
        let h = handles_of(&s);
        else_template = Some(s);
        h
    });
    let template = match then_template.or(else_template) {
        Some(t) => t,
        None => unreachable!("both closures ran"),
    };
    let (mut then_traced, mut else_traced) = match (then_traced, else_traced) {
        (Ok(t), Ok(e)) => (t, e),
        (Err(e), _) | (_, Err(e)) => return error_like(&template, e, location),
    };
    let captures = tracing::unify_captures(0, &mut [&mut then_traced, &mut else_traced]);
    let then_id = then_traced.function.register();
    let else_id = else_traced.function.register();
    let mut attrs = OpAttrs::new();
    attrs
        .set_func("then_branch", then_id)
        .set_func("else_branch", else_id);
    let mut args: Args = SmallVec::new();
    args.push(pred.handle.clone());
    args.extend(captures);
    run_control(&stagecraft_ops::IF, args, &attrs, location, &template)
}

/// `while_loop(init, |s| keep_going, |s| next)`: one `While` op. The state
/// `S` (a tensor or tuple of tensors) keeps its dtypes and shapes across
/// iterations; the condition returns a one-element `Tensor<bool>`. Both
/// closures are traced once into functions; tensors they capture become
/// loop-invariant inputs.
///
/// ```
/// use stagecraft::{while_loop, Device, Tensor};
/// let cpu = Device::cpu();
/// let x = Tensor::<f32>::full(&[4], 1.0, &cpu);
/// let halved = while_loop(x, |x| x.sum(&[0], false).gt(&Tensor::scalar(0.5, &cpu)), |x| x * 0.5);
/// assert_eq!(halved.to_vec()?, vec![0.125; 4]); // sums 4, 2, 1, then 0.5
/// # Ok::<(), stagecraft::Error>(())
/// ```
#[track_caller]
pub fn while_loop<S: TensorGroup>(
    init: S,
    cond: impl Fn(&S) -> Tensor<bool>,
    body: impl Fn(S) -> S,
) -> S {
    let location = Location::caller();
    let init_handles = handles_of(&init);
    let state_metas = metas(&init_handles);
    let n = init_handles.len();
    let cond_traced = trace("cond", &state_metas, location, |params| {
        match init.rebuild(&mut params.into_iter()) {
            Ok(state) => vec![cond(&state).handle],
            Err(e) => vec![TensorHandle::error(
                runtime::place(&[]),
                state_metas[0].clone(),
                e,
            )],
        }
    });
    let body_traced = trace("body", &state_metas, location, |params| {
        match init.rebuild(&mut params.into_iter()) {
            Ok(state) => handles_of(&body(state)),
            Err(e) => vec![TensorHandle::error(
                runtime::place(&[]),
                state_metas[0].clone(),
                e,
            )],
        }
    });
    let (mut cond_traced, mut body_traced) = match (cond_traced, body_traced) {
        (Ok(c), Ok(b)) => (c, b),
        (Err(e), _) | (_, Err(e)) => return error_like(&init, e, location),
    };
    let captures = tracing::unify_captures(n, &mut [&mut cond_traced, &mut body_traced]);
    // Invariant inputs pass through the body unchanged.
    let body_fn = &mut body_traced.function;
    body_fn
        .results
        .extend((0..captures.len()).map(|j| stagecraft_graph::Value::Param((n + j) as u32)));
    let cond_id = cond_traced.function.register();
    let body_id = body_traced.function.register();
    let mut attrs = OpAttrs::new();
    attrs.set_func("cond", cond_id).set_func("body", body_id);
    let mut args: Args = init_handles.into_iter().collect();
    args.extend(captures);
    run_control(&stagecraft_ops::WHILE, args, &attrs, location, &init)
}

#[derive(Clone)]
struct Traced<R> {
    id: FuncId,
    captures: Vec<TensorHandle>,
    template: R,
}

/// A closure staged into graph functions, one per input signature (dtypes
/// and shapes), created by [`function`].
pub struct StagedFunction<A, R, F> {
    f: F,
    cache: Mutex<HashMap<Vec<TensorMetadata>, Traced<R>>>,
    _args: PhantomData<fn(A) -> R>,
}

/// Stages `f` (the tf.function model): the first call with a given input
/// signature traces `f` into a graph function of the library; every call
/// runs that function as one `Call` op. Tensors `f` captures become extra
/// inputs (small concrete ones, like Rust numbers, are baked in as
/// constants at trace time).
///
/// ```
/// use stagecraft::{function, Device, Tensor};
/// let cpu = Device::cpu();
/// let affine = function(|(x, w): (Tensor<f32>, Tensor<f32>)| (x.matmul(&w) + 1.0).relu());
/// let x = Tensor::<f32>::ones(&[2, 3], &cpu);
/// let w = Tensor::<f32>::full(&[3, 1], 0.5, &cpu);
/// assert_eq!(affine.call((x, w)).to_vec()?, vec![2.5, 2.5]);
/// # Ok::<(), stagecraft::Error>(())
/// ```
pub fn function<A, R, F>(f: F) -> StagedFunction<A, R, F>
where
    A: TensorGroup,
    R: TensorGroup,
    F: Fn(A) -> R,
{
    StagedFunction {
        f,
        cache: Mutex::new(HashMap::new()),
        _args: PhantomData,
    }
}

impl<A, R, F> StagedFunction<A, R, F>
where
    A: TensorGroup,
    R: TensorGroup,
    F: Fn(A) -> R,
{
    /// Runs the staged function on `args`, tracing it first if this input
    /// signature is new.
    #[track_caller]
    pub fn call(&self, args: A) -> R {
        let location = Location::caller();
        let arg_handles = handles_of(&args);
        let signature = metas(&arg_handles);
        // The lock is not held while tracing: the closure may call this
        // staged function itself with another signature (recursion on
        // smaller shapes), which must not deadlock.
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&signature)
            .cloned();
        let entry = match cached {
            Some(entry) => entry,
            None => {
                let mut template = None;
                let traced = trace("function", &signature, location, |params| {
                    match args.rebuild(&mut params.into_iter()) {
                        Ok(symbolic) => {
                            let r = (self.f)(symbolic);
                            let h = handles_of(&r);
                            template = Some(r);
                            h
                        }
                        Err(e) => vec![TensorHandle::error(
                            runtime::place(&[]),
                            signature[0].clone(),
                            e,
                        )],
                    }
                });
                let (t, template) = match (traced, template) {
                    (Ok(t), Some(template)) => (t, template),
                    (Err(e), Some(template)) => return error_like(&template, e, location),
                    (_, None) => {
                        let e = Error::internal("the staged closure did not run").at(location);
                        panic!("{e}")
                    }
                };
                let entry = Traced {
                    id: t.function.register(),
                    captures: t.captures,
                    template,
                };
                // Another thread may have traced the same signature meanwhile;
                // the first one stored wins, so every call uses one function.
                self.cache
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(signature.clone())
                    .or_insert(entry)
                    .clone()
            }
        };
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", entry.id);
        let mut call_args: Args = arg_handles.into_iter().collect();
        call_args.extend(entry.captures.iter().cloned());
        run_control(
            &stagecraft_ops::CALL,
            call_args,
            &attrs,
            location,
            &entry.template,
        )
    }

    /// The traced functions with the tensors each captured (its parameters
    /// after the arguments), one per input signature traced so far.
    pub(crate) fn traces(&self) -> Vec<(std::sync::Arc<Function>, Vec<TensorHandle>)> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .values()
            .filter_map(|t| Function::lookup(t.id).map(|f| (f, t.captures.clone())))
            .collect()
    }

    /// The graph function traced for this input signature, if any (for
    /// printing and inspection).
    pub fn traced_function(&self, args: &A) -> Option<std::sync::Arc<Function>> {
        let signature = metas(&handles_of(args));
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.get(&signature).and_then(|t| Function::lookup(t.id))
    }
}
