//! Shapes with inline storage, tensor metadata and the NumPy broadcasting rule.

use crate::{DType, Error, Result};
use smallvec::SmallVec;
use std::fmt;

/// The dimensions of a tensor; up to four are stored inline without a heap
/// allocation.
#[derive(Eq, Default)]
pub struct Shape(SmallVec<[usize; 4]>);

impl std::hash::Hash for Shape {
    /// As the dims slice hashes, consistent with `eq`.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.dims().hash(state)
    }
}

impl PartialEq for Shape {
    /// Dim by dim, inline: slice equality calls `memcmp`, whose call
    /// costs more than comparing the few dims of a shape (the eager fast
    /// path compares every input's shape per op).
    #[inline]
    fn eq(&self, other: &Shape) -> bool {
        let (a, b) = (self.dims(), other.dims());
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
    }
}

impl Clone for Shape {
    /// A memcpy of the dims: SmallVec's own `Clone` goes through an
    /// element-by-element iterator, which dominated the cost of tiny ops.
    #[inline]
    fn clone(&self) -> Shape {
        Shape(SmallVec::from_slice(&self.0))
    }
}

impl Shape {
    /// The shape of a scalar (rank 0).
    pub fn scalar() -> Shape {
        Shape(SmallVec::new())
    }

    /// A shape from its dimensions.
    pub fn new(dims: &[usize]) -> Shape {
        Shape(SmallVec::from_slice(dims))
    }

    /// The dimensions.
    #[inline]
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Mutable dimensions, for shape rules that edit a copy.
    pub fn dims_mut(&mut self) -> &mut SmallVec<[usize; 4]> {
        &mut self.0
    }

    /// The number of dimensions.
    #[inline]
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The number of elements (1 for a scalar, 0 if any dimension is 0).
    ///
    /// An empty shape may hold huge dimensions (`[usize::MAX, 2, 0]`), so
    /// the product is checked; an overflow without a zero dimension cannot
    /// come from a valid shape and saturates, which every allocation
    /// refuses.
    #[inline]
    pub fn numel(&self) -> usize {
        element_count(&self.0)
    }

    /// The number of elements, or an error if it overflows `usize`.
    pub fn checked_numel(&self) -> Result<usize> {
        checked_element_count(&self.0)
            .ok_or_else(|| Error::shape(format!("the number of elements of {self} overflows")))
    }

