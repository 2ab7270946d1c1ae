//! Gradient rules: the reverse-mode derivative of each op, written once
//! against [`GradBuilder`] so the same rule serves every mode. The autodiff
//! engine implements the builder by running ops through the core runtime
//! (eager and lazy devices, traced functions), and one engine walks the
//! recorded ops, calls each rule and accumulates the returned gradients.

use crate::attrs::OpAttrs;
use crate::op::{Attrs, OpDef};
use smallvec::{smallvec, SmallVec};
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// A value inside a gradient computation (an index the builder assigns).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct G(pub u32);

/// Builds the ops a gradient rule emits.
pub trait GradBuilder {
    /// Applies a single-output op.
    fn op(&mut self, def: &'static OpDef, inputs: &[G], attrs: &OpAttrs) -> Result<G>;
    /// Applies an op with any number of outputs (control flow).
    fn op_multi(
        &mut self,
        def: &'static OpDef,
        inputs: &[G],
        attrs: &OpAttrs,
    ) -> Result<SmallVec<[G; 4]>>;
    /// The metadata of a value.
    fn meta(&self, value: G) -> TensorMetadata;
    /// A tensor of `meta` whose elements all equal `value`.
    fn fill(&mut self, value: f64, meta: &TensorMetadata) -> Result<G>;
}

/// What a rule sees: the forward op's inputs, outputs and attributes, and
/// the gradient flowing into each output (`None` where none flows).
pub struct GradContext<'a> {
    /// The forward inputs.
    pub inputs: &'a [G],
    /// The forward outputs.
    pub outputs: &'a [G],
    /// The incoming gradient of each output.
    pub grads: &'a [Option<G>],
    /// The forward attributes.
    pub attrs: Attrs<'a>,
}

impl GradContext<'_> {
    /// The gradient of the (only) output.
    pub fn grad(&self) -> Result<G> {
        self.grads
            .first()
            .copied()
            .flatten()
            .ok_or_else(|| Error::internal("a gradient rule ran without an incoming gradient"))
    }
}

/// Input gradients, `None` for inputs that get none (indices, bools).
pub type InputGrads = SmallVec<[Option<G>; 4]>;

/// A gradient rule.
pub type GradFn = fn(&mut dyn GradBuilder, &GradContext<'_>) -> Result<InputGrads>;

/// Shorthands rules are written with.
impl dyn GradBuilder + '_ {
    fn apply(&mut self, def: &'static OpDef, inputs: &[G]) -> Result<G> {
        self.op(def, inputs, &OpAttrs::new())
    }
    /// `a + b`
    pub fn add(&mut self, a: G, b: G) -> Result<G> {
        self.apply(&crate::ADD, &[a, b])
    }
    /// `a - b`
    pub fn sub(&mut self, a: G, b: G) -> Result<G> {
        self.apply(&crate::SUB, &[a, b])
    }
    /// `a * b`
    pub fn mul(&mut self, a: G, b: G) -> Result<G> {
        self.apply(&crate::MUL, &[a, b])
    }
    /// `a / b`
    pub fn div(&mut self, a: G, b: G) -> Result<G> {
        self.apply(&crate::DIV, &[a, b])
    }
    /// `-a`
    pub fn neg(&mut self, a: G) -> Result<G> {
        self.apply(&crate::NEG, &[a])
    }
    /// A unary op.
    pub fn unary(&mut self, def: &'static OpDef, a: G) -> Result<G> {
        self.apply(def, &[a])
    }
    /// A rank-0 constant of `dtype`.
    pub fn scalar(&mut self, value: f64, dtype: DType) -> Result<G> {
        self.fill(value, &TensorMetadata::new(dtype, Shape::scalar()))
    }
    /// `a * value` for a number.
    pub fn scale(&mut self, a: G, value: f64) -> Result<G> {
        let k = self.scalar(value, self.meta(a).dtype)?;
        self.mul(a, k)
    }
    /// Casts to `dtype`.
    pub fn cast(&mut self, a: G, dtype: DType) -> Result<G> {
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", dtype);
        self.op(&crate::CAST, &[a], &attrs)
    }
    /// Reshapes to `dims`.
    pub fn reshape(&mut self, a: G, dims: &[usize]) -> Result<G> {
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", dims);
        self.op(&crate::RESHAPE, &[a], &attrs)
    }
    /// Broadcasts to `dims`.
    pub fn broadcast_to(&mut self, a: G, dims: &[usize]) -> Result<G> {
        if self.meta(a).shape.dims() == dims {
            return Ok(a);
        }
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", dims);
        self.op(&crate::BROADCAST_TO, &[a], &attrs)
    }
    /// Sums over `axes`.
    pub fn sum(&mut self, a: G, axes: &[usize], keepdim: bool) -> Result<G> {
        let mut attrs = OpAttrs::new();
        let axes: SmallVec<[i64; 4]> = axes.iter().map(|&x| x as i64).collect();
        attrs.set_ints("axes", &axes).set_bool("keepdim", keepdim);
        self.op(&crate::SUM, &[a], &attrs)
    }
    /// Permutes axes.
    pub fn transpose(&mut self, a: G, perm: &[usize]) -> Result<G> {
        let mut attrs = OpAttrs::new();
        let perm: SmallVec<[i64; 4]> = perm.iter().map(|&x| x as i64).collect();
        attrs.set_ints("perm", &perm);
        self.op(&crate::TRANSPOSE, &[a], &attrs)
    }
    /// Swaps the last two axes.
    pub fn swap_last(&mut self, a: G) -> Result<G> {
        let rank = self.meta(a).shape.rank();
        let mut perm: SmallVec<[usize; 4]> = (0..rank).collect();
        if rank >= 2 {
            perm.swap(rank - 1, rank - 2);
        }
        self.transpose(a, &perm)
    }
    /// `a` as a float mask (1 where true).
    pub fn mask(&mut self, condition: G, dtype: DType) -> Result<G> {
        self.cast(condition, dtype)
    }
    /// Sums a broadcast gradient back to `shape` (the reverse of NumPy
    /// broadcasting: leading axes added, and axes of size 1 stretched).
    pub fn unbroadcast(&mut self, g: G, shape: &Shape) -> Result<G> {
        let gshape = self.meta(g).shape.clone();
        if &gshape == shape {
            return Ok(g);
        }
        let extra = gshape.rank() - shape.rank().min(gshape.rank());
        let mut axes: SmallVec<[usize; 4]> = (0..extra).collect();
        for (i, &d) in shape.dims().iter().enumerate() {
            if d == 1 && gshape.dims()[extra + i] != 1 {
                axes.push(extra + i);
            }
        }
        let summed = if axes.is_empty() {
            g
        } else {
            self.sum(g, &axes, false)?
        };
        self.reshape(summed, shape.dims())
    }
}

