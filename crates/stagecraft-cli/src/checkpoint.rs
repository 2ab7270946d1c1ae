//! Checkpoints in the safetensors format: one little-endian f32 tensor per
//! parameter, named as in [`ModelKind::shapes`] (`fc1.weight`, ...), and
//! the model kind in the file's metadata so a checkpoint is never loaded
//! into the other network.

use crate::error::{CliError, Result};
use crate::model::{Model, ModelKind};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// Writes `model`'s parameters to `path`.
pub fn save(model: &Model, path: &Path) -> Result<()> {
    let values = model.values()?;
    let bytes: Vec<Vec<u8>> = values
        .iter()
        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let shapes = model.kind.shapes();
    let views = shapes
        .iter()
        .zip(&bytes)
        .map(|((name, dims), data)| {
            TensorView::new(Dtype::F32, dims.clone(), data)
                .map(|view| (*name, view))
                .map_err(|e| CliError::new(format!("checkpoint tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("model".to_string(), model.kind.name().to_string())]);
    let file = safetensors::serialize(views, Some(metadata))
        .map_err(|e| CliError::new(format!("cannot encode the checkpoint: {e}")))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| CliError::new(format!("cannot create {}: {e}", dir.display())))?;
    }
    std::fs::write(path, file)
        .map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))
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
    let bad = |what: String| CliError::new(format!("{}: {what}", path.display()));
    let file =
        SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let (_, metadata) = SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    if let Some(saved) = metadata.metadata().as_ref().and_then(|m| m.get("model")) {
        if saved != kind.name() {
            return Err(bad(format!(
                "a checkpoint of the {saved} model, not of the {} model (use --model {saved})",
                kind.name()
            )));
        }
    }
    let mut values = Vec::new();
    for (name, dims) in kind.shapes() {
        let view = file
            .tensor(name)
            .map_err(|_| bad(format!("no tensor {name}")))?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!("{name} is {:?}, expected F32", view.dtype())));
        }
        if view.shape() != dims.as_slice() {
            return Err(bad(format!(
                "{name} has shape {:?}, expected {dims:?}",
                view.shape()
            )));
        }
        let data = view.data();
        values.push(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        );
    }
    Ok(Model::from_values(kind, values, device)?)
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
}
