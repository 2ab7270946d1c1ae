//! Data-parallel gradients: every process runs the same model on its own
//! shard of the batch, and the gradients are averaged over the processes
//! before the optimizer step, in buckets that start reducing while
//! backward is still computing the rest (PyTorch DDP's scheme).

use super::{all_reduce_start, broadcast, InFlight, Reduction};
use crate::nn::{Module, ModuleExt};
use crate::{Error, Gradients, Result, Tensor};
use std::collections::HashSet;

/// Averages a model's gradients over the group, bucket by bucket.
///
/// Parameters are grouped into buckets of about `bucket_bytes` in the
/// reverse of their visiting order, which is about the order backward
/// produces their gradients (the last layer's first). During
/// [`DataParallel::backward`], a bucket is flattened into one tensor and
/// its mean all-reduce *started* (`AllReduceStart`) as soon as its last
/// gradient is final, so the transfer overlaps with the backward of the
/// earlier layers; buckets start in order, so every process issues the
/// same reductions in the same order. On the lazy device the whole step,
/// reductions included, is one cached trace.
///
/// ```
/// use stagecraft::distributed::DataParallel;
/// use stagecraft::nn::{Forward, Linear, ModuleExt};
/// use stagecraft::{Device, Rng, Tensor};
/// let cpu = Device::cpu();
/// let mut model = Linear::new(3, 2, true, &mut Rng::new(7), &cpu);
/// let ddp = DataParallel::new(&model);
/// ddp.broadcast_parameters(&mut model).unwrap();
/// model.requires_grad();
/// let x = Tensor::<f32>::ones(&[4, 3], &cpu);
/// let loss = model.forward(&x).sum(&[], false);
/// let grads = ddp.backward(&model, &loss).unwrap();
/// // A group of one: the average over processes is this process's gradient.
/// let dw = grads.get(&model.weight).unwrap();
/// assert_eq!(dw.to_vec().unwrap(), vec![4.0; 6]);
/// ```
#[derive(Debug, Clone)]
pub struct DataParallel {
    names: Vec<String>,
    /// Parameter indices (into `names`) of each bucket, in the order the
    /// bucket's flattened tensor lays them out.
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
}

impl DataParallel {
    /// The bucket size PyTorch DDP uses for its first bucket: small enough
    /// that the first reduction starts early in backward.
    pub const DEFAULT_BUCKET_BYTES: usize = 1 << 20;

    /// Buckets of [`DataParallel::DEFAULT_BUCKET_BYTES`] for `model`'s
    /// parameters.
    pub fn new(model: &dyn Module) -> DataParallel {
        DataParallel::with_bucket_bytes(model, DataParallel::DEFAULT_BUCKET_BYTES)
    }

