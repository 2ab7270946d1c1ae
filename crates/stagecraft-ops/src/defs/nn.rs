//! Neural-network ops on NCHW images: 2-D convolution and pooling.

use super::{one, require_float, require_same_dtype};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use stagecraft_tensor::{Error, Result, Shape, TensorMetadata};

/// 2-D convolution (cross-correlation) of `x: [N, C, H, W]` with
/// `w: [O, C/groups, KH, KW]`, giving `[N, O, OH, OW]`.
pub static CONV2D: OpDef = OpDef {
    name: "Conv2d",
    inputs: &["x", "w"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("stride", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
        AttrSpec::optional("padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
        AttrSpec::optional("dilation", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
        AttrSpec::optional("groups", AttrKind::Int, AttrDefault::Int(1)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: conv2d_meta,
    grad: Some(conv2d_grad),
};

/// Resolved 2-D window parameters (height, width pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window2d {
    /// Window size.
    pub kernel: [usize; 2],
    /// Step between windows.
    pub stride: [usize; 2],
    /// Implicit padding on each side.
    pub padding: [usize; 2],
    /// Spacing between window taps.
    pub dilation: [usize; 2],
}

impl Window2d {
    /// The output size along one spatial axis, or an error if the window
    /// does not fit.
    pub fn output_dim(&self, axis: usize, input: usize) -> Result<usize> {
        let too_large = || {
            Error::shape(format!(
                "the window or the padded input overflows on spatial axis {axis} (input {input}, {self:?})"
            ))
        };
        let span = self.dilation[axis]
            .checked_mul(self.kernel[axis].saturating_sub(1))
            .and_then(|s| s.checked_add(1))
            .ok_or_else(too_large)?;
        let padded = self.padding[axis]
            .checked_mul(2)
            .and_then(|p| p.checked_add(input))
            .ok_or_else(too_large)?;
        if padded < span {
            return Err(Error::shape(format!(
                "the window ({span} wide with dilation) does not fit the padded input ({padded}) on spatial axis {axis}"
            )));
        }
        Ok((padded - span) / self.stride[axis] + 1)
    }
}

fn pair(attrs: &Attrs<'_>, name: &str, min: usize) -> Result<[usize; 2]> {
    let v = attrs.dims(name)?;
    if v.len() != 2 || v.iter().any(|&x| x < min) {
        return Err(Error::attribute(format!(
            "`{name}` needs two entries (height, width) of at least {min}, got {v:?}"
        )));
    }
    Ok([v[0], v[1]])
}

/// Reads and checks the window attributes of a convolution.
pub fn conv2d_window(attrs: &Attrs<'_>, kernel: [usize; 2]) -> Result<Window2d> {
    Ok(Window2d {
        kernel,
        stride: pair(attrs, "stride", 1)?,
        padding: pair(attrs, "padding", 0)?,
        dilation: pair(attrs, "dilation", 1)?,
    })
}

fn conv2d_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, w) = (&inputs[0], &inputs[1]);
    require_float("x", x)?;
    require_same_dtype(x, w)?;
    if x.shape.rank() != 4 || w.shape.rank() != 4 {
        return Err(Error::shape(format!(
            "conv2d needs x: [N, C, H, W] and w: [O, C/groups, KH, KW], got {} and {}",
            x.shape, w.shape
        )));
    }
    let groups = attrs.int("groups")?;
    if groups < 1 {
        return Err(Error::attribute(format!(
            "groups must be at least 1, got {groups}"
        )));
    }
    let groups = groups as usize;
    let (c, o) = (x.shape[1], w.shape[0]);
    if c % groups != 0 || o % groups != 0 || w.shape[1].checked_mul(groups) != Some(c) {
        return Err(Error::shape(format!(
            "with {groups} groups, x has {c} channels and w {} {} input channels per group: need C = groups * w.shape[1] and O divisible by groups",
            o, w.shape[1]
        )));
    }
    if w.shape[2] == 0 || w.shape[3] == 0 {
        return Err(Error::shape(format!("empty kernel {}", w.shape)));
    }
    let win = conv2d_window(attrs, [w.shape[2], w.shape[3]])?;
    let (oh, ow) = (
        win.output_dim(0, x.shape[2])?,
        win.output_dim(1, x.shape[3])?,
    );
    one(TensorMetadata::new(x.dtype, [x.shape[0], o, oh, ow]))
}

const POOL_ATTRS_MAX: &[AttrSpec] = &[
    AttrSpec::required("kernel", AttrKind::Ints),
    AttrSpec::optional("stride", AttrKind::Ints, AttrDefault::Ints(&[])),
    AttrSpec::optional("padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
];

const POOL_ATTRS_AVG: &[AttrSpec] = &[
    AttrSpec::required("kernel", AttrKind::Ints),
    AttrSpec::optional("stride", AttrKind::Ints, AttrDefault::Ints(&[])),
    AttrSpec::optional("padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
    AttrSpec::optional("count_include_pad", AttrKind::Bool, AttrDefault::Bool(true)),
];

/// Max over `kernel` windows of `x: [N, C, H, W]`; padding is -infinity.
/// `stride` defaults to the kernel size.
pub static MAX_POOL2D: OpDef = OpDef {
    name: "MaxPool2d",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: POOL_ATTRS_MAX,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pool_meta,
    grad: Some(max_pool_grad),
};

/// Mean over `kernel` windows of `x: [N, C, H, W]`; `stride` defaults to
/// the kernel size; padded zeros count unless `count_include_pad` is false.
pub static AVG_POOL2D: OpDef = OpDef {
    name: "AvgPool2d",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: POOL_ATTRS_AVG,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pool_meta,
    grad: Some(avg_pool_grad),
};

/// Reads and checks the window attributes of a pooling op.
pub fn pool_window(attrs: &Attrs<'_>) -> Result<Window2d> {
    let kernel = pair(attrs, "kernel", 1)?;
    let stride = if attrs.ints("stride")?.is_empty() {
        kernel
    } else {
        pair(attrs, "stride", 1)?
    };
    let padding = pair(attrs, "padding", 0)?;
    if padding[0] * 2 > kernel[0] || padding[1] * 2 > kernel[1] {
        return Err(Error::attribute(format!(
            "padding {padding:?} must be at most half the kernel {kernel:?}"
        )));
    }
    Ok(Window2d {
        kernel,
        stride,
        padding,
        dilation: [1, 1],
    })
}

fn pool_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_float("x", x)?;
    if x.shape.rank() != 4 {
        return Err(Error::shape(format!(
            "pooling needs x: [N, C, H, W], got {}",
            x.shape
        )));
    }
    let win = pool_window(attrs)?;
    let (oh, ow) = (
        win.output_dim(0, x.shape[2])?,
        win.output_dim(1, x.shape[3])?,
    );
    one(TensorMetadata::new(
        x.dtype,
        [x.shape[0], x.shape[1], oh, ow],
    ))
}

// ---------------------------------------------------------------------------
// Backward ops of convolution and pooling, and the gradient rules that use
// them.

const CONV_BACKPROP_ATTRS: &[AttrSpec] = &[
    AttrSpec::required("shape", AttrKind::Ints),
    AttrSpec::optional("stride", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
    AttrSpec::optional("padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
    AttrSpec::optional("dilation", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
    AttrSpec::optional("groups", AttrKind::Int, AttrDefault::Int(1)),
];

/// Checks that convolving an input of `x_shape` with a filter of `w_shape`
/// under `attrs` gives `g`'s shape.
fn check_conv_geometry(
    x_shape: &Shape,
    w_shape: &Shape,
    g: &TensorMetadata,
    attrs: &Attrs<'_>,
) -> Result<()> {
    let x = TensorMetadata::new(g.dtype, x_shape.clone());
    let w = TensorMetadata::new(g.dtype, w_shape.clone());
    let out = conv2d_meta(&[x, w], attrs)?;
    if out[0].shape != g.shape {
        return Err(Error::shape(format!(
            "the output gradient {} does not match the convolution output {}",
            g.shape, out[0].shape
        )));
    }
    Ok(())
}

fn backprop_input_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (g, w) = (&inputs[0], &inputs[1]);
    require_same_dtype(g, w)?;
    let x_shape = Shape::new(&attrs.dims("shape")?);
    check_conv_geometry(&x_shape, &w.shape, g, attrs)?;
    one(TensorMetadata::new(g.dtype, x_shape))
}

fn backprop_filter_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, g) = (&inputs[0], &inputs[1]);
    require_same_dtype(x, g)?;
    let w_shape = Shape::new(&attrs.dims("shape")?);
    check_conv_geometry(&x.shape, &w_shape, g, attrs)?;
    one(TensorMetadata::new(g.dtype, w_shape))
}

/// The gradient of `Conv2d` with respect to its input: `(g, w)` with the
/// forward window attributes and the input `shape`.
pub static CONV2D_BACKPROP_INPUT: OpDef = OpDef {
    name: "Conv2dBackpropInput",
    inputs: &["g", "w"],
    variadic: false,
    outputs: 1,
    attrs: CONV_BACKPROP_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: backprop_input_meta,
    grad: Some(backprop_input_grad),
};

/// The gradient of `Conv2d` with respect to its filter: `(x, g)` with the
/// forward window attributes and the filter `shape`.
pub static CONV2D_BACKPROP_FILTER: OpDef = OpDef {
    name: "Conv2dBackpropFilter",
    inputs: &["x", "g"],
    variadic: false,
    outputs: 1,
    attrs: CONV_BACKPROP_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: backprop_filter_meta,
    grad: Some(backprop_filter_grad),
};

/// Transposed 2-D convolution (the adjoint of [`CONV2D`], PyTorch's
/// `conv_transpose2d`) of `x: [N, C, H, W]` with `w: [C, O/groups, KH,
/// KW]`, giving `[N, O, OH, OW]` with `OH = (H-1)·stride - 2·padding +
/// dilation·(KH-1) + output_padding + 1` (and the same for the width).
/// `output_padding` picks among the output sizes a strided convolution
/// maps onto `H`, so it must be smaller than the stride.
pub static CONV_TRANSPOSE2D: OpDef = OpDef {
    name: "ConvTranspose2d",
    inputs: &["x", "w"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("stride", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
        AttrSpec::optional("padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
        AttrSpec::optional("output_padding", AttrKind::Ints, AttrDefault::Ints(&[0, 0])),
        AttrSpec::optional("dilation", AttrKind::Ints, AttrDefault::Ints(&[1, 1])),
        AttrSpec::optional("groups", AttrKind::Int, AttrDefault::Int(1)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: conv_transpose2d_meta,
    grad: Some(conv_transpose2d_grad),
};

/// The output size of a transposed convolution along spatial `axis` for
/// an input of `input` (at least 1).
fn transposed_dim(
    win: &Window2d,
    output_padding: usize,
    axis: usize,
    input: usize,
) -> Result<usize> {
    let overflow = || {
        Error::shape(format!(
            "the output of the transposed convolution overflows on spatial axis {axis} (input {input}, {win:?})"
        ))
    };
    let full = (input - 1)
        .checked_mul(win.stride[axis])
        .and_then(|v| v.checked_add(win.dilation[axis].checked_mul(win.kernel[axis] - 1)?))
        .and_then(|v| v.checked_add(output_padding + 1))
        .ok_or_else(overflow)?;
    let cropped = win.padding[axis].checked_mul(2).ok_or_else(overflow)?;
    if cropped >= full {
        return Err(Error::shape(format!(
            "padding {} on each side leaves nothing of the {full} outputs on spatial axis {axis}",
            win.padding[axis]
        )));
    }
    Ok(full - cropped)
}

fn conv_transpose2d_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, w) = (&inputs[0], &inputs[1]);
    require_float("x", x)?;
    require_same_dtype(x, w)?;
    if x.shape.rank() != 4 || w.shape.rank() != 4 {
        return Err(Error::shape(format!(
            "conv_transpose2d needs x: [N, C, H, W] and w: [C, O/groups, KH, KW], got {} and {}",
            x.shape, w.shape
        )));
    }
    let groups = attrs.int("groups")?;
    if groups < 1 {
        return Err(Error::attribute(format!(
            "groups must be at least 1, got {groups}"
        )));
    }
    let groups = groups as usize;
    let c = x.shape[1];
    if w.shape[0] != c || c % groups != 0 {
        return Err(Error::shape(format!(
            "with {groups} groups, x has {c} channels and w {} input channels: need them equal and divisible by groups",
            w.shape[0]
        )));
    }
    if w.shape[2] == 0 || w.shape[3] == 0 {
        return Err(Error::shape(format!("empty kernel {}", w.shape)));
    }
    if x.shape[2] == 0 || x.shape[3] == 0 {
        return Err(Error::shape(format!(
            "conv_transpose2d needs a non-empty image, got {}",
            x.shape
        )));
    }
    let win = conv2d_window(attrs, [w.shape[2], w.shape[3]])?;
    let output_padding = pair(attrs, "output_padding", 0)?;
    if (0..2).any(|i| output_padding[i] >= win.stride[i]) {
        return Err(Error::attribute(format!(
            "output_padding {output_padding:?} must be smaller than the stride {:?}",
            win.stride
        )));
    }
    let o = w.shape[1].checked_mul(groups).ok_or_else(|| {
        Error::shape(format!(
            "{groups} groups of {} output channels overflow",
            w.shape[1]
        ))
    })?;
    let (oh, ow) = (
        transposed_dim(&win, output_padding[0], 0, x.shape[2])?,
        transposed_dim(&win, output_padding[1], 1, x.shape[3])?,
    );
    one(TensorMetadata::new(x.dtype, [x.shape[0], o, oh, ow]))
}

/// `ConvTranspose2d(x, w) = Cᵀ_w x`, `C_w` the convolution with `w` under
/// the same window attributes: its gradient for `x` is `conv2d(G, w)` and
/// the one for `w` the filter gradient of that convolution,
/// `Conv2dBackpropFilter(G, x)` (as for [`CONV2D_BACKPROP_INPUT`], which
/// computes the same product).
fn conv_transpose2d_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, w, gg) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let ws = b.meta(w).shape;
    let dx = b.op(&CONV2D, &[gg, w], &forward_conv_attrs(&ctx.attrs)?)?;
    let dw = b.op(
        &CONV2D_BACKPROP_FILTER,
        &[gg, x],
        &backprop_attrs(&ctx.attrs, &ws)?,
    )?;
    Ok(smallvec::smallvec![Some(dx), Some(dw)])
}

fn pool_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, g) = (&inputs[0], &inputs[1]);
    require_same_dtype(x, g)?;
    let out = pool_meta(&inputs[..1], attrs)?;
    if out[0].shape != g.shape {
        return Err(Error::shape(format!(
            "the output gradient {} does not match the pooling output {}",
            g.shape, out[0].shape
        )));
    }
    one(x.clone())
}

/// The gradient of `MaxPool2d`: `(x, g)`; each window's gradient goes to
/// its (first) maximum.
pub static MAX_POOL2D_GRAD: OpDef = OpDef {
    name: "MaxPool2dGrad",
    inputs: &["x", "g"],
    variadic: false,
    outputs: 1,
    attrs: POOL_ATTRS_MAX,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pool_grad_meta,
    grad: None,
};

/// The gradient of `AvgPool2d`: `(x, g)`; each window's gradient is spread
/// evenly over the taps its average divided by.
pub static AVG_POOL2D_GRAD: OpDef = OpDef {
    name: "AvgPool2dGrad",
    inputs: &["x", "g"],
    variadic: false,
    outputs: 1,
    attrs: POOL_ATTRS_AVG,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pool_grad_meta,
    grad: Some(avg_pool_grad_grad),
};

/// Copies the forward attributes and adds the other operand's `shape`.
fn backprop_attrs(attrs: &Attrs<'_>, shape: &Shape) -> Result<crate::OpAttrs> {
    let mut out = crate::OpAttrs::new();
    out.set_dims("shape", shape.dims())
        .set_ints("stride", attrs.ints("stride")?)
        .set_ints("padding", attrs.ints("padding")?)
        .set_ints("dilation", attrs.ints("dilation")?)
        .set_int("groups", attrs.int("groups")?);
    Ok(out)
}

fn conv2d_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, w, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let (xs, ws) = (b.meta(x).shape, b.meta(w).shape);
    let dx = b.op(
        &CONV2D_BACKPROP_INPUT,
        &[g, w],
        &backprop_attrs(&ctx.attrs, &xs)?,
    )?;
    let dw = b.op(
        &CONV2D_BACKPROP_FILTER,
        &[x, g],
        &backprop_attrs(&ctx.attrs, &ws)?,
    )?;
    Ok(smallvec::smallvec![Some(dx), Some(dw)])
}

