//! The machinery behind the elementwise op table in `defs/elementwise.rs`.
//!
//! An elementwise op is one entry of [`unary_ops!`] or [`binary_ops!`]:
//! its name, the dtypes it accepts, its scalar meaning (a function generic
//! over [`Num`]) and its gradient rule. From that entry the macros make
//! the enum variant ([`UnaryOp`] / [`BinaryOp`]), the `OpDef` static, the
//! fused-program code, and a type implementing [`UnaryFn`] /
//! [`BinaryFn`]. Every interpretation reaches the meaning through a
//! visitor ([`UnaryOp::visit`]), which hands it the op's type, so a
//! kernel loop is monomorphized per op and the scalar function inlines
//! into it: the eager CPU kernel, the fused interpreter and the f64
//! reference kernel derive from the one definition and are never written
//! per op (the recipe is in ARCHITECTURE.md, "Adding an elementwise op").
//!
//! [`UnaryOp`]: crate::UnaryOp
//! [`BinaryOp`]: crate::BinaryOp

use crate::scalar::Num;
use stagecraft_tensor::DType;

/// The dtypes an elementwise op accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DTypeClass {
    /// Floating-point dtypes (f16, bf16, f32, f64).
    Float,
    /// Every number: integers and floats.
    Numeric,
    /// The integer dtypes (signed and unsigned). Their ops have no
    /// gradient rule at all: no float flows through them.
    Int,
    /// `bool` alone.
    Bool,
}

impl DTypeClass {
    /// True when `dtype` belongs to the class.
    pub const fn accepts(self, dtype: DType) -> bool {
        match self {
            DTypeClass::Float => dtype.is_float(),
            DTypeClass::Numeric => dtype.is_numeric(),
            DTypeClass::Int => dtype.is_int(),
            DTypeClass::Bool => matches!(dtype, DType::Bool),
        }
    }

    /// The class in words, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            DTypeClass::Float => "a floating-point tensor",
            DTypeClass::Numeric => "a numeric tensor",
            DTypeClass::Int => "an integer tensor",
            DTypeClass::Bool => "a bool tensor",
        }
    }
}

/// The scalar meaning of one unary elementwise op (made by
/// [`unary_ops!`]).
pub trait UnaryFn: 'static {
    /// The op.
    const OP: crate::UnaryOp;
    /// The dtypes it accepts.
    const CLASS: DTypeClass;
    /// The op on one element. A bool op is evaluated on `u8` 0 and 1 and
    /// must return 0 or 1.
    fn eval<T: Num>(x: T) -> T;
}

/// The scalar meaning of one binary elementwise op (made by
/// [`binary_ops!`]).
pub trait BinaryFn: 'static {
    /// The op.
    const OP: crate::BinaryOp;
    /// The dtypes it accepts.
    const CLASS: DTypeClass;
    /// True when an integer zero in the second operand is an error
    /// (division); the kernels check the operand before the loop.
    const ZERO_DIVISOR_IS_ERROR: bool;
    /// The op on one pair of elements. A bool op is evaluated on `u8` 0
    /// and 1 and must return 0 or 1.
    fn eval<T: Num>(a: T, b: T) -> T;
}

/// Something done with a unary op's meaning: [`crate::UnaryOp::visit`]
/// calls [`UnaryVisitor::visit`] with the op's [`UnaryFn`] type.
pub trait UnaryVisitor {
    /// What the visit returns.
    type Output;
    /// Called with the op's type.
    fn visit<F: UnaryFn>(self) -> Self::Output;
}

/// Something done with a binary op's meaning: [`crate::BinaryOp::visit`]
/// calls [`BinaryVisitor::visit`] with the op's [`BinaryFn`] type.
pub trait BinaryVisitor {
    /// What the visit returns.
    type Output;
    /// Called with the op's type.
    fn visit<F: BinaryFn>(self) -> Self::Output;
}

