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

/// The form an op takes when it is recorded for differentiation: an op
/// whose extra outputs (after the first `results`) are residuals, the
/// values its gradient needs (the cond_v2 design: intermediates as extra
/// outputs). For `If` and `While` it is the same op with other attributes;
/// for GELU, `GeluWithDerivative`. `extra_inputs` are appended to the op's
/// inputs, each a zero of its type (for a list, the empty list).
#[derive(Clone, Debug)]
pub struct ResidualForm {
    /// The op recorded: the same one for control flow, another for an op
    /// whose gradient is cheaper from values its forward pass can keep
    /// ([`crate::defs::recorded_form`]).
    pub op: &'static OpDef,
    /// The attributes of the augmented op.
    pub attrs: crate::OpAttrs,
    /// How many leading outputs are the op's own.
    pub results: usize,
    /// The types of the zero-valued inputs to append.
    pub extra_inputs: Vec<TensorMetadata>,
}

/// How the gradient of an augmented `If` reads its residuals. The forward
/// `If`'s outputs are `results ++ then residuals ++ else residuals`; the
/// branch that ran fills its own residuals, the other one's are
/// placeholders that own no memory (optionals that are none).
#[derive(Clone, Copy, Debug)]
pub struct IfResiduals {
    /// How many outputs the original `If` has.
    pub results: usize,
    /// `(args.., residuals.., result grads..) -> arg grads` when `then` ran.
    pub then_backward: crate::func::FuncId,
    /// The same when `else` ran.
    pub else_backward: crate::func::FuncId,
}

/// How the gradient of an augmented `While` reads its stacks. The forward
/// loop's state is `state ++ lists ++ trip count`: each iteration pushes
/// the values the body's gradient needs onto one list per value (values
/// that do not change across iterations are not stacked). The reverse loop
/// runs over `(lists.., k, grads.., invariants..)`.
#[derive(Clone, Debug)]
pub struct WhileResiduals {
    /// The original loop state's length.
    pub state: usize,
    /// How many lists the forward loop fills.
    pub lists: usize,
    /// The state positions whose (unchanging) values the reverse loop
    /// needs, passed as its trailing values.
    pub invariants: Vec<usize>,
    /// Condition of the reverse loop: `k > 0`.
    pub reverse_cond: crate::func::FuncId,
    /// Body: pops one iteration's values, runs the body's gradient.
    pub reverse_body: crate::func::FuncId,
}

/// The residual transforms, built by the graph layer.
#[derive(Clone, Copy)]
pub struct ResidualHooks {
    /// The residual form of an op, `None` for ops that have none.
    pub form: fn(&'static OpDef, &crate::OpAttrs) -> Result<Option<ResidualForm>>,
    /// The plan of an augmented `If`, by its branches.
    pub if_plan: fn(crate::func::FuncId, crate::func::FuncId) -> Option<IfResiduals>,
    /// The plan of an augmented `While`, by its condition and body.
    pub while_plan:
        fn(crate::func::FuncId, crate::func::FuncId) -> Option<std::sync::Arc<WhileResiduals>>,
}

static RESIDUAL_HOOKS: std::sync::OnceLock<ResidualHooks> = std::sync::OnceLock::new();

/// Installs the residual transforms (once).
pub fn set_residual_hooks(hooks: ResidualHooks) {
    let _ = RESIDUAL_HOOKS.set(hooks);
}

/// The form `op` takes when recorded for differentiation, `None` when it
/// is recorded as it is: the op's own ([`crate::defs::recorded_form`]),
/// else the graph layer's for control flow.
pub fn residual_form(op: &'static OpDef, attrs: &crate::OpAttrs) -> Result<Option<ResidualForm>> {
    if let Some(form) = crate::defs::recorded_form(op) {
        return Ok(Some(ResidualForm {
            op: form,
            attrs: attrs.clone(),
            results: op.outputs,
            extra_inputs: Vec::new(),
        }));
    }
    match RESIDUAL_HOOKS.get() {
        Some(hooks) => (hooks.form)(op, attrs),
        None => Ok(None),
    }
}

pub(crate) fn if_residuals(
    then_branch: crate::func::FuncId,
    else_branch: crate::func::FuncId,
) -> Option<IfResiduals> {
    RESIDUAL_HOOKS
        .get()
        .and_then(|h| (h.if_plan)(then_branch, else_branch))
}

pub(crate) fn while_residuals(
    cond: crate::func::FuncId,
    body: crate::func::FuncId,
) -> Option<std::sync::Arc<WhileResiduals>> {
    RESIDUAL_HOOKS
        .get()
        .and_then(|h| (h.while_plan)(cond, body))
}
