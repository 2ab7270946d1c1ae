//! The checks of the `idx_loader` and `safetensors_loader` targets,
//! shared with their proptest (`crates/stagecraft-cli/tests/fuzz_loaders.rs`
//! includes this file).
//!
//! Each takes arbitrary bytes and returns `Err` with a description when a
//! parser breaks its contract: an error that does not say which file or
//! line is wrong, or a result that is inconsistent with the input. A panic
//! is the callers' to catch, as for the op calls.

use std::path::Path;

/// The name the loaders are given for the bytes; every error must start
/// with it.
const FILE: &str = "fuzz/input.bin";

/// Feeds `bytes` to both IDX parsers. An error must start with the file's
/// name; a parsed file must encode back to exactly `bytes` (the format has
/// one encoding per value) and hold only digit labels.
pub fn idx(bytes: &[u8]) -> Result<(), String> {
    use stagecraft_cli::idx;
    let path = Path::new(FILE);
    let prefix = format!("{FILE}: ");
    match idx::parse_images(path, bytes) {
        Ok(images) => {
            if images.count * images.rows * images.cols != images.pixels.len() {
                return Err(format!(
                    "images {}x{}x{} hold {} pixels",
                    images.count,
                    images.rows,
                    images.cols,
                    images.pixels.len()
                ));
            }
            if idx::encode_images(&images) != bytes {
                return Err("parsed images do not encode back to the same bytes".into());
            }
        }
        Err(e) if !e.to_string().starts_with(&prefix) => {
            return Err(format!("an images error that does not name the file: {e}"));
        }
        Err(_) => {}
    }
    match idx::parse_labels(path, bytes) {
        Ok(labels) => {
            if let Some(bad) = labels.iter().find(|&&l| l as usize >= idx::CLASSES) {
                return Err(format!("accepted the label {bad}"));
            }
            if idx::encode_labels(&labels) != bytes {
                return Err("parsed labels do not encode back to the same bytes".into());
            }
        }
        Err(e) if !e.to_string().starts_with(&prefix) => {
            return Err(format!("a labels error that does not name the file: {e}"));
        }
        Err(_) => {}
    }
    Ok(())
}

/// Loads `bytes` as a checkpoint of each model kind. An error must start
/// with the file's name; a loaded model must have every parameter with the
/// shape its kind gives it.
pub fn safetensors(bytes: &[u8]) -> Result<(), String> {
    use stagecraft_cli::checkpoint;
    use stagecraft_cli::model::ModelKind;
    let prefix = format!("{FILE}: ");
    let cpu = stagecraft::Device::cpu();
    for kind in [ModelKind::Mlp, ModelKind::Cnn] {
        match checkpoint::load_bytes(kind, Path::new(FILE), bytes, &cpu) {
            Ok(model) => {
                use stagecraft::nn::ModuleExt;
                let shapes = kind.shapes();
                let params = model.named_params();
                if params.len() != shapes.len() {
                    return Err(format!(
                        "a {} model loaded with {} parameters",
                        kind.name(),
                        params.len()
                    ));
                }
                for ((_, p), (name, dims)) in params.iter().zip(&shapes) {
                    if p.dims() != dims.as_slice() {
                        return Err(format!("{name} loaded with shape {:?}", p.dims()));
                    }
                }
            }
            Err(e) if !e.to_string().starts_with(&prefix) => {
                return Err(format!(
                    "a {} checkpoint error that does not name the file: {e}",
                    kind.name()
                ));
            }
            Err(_) => {}
        }
    }
    Ok(())
}
