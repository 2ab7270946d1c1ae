//! Training methods: dropout, the squared norm of a tensor list and
//! gradient-norm clipping.

use crate::{Rng, Tensor};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_tensor::{Error, FloatElement, Location, Scalar};

impl<T: FloatElement> Tensor<T> {
    /// Inverted dropout: zeroes each element with probability `p` and
    /// scales the survivors by `1 / (1 - p)`, with the mask drawn from
    /// `rng` (so a seed reproduces it on every device and in every mode).
    ///
    /// The draw's `[seed, offset]` key is a tensor input of the op, not an
    /// attribute: in a lazy training loop the key changes every step while
    /// the trace stays the same, so the loop replays one cached trace.
    /// `p = 0` returns `self` (the stream still advances, so later draws do
    /// not depend on `p`).
    ///
    /// ```
    /// use stagecraft::{Device, Rng, Tensor};
    /// let x = Tensor::<f32>::ones(&[1000], &Device::cpu());
    /// let y = x.dropout(0.25, &mut Rng::new(7)).to_vec().unwrap();
    /// assert!(y.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
    /// let kept = y.iter().filter(|&&v| v != 0.0).count();
    /// assert!((700..800).contains(&kept));
    /// ```
    #[track_caller]
    pub fn dropout(&self, p: f64, rng: &mut Rng) -> Tensor<T> {
        let location = Location::caller();
        let (seed, offset) = rng.advance(self.dims());
        if p == 0.0 {
            return self.clone();
        }
        let key =
            match Tensor::<i64>::from_vec(vec![seed as i64, offset as i64], &[2], &self.device()) {
                Ok(key) => key,
                Err(err) => return self.fail("Dropout", location, err),
            };
        let mut attrs = OpAttrs::new();
        attrs.set_float("p", p);
        crate::tensor::run(
            &ops::DROPOUT,
            smallvec::smallvec![self.handle.clone(), key.handle.clone()],
            &attrs,
            location,
        )
    }

    /// `Σ x²` over every element of every tensor, as a rank-0 tensor: the
    /// squared global norm of a parameter list in one reduction (narrow
    /// dtypes summed in f64).
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let a = Tensor::<f32>::from_vec(vec![3.0], &[1], &cpu).unwrap();
    /// let b = Tensor::<f32>::from_vec(vec![4.0, 0.0], &[2], &cpu).unwrap();
    /// assert_eq!(Tensor::squared_norm(&[&a, &b]).item().unwrap(), 25.0);
    /// ```
    #[track_caller]
    pub fn squared_norm(tensors: &[&Tensor<T>]) -> Tensor<T> {
        let location = Location::caller();
        if tensors.is_empty() {
            let device = stagecraft_runtime::place(&[]);
            let err = Error::invalid("squared_norm needs at least one tensor");
            return Tensor::error_at("SquaredNorm", location, device, &[], err);
        }
        let args = tensors.iter().map(|t| t.handle.clone()).collect();
        crate::tensor::run(&ops::SQUARED_NORM, args, &OpAttrs::new(), location)
    }
}

/// Scales `grads` so that their global norm (over all of them, as one
/// vector) is at most `max_norm`, and returns the scaled gradients with the
/// norm before clipping.
///
/// The norm is one [`Tensor::squared_norm`] reduction over every gradient,
/// and the scale `min(1, max_norm / (norm + 1e-6))` is a tensor, so on the
/// lazy device the clipping records no host read and fuses into the step.
///
/// ```
/// use stagecraft::{clip_grad_norm, Device, Tensor};
/// let cpu = Device::cpu();
/// let g1 = Tensor::<f64>::from_vec(vec![3.0], &[1], &cpu).unwrap();
/// let g2 = Tensor::<f64>::from_vec(vec![4.0], &[1], &cpu).unwrap();
/// let (clipped, norm) = clip_grad_norm(&[g1, g2], 1.0);
/// assert_eq!(norm.item().unwrap(), 5.0);
/// assert!((clipped[0].item().unwrap() - 0.6).abs() < 1e-6);
/// assert!((clipped[1].item().unwrap() - 0.8).abs() < 1e-6);
/// ```
#[track_caller]
pub fn clip_grad_norm<T: FloatElement>(
    grads: &[Tensor<T>],
    max_norm: f64,
) -> (Vec<Tensor<T>>, Tensor<T>) {
    let location = Location::caller();
    let refs: Vec<&Tensor<T>> = grads.iter().collect();
    let norm = Tensor::squared_norm(&refs).sqrt();
    if !(max_norm > 0.0 && max_norm.is_finite()) {
        let err = Error::attribute(format!(
            "max_norm must be positive and finite, got {max_norm}"
        ));
        let failed = norm.fail_unless_failed("ClipGradNorm", location, err);
        return (grads.iter().map(|_| failed.clone()).collect(), failed);
    }
    let device = norm.device();
    let limit = Tensor::scalar(T::from_scalar(Scalar::F64(max_norm)), &device);
    let eps = Tensor::scalar(T::from_scalar(Scalar::F64(1e-6)), &device);
    let one = Tensor::scalar(T::from_scalar(Scalar::F64(1.0)), &device);
    let scale = (&limit / &(&norm + &eps)).minimum(&one);
    let clipped = grads.iter().map(|g| g * &scale).collect();
    (clipped, norm)
}
