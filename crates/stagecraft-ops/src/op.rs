//! What an op is: its name, inputs, typed attributes with defaults, its
//! properties, and its metadata function (the shape and dtype rule).

use crate::attrs::{AttrKind, AttrValue, OpAttrs};
use crate::defs::{BinaryOp, UnaryOp};
use smallvec::SmallVec;
use stagecraft_tensor::{DType, Error, Result, Scalar, TensorMetadata};
use std::fmt;

/// The output metadata a shape rule returns; almost every op has one output.
pub type OutputMetas = SmallVec<[TensorMetadata; 1]>;

/// A metadata function: synchronous, device-independent shape and dtype
/// inference plus validation of inputs and attributes.
pub type MetadataFn = fn(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas>;

/// The default of an optional attribute.
#[derive(Clone, Copy, Debug)]
pub enum AttrDefault {
    /// A bool.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// An integer list.
    Ints(&'static [i64]),
    /// A dtype.
    DType(DType),
    /// A string.
    Str(&'static str),
}

impl AttrDefault {
    fn value(self) -> AttrValue<'static> {
        match self {
            AttrDefault::Bool(v) => AttrValue::Bool(v),
            AttrDefault::Int(v) => AttrValue::Int(v),
            AttrDefault::Float(v) => AttrValue::Float(v),
            AttrDefault::Ints(v) => AttrValue::Ints(v),
            AttrDefault::DType(v) => AttrValue::DType(v),
            AttrDefault::Str(v) => AttrValue::Str(v),
        }
    }
}

/// One declared attribute of an op.
#[derive(Clone, Copy, Debug)]
pub struct AttrSpec {
    /// The attribute's name.
    pub name: &'static str,
    /// Its type.
    pub kind: AttrKind,
    /// Its default; `None` makes the attribute required.
    pub default: Option<AttrDefault>,
}

impl AttrSpec {
    /// A required attribute.
    pub const fn required(name: &'static str, kind: AttrKind) -> AttrSpec {
        AttrSpec {
            name,
            kind,
            default: None,
        }
    }

    /// An optional attribute with a default.
    pub const fn optional(name: &'static str, kind: AttrKind, default: AttrDefault) -> AttrSpec {
        AttrSpec {
            name,
            kind,
            default: Some(default),
        }
    }
}

/// Elementwise comparisons; the result is bool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareOp {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl CompareOp {
    /// The comparison as a WGSL `bool` expression over `a, b: f32`, for GPU
    /// kernels. NaN compares unequal to everything, as on the CPU; the
    /// explicit tests keep a compiler that assumes no NaN from folding
    /// that away (`sc_isnan` is in `stagecraft-wgpu`'s prelude).
    pub const fn wgsl(self) -> &'static str {
        match self {
            CompareOp::Eq => "!(sc_isnan(a) || sc_isnan(b)) && a == b",
            CompareOp::Ne => "sc_isnan(a) || sc_isnan(b) || a != b",
            CompareOp::Lt => "!(sc_isnan(a) || sc_isnan(b)) && a < b",
            CompareOp::Le => "!(sc_isnan(a) || sc_isnan(b)) && a <= b",
            CompareOp::Gt => "!(sc_isnan(a) || sc_isnan(b)) && a > b",
            CompareOp::Ge => "!(sc_isnan(a) || sc_isnan(b)) && a >= b",
        }
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// sum
    Sum,
    /// arithmetic mean
    Mean,
    /// maximum (NaN propagates)
    Max,
    /// minimum (NaN propagates)
    Min,
    /// product
    Prod,
}

/// Ops that run functions of the library.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ControlOp {
    /// Runs one of two branch functions, chosen by a bool scalar.
    If,
    /// Runs a body function while a condition function returns true.
    While,
    /// Runs one function.
    Call,
}

/// The property of an op that passes and kernels dispatch on, so that they
/// ask "is this elementwise?" rather than "is this op named Add?".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Elementwise, one input.
    Unary(UnaryOp),
    /// Elementwise, two broadcast inputs, same dtype out.
    Binary(BinaryOp),
    /// Elementwise, two broadcast inputs, bool out.
    Compare(CompareOp),
    /// A reduction over axes.
    Reduce(ReduceOp),
    /// Control flow: runs library functions named by its attributes.
    Control(ControlOp),
    /// One end of a cross-device edge (`Send`, `Recv`), run by the executor.
    Transfer,
    /// Anything else.
    Other,
}

