//! Host tensors: dense values in a shared buffer, and a broadcast scalar that
//! needs no buffer at all until it is converted.

use crate::buffer::{bytes_for, check_element_bytes};
use crate::{Buffer, DType, Element, Error, Location, Result, Scalar, Shape, TensorMetadata};

/// A dense, row-major tensor in host memory.
///
/// Cloning shares the buffer. Kernels may write into the buffer in place when
/// [`DenseHostTensor::is_unique`] holds.
///
/// Invariant, which [`DenseHostTensor::as_slice`] relies on to hand out
/// slices without a pass over the bytes: the buffer holds exactly the
/// metadata's elements, each a valid value of the dtype (a bool tensor's
/// bytes are 0 or 1). Every constructor establishes it ([`from_buffer`]
/// checks bool bytes), and the buffer is written only through
/// [`DenseHostTensor::as_mut_slice`] (typed values) while the tensor holds
/// it.
///
/// [`from_buffer`]: DenseHostTensor::from_buffer
#[derive(Clone, Debug)]
pub struct DenseHostTensor {
    meta: TensorMetadata,
    buffer: Buffer,
}

impl DenseHostTensor {
    /// A tensor of zeros.
    pub fn zeros(meta: TensorMetadata) -> Result<DenseHostTensor> {
        let bytes = meta.checked_size_in_bytes()?;
        let buffer = Buffer::try_zeroed(bytes).ok_or_else(|| Self::no_memory(&meta, bytes))?;
        Ok(DenseHostTensor { meta, buffer })
    }

    /// A tensor whose values are unspecified, for a kernel that writes every
    /// element (bool tensors are zeroed: a reused block may hold bytes that
    /// are not bools, and a tensor's bytes must be valid values).
    pub fn for_overwrite(meta: TensorMetadata) -> Result<DenseHostTensor> {
        let bytes = meta.checked_size_in_bytes()?;
        let buffer = if meta.dtype == DType::Bool {
            Buffer::try_zeroed(bytes)
        } else {
            Buffer::try_for_overwrite(bytes)
        };
        let buffer = buffer.ok_or_else(|| Self::no_memory(&meta, bytes))?;
        Ok(DenseHostTensor { meta, buffer })
    }

    /// The error for a tensor the system has no memory for (of the same
    /// kind as one too big to address, see `checked_size_in_bytes`).
    fn no_memory(meta: &TensorMetadata, bytes: usize) -> Error {
        Error::shape(format!(
            "a tensor of {meta} ({bytes} bytes) does not fit in memory"
        ))
    }

    /// A tensor taking its values from `values`, which must hold exactly
    /// `shape.numel()` elements.
    pub fn from_slice<T: Element>(
        values: &[T],
        shape: impl Into<Shape>,
    ) -> Result<DenseHostTensor> {
        let shape = shape.into();
        let numel = shape.checked_numel()?;
        if numel != values.len() {
            return Err(Error::invalid(format!(
                "{} values cannot fill a tensor of shape {shape} ({numel} elements)",
                values.len()
            )));
        }
        Ok(DenseHostTensor {
            meta: TensorMetadata::new(T::DTYPE, shape),
            buffer: Buffer::from_slice(values),
        })
    }

    /// Wraps an existing buffer; its length must match the metadata, and
    /// under bool metadata every byte must be 0 or 1 (checked: one pass over
    /// the bytes for bool, none for other dtypes, whose values any bytes
    /// are).
    #[track_caller]
    pub fn from_buffer(meta: TensorMetadata, buffer: Buffer) -> Result<DenseHostTensor> {
        let location = Location::caller();
        if buffer.len() != bytes_for(meta.dtype, meta.shape.numel()) {
            return Err(Error::invalid(format!(
                "a buffer of {} bytes cannot hold {meta}",
                buffer.len()
            ))
            .with_op("DenseHostTensor::from_buffer")
            .at(location));
        }
        if meta.dtype == DType::Bool {
            check_element_bytes::<bool>(buffer.bytes())
                .map_err(|e| e.with_op("DenseHostTensor::from_buffer").at(location))?;
        }
        Ok(DenseHostTensor { meta, buffer })
    }

    /// Dtype and shape.
    #[inline]
    pub fn metadata(&self) -> &TensorMetadata {
        &self.meta
    }

    /// The element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// The shape.
    #[inline]
    pub fn shape(&self) -> &Shape {
        &self.meta.shape
    }

