//! Tensor handles: the device a tensor lives on, its metadata (known at
//! once for almost every op) and its value (an [`AsyncValue`] that may still
//! be computing, or hold an error).

use crate::async_value::AsyncValue;
use crate::device::Device;
use stagecraft_tensor::{
    DType, DeviceTensor, Error, ErrorKind, HostTensor, Result, TensorMetadata, TensorValue,
};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether a handle's metadata was known when it was created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetadataState {
    /// Computed synchronously by the op's metadata function.
    Known,
    /// Known only with the value (data-dependent ops such as `Nonzero`).
    Deferred,
}

/// What a symbolic handle stands for: a value of a function being traced,
/// which has no data until the function runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TracedValue {
    /// The trace frame (see [`crate::tracing`]) the value belongs to.
    pub frame: u64,
    /// The value inside that frame's function.
    pub value: stagecraft_graph::Value,
}

struct HandleInner {
    device: Device,
    meta: TensorMetadata,
    meta_state: MetadataState,
    /// In host memory for host devices, in device memory for a GPU.
    value: AsyncValue<TensorValue>,
    traced: Option<TracedValue>,
    /// For a tensor on a lazy device: the recorded op output it stands for.
    lazy: Option<crate::lazy::LazyRef>,
    /// Set on a tensor whose gradient users want (a parameter): kept on the
    /// handle, so it survives the tapes that autodiff consumes, and shared
    /// by every clone.
    requires_grad: AtomicBool,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        if let Some(lazy) = &self.lazy {
            lazy.release();
        }
    }
}

/// A reference to a tensor that may not be computed yet. Cloning is one
/// atomic increment and the handle is one pointer wide.
#[derive(Clone)]
pub struct TensorHandle(Arc<HandleInner>);

impl TensorHandle {
    /// A handle to an available host value. On a device with its own
    /// memory (a GPU) the value is uploaded there (a tensor list, whose
    /// items are values of their own, stays in host memory); a failed
    /// upload is an error handle.
    #[inline]
    pub fn available(device: Device, value: HostTensor) -> TensorHandle {
        // A tensor list stays in host memory on every device.
        if device.kind() == crate::device::DeviceKind::Gpu && !matches!(value, HostTensor::List(_))
        {
            return TensorHandle::uploaded(device, value);
        }
        TensorHandle::available_value(device, TensorValue::Host(value))
    }

    #[cold]
    fn uploaded(device: Device, value: HostTensor) -> TensorHandle {
        let meta = value.metadata().clone();
        let upload = match device.handler().memory() {
            Some(memory) => value.to_dense().and_then(|dense| memory.upload(&dense)),
            None => Err(Device::try_gpu(device.index())
                .err()
                .unwrap_or_else(|| Error::internal(format!("{device} has no device memory")))),
        };
        match upload {
            Ok(on_device) => TensorHandle::available_on_device(device, on_device),
            Err(e) => TensorHandle::error(device, meta, e),
        }
    }

    /// A handle to `value` on `device`: a host value is copied into the
    /// memory of a device that has its own (as [`TensorHandle::available`]).
    pub fn placed(device: Device, value: TensorValue) -> TensorHandle {
        match value {
            TensorValue::Host(host) => TensorHandle::available(device, host),
            TensorValue::Device(on_device) => TensorHandle::available_on_device(device, on_device),
        }
    }

    /// A handle to an available value in device memory.
    pub fn available_on_device(device: Device, value: DeviceTensor) -> TensorHandle {
        TensorHandle::available_value(device, TensorValue::Device(value))
    }

    /// A handle to an available value wherever it lives.
    pub fn available_value(device: Device, value: TensorValue) -> TensorHandle {
        TensorHandle(Arc::new(HandleInner {
            device,
            meta: value.metadata().clone(),
            meta_state: MetadataState::Known,
            value: AsyncValue::available(value),
            traced: None,
            lazy: None,
            requires_grad: AtomicBool::new(false),
        }))
    }

