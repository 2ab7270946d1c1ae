//! Sorting kernels: `Sort` and `TopK` (their gradient is `ScatterAdd`'s).
//!
//! Each views its tensors as `[outer, n, inner]` around the axis and works
//! lane by lane (one `(outer, inner)` pair: `n` elements `inner` apart).
//! A lane is copied out, ordered by position with a comparator that is a
//! total order (NaN after every number, ties broken by position), and its
//! results written back, so a sort is stable and `TopK` picks exactly the
//! first `k` entries of that stable order.

use super::elementwise::is_nan;
use super::{first_dtype, split3, take};
use crate::{Inputs, Kernel, KernelContext, KernelRegistry, Outputs, PARALLEL_THRESHOLD};
use smallvec::smallvec;
use stagecraft_tensor::{normalize_axis, DenseHostTensor, Element, Error, Result, TensorMetadata};
use std::cmp::Ordering;
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    use stagecraft_ops as ops;
    registry.add(&ops::SORT, sort_factory);
    registry.add(&ops::TOP_K, sort_factory);
}

/// Ascending with NaN after every number; `-0.0` equals `0.0`.
fn ascending<T: PartialOrd + Copy>(a: T, b: T) -> Ordering {
    match (is_nan(a), is_nan(b)) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// What one lane's kernel computes.
#[derive(Clone, Copy)]
struct Order {
    descending: bool,
    /// How many leading entries of the order to keep (`n` for a sort).
    k: usize,
    /// Keep the kept entries in the order of the sort (else by position).
    sorted: bool,
}

/// The positions of `lane`'s first `order.k` entries in the stable order.
fn order_lane<T: PartialOrd + Copy>(lane: &[T], order: Order, positions: &mut Vec<usize>) {
    positions.clear();
    positions.extend(0..lane.len());
    // A total order: ties fall back to the position, so selecting and
    // sorting with it agree with a stable sort of the keys alone.
    let by = |&i: &usize, &j: &usize| {
        let keys = if order.descending {
            ascending(lane[j], lane[i])
        } else {
            ascending(lane[i], lane[j])
        };
        keys.then(i.cmp(&j))
    };
    if order.k < lane.len() {
        if order.k > 0 {
            positions.select_nth_unstable_by(order.k - 1, by);
        }
        positions.truncate(order.k);
    }
    if order.sorted {
        positions.sort_unstable_by(by);
    } else {
        positions.sort_unstable();
    }
}

fn sort_factory(attrs: &stagecraft_ops::Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let top_k = attrs.op() == &stagecraft_ops::TOP_K;
    let axis = attrs.int("axis")?;
    let (descending, k, sorted) = if top_k {
        (
            attrs.bool("largest")?,
            Some(attrs.int("k")?),
            attrs.bool("sorted")?,
        )
    } else {
        (attrs.bool("descending")?, None, true)
    };
    let run: fn(&DenseHostTensor, usize, Order, &[TensorMetadata]) -> Result<Outputs> =
        crate::with_any_type!(first_dtype(inputs)?, T => sort_typed::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let dims = x.shape().dims();
        let axis = normalize_axis(axis as isize, dims.len())?;
        let n = dims[axis];
        let k = match k {
            Some(k) => usize::try_from(k)
                .ok()
                .filter(|&k| k <= n)
                .ok_or_else(|| Error::internal(format!("TopK's k = {k} was not checked")))?,
            None => n,
        };
        let order = Order {
            descending,
            k,
            sorted,
        };
        run(&x, axis, order, ctx.outputs)
    }))
}

fn sort_typed<T: Element>(
    x: &DenseHostTensor,
    axis: usize,
    order: Order,
    metas: &[TensorMetadata],
) -> Result<Outputs> {
    let [values_meta, indices_meta] = metas else {
        return Err(Error::internal("Sort and TopK have two outputs"));
    };
    let mut values = DenseHostTensor::zeros(values_meta.clone())?;
    let mut indices = DenseHostTensor::zeros(indices_meta.clone())?;
    let (outer, n, inner) = split3(x.shape().dims(), axis);
    let k = order.k;
    if outer * k * inner == 0 {
        return Ok(smallvec![values, indices]);
    }
    let src = x.as_slice::<T>()?;
    // One outer slab of the input (`n · inner`) gives one slab of each
    // output (`k · inner`): slabs are independent and contiguous.
    let slab = |o: usize, vals: &mut [T], idx: &mut [i64]| {
        let input = &src[o * n * inner..][..n * inner];
        let mut lane = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for i in 0..inner {
            lane.clear();
            lane.extend(input[i..].iter().step_by(inner).copied());
            order_lane(&lane, order, &mut positions);
            for (j, &p) in positions.iter().enumerate() {
                vals[j * inner + i] = lane[p];
                idx[j * inner + i] = p as i64;
            }
        }
    };
    let vals = values.as_mut_slice::<T>()?;
    let idx = indices.as_mut_slice::<i64>()?;
    if outer > 1 && src.len() > PARALLEL_THRESHOLD {
        let slabs = vals
            .chunks_mut(k * inner)
            .zip(idx.chunks_mut(k * inner))
            .enumerate();
        crate::pool::for_each_item_init(slabs, outer, || (), |(), (o, (v, i))| slab(o, v, i));
    } else {
        for (o, (v, i)) in vals
            .chunks_mut(k * inner)
            .zip(idx.chunks_mut(k * inner))
            .enumerate()
        {
            slab(o, v, i);
        }
    }
    Ok(smallvec![values, indices])
}

