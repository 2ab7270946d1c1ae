//! The everyday shape and indexing methods: stack, split, chunk, flatten,
//! repeat/tile, expand, tril/triu, cumsum, take-along-axis, scatter-add
//! and index-add.
//!
//! Where a composite of existing ops is as fast as a kernel of its own,
//! the method is that composite (`stack` is unsqueezes and one concat,
//! `split`/`chunk` are slices, `flatten` a reshape, `repeat`/`tile` a
//! reshape, broadcast and reshape, `expand` a broadcast), so it inherits
//! their gradients, fusion and every device. A composite checks its own
//! arguments first, so a bad call is an error naming the method (`Stack`,
//! `Split`, ...) at the caller's line; an input that already holds an
//! error passes that error on unchanged.

use crate::Tensor;
use smallvec::{smallvec, SmallVec};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_tensor::{
    element_count, normalize_axis, Element, Error, IndexElement, Location, NumElement,
    TensorMetadata,
};

/// Options of [`Tensor::cumsum_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CumsumOptions {
    /// Leave each element out of its own sum (the first output is 0).
    pub exclusive: bool,
    /// Sum from the end of the axis towards its start.
    pub reverse: bool,
}

impl<T: Element> Tensor<T> {
    /// This tensor again if it already holds an error (which then passes
    /// on unchanged), else a new error of `op` at `location`.
    fn fail_unless_failed(&self, op: &str, location: Location, err: Error) -> Tensor<T> {
        match self.check() {
            Err(_) => self.clone(),
            Ok(()) => self.fail(op, location, err),
        }
    }