    /// A handle whose value is an error (`meta` is what the op would have
    /// produced, or a best guess when even that failed).
    pub fn error(device: Device, meta: TensorMetadata, error: Error) -> TensorHandle {
        TensorHandle(Arc::new(HandleInner {
            device,
            meta,
            meta_state: MetadataState::Known,
            value: AsyncValue::error(error),
            traced: None,
            lazy: None,
            requires_grad: AtomicBool::new(false),
        }))
    }

    /// A handle whose value a producer will set with [`TensorHandle::resolve`].
    pub fn pending(
        device: Device,
        meta: TensorMetadata,
        meta_state: MetadataState,
    ) -> TensorHandle {
        TensorHandle(Arc::new(HandleInner {
            device,
            meta,
            meta_state,
            value: AsyncValue::unavailable(),
            traced: None,
            lazy: None,
            requires_grad: AtomicBool::new(false),
        }))
    }

    /// A symbolic handle for a value of a function being traced.
    pub fn traced(device: Device, meta: TensorMetadata, traced: TracedValue) -> TensorHandle {
        TensorHandle(Arc::new(HandleInner {
            device,
            meta,
            meta_state: MetadataState::Known,
            value: AsyncValue::unavailable(),
            traced: Some(traced),
            lazy: None,
            requires_grad: AtomicBool::new(false),
        }))
    }

    /// A handle for output `lazy` of a recorded lazy op (its value is set
    /// when a trace containing the op runs).
    pub(crate) fn lazy(
        device: Device,
        meta: TensorMetadata,
        lazy: crate::lazy::LazyRef,
    ) -> TensorHandle {
        lazy.retain();
        TensorHandle(Arc::new(HandleInner {
            device,
            meta,
            meta_state: MetadataState::Known,
            value: AsyncValue::unavailable(),
            traced: None,
            lazy: Some(lazy),
            requires_grad: AtomicBool::new(false),
        }))
    }

    /// The recorded lazy op output this handle stands for, if any.
    pub(crate) fn lazy_ref(&self) -> Option<&crate::lazy::LazyRef> {
        self.0.lazy.as_ref()
    }

    /// Sets the value of a lazy handle whose op has run (no-op once set).
    pub(crate) fn fill_lazy(&self, result: Result<TensorValue>) {
        if !self.0.value.is_resolved() {
            self.0.value.set(result)
        }
    }

    /// Runs the lazy trace that computes this handle now, recording `trigger`
    /// as the reason (no-op for other handles or computed values).
    pub fn materialize(&self, trigger: crate::lazy::Trigger) {
        if self.0.lazy.is_some() && !self.0.value.is_resolved() {
            crate::lazy::materialize_handle(self, trigger);
        }
    }

    /// True for a handle whose value a lazy trace computed (or will).
    pub fn is_lazy(&self) -> bool {
        self.0.lazy.is_some()
    }

    /// The traced value this handle stands for, if it is symbolic.
    #[inline]
    pub fn traced_value(&self) -> Option<TracedValue> {
        self.0.traced
    }

    /// Sets the value of a pending handle (once), waking its dependents.
    ///
    /// A value that contradicts the metadata promised at creation becomes an
    /// internal error rather than a silently wrong tensor.
    pub fn resolve(&self, result: Result<HostTensor>) {
        self.resolve_value(result.map(TensorValue::Host))
    }

    /// Sets the value of a pending handle (once) to a value wherever it
    /// lives; see [`TensorHandle::resolve`].
    pub fn resolve_value(&self, result: Result<TensorValue>) {
        let result = match result {
            Ok(v) if self.0.meta_state == MetadataState::Known && v.metadata() != &self.0.meta => {
                Err(Error::internal(format!(
                    "a kernel produced {} where its metadata function promised {}",
                    v.metadata(),
                    self.0.meta
                )))
            }
            other => other,
        };
        self.0.value.set(result)
    }

