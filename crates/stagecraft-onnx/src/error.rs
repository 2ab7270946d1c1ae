//! Errors of the ONNX importer: what went wrong, and which node of the
//! model it happened at (name, op type, opset), so a user can find it.

use std::fmt;

/// What kind of problem an [`OnnxError`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnnxErrorKind {
    /// The bytes are not a valid ONNX protobuf (truncated, corrupt).
    Decode,
    /// The model uses something the importer does not support (an op, an
    /// opset version, a dtype, an attribute value). Conformance runs
    /// classify these as "unsupported", not as failures.
    Unsupported,
    /// The model or the call is invalid (a missing input, a wrong shape, an
    /// attribute out of range).
    Invalid,
    /// Running an op failed (the runtime's error, tagged with the node).
    Runtime,
    /// Reading or writing a file, or fetching test data, failed.
    Io,
}

/// The node an error happened at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRef {
    /// The node's name (may be empty in the model).
    pub name: String,
    /// Its op type, e.g. `Conv`.
    pub op_type: String,
    /// The opset version of its domain the model imports.
    pub opset: i64,
}

/// An error of loading or running an ONNX model.
#[derive(Clone, Debug)]
pub struct OnnxError {
    kind: OnnxErrorKind,
    node: Option<NodeRef>,
    message: String,
}

/// Results of the importer.
pub type Result<T> = std::result::Result<T, OnnxError>;

impl OnnxError {
    /// An error of `kind` with `message`, at no node.
    pub fn new(kind: OnnxErrorKind, message: impl Into<String>) -> OnnxError {
        OnnxError {
            kind,
            node: None,
            message: message.into(),
        }
    }

    /// An [`OnnxErrorKind::Unsupported`] error.
    pub fn unsupported(message: impl Into<String>) -> OnnxError {
        OnnxError::new(OnnxErrorKind::Unsupported, message)
    }

    /// An [`OnnxErrorKind::Invalid`] error.
    pub fn invalid(message: impl Into<String>) -> OnnxError {
        OnnxError::new(OnnxErrorKind::Invalid, message)
    }

    /// An [`OnnxErrorKind::Io`] error.
    pub fn io(message: impl Into<String>) -> OnnxError {
        OnnxError::new(OnnxErrorKind::Io, message)
    }

    /// Tags the error with `node`, unless it already names one.
    pub fn at_node(mut self, node: &NodeRef) -> OnnxError {
        if self.node.is_none() {
            self.node = Some(node.clone());
        }
        self
    }

    /// The kind of problem.
    pub fn kind(&self) -> OnnxErrorKind {
        self.kind
    }

    /// The node it happened at, if any.
    pub fn node(&self) -> Option<&NodeRef> {
        self.node.as_ref()
    }

    /// The message, without the node.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the model uses something unsupported.
    pub fn is_unsupported(&self) -> bool {
        self.kind == OnnxErrorKind::Unsupported
    }
}

impl fmt::Display for NodeRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.name.is_empty() {
            write!(f, "node {} (opset {})", self.op_type, self.opset)
        } else {
            write!(
                f,
                "node '{}' ({}, opset {})",
                self.name, self.op_type, self.opset
            )
        }
    }
}

impl fmt::Display for OnnxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(node) = &self.node {
            write!(f, "{node}: ")?;
        }
        if self.kind == OnnxErrorKind::Unsupported {
            write!(f, "unsupported: ")?;
        }
        write!(f, "{}", self.message)
    }
}

impl std::error::Error for OnnxError {}

impl From<stagecraft_tensor::Error> for OnnxError {
    fn from(e: stagecraft_tensor::Error) -> OnnxError {
        OnnxError::new(OnnxErrorKind::Runtime, e.to_string())
    }
}

impl From<stagecraft_fetch::FetchError> for OnnxError {
    fn from(e: stagecraft_fetch::FetchError) -> OnnxError {
        OnnxError::io(e.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_node() {
        let node = NodeRef {
            name: "conv1".into(),
            op_type: "Conv".into(),
            opset: 11,
        };
        let e = OnnxError::unsupported("auto_pad VALID").at_node(&node);
        assert_eq!(
            e.to_string(),
            "node 'conv1' (Conv, opset 11): unsupported: auto_pad VALID"
        );
        assert!(e.is_unsupported());
    }
}