    /// Joins tensors of one shape along a new axis `axis` (`-1` appends
    /// it last).
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &cpu).unwrap();
    /// let b = Tensor::<f32>::from_vec(vec![3.0, 4.0], &[2], &cpu).unwrap();
    /// let s = Tensor::stack(&[&a, &b], 1);
    /// assert_eq!(s.dims(), &[2, 2]);
    /// assert_eq!(s.to_vec().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    /// ```
    #[track_caller]
    pub fn stack(tensors: &[&Tensor<T>], axis: isize) -> Tensor<T> {
        let location = Location::caller();
        let Some(first) = tensors.first() else {
            let device = stagecraft_runtime::place(&[]);
            let err = Error::invalid("stack needs at least one tensor");
            return Tensor::error_at("Stack", location, device, &[], err);
        };
        if let Some(failed) = tensors.iter().find(|t| t.check().is_err()) {
            return (*failed).clone();
        }
        let dims = first.dims().to_vec();
        if let Some((i, other)) = tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.dims() != dims.as_slice())
        {
            let err = Error::shape(format!(
                "tensor {i} has shape {:?} but tensor 0 has {dims:?}: stacked tensors must have one shape",
                other.dims()
            ));
            return first.fail("Stack", location, err);
        }
        let axis = match normalize_axis(axis, dims.len() + 1) {
            Ok(a) => a,
            Err(e) => return first.fail("Stack", location, e),
        };
        let mut grown = dims;
        grown.insert(axis, 1);
        let mut reshape = OpAttrs::new();
        reshape.set_dims("shape", &grown);
        let parts: SmallVec<[Tensor<T>; 4]> = tensors
            .iter()
            .map(|t| t.unary(&ops::RESHAPE, &reshape, location))
            .collect();
        let mut concat = OpAttrs::new();
        concat.set_int("axis", axis as i64);
        let args = parts.iter().map(|t| t.handle.clone()).collect();
        crate::tensor::run(&ops::CONCAT, args, &concat, location)
    }

    /// `len` elements of `axis` from `start`, as a slice op; `op` names
    /// the method in the error of a range slice attributes cannot express.
    fn take_range(
        &self,
        axis: usize,
        start: usize,
        len: usize,
        op: &str,
        location: Location,
    ) -> Tensor<T> {
        let rank = self.rank();
        let dim = self.dims()[axis];
        // A slice that reaches the end says so with i64::MAX, which covers
        // axes longer than i64 counts (possible in empty tensors).
        let end = if start + len == dim {
            Some(i64::MAX)
        } else {
            i64::try_from(start + len).ok()
        };
        let (Ok(first), Some(end)) = (i64::try_from(start), end) else {
            let err = Error::shape(format!(
                "a piece starting at {start} of axis {axis} (size {dim}) is beyond what slices address"
            ));
            return self.fail(op, location, err);
        };
        let mut starts: SmallVec<[i64; 4]> = smallvec![0; rank];
        let mut ends: SmallVec<[i64; 4]> = smallvec![i64::MAX; rank];
        starts[axis] = first;
        ends[axis] = end;
        let mut attrs = OpAttrs::new();
        attrs.set_ints("starts", &starts).set_ints("ends", &ends);
        self.unary(&ops::SLICE, &attrs, location)
    }

    /// Splits `axis` into consecutive pieces of the given sizes, which
    /// must add up to the axis. A bad call gives a single error tensor.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::from_vec((0..5).map(|v| v as f32).collect(), &[5], &Device::cpu()).unwrap();
    /// let parts = x.split(&[2, 3], 0);
    /// assert_eq!(parts[0].to_vec().unwrap(), vec![0.0, 1.0]);
    /// assert_eq!(parts[1].to_vec().unwrap(), vec![2.0, 3.0, 4.0]);
    /// ```
    #[track_caller]
    pub fn split(&self, sizes: &[usize], axis: isize) -> Vec<Tensor<T>> {
        let location = Location::caller();
        let axis = match normalize_axis(axis, self.rank()) {
            Ok(a) => a,
            Err(e) => return vec![self.fail_unless_failed("Split", location, e)],
        };
        let dim = self.dims()[axis];
        let total = sizes.iter().try_fold(0usize, |acc, &s| acc.checked_add(s));
        if total != Some(dim) {
            let err = Error::shape(format!(
                "split sizes {sizes:?} do not add up to the size {dim} of axis {axis}"
            ));
            return vec![self.fail_unless_failed("Split", location, err)];
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let piece = self.take_range(axis, start, len, "Split", location);
                start += len;
                piece
            })
            .collect()
    }

    /// Splits `axis` into `chunks` pieces of `ceil(size / chunks)`
    /// elements, the last one smaller when the size does not divide (so
    /// there may be fewer than `chunks`); an empty axis gives one empty
    /// piece. A bad call (zero chunks, a bad axis) gives a single error
    /// tensor.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<i32>::from_vec(vec![1, 2, 3, 4, 5], &[5], &Device::cpu()).unwrap();
    /// let parts = x.chunk(2, 0);
    /// assert_eq!(parts.len(), 2);
    /// assert_eq!(parts[0].to_vec().unwrap(), vec![1, 2, 3]);
    /// assert_eq!(parts[1].to_vec().unwrap(), vec![4, 5]);
    /// ```
    #[track_caller]
    pub fn chunk(&self, chunks: usize, axis: isize) -> Vec<Tensor<T>> {
        let location = Location::caller();
        if chunks == 0 {
            let err = Error::invalid("chunk needs at least one chunk, got 0");
            return vec![self.fail_unless_failed("Chunk", location, err)];
        }
        let axis = match normalize_axis(axis, self.rank()) {
            Ok(a) => a,
            Err(e) => return vec![self.fail_unless_failed("Chunk", location, e)],
        };
        let dim = self.dims()[axis];
        if dim == 0 {
            return vec![self.take_range(axis, 0, 0, "Chunk", location)];
        }
        let size = dim.div_ceil(chunks);
        let count = dim.div_ceil(size);
        // An empty tensor's axis may be as long as a dimension can be: so
        // many pieces are an error, not an abort for lack of memory.
        let mut pieces = Vec::new();
        if pieces.try_reserve_exact(count).is_err() {
            let err = Error::shape(format!(
                "chunk({chunks}) of axis {axis} (size {dim}) makes {count} pieces, more than memory holds"
            ));
            return vec![self.fail_unless_failed("Chunk", location, err)];
        }
        pieces.extend((0..count).map(|k| {
            let start = k * size;
            self.take_range(axis, start, size.min(dim - start), "Chunk", location)
        }));
        pieces
    }

    /// Merges axes `start..=end` into one (negative axes count from the
    /// end); a rank-0 tensor becomes one element of rank 1.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::zeros(&[2, 3, 4, 5], &Device::cpu());
    /// assert_eq!(x.flatten(1, 2).dims(), &[2, 12, 5]);
    /// assert_eq!(x.flatten(0, -1).dims(), &[120]);
    /// ```
    #[track_caller]
    pub fn flatten(&self, start: isize, end: isize) -> Tensor<T> {
        let location = Location::caller();
        let mut dims = self.dims().to_vec();
        if dims.is_empty() {
            dims.push(1);
        }
        let rank = dims.len();
        let (first, last) = match (normalize_axis(start, rank), normalize_axis(end, rank)) {
            (Ok(a), Ok(b)) if a <= b => (a, b),
            (Ok(_), Ok(_)) => {
                let err = Error::new(
                    stagecraft_tensor::ErrorKind::Axis,
                    format!("flatten's start axis {start} comes after its end axis {end}"),
                );
                return self.fail_unless_failed("Flatten", location, err);
            }
            (Err(e), _) | (_, Err(e)) => return self.fail_unless_failed("Flatten", location, e),
        };
        let merged = element_count(&dims[first..=last]);
        dims.drain(first..=last);
        dims.insert(first, merged);
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", &dims);
        self.unary(&ops::RESHAPE, &attrs, location)
    }

    /// Copies the whole tensor `repeats[i]` times along each axis (as
    /// PyTorch's `repeat`): `repeats` has an entry per axis, and extra
    /// leading entries add new leading axes.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<i32>::from_vec(vec![1, 2], &[2], &Device::cpu()).unwrap();
    /// let r = x.repeat(&[2, 3]);
    /// assert_eq!(r.dims(), &[2, 6]);
    /// assert_eq!(r.to_vec().unwrap(), vec![1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2]);
    /// ```
    #[track_caller]
    pub fn repeat(&self, repeats: &[usize]) -> Tensor<T> {
        let location = Location::caller();
        if repeats.len() < self.rank() {
            let err = Error::invalid(format!(
                "repeat needs an entry per axis of {:?}, got {repeats:?}",
                self.dims()
            ));
            return self.fail_unless_failed("Repeat", location, err);
        }
        self.tiled(repeats, "Repeat", location)
    }

    /// Copies the whole tensor `reps[i]` times along each axis (as NumPy's
    /// `tile`): a shorter `reps` is padded with leading 1s, a longer one
    /// adds new leading axes.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<i32>::from_vec(vec![1, 2, 3, 4], &[2, 2], &Device::cpu()).unwrap();
    /// let t = x.tile(&[2]);
    /// assert_eq!(t.dims(), &[2, 4]);
    /// assert_eq!(t.to_vec().unwrap(), vec![1, 2, 1, 2, 3, 4, 3, 4]);
    /// ```
    #[track_caller]
    pub fn tile(&self, reps: &[usize]) -> Tensor<T> {
        let location = Location::caller();
        let rank = self.rank();
        let mut padded = vec![1; rank.saturating_sub(reps.len())];
        padded.extend_from_slice(reps);
        self.tiled(&padded, "Tile", location)
    }

    /// Tiles by `reps` (at least one entry per axis): each axis of size
    /// `d` gets a new axis of `r` in front, the result is broadcast to
    /// `[.., r, d, ..]` and the pairs merged. The gradient of that
    /// broadcast sums the copies back.
    fn tiled(&self, reps: &[usize], op: &str, location: Location) -> Tensor<T> {
        let mut dims = vec![1; reps.len() - self.rank()];
        dims.extend_from_slice(self.dims());
        let merged: Option<Vec<usize>> = reps
            .iter()
            .zip(&dims)
            .map(|(&r, &d)| r.checked_mul(d))
            .collect();
        let fits = merged
            .as_ref()
            .map(|m| TensorMetadata::new(T::DTYPE, m.as_slice()).checked_size_in_bytes());
        let merged = match (merged, fits) {
            (Some(m), Some(Ok(_))) => m,
            (_, Some(Err(e))) => return self.fail_unless_failed(op, location, e),
            _ => {
                let err = Error::shape(format!(
                    "tiling {:?} by {reps:?} gives more than usize::MAX elements",
                    self.dims()
                ));
                return self.fail_unless_failed(op, location, err);
            }
        };
        let spread: Vec<usize> = dims.iter().flat_map(|&d| [1, d]).collect();
        let target: Vec<usize> = reps.iter().zip(&dims).flat_map(|(&r, &d)| [r, d]).collect();
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", &spread);
        let spread = self.unary::<T>(&ops::RESHAPE, &attrs, location);
        attrs.set_dims("shape", &target);
        let copies = spread.unary::<T>(&ops::BROADCAST_TO, &attrs, location);
        attrs.set_dims("shape", &merged);
        copies.unary(&ops::RESHAPE, &attrs, location)
    }

    /// Broadcasts to `sizes` as PyTorch's `expand`: `-1` keeps an axis's
    /// size, an axis of size 1 may grow to any size, and extra leading
    /// entries (which may not be `-1`) add new axes. No data is copied
    /// until a kernel needs it.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2, 1], &Device::cpu()).unwrap();
    /// let e = x.expand(&[3, -1, 2]);
    /// assert_eq!(e.dims(), &[3, 2, 2]);
    /// assert_eq!(e.sum(&[], false).item().unwrap(), 18.0);
    /// ```
    #[track_caller]
    pub fn expand(&self, sizes: &[isize]) -> Tensor<T> {
        let location = Location::caller();
        let dims = self.dims();
        let Some(lead) = sizes.len().checked_sub(dims.len()) else {
            let err = Error::invalid(format!(
                "expand needs at least an entry per axis of {dims:?}, got {sizes:?}"
            ));
            return self.fail_unless_failed("Expand", location, err);
        };
        let mut target = Vec::with_capacity(sizes.len());
        for (i, &s) in sizes.iter().enumerate() {
            let have = i.checked_sub(lead).map(|k| dims[k]);
            let size = match (s, have) {
                (-1, Some(d)) => Some(d),
                (s, Some(d)) if s >= 0 && (s as usize == d || d == 1) => Some(s as usize),
                (s, None) if s >= 0 => Some(s as usize),
                _ => None,
            };
            match size {
                Some(size) => target.push(size),
                None => {
                    let what = match have {
                        Some(d) => format!("axis {} of size {d}", i - lead),
                        None => "a new leading axis".to_string(),
                    };
                    let err = Error::shape(format!(
                        "cannot expand {dims:?} to {sizes:?}: {s} does not fit {what}"
                    ));
                    return self.fail_unless_failed("Expand", location, err);
                }
            }
        }
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", &target);
        self.unary(&ops::BROADCAST_TO, &attrs, location)
    }

    /// The lower triangle of the last two axes (batched over the others):
    /// element `(i, j)` is kept when `j - i <= k`, the rest is zero. `k = 0`
    /// keeps the diagonal, positive `k` diagonals above it.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::ones(&[3, 3], &Device::cpu());
    /// assert_eq!(x.tril(0).to_vec().unwrap(), vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]);
    /// assert_eq!(x.tril(-1).sum(&[], false).item().unwrap(), 3.0);
    /// ```
    #[track_caller]
    pub fn tril(&self, k: i64) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_bool("upper", false).set_int("k", k);
        self.unary(&ops::TRILU, &attrs, Location::caller())
    }

    /// The upper triangle of the last two axes (batched over the others):
    /// element `(i, j)` is kept when `j - i >= k`, the rest is zero.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<bool>::full(&[2, 3], true, &Device::cpu());
    /// assert_eq!(x.triu(1).to_vec().unwrap(), vec![false, true, true, false, false, true]);
    /// ```
    #[track_caller]
    pub fn triu(&self, k: i64) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_bool("upper", true).set_int("k", k);
        self.unary(&ops::TRILU, &attrs, Location::caller())
    }

    /// `out[i][j] = self[indices[i][j]][j]` along `axis` (here 0): NumPy's
    /// `take_along_axis`, PyTorch's `gather`. `indices` has the rank of
    /// `self`, at most its size on the other axes, and gives the result
    /// its shape; negative indices count from the end.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &cpu).unwrap();
    /// let i = Tensor::<i64>::from_vec(vec![1, 0, 0, 0], &[2, 2], &cpu).unwrap();
    /// assert_eq!(x.take_along_axis(1, &i).to_vec().unwrap(), vec![2.0, 1.0, 3.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn take_along_axis<I: IndexElement>(&self, axis: isize, indices: &Tensor<I>) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        let args = smallvec![self.handle.clone(), indices.handle.clone()];
        crate::tensor::run(&ops::GATHER_ELEMENTS, args, &attrs, Location::caller())
    }
}