/// Defines the unary elementwise ops from one table. Each entry:
///
/// ```text
/// /// doc
/// Variant => STATIC("OpName", Class) {
///     eval: |x| <expression over `x: T` where `T: Num`>,
///     wgsl: "<WGSL f32 expression over `x`>",                 // optional
///     grad: |b, x, y, g| <Result<G>: the input's gradient>,   // or `grad: none`
/// }
/// ```
///
/// `wgsl` is the op's meaning for GPU kernels: a WGSL expression over `x`
/// of the class's WGSL type: `f32` for float and numeric ops (which may
/// call the helper functions of `stagecraft-wgpu`'s prelude: `sc_erf`,
/// `sc_tanh`, ...), `i32` for integer ops, and for bool ops `i32` holding
/// 0 or 1, giving 0 or 1. A numeric op's expression also runs over `i32`,
/// so it is written to read the same over both: integer literals (which
/// WGSL converts to `f32` where an `f32` is wanted), and the prelude's
/// helpers that both types have (`sc_isnan`, `sc_floor`, ...) in place
/// of float-only builtins. An op without one runs on the CPU when placed
/// on a GPU.
///
/// `grad` gets the gradient builder, the input, the output and the
/// output's gradient; `none` means the op passes no gradient (its
/// derivative is zero wherever it exists).
#[macro_export]
#[doc(hidden)]
macro_rules! unary_ops {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident => $stat:ident($name:literal, $class:ident) {
            eval: |$x:ident| $eval:expr,
            $(wgsl: $wgsl:literal,)?
            grad: $($grad:tt)+
        }
    )*) => {
        /// Elementwise functions of one tensor (`defs/elementwise.rs`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum UnaryOp {
            $($(#[doc = $doc])* $variant,)*
        }

        /// The types that carry each unary op's meaning ([`UnaryFn`]).
        pub mod unary_fns {
            $(
                $(#[doc = $doc])*
                #[derive(Clone, Copy, Debug)]
                pub struct $variant;
            )*
        }

        $(
            impl $crate::elementwise::UnaryFn for unary_fns::$variant {
                const OP: UnaryOp = UnaryOp::$variant;
                const CLASS: $crate::elementwise::DTypeClass =
                    $crate::elementwise::DTypeClass::$class;
                #[inline(always)]
                #[allow(unused_imports)]
                fn eval<T: $crate::scalar::Num>($x: T) -> T {
                    use $crate::scalar::Num as _;
                    $eval
                }
            }

            $(#[doc = $doc])*
            pub static $stat: OpDef = unary_def($name, UnaryOp::$variant);
        )*

        impl UnaryOp {
            /// Every unary op, in definition order; an op's fused-program
            /// code is its index here.
            pub const ALL: &'static [UnaryOp] = &[$(UnaryOp::$variant),*];

            /// The op's definition.
            pub const fn def(self) -> &'static OpDef {
                match self {
                    $(UnaryOp::$variant => &$stat,)*
                }
            }

            /// The dtypes it accepts.
            pub const fn class(self) -> $crate::elementwise::DTypeClass {
                match self {
                    $(UnaryOp::$variant => $crate::elementwise::DTypeClass::$class,)*
                }
            }

            /// The op's WGSL expression over `x` (see [`unary_ops!`]),
            /// or `None` when it has no GPU form yet.
            pub const fn wgsl(self) -> Option<&'static str> {
                match self {
                    $(UnaryOp::$variant => $crate::unary_ops!(@wgsl $($wgsl)?),)*
                }
            }

            /// Calls `visitor` with the op's [`UnaryFn`] type.
            #[inline(always)]
            pub fn visit<V: $crate::elementwise::UnaryVisitor>(self, visitor: V) -> V::Output {
                match self {
                    $(UnaryOp::$variant => visitor.visit::<unary_fns::$variant>(),)*
                }
            }
        }

        /// The gradient rule of every unary op.
        fn unary_grad_rule(
            op: UnaryOp,
            b: &mut dyn GradBuilder,
            x: G,
            y: G,
            g: G,
        ) -> Result<Option<G>> {
            match op {
                $(UnaryOp::$variant => $crate::unary_ops!(@grad b, x, y, g; $($grad)+),)*
            }
        }
    };
    (@wgsl) => { None };
    (@wgsl $wgsl:literal) => { Some($wgsl) };
    (@grad $b:ident, $x:ident, $y:ident, $g:ident; none $(,)?) => {{
        let _ = ($b, $x, $y, $g);
        Ok(None)
    }};
    (@grad $b:ident, $x:ident, $y:ident, $g:ident;
        |$pb:pat_param, $px:pat_param, $py:pat_param, $pg:pat_param| $body:expr $(,)?) => {{
        let ($pb, $px, $py, $pg) = ($b, $x, $y, $g);
        ($body).map(Some)
    }};
}

