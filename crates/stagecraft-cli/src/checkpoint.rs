//! Checkpoints of the MNIST networks: `stagecraft::nn`'s safetensors
//! files (one little-endian f32 tensor per parameter, named as in
//! [`ModelKind::shapes`]), with the model kind in the file's metadata so
//! a checkpoint is never loaded into the other network.

use crate::error::{CliError, Result};
use crate::model::{Model, ModelKind};
use std::collections::HashMap;
use std::path::Path;

/// The header key of the network's name.
const KIND_KEY: &str = "model";

/// Writes `model`'s parameters to `path`.
pub fn save(model: &Model, path: &Path) -> Result<()> {
    let metadata = HashMap::from([(KIND_KEY.to_string(), model.kind.name().to_string())]);
    stagecraft::nn::save_with_metadata(model, path, &metadata)?;
    Ok(())
}

/// Fails at once, before any data is fetched or any step runs, when a
/// checkpoint could not be written to `path` once training ends.
pub fn ensure_writable(path: &Path) -> Result<()> {
    let cannot = |why: String| CliError::new(format!("cannot save to {}: {why}", path.display()));
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(cannot(format!(
            "the directory {} does not exist",
            parent.display()
        )));
    }
    if path.is_dir() {
        return Err(cannot("it is a directory".to_string()));
    }
    let existed = path.exists();
    // Opening for append neither truncates an existing file nor, once
    // removed again, leaves a new one behind.
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| cannot(e.to_string()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Fails at once when the checkpoint at `path` cannot be read.
pub fn ensure_readable(path: &Path) -> Result<()> {
    let cannot = |why: String| CliError::new(format!("cannot read {}: {why}", path.display()));
    if path.is_dir() {
        return Err(cannot("it is a directory".to_string()));
    }
    std::fs::File::open(path).map_err(|e| cannot(e.to_string()))?;
    Ok(())
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
    let metadata =
        stagecraft::nn::read_metadata(bytes).map_err(|e| bad(e.message().to_string()))?;
    if let Some(saved) = metadata.get(KIND_KEY) {
        if saved != kind.name() {
            return Err(bad(format!(
                "a checkpoint of the {saved} model, not of the {} model (use --model {saved})",
                kind.name()
            )));
        }
    }
    let mut model = Model::init(kind, 0, device);
    stagecraft::nn::load_from_bytes(&mut model, bytes, &path.display().to_string())
        .map_err(|e| CliError::new(e.message()))?;
    Ok(model)
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