impl<T: NumElement> Tensor<T> {
    /// Running sums along `axis`: `out[i] = x[0] + … + x[i]`. Float sums
    /// are kept in f64 and each output rounded once; integer sums wrap.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<i64>::from_vec(vec![1, 2, 3, 4], &[2, 2], &Device::cpu()).unwrap();
    /// assert_eq!(x.cumsum(1).to_vec().unwrap(), vec![1, 3, 3, 7]);
    /// assert_eq!(x.cumsum(0).to_vec().unwrap(), vec![1, 2, 4, 6]);
    /// ```
    #[track_caller]
    pub fn cumsum(&self, axis: isize) -> Tensor<T> {
        self.scan(axis, CumsumOptions::default(), Location::caller())
    }

    /// [`Tensor::cumsum`] with options: exclusive (each element left out of
    /// its own sum) and reversed (summing from the end).
    ///
    /// ```
    /// use stagecraft::{CumsumOptions, Device, Tensor};
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3], &Device::cpu()).unwrap();
    /// let options = CumsumOptions { exclusive: true, reverse: true };
    /// assert_eq!(x.cumsum_with(0, options).to_vec().unwrap(), vec![5.0, 3.0, 0.0]);
    /// ```
    #[track_caller]
    pub fn cumsum_with(&self, axis: isize, options: CumsumOptions) -> Tensor<T> {
        self.scan(axis, options, Location::caller())
    }

    fn scan(&self, axis: isize, options: CumsumOptions, location: Location) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("axis", axis as i64)
            .set_bool("exclusive", options.exclusive)
            .set_bool("reverse", options.reverse);
        self.unary(&ops::CUMSUM, &attrs, location)
    }

    /// `out = self; out[indices[i][j]][j] += src[i][j]` along `axis` (here
    /// 0), as PyTorch's `scatter_add`: `src` has the shape of `indices`,
    /// which has the rank of `self` and at most its size on the other
    /// axes. Negative indices count from the end; an index out of range
    /// is an error when the kernel runs. Additions run in row-major order
    /// of `src`, each rounded to `T`.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let x = Tensor::<f32>::zeros(&[3], &cpu);
    /// let i = Tensor::<i64>::from_vec(vec![0, 2, 0], &[3], &cpu).unwrap();
    /// let src = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3], &cpu).unwrap();
    /// assert_eq!(x.scatter_add(0, &i, &src).to_vec().unwrap(), vec![4.0, 0.0, 2.0]);
    /// ```
    #[track_caller]
    pub fn scatter_add<I: IndexElement>(
        &self,
        axis: isize,
        indices: &Tensor<I>,
        src: &Tensor<T>,
    ) -> Tensor<T> {
        self.add_at(&ops::SCATTER_ADD, axis, indices, src, Location::caller())
    }

    /// `out = self; out[.., indices[k], ..] += src[.., k, ..]` along `axis`,
    /// as PyTorch's `index_add`: `indices` is 1-D and `src` is `self` with
    /// `axis` resized to the number of indices. Negative indices count
    /// from the end; an index out of range is an error when the kernel
    /// runs. Additions run in row-major order of `src`, each rounded to
    /// `T`.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let table = Tensor::<f32>::zeros(&[3, 2], &cpu);
    /// let rows = Tensor::<i32>::from_vec(vec![2, 2], &[2], &cpu).unwrap();
    /// let src = Tensor::<f32>::ones(&[2, 2], &cpu);
    /// let out = table.index_add(0, &rows, &src);
    /// assert_eq!(out.to_vec().unwrap(), vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0]);
    /// ```
    #[track_caller]
    pub fn index_add<I: IndexElement>(
        &self,
        axis: isize,
        indices: &Tensor<I>,
        src: &Tensor<T>,
    ) -> Tensor<T> {
        self.add_at(&ops::INDEX_ADD, axis, indices, src, Location::caller())
    }

    fn add_at<I: IndexElement>(
        &self,
        op: &'static ops::OpDef,
        axis: isize,
        indices: &Tensor<I>,
        src: &Tensor<T>,
        location: Location,
    ) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        let args = smallvec![
            self.handle.clone(),
            indices.handle.clone(),
            src.handle.clone()
        ];
        crate::tensor::run(op, args, &attrs, location)
    }
}
