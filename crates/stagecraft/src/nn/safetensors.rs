//! Saving and loading a module's parameters as safetensors files.
//!
//! Each parameter is one little-endian F32 tensor keyed by its full name
//! ([`Module::visit_params`]), the layout PyTorch's `safetensors.torch`
//! writes, so checkpoints move between the two when the names agree.
//! Loading checks the whole file against the module before replacing any
//! parameter: a bad file leaves the module as it was.

use super::Module;
use crate::{Error, ErrorKind, Result, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Writes `module`'s parameters to a safetensors file at `path`, creating
/// its directory if needed. Reads every parameter to the host, so a
/// parameter that failed to compute is this function's error.
pub fn save(module: &dyn Module, path: impl AsRef<Path>) -> Result<()> {
    save_with_metadata(module, path, &HashMap::new())
}

/// [`save`] with string `metadata` in the file's header (a model's name
/// or configuration, say; read it back with [`read_metadata`]).
pub fn save_with_metadata(
    module: &dyn Module,
    path: impl AsRef<Path>,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = save_to_bytes(module, metadata)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::invalid(format!("cannot create {}: {e}", dir.display())))?;
    }
    std::fs::write(path, bytes)
        .map_err(|e| Error::invalid(format!("cannot write {}: {e}", path.display())))
}

/// The bytes of the safetensors file [`save_with_metadata`] writes (no
/// header metadata when `metadata` is empty).
pub fn save_to_bytes(module: &dyn Module, metadata: &HashMap<String, String>) -> Result<Vec<u8>> {
    let mut params = Vec::new();
    module.visit_params("", &mut |name, t| {
        params.push((name.to_string(), t.dims().to_vec(), t.to_vec()))
    });
    let mut data = Vec::with_capacity(params.len());
    for (name, dims, values) in params {
        let values = values?;
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        data.push((name, dims, bytes));
    }
    let views = data
        .iter()
        .map(|(name, dims, bytes)| {
            TensorView::new(Dtype::F32, dims.clone(), bytes)
                .map(|view| (name.as_str(), view))
                .map_err(|e| Error::internal(format!("parameter {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = (!metadata.is_empty()).then(|| metadata.clone());
    safetensors::serialize(views, metadata)
        .map_err(|e| Error::invalid(format!("cannot encode the parameters as safetensors: {e}")))
}

/// Replaces `module`'s parameters by those in the safetensors file at
/// `path`, each placed on the device its current value is on.
///
/// The file must hold exactly the module's parameters: a missing key, an
/// extra key, a dtype other than F32 and a shape other than the current
/// parameter's are errors naming the key and the file, as is a file that
/// is not valid safetensors (corrupt or truncated). On error the module
/// is unchanged.
pub fn load(module: &mut dyn Module, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let bytes = std::fs::read(path)
        .map_err(|e| Error::invalid(format!("cannot read {}: {e}", path.display())))?;
    load_from_bytes(module, &bytes, &path.display().to_string())
}

/// [`load`] from the bytes of a safetensors file; `source` names them in
/// error messages (a path, a URL).
pub fn load_from_bytes(module: &mut dyn Module, bytes: &[u8], source: &str) -> Result<()> {
    let bad = |kind: ErrorKind, what: String| Error::new(kind, format!("{source}: {what}"));
    let file = SafeTensors::deserialize(bytes).map_err(|e| {
        bad(
            ErrorKind::InvalidArgument,
            format!("not a safetensors file: {e}"),
        )
    })?;
    let mut expected = Vec::new();
    module.visit_params("", &mut |name, t| {
        expected.push((name.to_string(), t.dims().to_vec()))
    });
    let mut values: HashMap<String, Vec<f32>> = HashMap::with_capacity(expected.len());
    for (name, dims) in &expected {
        let view = file.tensor(name).map_err(|_| {
            bad(
                ErrorKind::InvalidArgument,
                format!("missing parameter {name} (expected shape {dims:?})"),
            )
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(
                ErrorKind::DType,
                format!("parameter {name} is {:?}, expected F32", view.dtype()),
            ));
        }
        if view.shape() != dims.as_slice() {
            return Err(bad(
                ErrorKind::Shape,
                format!(
                    "parameter {name} has shape {:?} in the file, expected {dims:?}",
                    view.shape()
                ),
            ));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        values.insert(name.clone(), data);
    }
    let mut extra: Vec<String> = file
        .names()
        .into_iter()
        .filter(|name| !values.contains_key(*name))
        .map(str::to_string)
        .collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(bad(
            ErrorKind::InvalidArgument,
            format!(
                "unexpected parameter{} {} (not in the module)",
                if extra.len() == 1 { "" } else { "s" },
                extra.join(", ")
            ),
        ));
    }
    // Everything is checked; only making the device tensors can fail now,
    // so the tensors are all made before any parameter is replaced.
    let mut fresh: BTreeMap<String, Tensor<f32>> = BTreeMap::new();
    let mut failure = None;
    module.visit_params("", &mut |name, t| {
        if failure.is_some() {
            return;
        }
        let data = values.remove(name).unwrap_or_default();
        match Tensor::from_vec(data, t.dims(), &t.device()) {
            Ok(new) => {
                fresh.insert(name.to_string(), new);
            }
            Err(e) => failure = Some(e),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    module.visit_params_mut("", &mut |name, t| {
        if let Some(new) = fresh.remove(name) {
            crate::autodiff::replace_keeping_mark(t, new);
        }
    });
    Ok(())
}

/// The string metadata in the header of a safetensors file's bytes
/// (empty when it has none).
pub fn read_metadata(bytes: &[u8]) -> Result<HashMap<String, String>> {
    let (_, metadata) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::invalid(format!("not a safetensors file: {e}")))?;
    Ok(metadata.metadata().clone().unwrap_or_default())
}
