//! What `#[stage]` code runs on: host calls from staged code
//! ([`host_call`]), the graph text of staged functions ([`staged_graphs`]),
//! and the hidden traits the macro's output calls ([`__stage`]). Its
//! transfer guards (`stagecraft::transfer_guard`) live in the runtime.
//!
//! The macro decides nothing about tensors itself: it rewrites every `if`
//! and `while` into a call of a trait method on the condition's value, and
//! the trait's impl for `bool` runs ordinary Rust while its impl for
//! `Tensor<bool>` builds one `If`/`While` op. Which one applies is chosen
//! by the type checker, so a wrong mix is a compile error, never a run-time
//! type test.

use crate::staging::{run_control, trace};
use crate::{Device, Element, Error, Location, Result, Tensor};
use stagecraft_graph::Function;
use stagecraft_ops::{FuncId, OpAttrs};
use stagecraft_runtime::{self as runtime, tracing, Args, TensorHandle};
use stagecraft_tensor::{DenseHostTensor, TensorMetadata};
use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock};

// ---------------------------------------------------------------------------
// Host calls

/// Runs the Rust closure `f` on the host with `x`'s values and returns its
/// result as a tensor of the same shape.
///
/// Outside staged code this copies `x` to the host, calls `f` and copies
/// the result back. Inside staged code (a `#[stage]` function, `function`,
/// `cond`, `while_loop`) it becomes a `HostCall` node on the host device:
/// the graph sends `x` to the host through the run's rendezvous, the host
/// runs `f`, and sends the result back; graph work that does not need the
/// result runs meanwhile. Each call of `f` is counted as an explicit
/// device-to-host copy (see [`transfer_stats`]).
///
/// ```
/// use stagecraft::{host_call, Device, Tensor};
/// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &Device::cpu())?;
/// let y = host_call(&x, |v: Vec<f32>| v.iter().map(|e| e * 10.0).collect());
/// assert_eq!(y.to_vec()?, vec![10.0, 20.0]);
/// # Ok::<(), stagecraft::Error>(())
/// ```
#[track_caller]
pub fn host_call<T: Element>(
    x: &Tensor<T>,
    f: impl Fn(Vec<T>) -> Vec<T> + Send + Sync + 'static,
) -> Tensor<T> {
    let dims = x.dims().to_vec();
    host_call_with(x, &dims, f)
}

/// [`host_call`] whose result has another element type or shape: `f` must
/// return exactly `dims`' number of elements, else the result holds an
/// error naming `HostCall` and this call's line.
#[track_caller]
pub fn host_call_with<T: Element, U: Element>(
    x: &Tensor<T>,
    dims: &[usize],
    f: impl Fn(Vec<T>) -> Vec<U> + Send + Sync + 'static,
) -> Tensor<U> {
    let location = Location::caller();
    let out_meta = TensorMetadata::new(U::DTYPE, dims);
    let callback = move |input: DenseHostTensor| -> Result<DenseHostTensor> {
        runtime::count_explicit_copy();
        let values = input.to_vec::<T>()?;
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(values)))
            .map_err(|_| Error::invalid("the host closure panicked"))?;
        DenseHostTensor::from_slice(&out, out_meta.shape.dims()).map_err(|e| {
            Error::shape(format!(
                "the host closure returned {} values where {} ({} values) was declared: {e}",
                out.len(),
                out_meta,
                out_meta.shape.numel()
            ))
        })
    };
    if !tracing::is_tracing() {
        // Eagerly there is no graph to overlap with: run the closure now.
        let device = x.device();
        let result = x
            .handle
            .wait()
            .and_then(|v| v.to_dense())
            .and_then(callback);
        return match result {
            Ok(dense) => Tensor::from_handle(TensorHandle::available(device, dense.into())),
            Err(e) => Tensor::error_at("HostCall", location, device, dims, e),
        };
    }
    let id = stagecraft_ops::register_host_callback(Arc::new(callback));
    let mut attrs = OpAttrs::new();
    attrs
        .set_int("callback", id)
        .set_dtype("dtype", U::DTYPE)
        .set_dims("shape", dims);
    // The tracer records the scope's device on the node; partitioning then
    // puts the node in the host partition.
    runtime::with_device(&Device::host(), || {
        crate::tensor::run(
            &stagecraft_ops::HOST_CALL,
            smallvec::smallvec![x.handle.clone()],
            &attrs,
            location,
        )
    })
}

