//! The two MNIST networks, written with `stagecraft::nn`: an MLP
//! (784-256-256-10, ReLU) and a small convnet (two 5x5 convolutions with
//! max pooling, then two dense layers). Only the architectures live here:
//! layers, initializers, the loss, the optimizer and checkpoints come
//! from the library.

use stagecraft::nn::{init, join, Conv2d, Forward, Linear, Module};
use stagecraft::{
    Conv2dOptions, CrossEntropyOptions, Device, Pool2dOptions, Reduction, Result, Rng, Tensor,
};

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

    /// The parameter names and shapes (PyTorch's layouts: a dense weight
    /// is `[out, in]`), in the order the model visits them.
    pub fn shapes(self) -> Vec<(&'static str, Vec<usize>)> {
        match self {
            ModelKind::Mlp => vec![
                ("fc1.weight", vec![256, 784]),
                ("fc1.bias", vec![256]),
                ("fc2.weight", vec![256, 256]),
                ("fc2.bias", vec![256]),
                ("fc3.weight", vec![10, 256]),
                ("fc3.bias", vec![10]),
            ],
            ModelKind::Cnn => vec![
                ("conv1.weight", vec![8, 1, 5, 5]),
                ("conv1.bias", vec![8]),
                ("conv2.weight", vec![16, 8, 5, 5]),
                ("conv2.bias", vec![16]),
                ("fc1.weight", vec![128, 16 * 7 * 7]),
                ("fc1.bias", vec![128]),
                ("fc2.weight", vec![10, 128]),
                ("fc2.bias", vec![10]),
            ],
        }
    }
}

/// A network on one device: its convolutions (`conv1`, `conv2`, none for
/// the MLP) and dense layers (`fc1`, ...).
#[derive(Clone, Debug)]
pub struct Model {
    /// Which network.
    pub kind: ModelKind,
    /// The convolutions, in order.
    pub convs: Vec<Conv2d>,
    /// The dense layers, in order.
    pub fcs: Vec<Linear>,
}

impl Model {
    /// Fresh parameters: He-normal weights (std `sqrt(2 / fan_in)`, which
    /// keeps activations' scale through ReLU layers), zero biases.
    pub fn init(kind: ModelKind, seed: u64, device: &Device) -> Model {
        let mut rng = Rng::new(seed);
        let mut convs = Vec::new();
        let mut fcs = Vec::new();
        for pair in kind.shapes().chunks(2) {
            let ((name, dims), (_, bias_dims)) = (&pair[0], &pair[1]);
            let fan_in = dims[1..].iter().product();
            let weight = init::kaiming_normal(dims, fan_in, &mut rng, device);
            let bias = Some(Tensor::zeros(bias_dims, device));
            if name.starts_with("conv") {
                let same = Conv2dOptions {
                    padding: [2, 2],
                    ..Conv2dOptions::default()
                };
                convs.push(Conv2d {
                    weight,
                    bias,
                    options: same,
                });
            } else {
                fcs.push(Linear::from_params(weight, bias));
            }
        }
        Model { kind, convs, fcs }
    }

    /// The parameter values, read to the host, in visiting order.
    pub fn values(&self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        self.visit_params("", &mut |_, t| out.push(t.to_vec()));
        out.into_iter().collect()
    }

    /// A copy of the model on `device`.
    pub fn copy_to(&self, device: &Device) -> Model {
        let mut copy = self.clone();
        copy.visit_params_mut("", &mut |_, t| *t = t.to_device(device));
        copy
    }

    /// Logits `[batch, 10]` for images `x: [batch, 784]` (scaled pixels).
    pub fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let batch = x.dims()[0];
        let pool = Pool2dOptions::new([2, 2]);
        let mut h = x.clone();
        if !self.convs.is_empty() {
            h = h.reshape(&[batch, 1, 28, 28]);
            for conv in &self.convs {
                h = conv.forward(&h).relu().max_pool2d(pool);
            }
            h = h.reshape(&[batch, 16 * 7 * 7]);
        }
        let (last, hidden) = self.fcs.split_last().expect("a network has dense layers");
        for fc in hidden {
            h = fc.forward(&h).relu();
        }
        last.forward(&h)
    }
}

impl Module for Model {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        for (i, conv) in self.convs.iter().enumerate() {
            conv.visit_params(&join(prefix, &format!("conv{}", i + 1)), f);
        }
        for (i, fc) in self.fcs.iter().enumerate() {
            fc.visit_params(&join(prefix, &format!("fc{}", i + 1)), f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        for (i, conv) in self.convs.iter_mut().enumerate() {
            conv.visit_params_mut(&join(prefix, &format!("conv{}", i + 1)), f);
        }
        for (i, fc) in self.fcs.iter_mut().enumerate() {
            fc.visit_params_mut(&join(prefix, &format!("fc{}", i + 1)), f);
        }
    }
}

/// Mean cross-entropy of `logits` against class `labels`.
pub fn loss(logits: &Tensor<f32>, labels: &Tensor<i32>) -> Tensor<f32> {
    let options = CrossEntropyOptions {
        ignore_index: None,
        reduction: Reduction::Mean,
    };
    logits.cross_entropy(labels, options)
}

/// The predicted class of each row of `logits`.
pub fn predictions(logits: &Tensor<f32>) -> Result<Vec<i64>> {
    logits.argmax(-1, false).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft::nn::ModuleExt;

    #[test]
    fn parameters_have_the_listed_names_and_shapes() {
        for kind in [ModelKind::Mlp, ModelKind::Cnn] {
            let model = Model::init(kind, 1, &Device::cpu());
            let got: Vec<(String, Vec<usize>)> = model
                .named_params()
                .into_iter()
                .map(|(n, t)| (n, t.dims().to_vec()))
                .collect();
            let want: Vec<(String, Vec<usize>)> = kind
                .shapes()
                .into_iter()
                .map(|(n, d)| (n.to_string(), d))
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn forward_gives_ten_logits_per_image() {
        for kind in [ModelKind::Mlp, ModelKind::Cnn] {
            let model = Model::init(kind, 1, &Device::cpu());
            let x = Tensor::<f32>::ones(&[3, 784], &Device::cpu());
            assert_eq!(model.forward(&x).dims(), &[3, 10]);
        }
    }
}
