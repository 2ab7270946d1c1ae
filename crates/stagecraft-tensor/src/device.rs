//! Tensors in device memory: the storage dimension beside host tensors.
//!
//! A value lives either in host memory ([`HostTensor`], which CPU kernels
//! read and write) or in the memory of a device that is not the host (a
//! GPU's buffers), which only that device's kernels touch. This layer
//! knows nothing of any device API: a device crate implements
//! [`DeviceStorage`] for its buffers, and the runtime moves values between
//! host and device through the device's handler.

use crate::{HostTensor, TensorMetadata};
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A block of device memory a device crate allocated (a GPU buffer).
/// Dropping the last reference frees it, or returns it to the device's
/// pool.
pub trait DeviceStorage: Send + Sync + fmt::Debug + 'static {
    /// The device the memory belongs to, e.g. `gpu:0`, for messages.
    fn device_name(&self) -> &str;
    /// The bytes it holds.
    fn size_in_bytes(&self) -> usize;
    /// The device crate's own type, to reach its buffer.
    fn as_any(&self) -> &dyn Any;
}

/// A tensor whose elements are in device memory: its metadata, known on
/// the host, and the storage. Cloning shares the storage.
#[derive(Clone, Debug)]
pub struct DeviceTensor {
    meta: TensorMetadata,
    storage: Arc<dyn DeviceStorage>,
}

impl DeviceTensor {
    /// A tensor of `meta` whose row-major elements are in `storage`.
    pub fn new(meta: TensorMetadata, storage: Arc<dyn DeviceStorage>) -> DeviceTensor {
        DeviceTensor { meta, storage }
    }

    /// The dtype and shape.
    pub fn metadata(&self) -> &TensorMetadata {
        &self.meta
    }

    /// The memory holding the elements.
    pub fn storage(&self) -> &Arc<dyn DeviceStorage> {
        &self.storage
    }

    /// The device crate's storage type `S`, if the tensor's storage is one.
    pub fn storage_as<S: DeviceStorage>(&self) -> Option<&S> {
        self.storage.as_any().downcast_ref::<S>()
    }

    /// True when this is the only reference to the storage, so a kernel
    /// may write its result into it.
    pub fn storage_is_unique(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
    }

    /// The same storage seen with other metadata of the same byte size (a
    /// reshape).
    pub fn with_metadata(&self, meta: TensorMetadata) -> DeviceTensor {
        DeviceTensor {
            meta,
            storage: self.storage.clone(),
        }
    }
}

/// A tensor's value wherever it lives.
#[derive(Clone, Debug)]
pub enum TensorValue {
    /// In host memory.
    Host(HostTensor),
    /// In the memory of a device that is not the host.
    Device(DeviceTensor),
}

impl TensorValue {
    /// The dtype and shape.
    pub fn metadata(&self) -> &TensorMetadata {
        match self {
            TensorValue::Host(host) => host.metadata(),
            TensorValue::Device(device) => device.metadata(),
        }
    }

    /// The host value, if the value is in host memory.
    pub fn as_host(&self) -> Option<&HostTensor> {
        match self {
            TensorValue::Host(host) => Some(host),
            TensorValue::Device(_) => None,
        }
    }

    /// The device value, if the value is in device memory.
    pub fn as_device(&self) -> Option<&DeviceTensor> {
        match self {
            TensorValue::Host(_) => None,
            TensorValue::Device(device) => Some(device),
        }
    }
}

impl From<HostTensor> for TensorValue {
    fn from(host: HostTensor) -> TensorValue {
        TensorValue::Host(host)
    }
}

impl From<DeviceTensor> for TensorValue {
    fn from(device: DeviceTensor) -> TensorValue {
        TensorValue::Device(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, DenseHostTensor, Shape};

    #[derive(Debug)]
    struct FakeStorage(usize);

    impl DeviceStorage for FakeStorage {
        fn device_name(&self) -> &str {
            "fake:0"
        }
        fn size_in_bytes(&self) -> usize {
            self.0
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn a_device_value_keeps_its_metadata_and_storage_type() {
        let meta = TensorMetadata::new(DType::F32, Shape::new(&[2, 3]));
        let tensor = DeviceTensor::new(meta.clone(), Arc::new(FakeStorage(24)));
        assert!(tensor.storage_is_unique());
        let value = TensorValue::from(tensor.clone());
        assert!(!tensor.storage_is_unique());
        assert_eq!(value.metadata(), &meta);
        assert!(value.as_host().is_none());
        let device = value.as_device().unwrap();
        assert_eq!(device.storage_as::<FakeStorage>().unwrap().0, 24);
        assert_eq!(device.storage().device_name(), "fake:0");
        let flat = device.with_metadata(TensorMetadata::new(DType::F32, Shape::new(&[6])));
        assert_eq!(flat.metadata().shape.dims(), &[6]);

        let host = TensorValue::from(HostTensor::from(
            DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap(),
        ));
        assert!(host.as_device().is_none());
        assert_eq!(host.metadata().shape.dims(), &[2]);
    }
}
