//! The command's error: a message for the user, built from whatever failed
//! (a file, the runtime, a format) with the context that names it.

use std::fmt;

/// An error the command reports and exits with.
#[derive(Debug)]
pub struct CliError {
    message: String,
}

impl CliError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CliError {}

/// The command's result type.
pub type Result<T> = std::result::Result<T, CliError>;

impl From<stagecraft_fetch::FetchError> for CliError {
    fn from(e: stagecraft_fetch::FetchError) -> CliError {
        CliError::new(e.0)
    }
}

impl From<crate::idx::IdxError> for CliError {
    fn from(e: crate::idx::IdxError) -> CliError {
        CliError::new(e.to_string())
    }
}

impl From<stagecraft::Error> for CliError {
    fn from(e: stagecraft::Error) -> CliError {
        CliError::new(format!("runtime error: {e}"))
    }
}