    /// The device the tensor lives on.
    #[inline]
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// Dtype and shape. Known at once unless the producing op is
    /// data-dependent, in which case this waits for the value.
    pub fn metadata(&self) -> &TensorMetadata {
        if self.0.meta_state == MetadataState::Deferred {
            if let Ok(value) = self.0.value.wait() {
                return value.metadata();
            }
        }
        &self.0.meta
    }

    /// Whether the metadata was known at creation.
    pub fn metadata_state(&self) -> MetadataState {
        self.0.meta_state
    }

    /// The element type (always known synchronously).
    #[inline]
    pub fn dtype(&self) -> DType {
        self.0.meta.dtype
    }

    /// True once the value or an error is set.
    #[inline]
    pub fn is_resolved(&self) -> bool {
        self.0.value.is_resolved()
    }

    /// The host value, if it is already there: no wait, no error, not in
    /// a device's own memory (what an op may run on inline).
    #[inline]
    pub(crate) fn ready_host(&self) -> Option<&HostTensor> {
        match self.0.value.try_get() {
            Some(Ok(TensorValue::Host(host))) => Some(host),
            _ => None,
        }
    }

    /// The dense host value of a handle whose value is already there,
    /// moved out if this is the last reference (so a kernel may reuse its
    /// buffer), else shared; `None` for any other value.
    #[inline]
    pub fn into_ready_dense(self) -> Option<stagecraft_tensor::DenseHostTensor> {
        if Arc::strong_count(&self.0) > 1 {
            return match self.ready_host()? {
                HostTensor::Dense(dense) => Some(dense.clone()),
                _ => None,
            };
        }
        match Arc::try_unwrap(self.0) {
            Ok(mut inner) => {
                match std::mem::replace(&mut inner.value, AsyncValue::unavailable()).into_inner() {
                    Some(Ok(TensorValue::Host(HostTensor::Dense(dense)))) => Some(dense),
                    _ => None,
                }
            }
            Err(shared) => match TensorHandle(shared).ready_host()? {
                HostTensor::Dense(dense) => Some(dense.clone()),
                _ => None,
            },
        }
    }