    /// The number of elements.
    #[inline]
    pub fn numel(&self) -> usize {
        self.meta.shape.numel()
    }

    /// The underlying buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// True when no other tensor shares the buffer.
    pub fn is_unique(&self) -> bool {
        self.buffer.is_unique()
    }

    /// The same values under another shape with as many elements (no copy).
    pub fn reshaped(&self, shape: impl Into<Shape>) -> Result<DenseHostTensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::shape(format!(
                "cannot view {} elements as shape {shape}",
                self.numel()
            )));
        }
        Ok(DenseHostTensor {
            meta: TensorMetadata::new(self.dtype(), shape),
            buffer: self.buffer.clone(),
        })
    }

    /// A copy of the values in a new buffer of its own.
    pub fn deep_copy(&self) -> DenseHostTensor {
        DenseHostTensor {
            meta: self.meta.clone(),
            buffer: Buffer::copy_of(self.buffer.bytes()),
        }
    }

    /// Reuses this tensor's buffer for a result of the same byte size,
    /// relabelled with `meta` (checked as [`DenseHostTensor::from_buffer`]
    /// checks).
    #[track_caller]
    pub fn into_relabelled(self, meta: TensorMetadata) -> Result<DenseHostTensor> {
        DenseHostTensor::from_buffer(meta, self.buffer)
    }

    fn check_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(format!(
                "the tensor holds {} values, not {}",
                self.dtype(),
                T::DTYPE
            )));
        }
        Ok(())
    }

    /// The values as a slice, if `T` is the tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_dtype::<T>()?;
        // SAFETY: `T` is the dtype, and by the type's invariant the buffer
        // holds whole elements of it, each a valid value.
        Ok(unsafe { self.buffer.typed_unchecked() })
    }

    /// The values as a mutable slice, if `T` is the dtype and the buffer is
    /// not shared.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_dtype::<T>()?;
        // SAFETY: as in `as_slice`; what is written through the slice is
        // valid `T`s, so the invariant still holds afterwards.
        unsafe { self.buffer.typed_mut_unchecked() }
            .ok_or_else(|| Error::internal("cannot write to a shared buffer"))
    }

    /// A copy of the values.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        Ok(self.as_slice::<T>()?.to_vec())
    }

    /// The value at a flat (row-major) index, as a [`Scalar`].
    pub fn get_scalar(&self, index: usize) -> Option<Scalar> {
        fn get<T: Element>(t: &DenseHostTensor, i: usize) -> Option<Scalar> {
            t.as_slice::<T>().ok()?.get(i).map(|v| v.to_scalar())
        }
        match self.dtype() {
            DType::Bool => get::<bool>(self, index),
            DType::U8 => get::<u8>(self, index),
            DType::I8 => get::<i8>(self, index),
            DType::U16 => get::<u16>(self, index),
            DType::I16 => get::<i16>(self, index),
            DType::U32 => get::<u32>(self, index),
            DType::U64 => get::<u64>(self, index),
            DType::I32 => get::<i32>(self, index),
            DType::I64 => get::<i64>(self, index),
            DType::F16 => get::<half::f16>(self, index),
            DType::BF16 => get::<half::bf16>(self, index),
            DType::F32 => get::<f32>(self, index),
            DType::F64 => get::<f64>(self, index),
            DType::List => None,
        }
    }
}

/// A tensor whose elements all equal one scalar: `full`, `zeros` and `ones`
/// need no buffer until something asks for dense values.
#[derive(Clone, Debug)]
pub struct ScalarHostTensor {
    meta: TensorMetadata,
    value: Scalar,
}

impl ScalarHostTensor {
    /// A tensor of `shape` filled with `value`.
    pub fn new(value: Scalar, shape: impl Into<Shape>) -> ScalarHostTensor {
        ScalarHostTensor {
            meta: TensorMetadata::new(value.dtype(), shape),
            value,
        }
    }

    /// Dtype and shape.
    pub fn metadata(&self) -> &TensorMetadata {
        &self.meta
    }

    /// The repeated value.
    pub fn value(&self) -> Scalar {
        self.value
    }