/// The forward window attributes of a backprop op (without `shape`).
fn forward_conv_attrs(attrs: &Attrs<'_>) -> Result<crate::OpAttrs> {
    let mut out = crate::OpAttrs::new();
    out.set_ints("stride", attrs.ints("stride")?)
        .set_ints("padding", attrs.ints("padding")?)
        .set_ints("dilation", attrs.ints("dilation")?)
        .set_int("groups", attrs.int("groups")?);
    Ok(out)
}

/// Second order through convolutions. `dx = Cᵀ_w g` is bilinear in `g`
/// and `w`, with `⟨Cᵀ_w g, G⟩ = ⟨g, C_w G⟩` (`C_w` the convolution with
/// `w`): the gradient for `g` is `conv2d(G, w)` and the one for `w` the
/// filter gradient of that convolution, `Conv2dBackpropFilter(G, g)`.
fn backprop_input_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, w, gg) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let ws = b.meta(w).shape;
    let dg = b.op(&CONV2D, &[gg, w], &forward_conv_attrs(&ctx.attrs)?)?;
    let dw = b.op(
        &CONV2D_BACKPROP_FILTER,
        &[gg, g],
        &backprop_attrs(&ctx.attrs, &ws)?,
    )?;
    Ok(smallvec::smallvec![Some(dg), Some(dw)])
}