    /// The error, if the handle already resolved to one.
    #[inline]
    pub fn resolved_error(&self) -> Option<&Error> {
        match self.0.value.try_get() {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// The host value, waiting for it if needed. A value in device memory
    /// is an error here: host code reads it through a copy
    /// ([`crate::copy_to_device`] or [`crate::read_to_host`]).
    pub fn wait(&self) -> Result<&HostTensor> {
        match self.wait_value()? {
            TensorValue::Host(host) => Ok(host),
            TensorValue::Device(_) => Err(self.in_device_memory()),
        }
    }

    /// The error of host code reading a value in device memory.
    fn in_device_memory(&self) -> Error {
        Error::new(
            ErrorKind::Device,
            format!(
                "this tensor is in the memory of {}: copy it to the host first \
                 (`to_device(&Device::cpu())`; reading it with `to_vec` copies it)",
                self.0.device
            ),
        )
    }

    /// The value wherever it lives, waiting for it if needed.
    pub fn wait_value(&self) -> Result<&TensorValue> {
        if self.0.traced.is_some() && !self.0.value.is_resolved() {
            return Err(Error::invalid(
                "this tensor is a symbolic value of a function being traced \
                 (function, cond or while_loop): it has no data until the function runs; \
                 return it from the closure instead of reading it",
            ));
        }
        if self.0.lazy.is_some() && !self.0.value.is_resolved() {
            crate::lazy::materialize_handle(self, crate::lazy::Trigger::ValueRead);
        }
        self.0.value.wait().as_ref().map_err(Clone::clone)
    }

    /// Runs `f` once the handle is resolved.
    pub fn and_then(&self, f: impl FnOnce() + Send + 'static) {
        self.0.value.and_then(f)
    }

    /// The value, moved out if this is the last reference to the handle (so
    /// its buffer may be reused in place), else shared.
    pub fn into_value(self) -> Result<HostTensor> {
        match self.into_tensor_value()? {
            TensorValue::Host(host) => Ok(host),
            TensorValue::Device(value) => Err(Error::new(
                ErrorKind::Device,
                format!(
                    "this tensor is in the memory of {}: copy it to the host first",
                    value.storage().device_name()
                ),
            )),
        }
    }

    /// The value wherever it lives, moved out if this is the last reference
    /// to the handle, else shared.
    pub fn into_tensor_value(self) -> Result<TensorValue> {
        self.wait_value()?;
        if Arc::strong_count(&self.0) > 1 {
            // Shared (the user still holds the operand): a failed
            // `try_unwrap` would cost an atomic compare-and-swap per input.
            return self.0.value.wait().clone();
        }
        match Arc::try_unwrap(self.0) {
            Ok(mut inner) => std::mem::replace(&mut inner.value, AsyncValue::unavailable())
                .into_inner()
                .unwrap_or_else(|| Err(Error::internal("a waited-for value is missing"))),
            Err(shared) => shared.value.wait().clone(),
        }
    }

    /// An address identifying the tensor (equal for clones of one handle).
    pub fn addr(&self) -> usize {
        Arc::as_ptr(&self.0) as *const u8 as usize
    }

    /// True when both handles are the same tensor.
    pub fn ptr_eq(&self, other: &TensorHandle) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The number of handles sharing this tensor.
    pub fn ref_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// True when the tensor is marked as one whose gradient is wanted.
    pub fn requires_grad(&self) -> bool {
        // Relaxed: the flag orders nothing else; a thread that marks a
        // tensor and then uses it sees its own write.
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Marks the tensor (every clone of this handle) as one whose gradient
    /// is wanted, or clears the mark.
    pub fn set_requires_grad(&self, on: bool) {
        self.0.requires_grad.store(on, Ordering::Relaxed);
    }
}

impl fmt::Debug for TensorHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.0.value.try_get() {
            None => "pending",
            Some(Ok(_)) => "available",
            Some(Err(_)) => "error",
        };
        write!(
            f,
            "TensorHandle({} on {}, {state})",
            self.0.meta, self.0.device
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_tensor::DenseHostTensor;

    #[test]
    fn handles_are_one_pointer() {
        assert_eq!(
            std::mem::size_of::<TensorHandle>(),
            std::mem::size_of::<usize>()
        );
    }

    #[test]
    fn mismatched_kernel_output_becomes_internal_error() {
        let h = TensorHandle::pending(
            Device::cpu(),
            TensorMetadata::new(DType::F32, [2]),
            MetadataState::Known,
        );
        h.resolve(Ok(DenseHostTensor::from_slice(&[1.0f32], [1])
            .unwrap()
            .into()));
        assert!(h
            .wait()
            .unwrap_err()
            .to_string()
            .contains("promised f32[2]"));
    }

    #[test]
    fn into_value_moves_when_unique() {
        let t = DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap();
        let h = TensorHandle::available(Device::cpu(), t.into());
        let HostTensor::Dense(d) = h.into_value().unwrap() else {
            panic!("dense")
        };
        assert!(d.is_unique());
    }

    /// Clones of a pending handle on several threads see the value that
    /// another thread resolves, and the buffer is shared, not copied.
    #[test]
    fn pending_handles_resolve_across_threads() {
        let h = TensorHandle::pending(
            Device::cpu(),
            TensorMetadata::new(DType::F32, [3]),
            MetadataState::Known,
        );
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || {
                    let HostTensor::Dense(d) = h.wait().unwrap() else {
                        panic!("dense")
                    };
                    d.as_slice::<f32>().unwrap().to_vec()
                })
            })
            .collect();
        let resolver = {
            let h = h.clone();
            std::thread::spawn(move || {
                h.resolve(Ok(DenseHostTensor::from_slice(&[1.0f32, 2.0, 3.0], [3])
                    .unwrap()
                    .into()))
            })
        };
        resolver.join().unwrap();
        for r in readers {
            assert_eq!(r.join().unwrap(), vec![1.0, 2.0, 3.0]);
        }
        assert!(h.wait().is_ok());
    }
}