/// One gradient for a single-input op.
pub(crate) fn only(g: G) -> Result<InputGrads> {
    Ok(smallvec![Some(g)])
}

/// Turns a library function `f(params) -> results` into its gradient
/// function `f'(params, result grads) -> param grads`; registered by the
/// graph layer, which owns the IR (the ops layer sits below it).
pub type GradientTransform = fn(crate::func::FuncId) -> Result<crate::func::FuncId>;

static GRADIENT_TRANSFORM: std::sync::OnceLock<GradientTransform> = std::sync::OnceLock::new();

/// Installs the gradient transform of library functions (once).
pub fn set_gradient_transform(transform: GradientTransform) {
    let _ = GRADIENT_TRANSFORM.set(transform);
}

/// The gradient function of a library function.
pub fn gradient_function(id: crate::func::FuncId) -> Result<crate::func::FuncId> {
    let transform = GRADIENT_TRANSFORM.get().ok_or_else(|| {
        Error::internal("no gradient transform for library functions is installed")
    })?;
    transform(id)
}

/// The functions the gradient of a `While` runs, built by the graph layer:
/// a loop that counts the forward trip count, and a reverse loop that runs
/// the body's gradient that many times (see `stagecraft_graph::autodiff`).
#[derive(Clone, Copy, Debug)]
pub struct WhileGradient {
    /// Condition of the counting loop over `(state.., i)`.
    pub count_cond: crate::func::FuncId,
    /// Body of the counting loop.
    pub count_body: crate::func::FuncId,
    /// Condition of the reverse loop over `(state0.., k, grads..)`.
    pub reverse_cond: crate::func::FuncId,
    /// Body of the reverse loop.
    pub reverse_body: crate::func::FuncId,
}

/// Builds the [`WhileGradient`] of a loop's condition and body.
pub type WhileTransform = fn(crate::func::FuncId, crate::func::FuncId) -> Result<WhileGradient>;

static WHILE_TRANSFORM: std::sync::OnceLock<WhileTransform> = std::sync::OnceLock::new();

/// Installs the While gradient builder (once).
pub fn set_while_transform(transform: WhileTransform) {
    let _ = WHILE_TRANSFORM.set(transform);
}

/// The gradient loops of a While.
pub fn while_gradient(
    cond: crate::func::FuncId,
    body: crate::func::FuncId,
) -> Result<WhileGradient> {
    let transform = WHILE_TRANSFORM
        .get()
        .ok_or_else(|| Error::internal("no While gradient builder is installed"))?;
    transform(cond, body)
}