// ---------------------------------------------------------------------------
// Graph text

fn caches() -> &'static Mutex<Vec<&'static __stage::StageCache>> {
    static CACHES: OnceLock<Mutex<Vec<&'static __stage::StageCache>>> = OnceLock::new();
    CACHES.get_or_init(Default::default)
}

/// The graph text of every signature the `#[stage]` function named `name`
/// has been traced for so far (oldest first), each followed by the library
/// functions its `If`/`While`/`Call` ops name.
pub fn staged_graphs(name: &str) -> Vec<String> {
    let caches: Vec<&'static __stage::StageCache> = caches()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .copied()
        .filter(|c| c.name == name)
        .collect();
    caches
        .iter()
        .flat_map(|c| c.function_ids())
        .map(graph_text)
        .collect()
}

/// `id` and every library function reachable from it, printed.
fn graph_text(id: FuncId) -> String {
    let mut seen = vec![id];
    let mut text = String::new();
    let mut i = 0;
    while i < seen.len() {
        if let Some(f) = Function::lookup(seen[i]) {
            text.push_str(&stagecraft_graph::text::print(&f));
            text.push('\n');
            for node in &f.nodes {
                for callee in node.op.functions() {
                    if !seen.contains(&callee) {
                        seen.push(callee);
                    }
                }
            }
        }
        i += 1;
    }
    text
}

/// Support for the code `#[stage]` generates. Not a stable API: use the
/// macro.
#[doc(hidden)]
pub mod __stage {
    use super::*;

    pub use crate::staging::TensorGroup;
    pub use stagecraft_runtime::TensorHandle;
    pub use stagecraft_tensor::TensorMetadata;

    /// The cache key of a group of tensors: their metadata in order.
    pub fn group_key<G: TensorGroup>(g: &G, tensors: &mut Vec<TensorMetadata>) {
        let mut handles = Vec::new();
        g.handles(&mut handles);
        tensors.extend(handles.iter().map(|h| h.metadata().clone()));
    }