#[cfg(test)]
mod tests {
    use crate::kernels::elementwise::tests::{tensor, values};
    use crate::reference::sort as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::{DType, DenseHostTensor, TensorMetadata};

    /// Runs `op`'s kernel on `inputs`, returning every output.
    fn run(
        op: &'static OpDef,
        inputs: Vec<DenseHostTensor>,
        attrs: &OpAttrs,
    ) -> Vec<DenseHostTensor> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let outputs = op.infer(&metas, attrs).unwrap();
        let ctx = crate::KernelContext {
            attrs: stagecraft_ops::Attrs::new(attrs, op),
            outputs: &outputs,
        };
        let kernel = (crate::registry().get(op).unwrap())(&ctx.attrs, &metas).unwrap();
        kernel(inputs.into_iter().collect(), &ctx)
            .unwrap()
            .into_vec()
    }

    fn same(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
    }

    /// Values with many ties, NaNs, infinities and signed zeros.
    fn lane_values() -> impl Strategy<Value = f64> {
        prop_oneof![
            6 => (-3i32..4).prop_map(f64::from),
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
            1 => Just(-0.0),
            2 => -100.0f64..100.0,
        ]
    }

    const DTYPES: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
    ];

    proptest! {
        /// Sort and TopK against the reference (a stable sort of the
        /// values), every numeric dtype, any axis, both directions.
        #[test]
        fn sort_and_top_k_match_the_reference(
            dims in prop::collection::vec(0usize..5, 1..4),
            raw in prop::collection::vec(lane_values(), 64),
            axis in -3i64..3,
            dtype in 0usize..6,
            descending in any::<bool>(),
            sorted in any::<bool>(),
            k_seed in any::<usize>(),
        ) {
            let rank = dims.len() as i64;
            let axis = axis.rem_euclid(rank) - if axis < 0 { rank } else { 0 };
            let ax = axis.rem_euclid(rank) as usize;
            let dtype = DTYPES[dtype];
            let numel: usize = dims.iter().product();
            // Round through the dtype first, so the reference sees the
            // values the kernel sees.
            let x = tensor(dtype, &raw.iter().cycle().take(numel).copied().collect::<Vec<_>>(), &dims);
            let xv = values(&x);
            let mut attrs = OpAttrs::new();
            attrs.set_int("axis", axis).set_bool("descending", descending);
            let out = run(&stagecraft_ops::SORT, vec![x.clone()], &attrs);
            let n = dims[ax];
            let (want, want_idx) = reference::top_k(&xv, &dims, ax, n, descending, true);
            prop_assert!(same(&values(&out[0]), &want), "{:?} vs {:?}", values(&out[0]), want);
            prop_assert_eq!(out[1].as_slice::<i64>().unwrap(), want_idx.as_slice());
            let k = k_seed % (n + 1);
            let mut attrs = OpAttrs::new();
            attrs.set_int("axis", axis).set_int("k", k as i64)
                .set_bool("largest", descending).set_bool("sorted", sorted);
            let out = run(&stagecraft_ops::TOP_K, vec![x], &attrs);
            let (want, want_idx) = reference::top_k(&xv, &dims, ax, k, descending, sorted);
            prop_assert!(same(&values(&out[0]), &want), "{:?} vs {:?}", values(&out[0]), want);
            prop_assert_eq!(out[1].as_slice::<i64>().unwrap(), want_idx.as_slice());
        }
    }

    #[test]
    fn sort_is_stable_and_puts_nan_last() {
        let x = tensor(
            DType::F32,
            &[2.0, f64::NAN, -0.0, 1.0, 0.0, 2.0, f64::NAN],
            &[7],
        );
        let out = run(&stagecraft_ops::SORT, vec![x.clone()], &OpAttrs::new());
        assert!(same(
            &values(&out[0]),
            &[-0.0, 0.0, 1.0, 2.0, 2.0, f64::NAN, f64::NAN]
        ));
        assert_eq!(out[1].as_slice::<i64>().unwrap(), &[2, 4, 3, 0, 5, 1, 6]);
        let mut down = OpAttrs::new();
        down.set_bool("descending", true);
        let out = run(&stagecraft_ops::SORT, vec![x], &down);
        assert_eq!(out[1].as_slice::<i64>().unwrap(), &[1, 6, 0, 5, 3, 2, 4]);
    }

    /// A lane long enough to split across threads, and a long TopK.
    #[test]
    fn large_inputs_match_the_reference() {
        let n = 40_000;
        let raw: Vec<f64> = (0..n).map(|i| ((i * 7919) % 1000) as f64 - 500.0).collect();
        for dims in [[4, n / 4], [n / 4, 4]] {
            let x = tensor(DType::F32, &raw, &dims);
            for ax in 0..2 {
                let mut attrs = OpAttrs::new();
                attrs.set_int("axis", ax as i64).set_int("k", 3);
                let out = run(&stagecraft_ops::TOP_K, vec![x.clone()], &attrs);
                let (want, idx) = reference::top_k(&raw, &dims, ax, 3, true, true);
                assert!(same(&values(&out[0]), &want));
                assert_eq!(out[1].as_slice::<i64>().unwrap(), idx.as_slice());
                let out = run(&stagecraft_ops::SORT, vec![x.clone()], &attrs_axis(ax));
                let (want, idx) = reference::top_k(&raw, &dims, ax, dims[ax], false, true);
                assert!(same(&values(&out[0]), &want));
                assert_eq!(out[1].as_slice::<i64>().unwrap(), idx.as_slice());
            }
        }
    }

    fn attrs_axis(axis: usize) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_int("axis", axis as i64);
        a
    }
}