    /// Row-major (C order) strides in elements.
    ///
    /// A stride can only overflow when a later dimension is zero (shapes
    /// with more elements than `usize` holds are rejected), and then no
    /// element is ever addressed: such strides saturate instead of
    /// panicking.
    pub fn strides(&self) -> SmallVec<[usize; 4]> {
        let mut strides: SmallVec<[usize; 4]> = SmallVec::from_elem(1, self.rank());
        for i in (0..self.rank().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1].saturating_mul(self.0[i + 1]);
        }
        strides
    }

    /// Adds a dimension at the end.
    pub fn push(&mut self, dim: usize) {
        self.0.push(dim);
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Shape {
        Shape::new(dims)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Shape {
        Shape::new(&dims)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Shape {
        Shape(SmallVec::from_vec(dims))
    }
}

impl FromIterator<usize> for Shape {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Shape {
        Shape(iter.into_iter().collect())
    }
}

impl std::ops::Index<usize> for Shape {
    type Output = usize;
    fn index(&self, i: usize) -> &usize {
        &self.0[i]
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The dtype and shape of a tensor: everything known about it without its
/// values.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TensorMetadata {
    /// The element type.
    pub dtype: DType,
    /// The dimensions.
    pub shape: Shape,
}

impl TensorMetadata {
    /// Metadata from a dtype and a shape.
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorMetadata {
        TensorMetadata {
            dtype,
            shape: shape.into(),
        }
    }

    /// Bytes needed for the values of a dense tensor with this metadata.
    ///
    /// Saturates where the product overflows: such a tensor never fits.
    pub fn size_in_bytes(&self) -> usize {
        self.shape
            .numel()
            .saturating_mul(self.dtype.size_in_bytes())
    }

    /// Bytes needed for the values of a dense tensor with this metadata, or
    /// an error naming it if no address space holds that many (more than
    /// `isize::MAX`).
    pub fn checked_size_in_bytes(&self) -> Result<usize> {
        self.shape
            .checked_numel()?
            .checked_mul(self.dtype.size_in_bytes())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::shape(format!(
                    "a tensor of {self} does not fit in memory (it needs more than isize::MAX bytes)"
                ))
            })
    }
}

impl fmt::Display for TensorMetadata {
    /// The text form used in messages and traces, e.g. `f32[2,3]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl fmt::Debug for TensorMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The product of `dims`, as [`Shape::numel`] computes it: 0 when any is
/// 0 however large the others (their product may overflow before the zero
/// is reached), saturating at `usize::MAX` otherwise. Kernels use it for the
/// element counts of dimension runs.
#[inline]
pub fn element_count(dims: &[usize]) -> usize {
    checked_element_count(dims).unwrap_or(usize::MAX)
}

/// The product of `dims` (0 when any is 0), or `None` when it overflows.
#[inline]
fn checked_element_count(dims: &[usize]) -> Option<usize> {
    match dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) {
        Some(n) => Some(n),
        None if dims.contains(&0) => Some(0),
        None => None,
    }
}

/// The NumPy broadcast of two shapes: align trailing dimensions; each pair
/// must be equal or contain a 1.
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Result<Shape> {
    if a == b {
        return Ok(a.clone());
    }
    let rank = a.rank().max(b.rank());
    let mut out = Shape(SmallVec::from_elem(0, rank));
    for i in 0..rank {
        let da = dim_from_end(a, rank - 1 - i);
        let db = dim_from_end(b, rank - 1 - i);
        out.0[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            (x, y) => {
                return Err(Error::shape(format!(
                    "shapes {a} and {b} cannot be broadcast: dimension {x} vs {y} at axis {} from the end",
                    rank - i
                )))
            }
        };
    }
    Ok(out)
}

fn dim_from_end(shape: &Shape, from_end: usize) -> usize {
    if from_end < shape.rank() {
        shape.0[shape.rank() - 1 - from_end]
    } else {
        1
    }
}

/// Resolves a possibly negative axis against `rank`; `-1` is the last axis.
pub fn normalize_axis(axis: isize, rank: usize) -> Result<usize> {
    let resolved = if axis < 0 { axis + rank as isize } else { axis };
    if resolved < 0 || resolved >= rank as isize {
        return Err(Error::new(
            crate::ErrorKind::Axis,
            format!("axis {axis} is out of range for a tensor of rank {rank}"),
        ));
    }
    Ok(resolved as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Found by fuzzing: a zero-size shape whose other dimensions multiply
    /// past `usize::MAX` panicked computing its strides.
    #[test]
    fn strides_of_a_zero_size_shape_with_huge_dims_saturate() {
        let s = Shape::new(&[0, usize::MAX, usize::MAX]);
        assert_eq!(s.checked_numel().unwrap(), 0);
        assert_eq!(s.strides().as_slice(), &[usize::MAX, usize::MAX, 1]);
        assert_eq!(Shape::new(&[2, 3, 4]).strides().as_slice(), &[12, 4, 1]);
    }

    /// The product of the dimensions before the zero overflows here; the
    /// shape is still a valid empty one.
    #[test]
    fn element_counts_of_empty_shapes_with_huge_dims_are_zero() {
        let s = Shape::new(&[usize::MAX, 2, 0]);
        assert_eq!(s.numel(), 0);
        assert_eq!(s.checked_numel().unwrap(), 0);
        assert_eq!(TensorMetadata::new(DType::F64, s).size_in_bytes(), 0);
        let too_many = Shape::new(&[usize::MAX, 2]);
        assert!(too_many.checked_numel().is_err());
        assert_eq!(too_many.numel(), usize::MAX);
        let meta = TensorMetadata::new(DType::F32, Shape::new(&[usize::MAX / 2]));
        assert_eq!(meta.size_in_bytes(), usize::MAX);
    }

    #[test]
    fn broadcasting_follows_numpy() {
        let s = |d: &[usize]| Shape::new(d);
        assert_eq!(broadcast_shapes(&s(&[2, 3]), &s(&[3])).unwrap(), s(&[2, 3]));
        assert_eq!(
            broadcast_shapes(&s(&[4, 1, 5]), &s(&[3, 1])).unwrap(),
            s(&[4, 3, 5])
        );
        assert_eq!(broadcast_shapes(&s(&[]), &s(&[2, 2])).unwrap(), s(&[2, 2]));
        assert_eq!(
            broadcast_shapes(&s(&[0, 3]), &s(&[1, 3])).unwrap(),
            s(&[0, 3])
        );
        assert!(broadcast_shapes(&s(&[2, 3]), &s(&[4])).is_err());
        assert!(broadcast_shapes(&s(&[0]), &s(&[2])).is_err());
    }

    #[test]
    fn axes_normalize_or_fail() {
        assert_eq!(normalize_axis(-1, 3).unwrap(), 2);
        assert_eq!(normalize_axis(0, 1).unwrap(), 0);
        assert!(normalize_axis(3, 3).is_err());
        assert!(normalize_axis(-4, 3).is_err());
        assert!(normalize_axis(0, 0).is_err());
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(Shape::new(&[2, 3, 4]).strides().as_slice(), &[12, 4, 1]);
        assert!(Shape::scalar().strides().is_empty());
        assert_eq!(Shape::scalar().numel(), 1);
    }

    proptest! {
        #[test]
        fn broadcast_is_commutative_and_idempotent(
            a in proptest::collection::vec(0usize..4, 0..4),
            b in proptest::collection::vec(0usize..4, 0..4),
        ) {
            let (a, b) = (Shape::new(&a), Shape::new(&b));
            let ab = broadcast_shapes(&a, &b);
            let ba = broadcast_shapes(&b, &a);
            prop_assert_eq!(ab.is_ok(), ba.is_ok());
            if let (Ok(ab), Ok(ba)) = (ab, ba) {
                prop_assert_eq!(&ab, &ba);
                prop_assert_eq!(broadcast_shapes(&ab, &a).unwrap(), ab.clone());
                prop_assert_eq!(ab.rank(), a.rank().max(b.rank()));
            }
        }
    }
}
