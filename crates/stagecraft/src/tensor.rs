//! `Tensor<T>`: the typed, user-facing tensor. Its element type is part of
//! its Rust type, so mixing dtypes is a compile error; the untyped
//! [`TensorHandle`] underneath stays internal.

use crate::{Device, Error};
use stagecraft_ops::{OpAttrs, OpDef};
use stagecraft_runtime::{self as runtime, Args, TensorHandle};
use stagecraft_tensor::{
    DType, DenseHostTensor, Element, HostTensor, Location, Result, Scalar, ScalarHostTensor, Shape,
};
use std::fmt;
use std::marker::PhantomData;

/// A tensor of `T` values on some device, possibly still being computed.
///
/// Cloning is cheap (one reference count). Ops never fail at the call: an
/// invalid op returns a tensor holding the error, which later ops pass on
/// without running, and which reading the value (`to_vec`, `item`,
/// `Display`) or [`Tensor::check`] returns, naming the op, the shapes and
/// your source line.
pub struct Tensor<T: Element> {
    pub(crate) handle: TensorHandle,
    _element: PhantomData<fn() -> T>,
}

impl<T: Element> Clone for Tensor<T> {
    fn clone(&self) -> Self {
        Tensor::from_handle(self.handle.clone())
    }
}

impl<T: Element> Tensor<T> {
    pub(crate) fn from_handle(handle: TensorHandle) -> Tensor<T> {
        debug_assert_eq!(handle.dtype(), T::DTYPE);
        Tensor {
            handle,
            _element: PhantomData,
        }
    }

    /// Wraps an untyped handle, checking its dtype.
    pub fn try_from_handle(handle: TensorHandle) -> Result<Tensor<T>> {
        if handle.dtype() != T::DTYPE {
            return Err(Error::dtype(format!(
                "the handle holds {} values, not {}",
                handle.dtype(),
                T::DTYPE
            )));
        }
        Ok(Tensor::from_handle(handle))
    }

    /// The untyped handle (for runtime-level code).
    pub fn handle(&self) -> &TensorHandle {
        &self.handle
    }

    /// A tensor of shape `dims` on `device` that holds `err` as an error of
    /// `op` at the caller's line, for code built on stagecraft that checks
    /// its own inputs (a model given a sequence longer than its context):
    /// the error reaches the user the way an op's own errors do, when the
    /// value is read.
    ///
    /// ```
    /// use stagecraft::{Device, Error, Tensor};
    /// let t = Tensor::<f32>::failed("Gpt", Error::shape("too long"), &[2], &Device::cpu());
    /// let err = t.to_vec().unwrap_err();
    /// assert_eq!(err.op(), Some("Gpt"));
    /// ```
    #[track_caller]
    pub fn failed(op: &str, err: Error, dims: &[usize], device: &Device) -> Tensor<T> {
        Tensor::error_at(op, Location::caller(), *device, dims, err)
    }

    pub(crate) fn error_at(
        op: &str,
        location: Location,
        device: Device,
        dims: &[usize],
        err: Error,
    ) -> Tensor<T> {
        let err = err.with_op(op.to_string()).at(location);
        runtime::report_error(&err);
        Tensor::from_handle(TensorHandle::error(
            device,
            stagecraft_tensor::TensorMetadata::new(T::DTYPE, dims),
            err,
        ))
    }

    /// A tensor holding `values` with the given shape, on `device`.
    #[track_caller]
    pub fn from_vec(values: Vec<T>, dims: &[usize], device: &Device) -> Result<Tensor<T>> {
        Tensor::from_values("from_vec", &values, dims, device, Location::caller())
    }

    /// A tensor holding a copy of `values` with the given shape, on `device`.
    #[track_caller]
    pub fn from_slice(values: &[T], dims: &[usize], device: &Device) -> Result<Tensor<T>> {
        Tensor::from_values("from_slice", values, dims, device, Location::caller())
    }

    /// `from_vec` and `from_slice`, whose errors name the constructor the
    /// user called.
    fn from_values(
        constructor: &'static str,
        values: &[T],
        dims: &[usize],
        device: &Device,
        location: Location,
    ) -> Result<Tensor<T>> {
        let dense = device
            .ensure_in_this_process()
            .and_then(|()| DenseHostTensor::from_slice(values, dims))
            .map_err(|e| e.with_op(constructor).at(location))?;
        Ok(Tensor::from_handle(TensorHandle::available(
            *device,
            dense.into(),
        )))
    }

    /// A rank-0 tensor.
    pub fn scalar(value: T, device: &Device) -> Tensor<T> {
        Tensor::from_handle(TensorHandle::available(
            *device,
            ScalarHostTensor::new(value.to_scalar(), Shape::scalar()).into(),
        ))
    }

    /// A tensor of `dims` whose elements all equal `value`.
    ///
    /// On a CPU device this is a scalar host tensor: no buffer is filled
    /// until a kernel needs dense values.
    #[track_caller]
    pub fn full(dims: &[usize], value: T, device: &Device) -> Tensor<T> {
        Tensor::filled("full", dims, value, device, Location::caller())
    }