/// Defines the binary elementwise ops from one table. Each entry:
///
/// ```text
/// /// doc
/// Variant => STATIC("OpName", Class) {
///     eval: |a, b| <expression over `a, b: T` where `T: Num`>,
///     wgsl: "<WGSL expression over `a` and `b`>",         // optional
///     grad: |b, x, y, out, g| <Result<(G, G)>: both inputs' gradients
///                              at the output's shape>,   // or `grad: none`
///     zero_divisor_is_error: true,                        // optional
/// }
/// ```
///
/// `wgsl` is read as for [`unary_ops!`], over `a` and `b`.
///
/// The gradients are reduced to each input's shape (unbroadcast) after
/// the rule.
#[macro_export]
#[doc(hidden)]
macro_rules! binary_ops {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident => $stat:ident($name:literal, $class:ident) {
            eval: |$a:ident, $bb:ident| $eval:expr,
            $(wgsl: $wgsl:literal,)?
            $(zero_divisor_is_error: $zero:literal,)?
            grad: $($grad:tt)+
        }
    )*) => {
        /// Elementwise functions of two broadcast tensors of one dtype
        /// (`defs/elementwise.rs`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $($(#[doc = $doc])* $variant,)*
        }

        /// The types that carry each binary op's meaning ([`BinaryFn`]).
        pub mod binary_fns {
            $(
                $(#[doc = $doc])*
                #[derive(Clone, Copy, Debug)]
                pub struct $variant;
            )*
        }

        $(
            impl $crate::elementwise::BinaryFn for binary_fns::$variant {
                const OP: BinaryOp = BinaryOp::$variant;
                const CLASS: $crate::elementwise::DTypeClass =
                    $crate::elementwise::DTypeClass::$class;
                const ZERO_DIVISOR_IS_ERROR: bool = false $(|| $zero)?;
                #[inline(always)]
                #[allow(unused_imports)]
                fn eval<T: $crate::scalar::Num>($a: T, $bb: T) -> T {
                    use $crate::scalar::Num as _;
                    $eval
                }
            }

            $(#[doc = $doc])*
            pub static $stat: OpDef = binary_def($name, BinaryOp::$variant);
        )*

        impl BinaryOp {
            /// Every binary op, in definition order; an op's fused-program
            /// code is [`FUSED_BINARY_BASE`](crate::FUSED_BINARY_BASE) plus its
            /// index here.
            pub const ALL: &'static [BinaryOp] = &[$(BinaryOp::$variant),*];

            /// The op's definition.
            pub const fn def(self) -> &'static OpDef {
                match self {
                    $(BinaryOp::$variant => &$stat,)*
                }
            }

            /// The dtypes it accepts.
            pub const fn class(self) -> $crate::elementwise::DTypeClass {
                match self {
                    $(BinaryOp::$variant => $crate::elementwise::DTypeClass::$class,)*
                }
            }

            /// True when an integer zero in the second operand is an error.
            pub fn is_zero_divisor_error(self) -> bool {
                match self {
                    $(BinaryOp::$variant => false $(|| $zero)?,)*
                }
            }

            /// The op's WGSL expression over `a` and `b` (see
            /// [`binary_ops!`]), or `None` when it has no GPU form yet.
            pub const fn wgsl(self) -> Option<&'static str> {
                match self {
                    $(BinaryOp::$variant => $crate::unary_ops!(@wgsl $($wgsl)?),)*
                }
            }

            /// Calls `visitor` with the op's [`BinaryFn`] type.
            #[inline(always)]
            pub fn visit<V: $crate::elementwise::BinaryVisitor>(self, visitor: V) -> V::Output {
                match self {
                    $(BinaryOp::$variant => visitor.visit::<binary_fns::$variant>(),)*
                }
            }
        }

        /// The gradient rule of every binary op, before unbroadcasting.
        fn binary_grad_rule(
            op: BinaryOp,
            b: &mut dyn GradBuilder,
            x: G,
            y: G,
            out: G,
            g: G,
        ) -> Result<Option<(G, G)>> {
            match op {
                $(BinaryOp::$variant => $crate::binary_ops!(@grad b, x, y, out, g; $($grad)+),)*
            }
        }
    };
    (@grad $b:ident, $x:ident, $y:ident, $out:ident, $g:ident; none $(,)?) => {{
        let _ = ($b, $x, $y, $out, $g);
        Ok(None)
    }};
    (@grad $b:ident, $x:ident, $y:ident, $out:ident, $g:ident;
        |$pb:pat_param, $px:pat_param, $py:pat_param, $pout:pat_param, $pg:pat_param| $body:expr $(,)?) => {{
        let ($pb, $px, $py, $pout, $pg) = ($b, $x, $y, $out, $g);
        ($body).map(Some)
    }};
}
