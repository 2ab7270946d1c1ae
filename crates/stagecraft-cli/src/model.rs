//! The two models: an MLP (784-256-256-10, ReLU) and a small convnet
//! (two 5x5 convolutions with max pooling, then two dense layers), their
//! parameters, initialization, forward pass, loss and SGD step.

use stagecraft::{Conv2dOptions, Device, Pool2dOptions, Result, Rng, Tensor};

/// Which network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// 784-256-256-10 with ReLU.
    Mlp,
    /// conv 5x5x8, pool, conv 5x5x16, pool, dense 128, dense 10.
    Cnn,
}

impl ModelKind {
    /// The lowercase name (`mlp`, `cnn`), as in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
        }
    }

    /// The parameter names and shapes, in the order [`Model::params`]
    /// holds them.
    pub fn shapes(self) -> Vec<(&'static str, Vec<usize>)> {
        match self {
            ModelKind::Mlp => vec![
                ("fc1.weight", vec![784, 256]),
                ("fc1.bias", vec![256]),
                ("fc2.weight", vec![256, 256]),
                ("fc2.bias", vec![256]),
                ("fc3.weight", vec![256, 10]),
                ("fc3.bias", vec![10]),
            ],
            ModelKind::Cnn => vec![
                ("conv1.weight", vec![8, 1, 5, 5]),
                ("conv1.bias", vec![1, 8, 1, 1]),
                ("conv2.weight", vec![16, 8, 5, 5]),
                ("conv2.bias", vec![1, 16, 1, 1]),
                ("fc1.weight", vec![16 * 7 * 7, 128]),
                ("fc1.bias", vec![128]),
                ("fc2.weight", vec![128, 10]),
                ("fc2.bias", vec![10]),
            ],
        }
    }
}

/// A model's parameters on one device.
#[derive(Clone, Debug)]
pub struct Model {
    /// Which network.
    pub kind: ModelKind,
    /// The parameters, in [`ModelKind::shapes`] order.
    pub params: Vec<Tensor<f32>>,
}

/// Fan-in of a weight: everything but the output dimension.
fn fan_in(name: &str, dims: &[usize]) -> usize {
    if name.starts_with("conv") {
        dims[1..].iter().product()
    } else {
        dims[0]
    }
}

impl Model {
    /// Fresh parameters: He-normal weights (std `sqrt(2 / fan_in)`, which
    /// keeps activations' scale through ReLU layers), zero biases.
    pub fn init(kind: ModelKind, seed: u64, device: &Device) -> Model {
        let mut rng = Rng::new(seed);
        let params = kind
            .shapes()
            .into_iter()
            .map(|(name, dims)| {
                if name.ends_with(".bias") {
                    Tensor::zeros(&dims, device)
                } else {
                    let std = (2.0 / fan_in(name, &dims) as f64).sqrt();
                    Tensor::rand_normal(&dims, 0.0, std, &mut rng, device)
                }
            })
            .collect();
        Model { kind, params }
    }

    /// A model from parameter values (in [`ModelKind::shapes`] order),
    /// checking their count and sizes.
    pub fn from_values(kind: ModelKind, values: Vec<Vec<f32>>, device: &Device) -> Result<Model> {
        let shapes = kind.shapes();
        if values.len() != shapes.len() {
            return Err(stagecraft::Error::invalid(format!(
                "{} has {} parameters, got {}",
                kind.name(),
                shapes.len(),
                values.len()
            )));
        }
        let params = shapes
            .iter()
            .zip(values)
            .map(|((_, dims), v)| Tensor::from_vec(v, dims, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model { kind, params })
    }

    /// The parameter values, read to the host.
    pub fn values(&self) -> Result<Vec<Vec<f32>>> {
        self.params.iter().map(|p| p.to_vec()).collect()
    }

    /// A copy of the model on `device`.
    pub fn copy_to(&self, device: &Device) -> Result<Model> {
        Model::from_values(self.kind, self.values()?, device)
    }

    /// Logits `[batch, 10]` for images `x: [batch, 784]` (scaled pixels),
    /// with `params` standing in for the model's own (the tracked copies
    /// during a training step).
    pub fn forward(kind: ModelKind, params: &[Tensor<f32>], x: &Tensor<f32>) -> Tensor<f32> {
        match kind {
            ModelKind::Mlp => {
                let h = (x.matmul(&params[0]) + &params[1]).relu();
                let h = (h.matmul(&params[2]) + &params[3]).relu();
                h.matmul(&params[4]) + &params[5]
            }
            ModelKind::Cnn => {
                let batch = x.dims()[0];
                let same = Conv2dOptions {
                    padding: [2, 2],
                    ..Conv2dOptions::default()
                };
                let pool = Pool2dOptions::new([2, 2]);
                let x = x.reshape(&[batch, 1, 28, 28]);
                let h = (x.conv2d(&params[0], same) + &params[1])
                    .relu()
                    .max_pool2d(pool);
                let h = (h.conv2d(&params[2], same) + &params[3])
                    .relu()
                    .max_pool2d(pool);
                let h = h.reshape(&[batch, 16 * 7 * 7]);
                let h = (h.matmul(&params[4]) + &params[5]).relu();
                h.matmul(&params[6]) + &params[7]
            }
        }
    }
}

/// Mean cross-entropy of `logits` against one-hot `targets`.
pub fn cross_entropy(logits: &Tensor<f32>, targets: &Tensor<f32>) -> Tensor<f32> {
    -(logits.log_softmax(-1) * targets)
        .sum(&[-1], false)
        .mean(&[0], false)
}

/// SGD with momentum: its velocities live beside the parameters.
#[derive(Clone, Debug)]
pub struct Sgd {
    /// Step size.
    pub lr: f32,
    /// Momentum factor (0 for plain SGD).
    pub momentum: f32,
    velocity: Vec<Tensor<f32>>,
}

impl Sgd {
    /// An optimizer for `model`'s parameters, velocities at zero.
    pub fn new(model: &Model, lr: f32, momentum: f32) -> Sgd {
        let velocity = model
            .params
            .iter()
            .map(|p| Tensor::zeros(p.dims(), &p.device()))
            .collect();
        Sgd {
            lr,
            momentum,
            velocity,
        }
    }

    /// One training step on a batch: forward, backward, update. Returns the
    /// loss (on a lazy device still pending until `mark_step`).
    pub fn step(
        &mut self,
        model: &mut Model,
        x: &Tensor<f32>,
        y: &Tensor<f32>,
    ) -> Result<Tensor<f32>> {
        let tracked: Vec<Tensor<f32>> = model.params.iter().map(|p| p.requires_grad()).collect();
        let loss = cross_entropy(&Model::forward(model.kind, &tracked, x), y);
        let grads = loss.backward()?;
        for (i, p) in tracked.iter().enumerate() {
            let g = grads.get(p).ok_or_else(|| {
                stagecraft::Error::internal(format!("no gradient for parameter {i}"))
            })?;
            let v = if self.momentum == 0.0 {
                g
            } else {
                &self.velocity[i] * self.momentum + g
            };
            model.params[i] = p - &(&v * self.lr);
            self.velocity[i] = v;
        }
        Ok(loss)
    }
}

/// The predicted class of each row of `logits`.
pub fn predictions(logits: &Tensor<f32>) -> Result<Vec<i64>> {
    logits.argmax(-1, false).to_vec()
}