    /// A tensor of zeros.
    #[track_caller]
    pub fn zeros(dims: &[usize], device: &Device) -> Tensor<T> {
        let zero = T::from_scalar(Scalar::I32(0));
        Tensor::filled("zeros", dims, zero, device, Location::caller())
    }

    /// A tensor of ones.
    #[track_caller]
    pub fn ones(dims: &[usize], device: &Device) -> Tensor<T> {
        let one = T::from_scalar(Scalar::I32(1));
        Tensor::filled("ones", dims, one, device, Location::caller())
    }

    /// `full`, `zeros` and `ones`, whose errors name the constructor the
    /// user called.
    fn filled(
        constructor: &'static str,
        dims: &[usize],
        value: T,
        device: &Device,
        location: Location,
    ) -> Tensor<T> {
        let shape = Shape::new(dims);
        match device
            .ensure_in_this_process()
            .and_then(|()| shape.checked_numel())
        {
            Ok(_) => Tensor::from_handle(TensorHandle::available(
                *device,
                ScalarHostTensor::new(value.to_scalar(), shape).into(),
            )),
            // The error tensor cannot carry `dims`: later ops infer their
            // output metadata from it, and a shape whose element count
            // overflows would make that arithmetic overflow too.
            Err(e) => Tensor::error_at(constructor, location, *device, &[], e),
        }
    }

    /// The dimensions. Known at once, without running anything (for a
    /// data-dependent op such as `nonzero`, this waits for the value).
    pub fn dims(&self) -> &[usize] {
        self.handle.metadata().shape.dims()
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.handle.metadata().shape
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims().len()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape().numel()
    }

    /// The element type (always `T::DTYPE`).
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        self.handle.device()
    }

    /// Returns the error this tensor holds, if its op (or an op it depends
    /// on) failed validation; does not wait for or read values.
    pub fn check(&self) -> Result<()> {
        match self.handle.resolved_error() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Waits until the value is computed (on a GPU: until its kernels are
    /// recorded, which later reads wait behind; `Device::synchronize` waits
    /// for them to run); returns its error if any. Reads nothing back, so
    /// it works wherever the value lives.
    pub fn wait(&self) -> Result<()> {
        self.handle.wait_value().map(|_| ())
    }

    /// The value, for a read by the user: an implicit device-to-host copy
    /// unless the tensor is on the host device, so the thread's transfer
    /// guard may log or refuse it.
    fn host_value(&self, what: &str, location: Option<Location>) -> Result<HostTensor> {
        stagecraft_runtime::implicit_read(what, self.device(), self.handle.metadata(), location)?;
        runtime::count_host_read();
        let span = runtime::profile::begin();
        let value = runtime::read_to_host(&self.handle);
        if let (Some(span), Ok(v)) = (span, &value) {
            let bytes = v.metadata().shape.numel() * v.metadata().dtype.size_in_bytes();
            span.end(
                runtime::profile::TRANSFER,
                "to host",
                vec![("bytes", bytes.to_string())],
            );
        }
        value
    }

    /// The values in row-major order. Outside the host device this is an
    /// implicit device-to-host copy (see [`crate::transfer_guard`]).
    #[track_caller]
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // Taken here: inside the closure below it would name this file.
        let caller = Location::caller();
        match self.host_value("to_vec", Some(caller))? {
            HostTensor::Dense(d) => d.to_vec(),
            HostTensor::Scalar(s) => {
                // A broadcast scalar may stand for more elements than fit
                // in memory: refuse it instead of aborting.
                let n = s.metadata().shape.numel();
                let mut values = Vec::new();
                values.try_reserve_exact(n).map_err(|_| {
                    Error::shape(format!(
                        "to_vec: a tensor of {} does not fit in memory",
                        s.metadata()
                    ))
                    .with_op("to_vec")
                    .at(caller)
                })?;
                values.resize(n, T::from_scalar(s.value()));
                Ok(values)
            }
            list @ HostTensor::List(_) => list.to_dense()?.to_vec(),
        }
    }

    /// The single value of a one-element tensor (an implicit
    /// device-to-host copy, like [`Tensor::to_vec`]).
    #[track_caller]
    pub fn item(&self) -> Result<T> {
        let location = Location::caller();
        if T::DTYPE == DType::Bool {
            // Reading a bool scalar is the host deciding on a value.
            self.handle
                .materialize(stagecraft_runtime::lazy::Trigger::HostControlFlow);
        }
        let value = self.host_value("item", Some(location))?;
        let numel = value.metadata().shape.numel();
        if numel != 1 {
            return Err(Error::shape(format!(
                "item() needs exactly one element, the tensor has shape {} ({numel} elements)",
                value.metadata().shape
            ))
            .with_op("item")
            .at(location));
        }
        match value {
            HostTensor::Dense(d) => Ok(d.as_slice::<T>()?[0]),
            HostTensor::Scalar(s) => Ok(T::from_scalar(s.value())),
            list @ HostTensor::List(_) => Ok(list.to_dense()?.as_slice::<T>()?[0]),
        }
    }

    /// A copy on `device` (the only way tensors move between devices; each
    /// copy is counted in the runtime stats).
    #[track_caller]
    pub fn to_device(&self, device: &Device) -> Tensor<T> {
        if self.device() != *device {
            stagecraft_runtime::count_explicit_copy();
        }
        Tensor::from_handle(runtime::copy_to_device(
            &self.handle,
            *device,
            Location::caller(),
        ))
    }

    /// An explicit copy to the host device ([`Device::host`]): reading
    /// the copy's values is never an implicit transfer, so transfer guards
    /// let it pass. The way to say "this copy is intended".
    #[track_caller]
    pub fn to_host(&self) -> Tensor<T> {
        self.to_device(&Device::host())
    }

    pub(crate) fn unary<U: Element>(
        &self,
        op: &'static OpDef,
        attrs: &OpAttrs,
        location: Location,
    ) -> Tensor<U> {
        run_borrowed(op, &[&self.handle], attrs, location)
    }

    pub(crate) fn binary<U: Element>(
        &self,
        op: &'static OpDef,
        other: &Tensor<T>,
        location: Location,
    ) -> Tensor<U> {
        run_borrowed(
            op,
            &[&self.handle, &other.handle],
            &OpAttrs::new(),
            location,
        )
    }
}

