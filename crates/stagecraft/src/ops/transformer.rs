//! The transformer methods: `embedding`, `layer_norm`, `rms_norm` and
//! `cross_entropy`.
//!
//! Each is one fused op (`Embedding`, `LayerNorm`, `RmsNorm`,
//! `CrossEntropy`; see `stagecraft_ops::defs::transformer`), so a bad call
//! is an error naming that op at the caller's line, and each runs on every
//! device and inside `function`, `cond` and `while_loop` like any op. The
//! norms and the loss also compute per-row statistics that their fused
//! backward ops read; those stay with the op (a tape or a trace keeps
//! them), and the methods return the result alone.

use crate::Tensor;
use smallvec::{smallvec, SmallVec};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{FloatElement, IndexElement, Location};

/// How [`Tensor::cross_entropy`] reduces its per-row losses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// One loss per row, shaped like the targets; ignored rows give 0.
    None,
    /// The mean over the rows whose target is not ignored: a scalar, NaN
    /// when every row is ignored (as in PyTorch).
    #[default]
    Mean,
    /// The sum over every row (ignored rows add 0): a scalar.
    Sum,
}

impl Reduction {
    fn attr(self) -> &'static str {
        let op = match self {
            Reduction::None => ops::LossReduction::None,
            Reduction::Mean => ops::LossReduction::Mean,
            Reduction::Sum => ops::LossReduction::Sum,
        };
        op.as_str()
    }
}

/// Options of [`Tensor::cross_entropy`]. The default counts every row
/// and takes the mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CrossEntropyOptions {
    /// Rows whose target equals this value get no loss and no gradient
    /// (PyTorch's `ignore_index`, often -100 or a padding token); `None`
    /// counts every row.
    pub ignore_index: Option<i64>,
    /// How the per-row losses are reduced.
    pub reduction: Reduction,
}

/// `x` followed by the parameters that are present, and the flags saying
/// which are.
fn with_params<T: FloatElement>(
    x: &Tensor<T>,
    weight: Option<&Tensor<T>>,
    bias: Option<&Tensor<T>>,
) -> SmallVec<[TensorHandle; 4]> {
    let mut args: SmallVec<[TensorHandle; 4]> = smallvec![x.handle.clone()];
    args.extend(weight.map(|w| w.handle.clone()));
    args.extend(bias.map(|b| b.handle.clone()));
    args
}