    /// Materializes the values (the explicit conversion to a dense tensor).
    pub fn to_dense(&self) -> Result<DenseHostTensor> {
        fn fill<T: Element>(meta: &TensorMetadata, v: Scalar) -> Result<DenseHostTensor> {
            // Always fill: comparing with zero would lose the sign of -0.0.
            let mut dense = DenseHostTensor::for_overwrite(meta.clone())?;
            dense.as_mut_slice::<T>()?.fill(T::from_scalar(v));
            Ok(dense)
        }
        match self.meta.dtype {
            DType::Bool => fill::<bool>(&self.meta, self.value),
            DType::U8 => fill::<u8>(&self.meta, self.value),
            DType::I8 => fill::<i8>(&self.meta, self.value),
            DType::U16 => fill::<u16>(&self.meta, self.value),
            DType::I16 => fill::<i16>(&self.meta, self.value),
            DType::U32 => fill::<u32>(&self.meta, self.value),
            DType::U64 => fill::<u64>(&self.meta, self.value),
            DType::I32 => fill::<i32>(&self.meta, self.value),
            DType::I64 => fill::<i64>(&self.meta, self.value),
            DType::F16 => fill::<half::f16>(&self.meta, self.value),
            DType::BF16 => fill::<half::bf16>(&self.meta, self.value),
            DType::F32 => fill::<f32>(&self.meta, self.value),
            DType::F64 => fill::<f64>(&self.meta, self.value),
            DType::List => Err(list_is_not_dense()),
        }
    }
}

/// Any host tensor kind.
#[derive(Clone, Debug)]
pub enum HostTensor {
    /// Dense values in a buffer.
    Dense(DenseHostTensor),
    /// One value repeated over a shape.
    Scalar(ScalarHostTensor),
    /// A list of tensors (dtype [`DType::List`], rank 0).
    List(TensorList),
}

/// An immutable list of tensors, the value a While's gradient stacks
/// per-iteration values in. Pushing to a list nobody else holds reuses its
/// storage, so a loop that threads one list through its iterations pushes
/// in amortized O(1); the items themselves are shared, never copied.
#[derive(Clone, Debug)]
pub struct TensorList {
    items: std::sync::Arc<Vec<HostTensor>>,
}

static LIST_META: std::sync::OnceLock<TensorMetadata> = std::sync::OnceLock::new();

impl TensorList {
    /// The empty list (also the zero of a list's gradient).
    pub fn empty() -> TensorList {
        TensorList {
            items: std::sync::Arc::new(Vec::new()),
        }
    }

    /// The metadata every list has: dtype list, rank 0.
    pub fn metadata() -> &'static TensorMetadata {
        LIST_META.get_or_init(|| TensorMetadata::new(DType::List, Shape::scalar()))
    }

    /// An identity of the items' storage: two lists with the same identity
    /// hold the same items (used to deduplicate constants).
    pub fn identity(&self) -> usize {
        std::sync::Arc::as_ptr(&self.items) as usize
    }

    /// The number of items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when the list has no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The list with `item` appended.
    pub fn push(mut self, item: HostTensor) -> TensorList {
        std::sync::Arc::make_mut(&mut self.items).push(item);
        self
    }

    /// The list without its last item, and that item (`None` when empty).
    pub fn pop(mut self) -> (TensorList, Option<HostTensor>) {
        let item = std::sync::Arc::make_mut(&mut self.items).pop();
        (self, item)
    }

    /// The bytes held by the items' buffers (shared buffers count fully).
    pub fn item_bytes(&self) -> usize {
        self.items
            .iter()
            .map(|t| match t {
                HostTensor::Dense(d) => d.buffer().len(),
                HostTensor::Scalar(_) => 0,
                HostTensor::List(l) => l.item_bytes(),
            })
            .sum()
    }
}

impl HostTensor {
    /// Dtype and shape.
    pub fn metadata(&self) -> &TensorMetadata {
        match self {
            HostTensor::Dense(t) => t.metadata(),
            HostTensor::Scalar(t) => t.metadata(),
            HostTensor::List(_) => TensorList::metadata(),
        }
    }

    /// A tensor of `meta` whose elements all equal `value`, owning no
    /// buffer; for the list dtype, the empty list.
    pub fn filled(value: Scalar, meta: &TensorMetadata) -> HostTensor {
        if meta.dtype == DType::List {
            return HostTensor::List(TensorList::empty());
        }
        HostTensor::Scalar(ScalarHostTensor::new(
            value.cast(meta.dtype),
            meta.shape.clone(),
        ))
    }