impl OpKind {
    /// True for ops that compute each output element from the same element
    /// of their (broadcast) inputs.
    pub fn is_elementwise(self) -> bool {
        matches!(
            self,
            OpKind::Unary(_) | OpKind::Binary(_) | OpKind::Compare(_)
        )
    }
}

/// Whether an op may be reordered, deduplicated or dropped when unused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Effect {
    /// A function of its inputs and attributes only.
    Pure,
    /// Observable effects (printing, generator state, assignment): ordered
    /// by chains, never deduplicated or dropped.
    SideEffecting,
}

/// Whether the output shapes follow from input metadata alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShapeKind {
    /// Known synchronously from the metadata function.
    Static,
    /// Known only when the values are (e.g. `Nonzero`); the metadata
    /// function returns the dtype and rank, with 0 in the unknown dims.
    DataDependent,
}

/// The definition of an op: everything about it that does not depend on a
/// device. Kernels are registered separately, per device kind.
pub struct OpDef {
    /// The op's name, as it appears in traces and errors.
    pub name: &'static str,
    /// Names of the inputs; for a variadic op, the inputs repeat the last
    /// name.
    pub inputs: &'static [&'static str],
    /// True when the op takes any number (≥ 1) of inputs.
    pub variadic: bool,
    /// The number of outputs; 0 for control-flow ops, whose outputs are
    /// those of the functions they run (the metadata function says how
    /// many).
    pub outputs: usize,
    /// Declared attributes.
    pub attrs: &'static [AttrSpec],
    /// Property used by passes and kernel dispatch.
    pub kind: OpKind,
    /// Pure or side-effecting.
    pub effect: Effect,
    /// Static or data-dependent output shapes.
    pub shape_kind: ShapeKind,
    /// The shape and dtype rule.
    pub metadata: MetadataFn,
    /// The reverse-mode gradient rule; `None` for ops that are not
    /// differentiable (comparisons, indices, random numbers).
    pub grad: Option<crate::grad::GradFn>,
}

impl fmt::Debug for OpDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for OpDef {
    fn eq(&self, other: &OpDef) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for OpDef {}

impl std::hash::Hash for OpDef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self as *const OpDef).hash(state)
    }
}

impl OpDef {
    /// Checks arity and attributes, then runs the metadata function.
    ///
    /// The error is not yet tagged with the op name or location; the caller
    /// (the core runtime) adds both.
    pub fn infer(&self, inputs: &[TensorMetadata], attrs: &OpAttrs) -> Result<OutputMetas> {
        self.check_arity(inputs.len())?;
        self.check_attrs(attrs)?;
        let outputs = (self.metadata)(inputs, &Attrs { attrs, def: self })?;
        // An element count that fits `usize` can still need more bytes than
        // an address space holds: no kernel could allocate such an output,
        // so it is an error of the op here, wherever metadata is computed.
        for meta in &outputs {
            meta.checked_size_in_bytes()?;
        }
        Ok(outputs)
    }

    fn check_arity(&self, n: usize) -> Result<()> {
        // A variadic op repeats its last input zero or more times, except
        // that an op whose only input is variadic needs at least one.
        let ok = if self.variadic {
            n >= self.inputs.len()
        } else {
            n == self.inputs.len()
        };
        if ok {
            return Ok(());
        }
        let expected = if self.variadic {
            format!("at least {}", self.inputs.len())
        } else {
            self.inputs.len().to_string()
        };
        Err(Error::invalid(format!(
            "expects {expected} inputs ({}), got {n}",
            self.inputs.join(", ")
        )))
    }

    /// Rejects unknown names, wrong kinds and missing required attributes.
    pub fn check_attrs(&self, attrs: &OpAttrs) -> Result<()> {
        for (name, value) in attrs.iter() {
            // Names usually come from the op's own declaration: the same
            // string, compared by address before by content.
            let declared = |s: &&AttrSpec| std::ptr::eq(s.name, name) || s.name == name;
            match self.attrs.iter().find(declared) {
                None => {
                    return Err(Error::attribute(format!(
                        "unknown attribute `{name}`; {} takes {}",
                        self.name,
                        self.attr_list()
                    )))
                }
                Some(spec) if spec.kind != value.kind() => {
                    return Err(Error::attribute(format!(
                        "attribute `{name}` must be a {}, got a {}",
                        spec.kind.name(),
                        value.kind().name()
                    )))
                }
                Some(_) => {}
            }
        }
        for spec in self.attrs {
            if spec.default.is_none() && attrs.get(spec.name).is_none() {
                return Err(Error::attribute(format!(
                    "missing required attribute `{}` ({})",
                    spec.name,
                    spec.kind.name()
                )));
            }
        }
        Ok(())
    }