impl<T: FloatElement> Tensor<T> {
    /// Rows of this table (`[V, D]`) picked by integer `ids` of any shape:
    /// the result is `[.., D]`, row `ids[i]` for every id. An id outside
    /// `[0, V)` is an error of the `Embedding` op naming the id, its
    /// position and this call's line (negative ids do not count from the
    /// end, unlike [`Tensor::gather`]). The table's gradient adds each
    /// incoming row into the row its id picked (an index-add, O(ids × D);
    /// no one-hot matrix over the vocabulary is ever made).
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let table = Tensor::<f32>::from_vec(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2], &cpu)?;
    /// let ids = Tensor::<i64>::from_vec(vec![2, 0, 2], &[3], &cpu)?;
    /// let rows = table.embedding(&ids);
    /// assert_eq!(rows.dims(), &[3, 2]);
    /// assert_eq!(rows.to_vec()?, vec![4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn embedding<I: IndexElement>(&self, ids: &Tensor<I>) -> Tensor<T> {
        let args = smallvec![self.handle.clone(), ids.handle.clone()];
        crate::tensor::run(&ops::EMBEDDING, args, &OpAttrs::new(), Location::caller())
    }

    /// Layer normalization over the last axis (`[.., D]`): each row
    /// becomes `(x - mean)/sqrt(var + eps)·weight + bias`, `var` being the
    /// population variance. `weight` and `bias` are optional `[D]`
    /// tensors (GPT-2-style models without biases pass `None`); `eps` is
    /// usually `1e-5`.
    ///
    /// One fused kernel per row: the statistics in f64 in two passes over
    /// the cached row (mean, then mean squared deviation), the output in
    /// one more; f16 and bf16 rows are computed in f32. Its gradient is
    /// one fused backward kernel for `x`, `weight` and `bias` together,
    /// reading the forward's statistics; second derivatives exist too.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let x = Tensor::<f64>::from_vec(vec![1.0, 3.0, 10.0, 10.0], &[2, 2], &cpu)?;
    /// let w = Tensor::<f64>::from_vec(vec![2.0, 3.0], &[2], &cpu)?;
    /// let b = Tensor::<f64>::from_vec(vec![0.5, 0.5], &[2], &cpu)?;
    /// // Row 0: mean 2, variance 1; row 1 is constant.
    /// assert_eq!(x.layer_norm(None, None, 0.0).to_vec()?[..2], [-1.0, 1.0]);
    /// assert_eq!(x.layer_norm(Some(&w), Some(&b), 0.0).to_vec()?[..2], [-1.5, 3.5]);
    /// assert_eq!(x.layer_norm(Some(&w), Some(&b), 1e-5).to_vec()?[2..], [0.5, 0.5]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor<T>>,
        bias: Option<&Tensor<T>>,
        eps: f64,
    ) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_bool("has_weight", weight.is_some())
            .set_bool("has_bias", bias.is_some())
            .set_float("eps", eps);
        let args = with_params(self, weight, bias);
        crate::tensor::run(&ops::LAYER_NORM, args, &attrs, Location::caller())
    }

    /// RMS normalization over the last axis (`[.., D]`, as in LLaMA):
    /// each row becomes `x/sqrt(mean(x²) + eps)·weight`, with an optional
    /// `[D]` weight. Fused like [`Tensor::layer_norm`], with a fused
    /// backward.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let x = Tensor::<f64>::from_vec(vec![2.0, -2.0], &[1, 2], &cpu)?;
    /// let w = Tensor::<f64>::from_vec(vec![3.0, 0.5], &[2], &cpu)?;
    /// // mean(x²) = 4: the row is divided by 2.
    /// assert_eq!(x.rms_norm(Some(&w), 0.0).to_vec()?, vec![3.0, -0.5]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Tensor<T>>, eps: f64) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_bool("has_weight", weight.is_some())
            .set_float("eps", eps);
        let args = with_params(self, weight, None);
        crate::tensor::run(&ops::RMS_NORM, args, &attrs, Location::caller())
    }

    /// Cross-entropy of these logits (`[N, C]`, or `[.., C]`: classes on
    /// the last axis) against integer class `targets` (`[N]`, or `[..]`):
    /// `-log softmax(logits)[target]` per row, reduced as `options` says
    /// (the mean by default). Computed in one fused pass per row, with the
    /// row's maximum subtracted before exponentiating (no overflow for any
    /// finite logits) and the log-sum-exp kept for the gradient, which is
    /// `softmax - one_hot(target)` scaled row by row (no one-hot tensor is
    /// made; ignored rows get 0).
    ///
    /// A target outside `[0, C)` that is not the `ignore_index` is an
    /// error of the `CrossEntropy` op naming it; targets whose shape is
    /// not the logits' without the last axis are a shape error. Both name
    /// this call's line.
    ///
    /// ```
    /// use stagecraft::{CrossEntropyOptions, Device, Reduction, Tensor};
    /// let cpu = Device::cpu();
    /// let logits = Tensor::<f64>::from_vec(vec![0.0, 0.0, 5.0, 1.0, 1.0, 1.0], &[3, 2], &cpu)?;
    /// let targets = Tensor::<i64>::from_vec(vec![1, -100, 0], &[3], &cpu)?;
    /// let options = CrossEntropyOptions { ignore_index: Some(-100), reduction: Reduction::None };
    /// let loss = logits.cross_entropy(&targets, options).to_vec()?;
    /// // Equal logits over two classes: ln 2 whichever the target.
    /// assert!((loss[0] - 2f64.ln()).abs() < 1e-15 && (loss[2] - 2f64.ln()).abs() < 1e-15);
    /// assert_eq!(loss[1], 0.0);
    /// let options = CrossEntropyOptions { ignore_index: Some(-100), ..Default::default() };
    /// let mean = logits.cross_entropy(&targets, options).item()?;
    /// assert!((mean - 2f64.ln()).abs() < 1e-15);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn cross_entropy<I: IndexElement>(
        &self,
        targets: &Tensor<I>,
        options: CrossEntropyOptions,
    ) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_str("reduction", options.reduction.attr());
        if let Some(ignore) = options.ignore_index {
            attrs.set_ints("ignore_index", &[ignore]);
        }
        let args = smallvec![self.handle.clone(), targets.handle.clone()];
        crate::tensor::run(&ops::CROSS_ENTROPY, args, &attrs, Location::caller())
    }
}
