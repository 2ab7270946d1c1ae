//! ONNX import and export: the `stagecraft-onnx` crate, with [`Tensor`]s
//! as model inputs, imported models as trainable modules
//! ([`OnnxModule`]), and staged functions written as ONNX models
//! ([`export`]).
//!
//! ```no_run
//! use stagecraft::{onnx, Device, Tensor};
//! let model = onnx::Model::load("m.onnx")?;
//! let x = Tensor::<f32>::zeros(&[1, 3, 224, 224], &Device::cpu());
//! let outs = model.run(&[("input", x)])?;
//! let y = onnx::to_tensor::<f32>(&outs[0])?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::{Device, Element, Error, Tensor};
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DenseHostTensor;
use stagecraft_tensor::Location;

pub use stagecraft_onnx::*;

impl<T: Element> ModelInput for Tensor<T> {
    fn to_host(&self) -> stagecraft_onnx::Result<DenseHostTensor> {
        self.handle().to_host()
    }
}

/// A model output as a CPU [`Tensor`] (its dtype must be `T`'s).
pub fn to_tensor<T: Element>(value: &DenseHostTensor) -> crate::Result<Tensor<T>> {
    Tensor::try_from_handle(TensorHandle::available(Device::cpu(), value.clone().into()))
}

/// An imported model as a trainable [`Module`](crate::nn::Module): its
/// floating-point initializers (see [`Model::trainable_initializers`])
/// become named parameters, so `grad` flows through the model to them and
/// to its inputs, and `stagecraft::optim` fine-tunes them.
///
/// A forward pass calls the model's graph function (traced once per input
/// signature, with the weights as parameters instead of constants)
/// through the same `Call` op as [`crate::function`], so it is recorded on
/// the tape like any op and its gradient is the function's gradient.
///
/// ```no_run
/// use stagecraft::optim::{self, Optimizer};
/// use stagecraft::{nn::ModuleExt, onnx, Device, Tensor};
/// let mut net = onnx::OnnxModule::new(onnx::Model::load("classifier.onnx")?, &Device::cpu());
/// let mut opt = optim::Adam::new(optim::AdamConfig::default());
/// let x = Tensor::<f32>::zeros(&[8, 4], &Device::cpu());
/// net.requires_grad();
/// let logits = net.forward(&[("input", &x)])?.remove(0);
/// let loss = logits.square().mean(&[], false);
/// let grads = loss.backward()?;
/// opt.step(&mut net, &grads)?;
/// net.save("fine_tuned.onnx")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OnnxModule {
    model: Model,
    params: Vec<(String, Tensor<f32>)>,
}

impl std::fmt::Debug for OnnxModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxModule")
            .field("model", &self.model)
            .field(
                "params",
                &self.params.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl OnnxModule {
    /// The model with its f32 trainable initializers as parameters on
    /// `device` (initializers of other float dtypes stay constants).
    pub fn new(model: Model, device: &Device) -> OnnxModule {
        let params = model
            .trainable_initializers()
            .into_iter()
            .filter(|(_, t)| t.dtype() == f32::DTYPE)
            .map(|(name, t)| {
                let handle = TensorHandle::available(*device, t.into());
                (name, Tensor::from_handle(handle))
            })
            .collect();
        OnnxModule { model, params }
    }

    /// The imported model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Runs the model on named inputs of one dtype and returns its outputs,
    /// which must be f32 (see [`OnnxModule::forward_handles`] for others).
    #[track_caller]
    pub fn forward<T: Element>(
        &self,
        inputs: &[(&str, &Tensor<T>)],
    ) -> crate::Result<Vec<Tensor<f32>>> {
        let location = Location::caller();
        let handles: Vec<(&str, TensorHandle)> =
            inputs.iter().map(|(n, t)| (*n, t.handle.clone())).collect();
        let outs = self.forward_at(&handles, location)?;
        outs.into_iter()
            .zip(self.model.outputs())
            .map(|(h, info)| {
                Tensor::try_from_handle(h).map_err(|e| {
                    Error::dtype(format!("model output '{}': {}", info.name, e.message()))
                        .with_op("OnnxModule::forward")
                        .at(location)
                })
            })
            .collect()
    }

    /// [`OnnxModule::forward`] with untyped inputs and outputs (models that
    /// take token ids beside floats, or return indices).
    #[track_caller]
    pub fn forward_handles(
        &self,
        inputs: &[(&str, TensorHandle)],
    ) -> crate::Result<Vec<TensorHandle>> {
        self.forward_at(inputs, Location::caller())
    }

    fn forward_at(
        &self,
        inputs: &[(&str, TensorHandle)],
        location: Location,
    ) -> crate::Result<Vec<TensorHandle>> {
        let onnx_err = |e: stagecraft_onnx::OnnxError| {
            Error::invalid(e.to_string())
                .with_op("OnnxModule::forward")
                .at(location)
        };
        let given: Vec<(&str, &stagecraft_tensor::TensorMetadata)> =
            inputs.iter().map(|(n, h)| (*n, h.metadata())).collect();
        let order = self.model.match_inputs(&given).map_err(onnx_err)?;
        let ordered: Vec<TensorHandle> = order.iter().map(|&i| inputs[i].1.clone()).collect();
        let baked = self
            .model
            .inputs()
            .iter()
            .zip(&ordered)
            .map(|(info, h)| {
                if self.model.input_is_baked(&info.name) {
                    Ok(Some(h.wait()?.to_dense()?))
                } else {
                    Ok(None)
                }
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let metas: Vec<_> = ordered.iter().map(|h| h.metadata().clone()).collect();
        let names: Vec<String> = self.params.iter().map(|(n, _)| n.clone()).collect();
        let id = self
            .model
            .function_with_params(&metas, &baked, &names)
            .map_err(onnx_err)?;
        let mut attrs = stagecraft_ops::OpAttrs::new();
        attrs.set_func("f", id);
        let mut args: stagecraft_runtime::Args = ordered.into_iter().collect();
        args.extend(self.params.iter().map(|(_, t)| t.handle.clone()));
        let device = stagecraft_runtime::place(&args);
        let results = if crate::autodiff::is_recording(&args) {
            crate::autodiff::execute_recorded(&stagecraft_ops::CALL, device, location, args, &attrs)
        } else {
            stagecraft_runtime::execute(
                &stagecraft_ops::CALL,
                device,
                location,
                args,
                (&attrs).into(),
            )
        };
        Ok(results.into_iter().collect())
    }

    /// The model with its current parameter values as initializers, as
    /// the bytes of an `.onnx` file.
    pub fn to_bytes(&self) -> crate::Result<Vec<u8>> {
        let values = self
            .params
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.handle.wait()?.to_dense()?)))
            .collect::<crate::Result<Vec<_>>>()?;
        self.model
            .to_bytes_with(&values)
            .map_err(|e| Error::invalid(e.to_string()))
    }

    /// Writes the model with its current parameter values to `path`.
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> crate::Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()?)
            .map_err(|e| Error::invalid(format!("cannot write {}: {e}", path.display())))
    }
}