/// `dw` is bilinear in `x` and `g`, with `⟨dw, G⟩ = ⟨g, conv2d(x, G)⟩`:
/// the gradient for `g` is `conv2d(x, G)` and the one for `x` the input
/// gradient of that convolution, `Conv2dBackpropInput(g, G)`.
fn backprop_filter_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, g, gg) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let xs = b.meta(x).shape;
    let dx = b.op(
        &CONV2D_BACKPROP_INPUT,
        &[g, gg],
        &backprop_attrs(&ctx.attrs, &xs)?,
    )?;
    let dg = b.op(&CONV2D, &[x, gg], &forward_conv_attrs(&ctx.attrs)?)?;
    Ok(smallvec::smallvec![Some(dx), Some(dg)])
}

/// `AvgPool2dGrad` is `Pᵀ g` for the (linear) average pooling `P`; it
/// reads only the shape of `x`. Its gradient for `g` is `P G`.
fn avg_pool_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let gg = ctx.grad()?;
    let dg = b.op(&AVG_POOL2D, &[gg], ctx.attrs.raw())?;
    Ok(smallvec::smallvec![None, Some(dg)])
}

fn max_pool_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, g) = (ctx.inputs[0], ctx.grad()?);
    crate::grad::only(b.op(&MAX_POOL2D_GRAD, &[x, g], ctx.attrs.raw())?)
}