    /// True when both hold the same values of the same type, bit for bit
    /// (NaN payloads and signed zeros included). Lists compare by identity,
    /// and every empty list equals every other.
    pub fn same_value(&self, other: &HostTensor) -> bool {
        match (self, other) {
            (HostTensor::Dense(x), HostTensor::Dense(y)) => {
                x.metadata() == y.metadata() && x.buffer().bytes() == y.buffer().bytes()
            }
            (HostTensor::Scalar(x), HostTensor::Scalar(y)) => {
                x.metadata() == y.metadata() && x.value().to_bits() == y.value().to_bits()
            }
            (HostTensor::List(x), HostTensor::List(y)) => {
                x.identity() == y.identity() || (x.is_empty() && y.is_empty())
            }
            _ => false,
        }
    }

    /// The values as a dense tensor (free for dense, one fill for scalar).
    pub fn to_dense(&self) -> Result<DenseHostTensor> {
        match self {
            HostTensor::Dense(t) => Ok(t.clone()),
            HostTensor::Scalar(t) => t.to_dense(),
            HostTensor::List(_) => Err(list_is_not_dense()),
        }
    }

    /// Converts into a dense tensor without sharing when already dense.
    pub fn into_dense(self) -> Result<DenseHostTensor> {
        match self {
            HostTensor::Dense(t) => Ok(t),
            HostTensor::Scalar(t) => t.to_dense(),
            HostTensor::List(_) => Err(list_is_not_dense()),
        }
    }
}

fn list_is_not_dense() -> Error {
    Error::dtype("a list of tensors has no elements of its own; only list ops take it")
}

impl From<DenseHostTensor> for HostTensor {
    fn from(t: DenseHostTensor) -> HostTensor {
        HostTensor::Dense(t)
    }
}

impl From<ScalarHostTensor> for HostTensor {
    fn from(t: ScalarHostTensor) -> HostTensor {
        HostTensor::Scalar(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_slice_checks_length() {
        assert!(DenseHostTensor::from_slice(&[1.0f32, 2.0], [3]).is_err());
        let t = DenseHostTensor::from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        assert!(t.as_slice::<f64>().is_err());
    }

    #[test]
    fn scalar_tensor_converts_explicitly() {
        let s = ScalarHostTensor::new(Scalar::I32(7), [2, 2]);
        assert_eq!(s.to_dense().unwrap().to_vec::<i32>().unwrap(), vec![7; 4]);
        let empty = ScalarHostTensor::new(Scalar::F32(1.0), [0, 5]);
        assert_eq!(empty.to_dense().unwrap().numel(), 0);
    }

    #[test]
    fn reshape_shares_and_checks() {
        let t = DenseHostTensor::from_slice(&[1i64, 2, 3, 4, 5, 6], [2, 3]).unwrap();
        let r = t.reshaped([3, 2]).unwrap();
        assert!(r.buffer().ptr_eq(t.buffer()));
        assert!(t.reshaped([4]).is_err());
    }

    #[test]
    fn huge_shapes_fail_cleanly() {
        let meta = TensorMetadata::new(DType::F64, [usize::MAX / 2, 4]);
        assert!(DenseHostTensor::zeros(meta).is_err());
    }

    #[test]
    fn bool_metadata_over_bytes_that_are_not_bools_is_refused() {
        let meta = TensorMetadata::new(DType::Bool, [3]);
        let bad = Buffer::copy_of(&[1, 0, 2]);
        let line = line!() + 1;
        let err = DenseHostTensor::from_buffer(meta.clone(), bad).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidArgument);
        assert_eq!(err.op(), Some("DenseHostTensor::from_buffer"));
        assert!(err.message().contains("byte 2 holds 2"), "{err}");
        assert_eq!(err.location().unwrap().line(), line);
        let ok = DenseHostTensor::from_buffer(meta, Buffer::copy_of(&[1, 0, 1])).unwrap();
        assert_eq!(ok.to_vec::<bool>().unwrap(), vec![true, false, true]);
        // Relabelling another dtype's buffer as bools checks the same way.
        let ints = DenseHostTensor::from_slice(&[2i32], [1]).unwrap();
        let relabelled = ints.into_relabelled(TensorMetadata::new(DType::Bool, [4]));
        assert!(relabelled.is_err());
    }

    #[test]
    fn negative_zero_scalars_keep_their_sign_when_densified() {
        let s = ScalarHostTensor::new(Scalar::F32(-0.0), [3]);
        let d = s.to_dense().unwrap();
        assert!(d
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.to_bits() == (-0.0f32).to_bits()));
    }
}