impl crate::nn::Module for OnnxModule {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        for (name, t) in &self.params {
            f(&crate::nn::join(prefix, name), t);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        for (name, t) in &mut self.params {
            f(&crate::nn::join(prefix, name), t);
        }
    }
}

/// Writes the staged function `function` as an ONNX model at `path`: the
/// graph traced on its one call signature, its arguments as inputs
/// `input_0, input_1, ..`, the tensors it captured (a model's weights) as
/// initializers `param_0, ..`, its results as outputs `output_0, ..`.
/// Call it once before exporting; a function traced on several signatures
/// is an error (each would be a model of its own).
///
/// ```
/// use stagecraft::{function, onnx, Device, Tensor};
/// let cpu = Device::cpu();
/// let w = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &cpu)?;
/// let f = function(|x: Tensor<f32>| x.matmul(&w).relu());
/// let x = Tensor::<f32>::from_vec(vec![1.0, -1.0], &[1, 2], &cpu)?;
/// let y = f.call(x.clone());
/// let bytes = onnx::export_to_bytes(&f)?;
/// let model = onnx::Model::from_bytes(&bytes)?;
/// let out = model.run(&[("input_0", x)])?;
/// assert_eq!(out[0].as_slice::<f32>()?, y.to_vec()?.as_slice());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn export<A, R, F>(
    function: &crate::StagedFunction<A, R, F>,
    path: impl AsRef<std::path::Path>,
) -> crate::Result<()>
where
    A: crate::TensorGroup,
    R: crate::TensorGroup,
    F: Fn(A) -> R,
{
    let path = path.as_ref();
    let bytes = export_to_bytes(function)?;
    std::fs::write(path, bytes)
        .map_err(|e| Error::invalid(format!("cannot write {}: {e}", path.display())))
}

/// [`export`] as the bytes of an `.onnx` file.
pub fn export_to_bytes<A, R, F>(function: &crate::StagedFunction<A, R, F>) -> crate::Result<Vec<u8>>
where
    A: crate::TensorGroup,
    R: crate::TensorGroup,
    F: Fn(A) -> R,
{
    let mut traces = function.traces();
    let (f, captures) = match traces.len() {
        1 => traces.remove(0),
        0 => {
            return Err(Error::invalid(
                "the function has not been traced yet: call it once with inputs of the shapes to export",
            )
            .with_op("onnx::export"))
        }
        n => {
            return Err(Error::invalid(format!(
                "the function was traced for {n} input signatures; export one traced once"
            ))
            .with_op("onnx::export"))
        }
    };
    let inputs = f.params.len() - captures.len();
    let mut params: Vec<ExportParam> = (0..inputs)
        .map(|i| ExportParam::Input(format!("input_{i}")))
        .collect();
    for (i, c) in captures.iter().enumerate() {
        let value = c.wait()?.to_dense()?;
        params.push(ExportParam::Initializer(format!("param_{i}"), value));
    }
    let outputs: Vec<String> = (0..f.results.len())
        .map(|i| format!("output_{i}"))
        .collect();
    stagecraft_onnx::export_to_bytes(&f, &params, &outputs)
        .map_err(|e| Error::invalid(e.to_string()).with_op("onnx::export"))
}