/// [`run`] on arguments the caller keeps: an op that runs on its device's
/// fast path clones no handle (the autodiff tapes, which keep their
/// arguments, take the full path).
pub(crate) fn run_borrowed<U: Element>(
    op: &'static OpDef,
    args: &[&TensorHandle],
    attrs: &OpAttrs,
    location: Location,
) -> Tensor<U> {
    if crate::autodiff::is_recording_borrowed(args) {
        let owned: Args = args.iter().map(|&a| a.clone()).collect();
        return run(op, owned, attrs, location);
    }
    let device = runtime::place_borrowed(args);
    let handle = runtime::execute_borrowed(op, device, location, args, attrs).swap_remove(0);
    typed(op, handle)
}

/// Runs `op` on `args`, placed by the eager rules, and records it on the
/// autodiff tapes that track one of its arguments; returns the first output.
pub(crate) fn run_handle(
    op: &'static OpDef,
    args: Args,
    attrs: &OpAttrs,
    location: Location,
) -> TensorHandle {
    run_handles(op, args, attrs, location).swap_remove(0)
}

/// [`run_handle`] returning every output.
pub(crate) fn run_handles(
    op: &'static OpDef,
    args: Args,
    attrs: &OpAttrs,
    location: Location,
) -> runtime::Results {
    let device = runtime::place(&args);
    if crate::autodiff::is_recording(&args) {
        return crate::autodiff::execute_recorded(op, device, location, args, attrs);
    }
    runtime::execute(op, device, location, args, attrs.into())
}

/// Runs `op` on `args`, placed by the eager rules, returning its first
/// output.
pub(crate) fn run<U: Element>(
    op: &'static OpDef,
    args: Args,
    attrs: &OpAttrs,
    location: Location,
) -> Tensor<U> {
    typed(op, run_handle(op, args, attrs, location))
}

/// Runs a two-output `op` (values and indices), returning both typed.
pub(crate) fn run_pair<A: Element, B: Element>(
    op: &'static OpDef,
    args: Args,
    attrs: &OpAttrs,
    location: Location,
) -> (Tensor<A>, Tensor<B>) {
    let outputs = run_handles(op, args, attrs, location);
    if let [first, second] = &outputs[..] {
        return (typed(op, first.clone()), typed(op, second.clone()));
    }
    let device = outputs
        .first()
        .map_or_else(|| runtime::place(&[]), |h| h.device());
    let err = Error::internal(format!("{} gave {} outputs, not 2", op.name, outputs.len()));
    (
        Tensor::error_at(op.name, location, device, &[], err.clone()),
        Tensor::error_at(op.name, location, device, &[], err),
    )
}

/// `handle` as a `Tensor<U>`.
fn typed<U: Element>(op: &'static OpDef, handle: TensorHandle) -> Tensor<U> {
    let device = handle.device();
    if handle.dtype() != U::DTYPE {
        // Only an error handle whose op failed before its output dtype was
        // known can disagree with the typed signature: keep the error, fix
        // the dtype.
        let err = handle.wait().err().unwrap_or_else(|| {
            Error::internal(format!(
                "{} produced {} where {} was expected",
                op.name,
                handle.dtype(),
                U::DTYPE
            ))
        });
        return Tensor::from_handle(TensorHandle::error(
            device,
            stagecraft_tensor::TensorMetadata::new(U::DTYPE, handle.metadata().shape.clone()),
            err,
        ));
    }
    Tensor::from_handle(handle)
}

impl<T: Element> fmt::Display for Tensor<T> {
    /// The values (eliding long axes), or the error the tensor holds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host_value("Display", None) {
            Ok(value) => match stagecraft_runtime::format::format_values(&value, 3) {
                Ok(text) => write!(f, "{text}"),
                Err(e) => write!(f, "<error: {e}>"),
            },
            Err(e) => write!(f, "<error: {e}>"),
        }
    }
}

impl<T: Element> fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor<{}>{} on {}",
            T::DTYPE,
            self.shape(),
            self.device()
        )
    }
}