    /// A value an `if`/`while` condition can have in `#[stage]` code.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be the condition of an `if`/`while` in #[stage] code",
        label = "expected `bool` (ordinary Rust) or `Tensor<bool>` (one staged If/While op)"
    )]
    pub trait StageCond {
        /// The owned condition (`bool` or `Tensor<bool>`).
        type Owned;
        /// Copies the condition out, so that evaluating it borrows nothing
        /// the branches then take.
        fn stage_cond(&self) -> Self::Owned;
    }

    impl StageCond for bool {
        type Owned = bool;
        fn stage_cond(&self) -> bool {
            *self
        }
    }

    impl StageCond for Tensor<bool> {
        type Owned = Tensor<bool>;
        fn stage_cond(&self) -> Tensor<bool> {
            self.clone()
        }
    }

    impl<T: StageCond + ?Sized> StageCond for &T {
        type Owned = T::Owned;
        fn stage_cond(&self) -> T::Owned {
            (**self).stage_cond()
        }
    }

    /// `if`: ordinary Rust on `bool`, one `If` op on `Tensor<bool>`. `S`
    /// holds the variables a branch assigns (SSA renaming); `F` runs the
    /// then (`true`) or else (`false`) branch on them and returns the
    /// branch's value and them (`R`).
    ///
    /// Staging traces both branches, each with its own copy of `F`, so on
    /// `Tensor<bool>` `F` must be `Clone`: a branch may borrow outer values
    /// or consume tensors, but not mutate captured host values.
    pub trait StageIf<S, R, F>: Sized {
        /// Runs (or stages) the branch `self` selects.
        fn stage_if(self, state: S, branches: F) -> R;
    }

    /// Gives the branch closure its signature before the condition's type
    /// picks the impl.
    pub fn branches<S, R, F: FnOnce(bool, S) -> R>(_: &S, f: F) -> F {
        f
    }

    impl<S, R, F: FnOnce(bool, S) -> R> StageIf<S, R, F> for bool {
        fn stage_if(self, state: S, branches: F) -> R {
            branches(self, state)
        }
    }

    impl<S, R, F> StageIf<S, R, F> for Tensor<bool>
    where
        S: TensorGroup,
        R: TensorGroup,
        F: FnOnce(bool, S) -> R + Clone,
    {
        #[track_caller]
        fn stage_if(self, state: S, branches: F) -> R {
            // A copy of the closure per traced branch: its captures are
            // references or tensors (cheap clones).
            let other = state.clone();
            let else_branches = branches.clone();
            crate::cond(
                &self,
                || branches(true, state),
                || else_branches(false, other),
            )
        }
    }

    /// `while`: an ordinary loop on `bool`, one `While` op on
    /// `Tensor<bool>`. `self` is the condition on the state before the
    /// loop (its type picks the impl); `cond` evaluates it again on a
    /// state, handing the state back.
    pub trait StageWhile<S>: Sized {
        /// Runs (or stages) the loop.
        fn stage_while(
            self,
            state: S,
            cond: impl FnMut(S) -> (Self, S),
            body: impl FnMut(S) -> S,
        ) -> S;
    }

    impl<S> StageWhile<S> for bool {
        fn stage_while(
            self,
            mut state: S,
            mut cond: impl FnMut(S) -> (bool, S),
            mut body: impl FnMut(S) -> S,
        ) -> S {
            let mut keep_going = self;
            while keep_going {
                state = body(state);
                (keep_going, state) = cond(state);
            }
            state
        }
    }

    impl<S: TensorGroup> StageWhile<S> for Tensor<bool> {
        #[track_caller]
        fn stage_while(
            self,
            state: S,
            cond: impl FnMut(S) -> (Tensor<bool>, S),
            body: impl FnMut(S) -> S,
        ) -> S {
            // `while_loop` traces each closure once; the cells only lend
            // the `FnMut`s to its `Fn` closures.
            let cond = RefCell::new(cond);
            let body = RefCell::new(body);
            crate::while_loop(
                state,
                |s| (cond.borrow_mut())(s.clone()).0,
                |s| (body.borrow_mut())(s),
            )
        }
    }

    /// The flags that lower `break` and `continue`: `bool` in host loops,
    /// `Tensor<bool>` (extra loop state) in staged ones.
    pub trait Flag: Sized {
        /// A lowered flag of the same kind (and shape) as `self`.
        fn lowered(&self) -> Self;
        /// A raised flag of the same kind as `self`.
        fn raised(&self) -> Self;
        /// `!self && cond()`: a loop condition that stops after a `break`
        /// (on `bool`, without evaluating `cond` again).
        fn unless(&self, cond: impl FnOnce() -> Self) -> Self;
        /// `!self && !other`: whether the rest of a loop body runs.
        fn neither(&self, other: &Self) -> Self;
    }

    impl Flag for bool {
        fn lowered(&self) -> bool {
            false
        }
        fn raised(&self) -> bool {
            true
        }
        fn unless(&self, cond: impl FnOnce() -> bool) -> bool {
            !*self && cond()
        }
        fn neither(&self, other: &bool) -> bool {
            !self && !other
        }
    }

    impl Flag for Tensor<bool> {
        // Built from `self` by ops rather than as constants, so the flag
        // lives wherever the condition does (a device, a trace frame).
        #[track_caller]
        fn lowered(&self) -> Tensor<bool> {
            self.and(&self.not())
        }
        #[track_caller]
        fn raised(&self) -> Tensor<bool> {
            self.or(&self.not())
        }
        #[track_caller]
        fn unless(&self, cond: impl FnOnce() -> Tensor<bool>) -> Tensor<bool> {
            // Staged, the condition is one more node in the loop's cond
            // function; it runs either way, its value is masked.
            cond().and(&self.not())
        }
        #[track_caller]
        fn neither(&self, other: &Tensor<bool>) -> Tensor<bool> {
            self.or(other).not()
        }
    }

    /// An argument or result of a `#[stage]` function: tensors (and
    /// groups of them) become parameters of the traced graph and key the
    /// cache by dtype and shape; host values (numbers, strings, flags) are
    /// baked into the trace and key the cache by value.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be an argument or result of a #[stage] function",
        label = "expected a tensor, a tuple or `Vec` of them, a `#[derive(TensorGroup)]` struct, or a host number/`bool`/`String`"
    )]
    pub trait StageArg: Sized + Clone + Send + Sync + 'static {
        /// Adds this value's part of the cache key.
        fn stage_key(&self, tensors: &mut Vec<TensorMetadata>, host: &mut String);
        /// Appends the tensor handles, in order.
        fn stage_handles(&self, out: &mut Vec<TensorHandle>);
        /// The same structure with tensors from `handles`; host values are
        /// copied from `self`.
        fn stage_rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self>;
    }

    impl<T: Element> StageArg for Tensor<T> {
        fn stage_key(&self, tensors: &mut Vec<TensorMetadata>, _: &mut String) {
            tensors.push(self.handle.metadata().clone());
        }
        fn stage_handles(&self, out: &mut Vec<TensorHandle>) {
            out.push(self.handle.clone());
        }
        fn stage_rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
            TensorGroup::rebuild(self, handles)
        }
    }

    macro_rules! host_arg {
        ($($t:ty),*) => {$(
            impl StageArg for $t {
                fn stage_key(&self, _: &mut Vec<TensorMetadata>, host: &mut String) {
                    // Debug output of these types is exact (floats print
                    // their shortest round-trip form).
                    host.push_str(&format!("{:?};", self));
                }
                fn stage_handles(&self, _: &mut Vec<TensorHandle>) {}
                fn stage_rebuild(&self, _: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
                    Ok(self.clone())
                }
            }
        )*};
    }

    host_arg!(
        (),
        bool,
        u8,
        u16,
        u32,
        u64,
        usize,
        i8,
        i16,
        i32,
        i64,
        isize,
        f32,
        f64,
        char,
        String,
        &'static str
    );

    impl<A: StageArg> StageArg for Vec<A> {
        fn stage_key(&self, tensors: &mut Vec<TensorMetadata>, host: &mut String) {
            host.push_str(&format!("[{}]", self.len()));
            self.iter().for_each(|a| a.stage_key(tensors, host));
        }
        fn stage_handles(&self, out: &mut Vec<TensorHandle>) {
            self.iter().for_each(|a| a.stage_handles(out));
        }
        fn stage_rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
            self.iter().map(|a| a.stage_rebuild(handles)).collect()
        }
    }

    macro_rules! tuple_arg {
        ($($name:ident . $index:tt),+) => {
            impl<$($name: StageArg),+> StageArg for ($($name,)+) {
                fn stage_key(&self, tensors: &mut Vec<TensorMetadata>, host: &mut String) {
                    $(self.$index.stage_key(tensors, host);)+
                }
                fn stage_handles(&self, out: &mut Vec<TensorHandle>) {
                    $(self.$index.stage_handles(out);)+
                }
                fn stage_rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
                    Ok(($(self.$index.stage_rebuild(handles)?,)+))
                }
            }
        };
    }

    tuple_arg!(A.0);
    tuple_arg!(A.0, B.1);
    tuple_arg!(A.0, B.1, C.2);
    tuple_arg!(A.0, B.1, C.2, D.3);
    tuple_arg!(A.0, B.1, C.2, D.3, E.4);
    tuple_arg!(A.0, B.1, C.2, D.3, E.4, F.5);
    tuple_arg!(A.0, B.1, C.2, D.3, E.4, F.5, G.6);
    tuple_arg!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7);

    /// A [`StageArg`] seen as a [`TensorGroup`] (host parts are carried
    /// along, not staged), so the staged call reuses `run_control`.
    #[derive(Clone)]
    struct Grouped<R>(R);

    impl<R: StageArg> TensorGroup for Grouped<R> {
        fn handles(&self, out: &mut Vec<TensorHandle>) {
            self.0.stage_handles(out);
        }
        fn rebuild(&self, handles: &mut dyn Iterator<Item = TensorHandle>) -> Result<Self> {
            self.0.stage_rebuild(handles).map(Grouped)
        }
    }

    type Key = (Vec<TensorMetadata>, String);

    struct Entry {
        id: FuncId,
        captures: Vec<TensorHandle>,
        /// The traced result (an `R`), whose structure and host values
        /// every call's result copies.
        template: Arc<dyn Any + Send + Sync>,
    }

    /// The per-function cache of a `#[stage]` function: one traced graph
    /// function per input signature (tensor dtypes and shapes, host
    /// argument values).
    pub struct StageCache {
        pub(super) name: &'static str,
        entries: OnceLock<Mutex<Vec<(Key, Entry)>>>,
    }

    impl StageCache {
        /// An empty cache for the function `name`.
        pub const fn new(name: &'static str) -> StageCache {
            StageCache {
                name,
                entries: OnceLock::new(),
            }
        }

        fn entries(&'static self) -> &'static Mutex<Vec<(Key, Entry)>> {
            self.entries.get_or_init(|| {
                caches()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(self);
                Mutex::new(Vec::new())
            })
        }

        pub(super) fn function_ids(&'static self) -> Vec<FuncId> {
            self.entries()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|(_, e)| e.id)
                .collect()
        }

        /// Runs the staged function on `args`: traces `body` into a graph
        /// function the first time this signature is seen, then runs it as
        /// one `Call` op.
        #[track_caller]
        pub fn call<A: StageArg, R: StageArg>(&'static self, args: A, body: impl Fn(A) -> R) -> R {
            let location = Location::caller();
            let mut key: Key = (Vec::new(), String::new());
            args.stage_key(&mut key.0, &mut key.1);
            let mut arg_handles = Vec::new();
            args.stage_handles(&mut arg_handles);
            let hit = self
                .entries()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, e)| {
                    let template = e.template.downcast_ref::<R>()?.clone();
                    Some((e.id, e.captures.clone(), template))
                });
            let (id, captures, template) = match hit {
                Some(hit) => hit,
                None => {
                    // The lock is not held while tracing: the body may call
                    // this function again with another signature.
                    let mut template = None;
                    let traced = trace(self.name, &key.0, location, |params| {
                        match args.stage_rebuild(&mut params.into_iter()) {
                            Ok(symbolic) => {
                                let r = body(symbolic);
                                let mut h = Vec::new();
                                r.stage_handles(&mut h);
                                template = Some(r);
                                h
                            }
                            Err(e) => vec![TensorHandle::error(
                                runtime::place(&[]),
                                TensorMetadata::new(crate::DType::F32, &[] as &[usize]),
                                e,
                            )],
                        }
                    });
                    let Some(template) = template else {
                        // Only a broken invariant gets here (rebuilding the
                        // arguments' own structure failed): there is no
                        // result of type `R` to hold the error.
                        let e = traced
                            .err()
                            .unwrap_or_else(|| Error::internal("the staged body did not run"));
                        panic!("{}", e.with_op(self.name).at(location));
                    };
                    let traced = match traced {
                        Ok(t) => t,
                        Err(e) => {
                            let e = e.at(location);
                            runtime::report_error(&e);
                            let mut handles = Vec::new();
                            template.stage_handles(&mut handles);
                            let device = runtime::place(&[]);
                            let errors: Vec<TensorHandle> = handles
                                .iter()
                                .map(|h| {
                                    TensorHandle::error(device, h.metadata().clone(), e.clone())
                                })
                                .collect();
                            return template
                                .stage_rebuild(&mut errors.into_iter())
                                .unwrap_or(template);
                        }
                    };
                    let id = traced.function.register();
                    let captures = traced.captures;
                    let mut entries = self.entries().lock().unwrap_or_else(|p| p.into_inner());
                    // Another thread may have traced the same signature
                    // meanwhile; the first one stored wins.
                    match entries.iter().find(|(k, _)| *k == key) {
                        Some((_, e)) => match e.template.downcast_ref::<R>() {
                            Some(t) => (e.id, e.captures.clone(), t.clone()),
                            None => (id, captures, template),
                        },
                        None => {
                            entries.push((
                                key,
                                Entry {
                                    id,
                                    captures: captures.clone(),
                                    template: Arc::new(template.clone()),
                                },
                            ));
                            (id, captures, template)
                        }
                    }
                }
            };
            let mut attrs = OpAttrs::new();
            attrs.set_func("f", id);
            let mut call_args: Args = arg_handles.into_iter().collect();
            call_args.extend(captures);
            run_control(
                &stagecraft_ops::CALL,
                call_args,
                &attrs,
                location,
                &Grouped(template),
            )
            .0
        }
    }
}
