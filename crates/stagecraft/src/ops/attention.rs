//! Scaled dot-product attention, as one fused op
//! (`ScaledDotProductAttention`, defined in `stagecraft-ops`): its CPU
//! kernel never forms the matrix of scores, and its gradient is one fused
//! op too.

use crate::Tensor;
use smallvec::smallvec;
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_tensor::{Error, FloatElement, Location};

impl<T: FloatElement> Tensor<T> {
    /// Attention of the queries `self: [B, H, T, D]` over keys `k: [B, H,
    /// S, D]` and values `v: [B, H, S, Dv]`: `softmax(self·kᵀ·scale +
    /// mask)·v`, shape `[B, H, T, Dv]`. Rank-3 inputs (`[BH, T, D]`, ...)
    /// work the same way. `scale` defaults to `1/√D`.
    ///
    /// With `causal`, query `i` sees keys `0..=i`, counted from the first
    /// query and the first key as PyTorch's `is_causal` does (the
    /// upper-left alignment): when `T > S`, queries `S..T` see every key,
    /// and when `T < S`, keys `T..S` are seen by none. A query that sees no
    /// key (only possible when `S = 0`) gets zeros.
    ///
    /// The CPU kernel is fused and tiled (FlashAttention's online softmax
    /// over blocks of 64 keys), so memory beyond the inputs and output is
    /// a few blocks per thread, never `T × S`; the gradient is one fused
    /// op as well. Mismatched shapes, a non-finite `scale` and integer
    /// inputs are errors naming `ScaledDotProductAttention` and the
    /// caller's line.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// // One head, two queries, two keys with values 4 and 8.
    /// let q = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 1, 2, 1], &cpu)?;
    /// let k = Tensor::<f32>::from_vec(vec![0.0, 3f32.ln()], &[1, 1, 2, 1], &cpu)?;
    /// let v = Tensor::<f32>::from_vec(vec![4.0, 8.0], &[1, 1, 2, 1], &cpu)?;
    /// // Weights 1/4 and 3/4; causal, the first query sees the first key.
    /// let o = q.scaled_dot_product_attention(&k, &v, true, Some(1.0));
    /// let o = o.to_vec()?;
    /// assert_eq!(o[0], 4.0);
    /// assert!((o[1] - 7.0).abs() < 1e-5);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn scaled_dot_product_attention(
        &self,
        k: &Tensor<T>,
        v: &Tensor<T>,
        causal: bool,
        scale: Option<f64>,
    ) -> Tensor<T> {
        attention(
            self,
            k,
            v,
            causal,
            scale,
            ops::HEADS_FIRST,
            Location::caller(),
        )
    }

    /// [`Tensor::scaled_dot_product_attention`] for operands whose heads
    /// come after the sequence (FlashAttention's layout): queries `self:
    /// [B, T, H, D]`, keys `k: [B, S, H, D]` and values `v: [B, S, H,
    /// Dv]` give `[B, T, H, Dv]`. This is what a `[B, T, H·D]` projection
    /// reshapes to, and what the output reshapes back from, without a
    /// transpose either way: the kernels read each head's rows in place.
    /// The results are those of the other layout, transposed, to the bit.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// // Batch 1, two positions, two heads of size 1.
    /// let q = Tensor::<f32>::from_vec(vec![1.0, 0.0, 1.0, 0.0], &[1, 2, 2, 1], &cpu)?;
    /// let k = Tensor::<f32>::from_vec(vec![0.0, 0.0, 3f32.ln(), 0.0], &[1, 2, 2, 1], &cpu)?;
    /// let v = Tensor::<f32>::from_vec(vec![4.0, 1.0, 8.0, 3.0], &[1, 2, 2, 1], &cpu)?;
    /// let o = q.scaled_dot_product_attention_bthd(&k, &v, true, Some(1.0)).to_vec()?;
    /// // Head 0: weights 1/4 and 3/4 at the second position; head 1's
    /// // scores are all 0, so it averages its values 1 and 3.
    /// assert_eq!([o[0], o[1], o[3]], [4.0, 1.0, 2.0]);
    /// assert!((o[2] - 7.0).abs() < 1e-5);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn scaled_dot_product_attention_bthd(
        &self,
        k: &Tensor<T>,
        v: &Tensor<T>,
        causal: bool,
        scale: Option<f64>,
    ) -> Tensor<T> {
        attention(
            self,
            k,
            v,
            causal,
            scale,
            ops::SEQUENCE_FIRST,
            Location::caller(),
        )
    }
}

/// [`Tensor::scaled_dot_product_attention`] as a function of all three
/// operands, as PyTorch's `F.scaled_dot_product_attention(q, k, v,
/// is_causal=causal, scale=scale)`.
#[track_caller]
pub fn scaled_dot_product_attention<T: FloatElement>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<T> {
    attention(q, k, v, causal, scale, ops::HEADS_FIRST, Location::caller())
}

fn attention<T: FloatElement>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
    scale: Option<f64>,
    layout: &str,
    location: Location,
) -> Tensor<T> {
    let mut attrs = OpAttrs::new();
    attrs.set_bool("causal", causal);
    if layout != ops::HEADS_FIRST {
        attrs.set_str("layout", layout);
    }
    if let Some(scale) = scale {
        // The op reads NaN as "the default": the method says so instead
        // of taking a NaN for it.
        if scale.is_nan() {
            // An operand that already failed passes its own error on.
            if let Some(failed) = [q, k, v].into_iter().find(|t| t.check().is_err()) {
                return failed.clone();
            }
            let err = Error::attribute("scale must be finite, got NaN");
            return Tensor::error_at(
                ops::SCALED_DOT_PRODUCT_ATTENTION.name,
                location,
                q.device(),
                &[],
                err,
            );
        }
        attrs.set_float("scale", scale);
    }
    let args = smallvec![q.handle.clone(), k.handle.clone(), v.handle.clone()];
    crate::tensor::run(&ops::SCALED_DOT_PRODUCT_ATTENTION, args, &attrs, location)
}