    /// Buckets of about `bucket_bytes` (at least one parameter each; a
    /// parameter larger than that is a bucket of its own).
    pub fn with_bucket_bytes(model: &dyn Module, bucket_bytes: usize) -> DataParallel {
        let params = unique_params(model);
        let names: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0usize;
        for i in (0..params.len()).rev() {
            let size = params[i].1.dims().iter().product::<usize>() * 4;
            match buckets.last_mut() {
                Some(bucket) if bytes + size <= bucket_bytes => {
                    bucket.push(i);
                    bytes += size;
                }
                _ => {
                    buckets.push(vec![i]);
                    bytes = size;
                }
            }
        }
        let mut bucket_of = vec![0; names.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        DataParallel {
            names,
            buckets,
            bucket_of,
        }
    }

    /// The parameter names of each bucket, in the order they are reduced.
    pub fn buckets(&self) -> Vec<Vec<&str>> {
        self.buckets
            .iter()
            .map(|b| b.iter().map(|&i| self.names[i].as_str()).collect())
            .collect()
    }

    /// Replaces every parameter by rank 0's, so that all processes start
    /// from the same model. Marked parameters stay marked.
    #[track_caller]
    pub fn broadcast_parameters(&self, model: &mut dyn Module) -> Result<()> {
        let mut failure = None;
        crate::no_grad(|| {
            model.visit_params_mut("", &mut |name, t| {
                let shared = broadcast(t, 0);
                match shared.wait() {
                    Err(e) if failure.is_none() => {
                        failure = Some(Error::new(
                            e.kind(),
                            format!("broadcasting parameter `{name}` from rank 0: {e}"),
                        ))
                    }
                    _ => crate::autodiff::replace_keeping_mark(t, shared),
                }
            })
        });
        failure.map_or(Ok(()), Err)
    }

    /// `loss.backward()` with every parameter's gradient replaced by its
    /// mean over the group. The parameters must be marked with
    /// `requires_grad()` (once, before training), as for `backward`.
    #[track_caller]
    pub fn backward(&self, model: &dyn Module, loss: &Tensor<f32>) -> Result<Gradients> {
        let params = unique_params(model);
        let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        if names != self.names {
            return Err(Error::invalid(format!(
                "the model's parameters ({} of them) are not those DataParallel was built for \
                 ({}): build it again after changing the model",
                names.len(),
                self.names.len()
            )));
        }
        let watch: Vec<&Tensor<f32>> = params.iter().map(|(_, t)| t).collect();
        let mut ready: Vec<Option<Tensor<f32>>> = vec![None; params.len()];
        let mut missing: Vec<usize> = self.buckets.iter().map(Vec::len).collect();
        let mut in_flight: Vec<InFlight<f32>> = Vec::with_capacity(self.buckets.len());
        let mut grads = loss.backward_watching(&watch, |i, g| {
            ready[i] = Some(g);
            missing[self.bucket_of[i]] -= 1;
            // Buckets start in order, whatever order they fill in, so
            // every process issues the same reductions in the same order.
            while in_flight.len() < self.buckets.len() && missing[in_flight.len()] == 0 {
                let b = in_flight.len();
                in_flight.push(self.start(b, &params, &ready));
            }
            Ok(())
        })?;
        // Buckets with a parameter that got no gradient here (unused by this
        // loss, or tied to another) start now; other processes may have one.
        for (i, (_, p)) in params.iter().enumerate() {
            if ready[i].is_none() {
                ready[i] = Some(
                    grads
                        .get(p)
                        .unwrap_or_else(|| Tensor::zeros(p.dims(), &p.device())),
                );
            }
        }
        while in_flight.len() < self.buckets.len() {
            let b = in_flight.len();
            in_flight.push(self.start(b, &params, &ready));
        }
        for (members, flight) in self.buckets.iter().zip(&in_flight) {
            let flat = flight.wait();
            let sizes: Vec<usize> = members
                .iter()
                .map(|&i| params[i].1.dims().iter().product())
                .collect();
            let parts = if members.len() == 1 {
                vec![flat]
            } else {
                flat.split(&sizes, 0)
            };
            for (&i, part) in members.iter().zip(parts) {
                let p = &params[i].1;
                grads.insert(p, part.reshape(p.dims()));
            }
        }
        Ok(grads)
    }

    /// Flattens bucket `b`'s gradients into one tensor and starts its mean
    /// all-reduce.
    fn start(
        &self,
        b: usize,
        params: &[(String, Tensor<f32>)],
        ready: &[Option<Tensor<f32>>],
    ) -> InFlight<f32> {
        let flat: Vec<Tensor<f32>> = self.buckets[b]
            .iter()
            .map(|&i| {
                let g = ready[i]
                    .as_ref()
                    .expect("a started bucket has every gradient");
                g.reshape(&[params[i].1.dims().iter().product()])
            })
            .collect();
        let flat = if flat.len() == 1 {
            flat[0].clone()
        } else {
            Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
        };
        all_reduce_start(&flat, Reduction::Mean)
    }
}

/// The model's parameters by name, each tensor once (a tied parameter
/// keeps its first name).
fn unique_params(model: &dyn Module) -> Vec<(String, Tensor<f32>)> {
    let mut seen = HashSet::new();
    model
        .named_params()
        .into_iter()
        .filter(|(_, t)| seen.insert(t.handle.addr()))
        .collect()
}
