//! The loader fuzzers as bounded proptests: arbitrary bytes, and valid
//! files with a few bytes changed, as IDX images/labels files and as
//! safetensors checkpoints. The checks are the `idx_loader` and
//! `safetensors_loader` fuzz targets' own (`fuzz/src/cli_loaders.rs`): no
//! panic, every error names the file, and what loads is consistent.

#[path = "../../../fuzz/src/cli_loaders.rs"]
mod cli_loaders;

use proptest::prelude::*;
use stagecraft_cli::idx::{self, Images};
use std::collections::HashMap;

/// Runs `check` on `bytes`, turning a panic into a failure that shows the
/// bytes.
fn run(check: fn(&[u8]) -> Result<(), String>, bytes: &[u8]) -> Result<(), String> {
    match std::panic::catch_unwind(|| check(bytes)) {
        Ok(result) => result,
        Err(_) => Err(format!("panicked on {bytes:?}")),
    }
}

/// A valid small IDX file of either kind.
fn idx_file(labels: bool, count: usize, rows: usize, cols: usize, seed: u8) -> Vec<u8> {
    if labels {
        idx::encode_labels(
            &(0..count)
                .map(|i| (i as u8 ^ seed) % 10)
                .collect::<Vec<_>>(),
        )
    } else {
        idx::encode_images(&Images {
            count,
            rows,
            cols,
            pixels: (0..count * rows * cols).map(|i| i as u8 ^ seed).collect(),
        })
    }
}

/// A safetensors file whose header lists `tensors` (name, dtype, shape),
/// each with zeroed data of the right size, and the model kind.
fn safetensors_file(model: &str, tensors: &[(&str, &str, Vec<usize>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!(HashMap::from([("model", model)])),
    );
    let mut offset = 0;
    for (name, dtype, shape) in tensors {
        let size = match *dtype {
            "F64" | "I64" => 8,
            "F16" | "BF16" => 2,
            "U8" | "BOOL" => 1,
            _ => 4,
        };
        let bytes = shape.iter().product::<usize>() * size;
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + offset, 0);
    out
}

/// Overwrites a few bytes of `file` (positions taken modulo its length).
fn mutate(mut file: Vec<u8>, edits: &[(usize, u8)]) -> Vec<u8> {
    if !file.is_empty() {
        let n = file.len();
        for &(at, b) in edits {
            file[at % n] = b;
        }
    }
    file
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn idx_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        prop_assert_eq!(run(cli_loaders::idx, &bytes), Ok(()));
    }

    #[test]
    fn idx_mutated_files(
        labels in any::<bool>(),
        count in 0usize..4,
        rows in 0usize..4,
        cols in 0usize..4,
        seed in any::<u8>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<usize>()),
    ) {
        let mut file = mutate(idx_file(labels, count, rows, cols, seed), &edits);
        if let Some(cut) = cut {
            file.truncate(cut % (file.len() + 1));
        }
        prop_assert_eq!(run(cli_loaders::idx, &file), Ok(()));
    }

    #[test]
    fn safetensors_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        prop_assert_eq!(run(cli_loaders::safetensors, &bytes), Ok(()));
    }

    #[test]
    fn safetensors_mutated_files(
        model in prop::sample::select(vec!["mlp", "cnn", "other"]),
        dtype in prop::sample::select(vec!["F32", "F64", "F16", "I64", "U8", "BOOL"]),
        shape in proptest::collection::vec(0usize..5, 0..4),
        name in prop::sample::select(vec!["fc1.weight", "fc3.bias", "conv1.weight", "x"]),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        cut in proptest::option::of(any::<usize>()),
    ) {
        let file = safetensors_file(model, &[(name, dtype, shape)]);
        let mut file = mutate(file, &edits);
        if let Some(cut) = cut {
            file.truncate(cut % (file.len() + 1));
        }
        prop_assert_eq!(run(cli_loaders::safetensors, &file), Ok(()));
    }
}

/// The generators reach the loaders' success paths: valid files load, so
/// the properties above also check what a successful load returns.
#[test]
fn valid_files_pass_the_checks_and_load() {
    let images = idx_file(false, 2, 3, 4, 7);
    assert!(idx::parse_images(std::path::Path::new("x"), &images).is_ok());
    assert_eq!(run(cli_loaders::idx, &images), Ok(()));
    let labels = idx_file(true, 5, 0, 0, 1);
    assert!(idx::parse_labels(std::path::Path::new("x"), &labels).is_ok());
    assert_eq!(run(cli_loaders::idx, &labels), Ok(()));

    use stagecraft_cli::model::ModelKind;
    let shapes = ModelKind::Cnn.shapes();
    let tensors: Vec<_> = shapes
        .iter()
        .map(|(name, dims)| (*name, "F32", dims.clone()))
        .collect();
    let file = safetensors_file("cnn", &tensors);
    let cpu = stagecraft::Device::cpu();
    let path = std::path::Path::new("ckpt.safetensors");
    let model = stagecraft_cli::checkpoint::load_bytes(ModelKind::Cnn, path, &file, &cpu).unwrap();
    use stagecraft::nn::ModuleExt;
    assert_eq!(model.named_params().len(), shapes.len());
    assert_eq!(run(cli_loaders::safetensors, &file), Ok(()));
    let e = stagecraft_cli::checkpoint::load_bytes(ModelKind::Mlp, path, &file, &cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("ckpt.safetensors: a checkpoint of the cnn model"),
        "{e}"
    );
}
