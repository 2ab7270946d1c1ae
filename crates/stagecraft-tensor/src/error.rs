//! Errors as values: every error carries what went wrong, which op it came
//! from and the user's source line that called that op.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// A source location recorded with `#[track_caller]` at the user's call site
/// (or read back from a printed graph).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    file: &'static str,
    line: u32,
    column: u32,
}

impl Location {
    /// The location of the caller of the current `#[track_caller]` function.
    #[track_caller]
    #[inline]
    pub fn caller() -> Location {
        let l = std::panic::Location::caller();
        Location {
            file: l.file(),
            line: l.line(),
            column: l.column(),
        }
    }

    /// A location from its parts (for locations read back from text).
    pub fn new(file: &'static str, line: u32, column: u32) -> Location {
        Location { file, line, column }
    }

    /// The source file of the call.
    pub fn file(&self) -> &'static str {
        self.file
    }

    /// The 1-based line of the call.
    pub fn line(&self) -> u32 {
        self.line
    }

    /// The 1-based column of the call.
    pub fn column(&self) -> u32 {
        self.column
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file(), self.line(), self.column())
    }
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What kind of failure an [`Error`] describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ErrorKind {
    /// Incompatible or invalid shapes.
    #[error("shape error")]
    Shape,
    /// An element type the op does not accept, or mismatched element types.
    #[error("dtype error")]
    DType,
    /// A missing, mistyped or out-of-range op attribute.
    #[error("attribute error")]
    Attribute,
    /// An axis outside the tensor's rank.
    #[error("axis error")]
    Axis,
    /// A data-dependent index outside its bounds.
    #[error("index error")]
    Index,
    /// Any other invalid argument (wrong length of data, bad device name...).
    #[error("invalid argument")]
    InvalidArgument,
    /// The execution was cancelled with `cancel_execution()`.
    #[error("cancelled")]
    Cancelled,
    /// A device has no kernel for the op, or a device cannot be used.
    #[error("device error")]
    Device,
    /// Another process of a collective's group failed, hung, or ran a
    /// different collective (a distributed run cannot go on).
    #[error("distributed error")]
    Distributed,
    /// A broken internal invariant: always a stagecraft bug.
    #[error("internal error")]
    Internal,
}

struct ErrorInner {
    kind: ErrorKind,
    op: Option<Cow<'static, str>>,
    message: String,
    location: Option<Location>,
}

/// A stagecraft error: kind, message, the op that raised it and the user's
/// source location.
///
/// Errors travel through the runtime as values (an error handle's value), so
/// they are reference counted and cheap to clone.
#[derive(Clone)]
pub struct Error(Arc<ErrorInner>);

/// `Result` with stagecraft's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a message; attach the op and location with
    /// [`Error::with_op`] and [`Error::at`].
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error(Arc::new(ErrorInner {
            kind,
            op: None,
            message: message.into(),
            location: None,
        }))
    }

    /// Shorthand for a [`ErrorKind::Shape`] error.
    pub fn shape(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Shape, message)
    }

    /// Shorthand for a [`ErrorKind::DType`] error.
    pub fn dtype(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::DType, message)
    }

    /// Shorthand for an [`ErrorKind::Attribute`] error.
    pub fn attribute(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Attribute, message)
    }

    /// Shorthand for an [`ErrorKind::InvalidArgument`] error.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// Shorthand for an [`ErrorKind::Internal`] error.
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
    }

    /// The cancellation error given to ops pending or issued after
    /// `cancel_execution()`.
    pub fn cancelled() -> Error {
        Error::new(ErrorKind::Cancelled, "execution was cancelled")
    }

    /// Names the op that raised the error, unless one is already named.
    pub fn with_op(self, op: impl Into<Cow<'static, str>>) -> Error {
        if self.0.op.is_some() {
            return self;
        }
        self.map_inner(|inner| inner.op = Some(op.into()))
    }

    /// Records the source location, unless one is already recorded (the
    /// innermost location, closest to the failing op, wins).
    pub fn at(self, location: Location) -> Error {
        if self.0.location.is_some() {
            return self;
        }
        self.map_inner(|inner| inner.location = Some(location))
    }

    fn map_inner(self, edit: impl FnOnce(&mut ErrorInner)) -> Error {
        let mut inner = match Arc::try_unwrap(self.0) {
            Ok(inner) => inner,
            Err(shared) => ErrorInner {
                kind: shared.kind,
                op: shared.op.clone(),
                message: shared.message.clone(),
                location: shared.location,
            },
        };
        edit(&mut inner);
        Error(Arc::new(inner))
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    /// The op that raised the error, if known.
    pub fn op(&self) -> Option<&str> {
        self.0.op.as_deref()
    }

    /// The message, without op and location.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The user's source location of the failing op, if known.
    pub fn location(&self) -> Option<Location> {
        self.0.location
    }

    /// True for the cancellation error.
    pub fn is_cancelled(&self) -> bool {
        self.0.kind == ErrorKind::Cancelled
    }

    /// True when both values are the same shared error (propagated, not
    /// raised twice).
    pub fn same_as(&self, other: &Error) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.0.op, &self.0.location) {
            (Some(op), Some(loc)) => write!(f, "{op} at {loc}: ")?,
            (Some(op), None) => write!(f, "{op}: ")?,
            (None, Some(loc)) => write!(f, "at {loc}: ")?,
            (None, None) => {}
        }
        write!(f, "{}: {}", self.0.kind, self.0.message)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_op_location_kind_and_message() {
        let loc = Location::caller();
        let err = Error::shape("[2,3] vs [4,5]").with_op("MatMul").at(loc);
        let text = err.to_string();
        assert!(text.starts_with("MatMul at "), "{text}");
        assert!(text.contains(&format!("error.rs:{}", loc.line())), "{text}");
        assert!(text.ends_with("shape error: [2,3] vs [4,5]"), "{text}");
    }

    #[test]
    fn first_op_and_location_win() {
        let inner = Location::caller();
        let err = Error::invalid("x").with_op("A").at(inner);
        let outer = Location::caller();
        let err = err.with_op("B").at(outer);
        assert_eq!(err.op(), Some("A"));
        assert_eq!(err.location(), Some(inner));
    }
}
