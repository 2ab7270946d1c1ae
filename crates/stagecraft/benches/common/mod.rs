//! Programs shared by the bench files.

// Each bench file includes this module and uses only part of it.
#![allow(dead_code)]

use stagecraft::{Device, Rng, Tensor};

/// The B3 chain: t=x*2; t=t+1; t=t*x; t=t-3; relu; t=t*0.5; t=t+x; t=t*t.
pub fn b3(x: &Tensor<f32>) -> Tensor<f32> {
    let t = x * 2.0;
    let t = t + 1.0;
    let t = t * x;
    let t = t - 3.0;
    let t = t.relu();
    let t = t * 0.5;
    let t = t + x;
    &t * &t
}

/// The host line of a bench's header: CPU model, cores, the vector set the
/// kernels use (`STAGECRAFT_CPU_ISA` may force a lower one), and the rayon
/// threads.
pub fn host() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim)
    };
    let model = field("model name").unwrap_or("unknown CPU");
    let isa = stagecraft::layers::cpu::isa::level();
    let detected = stagecraft::layers::cpu::isa::detected();
    let isa = if isa == detected {
        isa.name().to_string()
    } else {
        format!("{} (forced; the CPU has {})", isa.name(), detected.name())
    };
    format!(
        "{model}, {} cores, {isa}, {} rayon threads",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        rayon::current_num_threads()
    )
}

/// The parameters of the B5 MLP, 784-256-256-10.
pub struct Mlp {
    pub w: [Tensor<f32>; 3],
    pub b: [Tensor<f32>; 3],
}

impl Mlp {
    pub fn new(d: &Device) -> Mlp {
        let mut rng = Rng::new(0);
        let dims = [784, 256, 256, 10];
        let w = std::array::from_fn(|i| {
            Tensor::rand_normal(&[dims[i], dims[i + 1]], 0.0, 0.05, &mut rng, d)
        });
        let b = std::array::from_fn(|i| Tensor::zeros(&[dims[i + 1]], d));
        Mlp { w, b }
    }

    /// One SGD step with gradients from `backward`; the loss.
    pub fn autodiff_step(&mut self, x: &Tensor<f32>, y: &Tensor<f32>, lr: f32) -> Tensor<f32> {
        let w: Vec<Tensor<f32>> = self.w.iter().map(|t| t.requires_grad()).collect();
        let b: Vec<Tensor<f32>> = self.b.iter().map(|t| t.requires_grad()).collect();
        let h1 = (x.matmul(&w[0]) + &b[0]).relu();
        let h2 = (h1.matmul(&w[1]) + &b[1]).relu();
        let logits = h2.matmul(&w[2]) + &b[2];
        let loss = -(logits.log_softmax(-1) * y)
            .sum(&[-1], false)
            .mean(&[0], false);
        let grads = loss.backward().expect("differentiable");
        for i in 0..3 {
            self.w[i] = &w[i] - &(grads.get(&w[i]).expect("tracked") * lr);
            self.b[i] = &b[i] - &(grads.get(&b[i]).expect("tracked") * lr);
        }
        loss
    }
}

/// The B5 batch: 128 random images and one-hot labels.
pub fn mlp_batch(d: &Device) -> (Tensor<f32>, Tensor<f32>) {
    let x = Tensor::<f32>::rand_uniform(&[128, 784], 0.0, 1.0, &mut Rng::new(1), d);
    let labels: Vec<f32> = (0..1280)
        .map(|i| if i % 10 == (i / 10) % 10 { 1.0 } else { 0.0 })
        .collect();
    let y = Tensor::<f32>::from_vec(labels, &[128, 10], d).unwrap();
    (x, y)
}
