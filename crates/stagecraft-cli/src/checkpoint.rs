//! Checkpoints in the safetensors format: one little-endian f32 tensor per
//! parameter, named as in [`ModelKind::shapes`] (`fc1.weight`, ...), and
//! the model kind in the file's metadata so a checkpoint is never loaded
//! into the other network.
//!
//! The encoding and the checks of names, dtypes and shapes are
//! `stagecraft::nn`'s; this module only adapts the CLI's flat parameter
//! list (whose dense weights are `[in, out]`, unlike `nn::Linear`) to a
//! [`Module`] and adds the model-kind check.

use crate::error::{CliError, Result};
use crate::model::{Model, ModelKind};
use stagecraft::nn::{self, Module};
use stagecraft::Tensor;
use std::collections::HashMap;
use std::path::Path;

/// A model's parameters under their checkpoint names, in
/// [`ModelKind::shapes`] order.
struct Named {
    names: Vec<&'static str>,
    params: Vec<Tensor<f32>>,
}

impl Named {
    fn new(kind: ModelKind, params: Vec<Tensor<f32>>) -> Named {
        let names = kind.shapes().into_iter().map(|(name, _)| name).collect();
        Named { names, params }
    }
}

impl Module for Named {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<f32>)) {
        for (name, p) in self.names.iter().zip(&self.params) {
            f(&nn::join(prefix, name), p);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor<f32>)) {
        for (name, p) in self.names.iter().zip(&mut self.params) {
            f(&nn::join(prefix, name), p);
        }
    }
}

/// The library's message without its kind prefix: the CLI's errors read
/// as sentences about the file.
fn cli_error(e: stagecraft::Error) -> CliError {
    CliError::new(e.message().to_string())
}

/// Writes `model`'s parameters to `path`.
pub fn save(model: &Model, path: &Path) -> Result<()> {
    let named = Named::new(model.kind, model.params.clone());
    let metadata = HashMap::from([("model".to_string(), model.kind.name().to_string())]);
    nn::save_with_metadata(&named, path, &metadata).map_err(cli_error)
}

/// Reads the parameters of a `kind` model from `path`, checking names,
/// dtypes and shapes.
pub fn load(kind: ModelKind, path: &Path, device: &stagecraft::Device) -> Result<Model> {
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::new(format!("cannot read {}: {e}", path.display())))?;
    load_bytes(kind, path, &bytes, device)
}

/// Parses the parameters of a `kind` model from the bytes of a
/// safetensors file, checking names, dtypes and shapes. `path` only names
/// the file: every error starts with it.
pub fn load_bytes(
    kind: ModelKind,
    path: &Path,
    bytes: &[u8],
    device: &stagecraft::Device,
) -> Result<Model> {
    let source = path.display().to_string();
    let bad = |what: String| CliError::new(format!("{source}: {what}"));
    let metadata = nn::read_metadata(bytes).map_err(|e| bad(e.message().to_string()))?;
    if let Some(saved) = metadata.get("model") {
        if saved != kind.name() {
            return Err(bad(format!(
                "a checkpoint of the {saved} model, not of the {} model (use --model {saved})",
                kind.name()
            )));
        }
    }
    // Placeholders of the right shapes on `device`: loading checks the
    // file against them and replaces them.
    let zeros = kind
        .shapes()
        .iter()
        .map(|(_, dims)| Tensor::zeros(dims, device))
        .collect();
    let mut named = Named::new(kind, zeros);
    nn::load_from_bytes(&mut named, bytes, &source).map_err(cli_error)?;
    Ok(Model {
        kind,
        params: named.params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft::Device;

    #[test]
    fn round_trip_keeps_every_value_and_checks_the_kind() {
        let dir = std::env::temp_dir().join(format!("stagecraft-ckpt-{}", std::process::id()));
        let path = dir.join("m.safetensors");
        let cpu = Device::cpu();
        let model = Model::init(ModelKind::Mlp, 3, &cpu);
        save(&model, &path).unwrap();
        let loaded = load(ModelKind::Mlp, &path, &cpu).unwrap();
        assert_eq!(loaded.values().unwrap(), model.values().unwrap());
        let e = load(ModelKind::Cnn, &path, &cpu).unwrap_err().to_string();
        assert!(e.contains("a checkpoint of the mlp model"), "{e}");
        std::fs::write(&path, b"garbage").unwrap();
        let e = load(ModelKind::Mlp, &path, &cpu).unwrap_err().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_format_is_unchanged() {
        let cpu = Device::cpu();
        let model = Model::init(ModelKind::Cnn, 4, &cpu);
        let dir = std::env::temp_dir().join(format!("stagecraft-ckpt-fmt-{}", std::process::id()));
        let path = dir.join("c.safetensors");
        save(&model, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names = file.names();
        names.sort();
        let mut want: Vec<&str> = ModelKind::Cnn.shapes().iter().map(|(n, _)| *n).collect();
        want.sort();
        assert_eq!(names, want);
        for ((name, dims), values) in ModelKind::Cnn.shapes().iter().zip(model.values().unwrap()) {
            let view = file.tensor(name).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            assert_eq!(view.shape(), dims.as_slice());
            let got: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(got, values, "{name}");
        }
        let metadata = nn::read_metadata(&bytes).unwrap();
        assert_eq!(metadata.get("model").map(String::as_str), Some("cnn"));
        let e = load_bytes(ModelKind::Cnn, &path, &bytes[..bytes.len() - 1], &cpu)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&path.display().to_string()), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