fn avg_pool_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, g) = (ctx.inputs[0], ctx.grad()?);
    crate::grad::only(b.op(&AVG_POOL2D_GRAD, &[x, g], ctx.attrs.raw())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use stagecraft_tensor::DType;

    fn f(dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(DType::F32, dims)
    }

    #[test]
    fn conv_shapes() {
        let mut a = OpAttrs::new();
        a.set_ints("padding", &[1, 1]).set_ints("stride", &[2, 2]);
        assert_eq!(
            CONV2D
                .infer(&[f(&[2, 3, 8, 8]), f(&[4, 3, 3, 3])], &a)
                .unwrap()[0],
            f(&[2, 4, 4, 4])
        );
        assert!(CONV2D
            .infer(&[f(&[2, 3, 8, 8]), f(&[4, 2, 3, 3])], &a)
            .is_err());
        assert!(CONV2D
            .infer(&[f(&[2, 3, 2, 2]), f(&[4, 3, 7, 7])], &OpAttrs::new())
            .is_err());
        a.set_int("groups", 3);
        assert_eq!(
            CONV2D
                .infer(&[f(&[1, 3, 5, 5]), f(&[6, 1, 3, 3])], &a)
                .unwrap()[0],
            f(&[1, 6, 3, 3])
        );
        a.set_int("groups", 0);
        assert!(CONV2D
            .infer(&[f(&[1, 3, 5, 5]), f(&[6, 1, 3, 3])], &a)
            .is_err());
        a.set_int("groups", 1).set_ints("stride", &[0, 1]);
        assert!(CONV2D
            .infer(&[f(&[1, 3, 5, 5]), f(&[6, 3, 3, 3])], &a)
            .is_err());
    }

    #[test]
    fn conv_transpose_shapes_follow_pytorch() {
        let mut a = OpAttrs::new();
        a.set_ints("stride", &[2, 3])
            .set_ints("padding", &[1, 0])
            .set_ints("output_padding", &[1, 2])
            .set_ints("dilation", &[1, 2])
            .set_int("groups", 2);
        // H: (5-1)·2 - 2 + 1·2 + 1 + 1 = 10; W: (4-1)·3 - 0 + 2·1 + 2 + 1 = 14.
        assert_eq!(
            CONV_TRANSPOSE2D
                .infer(&[f(&[3, 4, 5, 4]), f(&[4, 3, 3, 2])], &a)
                .unwrap()[0],
            f(&[3, 6, 10, 14])
        );
        // Mismatched channels, channels not divisible by groups, output
        // padding not below the stride, padding eating the output.
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[3, 4, 5, 4]), f(&[2, 3, 3, 2])], &a)
            .is_err());
        a.set_int("groups", 3);
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[3, 3, 5, 4]), f(&[3, 3, 3, 2])], &a)
            .is_ok());
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[3, 4, 5, 4]), f(&[4, 3, 3, 2])], &a)
            .is_err());
        a.set_int("groups", 1).set_ints("output_padding", &[2, 0]);
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[3, 4, 5, 4]), f(&[4, 3, 3, 2])], &a)
            .is_err());
        let mut p = OpAttrs::new();
        p.set_ints("padding", &[1, 1]);
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[1, 1, 1, 1]), f(&[1, 1, 1, 1])], &p)
            .is_err());
        assert!(CONV_TRANSPOSE2D
            .infer(&[f(&[1, 1, 0, 1]), f(&[1, 1, 1, 1])], &OpAttrs::new())
            .is_err());
    }

    proptest::proptest! {
        /// A convolution with the same attributes maps the transposed
        /// convolution's output shape back onto its input shape, and the
        /// sizes are PyTorch's formula.
        #[test]
        fn conv_transpose_inverts_conv_shapes(
            h in 1usize..6, w in 1usize..6, kh in 1usize..4, kw in 1usize..4,
            stride in (1usize..4, 1usize..4), pad in (0usize..3, 0usize..3),
            dil in (1usize..3, 1usize..3), extra in (0usize..3, 0usize..3),
            groups in 1usize..3, per_group in 1usize..3,
        ) {
            let c = groups * per_group;
            let op = [extra.0 % stride.0, extra.1 % stride.1];
            let mut a = OpAttrs::new();
            a.set_dims("stride", &[stride.0, stride.1])
                .set_dims("padding", &[pad.0, pad.1])
                .set_dims("output_padding", &op)
                .set_dims("dilation", &[dil.0, dil.1])
                .set_int("groups", groups as i64);
            let x = f(&[2, c, h, w]);
            let wt = f(&[c, 2, kh, kw]);
            let formula = |i: usize, s: usize, p: usize, d: usize, k: usize, o: usize| {
                ((i - 1) * s + d * (k - 1) + o + 1) as i64 - 2 * p as i64
            };
            let oh = formula(h, stride.0, pad.0, dil.0, kh, op[0]);
            let ow = formula(w, stride.1, pad.1, dil.1, kw, op[1]);
            let out = CONV_TRANSPOSE2D.infer(&[x.clone(), wt.clone()], &a);
            if oh < 1 || ow < 1 {
                proptest::prop_assert!(out.is_err());
                return Ok(());
            }
            let out = out.unwrap();
            proptest::prop_assert_eq!(&out[0], &f(&[2, 2 * groups, oh as usize, ow as usize]));
            let mut fwd = OpAttrs::new();
            fwd.set_dims("stride", &[stride.0, stride.1])
                .set_dims("padding", &[pad.0, pad.1])
                .set_dims("dilation", &[dil.0, dil.1])
                .set_int("groups", groups as i64);
            let back = CONV2D.infer(&[out[0].clone(), f(&[c, 2, kh, kw])], &fwd).unwrap();
            proptest::prop_assert_eq!(&back[0], &x);
        }
    }

    #[test]
    fn pool_shapes() {
        let mut a = OpAttrs::new();
        a.set_ints("kernel", &[2, 2]);
        assert_eq!(
            MAX_POOL2D.infer(&[f(&[1, 3, 28, 28])], &a).unwrap()[0],
            f(&[1, 3, 14, 14])
        );
        a.set_ints("padding", &[2, 0]);
        assert!(AVG_POOL2D.infer(&[f(&[1, 3, 28, 28])], &a).is_err());
        assert!(MAX_POOL2D
            .infer(&[f(&[3, 28, 28])], &OpAttrs::new())
            .is_err());
    }
}