    fn attr_list(&self) -> String {
        if self.attrs.is_empty() {
            return "no attributes".into();
        }
        self.attrs
            .iter()
            .map(|s| format!("`{}`", s.name))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Typed access to an op's attributes, falling back to the declared
/// defaults.
#[derive(Clone, Copy)]
pub struct Attrs<'a> {
    attrs: &'a OpAttrs,
    def: &'a OpDef,
}

impl<'a> Attrs<'a> {
    /// Wraps attributes for reading under `def`'s declarations.
    pub fn new(attrs: &'a OpAttrs, def: &'a OpDef) -> Attrs<'a> {
        Attrs { attrs, def }
    }

    /// The raw map.
    pub fn raw(&self) -> &'a OpAttrs {
        self.attrs
    }

    fn value(&self, name: &str) -> Result<AttrValue<'a>> {
        if let Some(v) = self.attrs.get(name) {
            return Ok(v);
        }
        let spec = self.def.attrs.iter().find(|s| s.name == name);
        match spec.and_then(|s| s.default) {
            Some(default) => Ok(default.value()),
            None => Err(Error::attribute(format!(
                "missing required attribute `{name}`"
            ))),
        }
    }

    fn mismatch(name: &str, want: AttrKind, got: AttrValue<'_>) -> Error {
        Error::attribute(format!(
            "attribute `{name}` must be a {}, got a {}",
            want.name(),
            got.kind().name()
        ))
    }

    /// A bool attribute.
    pub fn bool(&self, name: &str) -> Result<bool> {
        match self.value(name)? {
            AttrValue::Bool(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Bool, other)),
        }
    }

    /// An integer attribute.
    pub fn int(&self, name: &str) -> Result<i64> {
        match self.value(name)? {
            AttrValue::Int(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Int, other)),
        }
    }

    /// A float attribute.
    pub fn float(&self, name: &str) -> Result<f64> {
        match self.value(name)? {
            AttrValue::Float(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Float, other)),
        }
    }

    /// A dtype attribute.
    pub fn dtype(&self, name: &str) -> Result<DType> {
        match self.value(name)? {
            AttrValue::DType(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::DType, other)),
        }
    }

    /// A scalar attribute.
    pub fn scalar(&self, name: &str) -> Result<Scalar> {
        match self.value(name)? {
            AttrValue::Scalar(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Scalar, other)),
        }
    }

    /// An integer-list attribute.
    pub fn ints(&self, name: &str) -> Result<&'a [i64]> {
        match self.value(name)? {
            AttrValue::Ints(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Ints, other)),
        }
    }

    /// An integer-list attribute whose entries must be non-negative sizes.
    pub fn dims(&self, name: &str) -> Result<SmallVec<[usize; 4]>> {
        self.ints(name)?
            .iter()
            .map(|&v| {
                usize::try_from(v).map_err(|_| {
                    Error::attribute(format!("attribute `{name}` has a negative entry {v}"))
                })
            })
            .collect()
    }

    /// A float-list attribute.
    pub fn floats(&self, name: &str) -> Result<&'a [f64]> {
        match self.value(name)? {
            AttrValue::Floats(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Floats, other)),
        }
    }

    /// A function attribute.
    pub fn func(&self, name: &str) -> Result<crate::func::FuncId> {
        match self.value(name)? {
            AttrValue::Func(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Func, other)),
        }
    }

    /// A string attribute.
    pub fn str(&self, name: &str) -> Result<&'a str> {
        match self.value(name)? {
            AttrValue::Str(v) => Ok(v),
            other => Err(Self::mismatch(name, AttrKind::Str, other)),
        }
    }
}

impl<'a> Attrs<'a> {
    /// The op whose attributes these are.
    pub fn op(&self) -> &'a OpDef {
        self.def
    }
}
