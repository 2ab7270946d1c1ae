//! WGSL source for the kernels. Elementwise shaders are made from an op's
//! WGSL expression in its definition (`stagecraft-ops`, `wgsl:` in the op
//! table); this file holds only the shapes of the loops and the prelude of
//! math helpers those expressions may call.
//!
//! Every shader has one entry point, `main`, and one bind group: its
//! inputs, its output, then `params`, an array of `u32` with the sizes and
//! strides of the launch. Sizes live in `params`, not in the source, so one
//! compiled pipeline serves every shape.

/// The largest rank a strided kernel indexes; a broadcast whose shape still
/// has more dimensions after merging runs on the CPU.
pub(crate) const MAX_RANK: usize = 6;

/// Threads per workgroup of the one-thread-per-element kernels.
pub(crate) const WORKGROUP: u32 = 256;

/// Math the elementwise expressions call where WGSL has no builtin, or
/// where the builtin's range is narrower than the CPU's (WGSL leaves
/// `pow` of a negative base and `tanh` of a large argument undefined).
pub(crate) const PRELUDE: &str = r#"
// WGSL lets a compiler assume floats are never NaN, so `x != x` may fold
// to false: NaN is tested on the bits.
fn sc_isnan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn sc_nan() -> f32 { return bitcast<f32>(0x7fc00000u); }
fn sc_inf() -> f32 { return bitcast<f32>(0x7f800000u); }

// The roundings by names the integer prelude also has, so that a numeric
// op's expression reads the same over i32 (where they are the identity).
fn sc_floor(x: f32) -> f32 { return floor(x); }
fn sc_ceil(x: f32) -> f32 { return ceil(x); }
fn sc_round(x: f32) -> f32 { return round(x); }

// e^x - 1 without cancellation near 0 (Kahan's correction).
fn sc_expm1(x: f32) -> f32 {
    let u = exp(x);
    if (u == 1.0) { return x; }
    let um1 = u - 1.0;
    if (um1 == -1.0) { return -1.0; }
    if (u > 3.0e38) { return u; }
    return um1 * x / log(u);
}

// ln(1 + x) without cancellation near 0.
fn sc_log1p(x: f32) -> f32 {
    let u = 1.0 + x;
    if (u == 1.0) { return x; }
    if (u > 3.0e38) { return log(u); }
    return log(u) * x / (u - 1.0);
}

// tanh: its Taylor series below |x| = 0.9, else 1 - 2/(e^(2|x|) + 1),
// which neither overflows nor cancels and shrinks the exponential's error.
// Forms through expm1 and log (or the builtin) carry the error of two
// approximate builtins: 10 ulp on NVIDIA's Vulkan driver.
fn sc_tanh(x: f32) -> f32 {
    let a = abs(x);
    // tanh(x) rounds to x here, and -0 stays -0.
    if (a < 0.0001) { return x; }
    if (a < 0.9) {
        let z = x * x;
        var p = -1.0597268320104654e-06;
        p = p * z + 2.6147711512907546e-06;
        p = p * z + -6.451689215655431e-06;
        p = p * z + 1.5918905069328964e-05;
        p = p * z + -3.927832388331683e-05;
        p = p * z + 9.691537956929451e-05;
        p = p * z + -0.00023912911424355248;
        p = p * z + 0.000590027440945586;
        p = p * z + -0.0014558343870513183;
        p = p * z + 0.003592128036572481;
        p = p * z + -0.008863235529902197;
        p = p * z + 0.021869488536155203;
        p = p * z + -0.05396825396825397;
        p = p * z + 0.13333333333333333;
        p = p * z + -0.3333333333333333;
        return x + x * z * p;
    }
    let t = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    return select(t, -t, x < 0.0);
}

// sin and cos: x less k·π/2 (Cody-Waite: π/2 as three 9-bit parts, whose
// products with |k| < 2^15 are exact, and a remainder), then their Taylor
// series on |r| <= π/4, within 2.2 ulp. Vulkan bounds the builtins only
// on [-π, π], and loosely: NVIDIA's are off by 2e-6 at |x| = 18. Past
// |x| = 51471 (k = 2^15) the builtins run.
fn sc_quarter_turns(x: f32) -> vec2<f32> {
    let k = round(x * 0.63661977236758134);
    var r = x - k * 1.5703125;
    r = r - k * 0.00048351287841796875;
    r = r - k * 3.1385570764541626e-07;
    r = r - k * 6.07710062827671e-11;
    return vec2<f32>(r, k);
}

fn sc_sin_series(r: f32) -> f32 {
    let z = r * r;
    var p = -1.0 / 39916800.0;
    p = p * z + 1.0 / 362880.0;
    p = p * z - 1.0 / 5040.0;
    p = p * z + 1.0 / 120.0;
    p = p * z - 1.0 / 6.0;
    return r + r * z * p;
}

fn sc_cos_series(r: f32) -> f32 {
    let z = r * r;
    var p = 1.0 / 479001600.0;
    p = p * z - 1.0 / 3628800.0;
    p = p * z + 1.0 / 40320.0;
    p = p * z - 1.0 / 720.0;
    p = p * z + 1.0 / 24.0;
    p = p * z - 0.5;
    return 1.0 + z * p;
}

// sin(x + shift·π/2) for |x| <= 51471: cos is sin a quarter turn on.
fn sc_sin_turned(x: f32, shift: i32) -> f32 {
    let rk = sc_quarter_turns(x);
    let q = (i32(rk.y) + shift) & 3;
    let v = select(sc_sin_series(rk.x), sc_cos_series(rk.x), (q & 1) == 1);
    return select(v, -v, (q & 2) == 2);
}

fn sc_sin(x: f32) -> f32 {
    // sin(x) rounds to x here, and -0 stays -0.
    if (abs(x) < 0.0001) { return x; }
    if (!(abs(x) <= 51471.0)) { return select(sin(x), sc_nan(), abs(x) > 3.0e38); }
    return sc_sin_turned(x, 0);
}

fn sc_cos(x: f32) -> f32 {
    if (!(abs(x) <= 51471.0)) { return select(cos(x), sc_nan(), abs(x) > 3.0e38); }
    return sc_sin_turned(x, 1);
}

// atan by its series on |t| <= tan(pi/8), after t -> 1/t and
// t -> (t-1)/(t+1); builtin inverse trigonometry may be far less accurate
// (Vulkan allows thousands of ulps; lavapipe's asin is off by 3e-4).
fn sc_atan(x: f32) -> f32 {
    let a = abs(x);
    let inverted = a > 1.0;
    var t = select(a, 1.0 / a, inverted);
    let shifted = t > 0.41421356;
    t = select(t, (t - 1.0) / (t + 1.0), shifted);
    let z = t * t;
    var p = -1.0 / 19.0;
    p = p * z + 1.0 / 17.0;
    p = p * z - 1.0 / 15.0;
    p = p * z + 1.0 / 13.0;
    p = p * z - 1.0 / 11.0;
    p = p * z + 1.0 / 9.0;
    p = p * z - 1.0 / 7.0;
    p = p * z + 1.0 / 5.0;
    p = p * z - 1.0 / 3.0;
    p = p * z + 1.0;
    var r = t * p;
    r = select(r, r + 0.78539816339744831, shifted);
    r = select(r, 1.5707963267948966 - r, inverted);
    return select(r, -r, x < 0.0);
}

fn sc_sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// erf: its Taylor series near 0 (relative accuracy), Abramowitz & Stegun
// 7.1.26 beyond (absolute error below 1.5e-7 where erf is above 0.5).
fn sc_erf(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.5) {
        let x2 = x * x;
        let series = 1.0 + x2 * (-1.0 / 3.0 + x2 * (1.0 / 10.0 + x2 * (-1.0 / 42.0
            + x2 * (1.0 / 216.0 + x2 * (-1.0 / 1320.0)))));
        return 1.1283791670955126 * x * series;
    }
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
        + t * (-1.453152027 + t * 1.061405429))));
    let y = 1.0 - poly * exp(-a * a);
    return select(y, -y, x < 0.0);
}

// a^b as the CPU's powf: a negative base with an integer exponent, zero
// and one bases, NaN otherwise.
fn sc_pow(a: f32, b: f32) -> f32 {
    if (b == 0.0 || a == 1.0) { return 1.0; }
    if (sc_isnan(a) || sc_isnan(b)) { return sc_nan(); }
    if (a == 0.0) { return select(0.0, sc_inf(), b < 0.0); }
    let m = exp2(b * log2(abs(a)));
    if (a < 0.0) {
        if (floor(b) != b) { return sc_nan(); }
        let odd = floor(b * 0.5) * 2.0 != b;
        return select(m, -m, odd);
    }
    return m;
}

// d gelu(x) / dx given x and y = gelu(x): Φ(x) + x φ(x).
fn sc_gelu_derivative(x: f32, y: f32) -> f32 {
    if (x > 3.0e38) { return 1.0; }
    if (x < -3.0e38) { return 0.0; }
    let cdf = select(y / x, 0.5, x == 0.0);
    let pdf = 0.3989422804014327 * exp(-0.5 * x * x);
    return cdf + x * pdf;
}
"#;

/// The flat index of the thread in a launch of [`WORKGROUP`]-wide
/// workgroups over a 2-D grid (one dimension holds at most 65,535 groups);
/// `params[1]` is the grid's row width in threads.
const FLAT_INDEX: &str = "let i = id.x + id.y * params[1];";

/// `y = f(x)` over contiguous tensors. `params`: `[count, row_width]`.
pub(crate) fn unary(expression: &str) -> String {
    format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

// Every float unary op maps NaN to NaN, which WGSL's builtins need not do.
fn op(x: f32) -> f32 {{ if (sc_isnan(x)) {{ return x; }} return {expression}; }}

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{ output[i] = op(input[i]); }}
}}
"#
    )
}

/// `(y, d) = (gelu(x), gelu'(x))` over contiguous tensors, from GELU's
/// `wgsl:` expression (over `x`) and `sc_gelu_derivative`, as `Gelu` and
/// `GeluDerivative` compute them apart. `params`: `[count, row_width]`.
pub(crate) fn gelu_with_derivative(gelu: &str) -> String {
    format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@group(0) @binding(2) var<storage, read_write> derivative: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

fn gelu(x: f32) -> f32 {{ if (sc_isnan(x)) {{ return x; }} return {gelu}; }}

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{
        let x = input[i];
        let y = gelu(x);
        output[i] = y;
        derivative[i] = sc_gelu_derivative(x, y);
    }}
}}
"#
    )
}

/// The helpers an op's `wgsl:` expression may call, for i32 operands: no
/// i32 is NaN, so an expression written for f32 that guards its NaNs
/// with `sc_isnan`/`sc_nan` reads the same over integers, and every i32
/// is its own rounding.
const INT_PRELUDE: &str = r#"
fn sc_isnan(x: i32) -> bool { return false; }
fn sc_nan() -> i32 { return 0; }
fn sc_floor(x: i32) -> i32 { return x; }
fn sc_ceil(x: i32) -> i32 { return x; }
fn sc_round(x: i32) -> i32 { return x; }
"#;

/// The helpers for kernels over `ty` (`f32` or `i32`).
pub(crate) fn prelude_of(ty: &str) -> &'static str {
    if ty == "f32" {
        PRELUDE
    } else {
        INT_PRELUDE
    }
}

/// What an elementwise op's `wgsl:` expression computes over, by its
/// dtype class (see `stagecraft_ops::unary_ops!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Element {
    /// f32: float and numeric ops.
    F32,
    /// i32: integer ops.
    I32,
    /// Bools packed four per word, read as i32 0/1: logical ops.
    PackedBool,
}

impl Element {
    /// The type the expressions of `class`'s ops compute over.
    pub(crate) fn of(class: stagecraft_ops::DTypeClass) -> Element {
        use stagecraft_ops::DTypeClass;
        match class {
            DTypeClass::Float | DTypeClass::Numeric => Element::F32,
            DTypeClass::Int => Element::I32,
            DTypeClass::Bool => Element::PackedBool,
        }
    }
}

/// The shader of an elementwise op with `arity` inputs (1 or 2), its
/// expression computing over `element`.
pub(crate) fn elementwise(expression: &str, element: Element, arity: usize) -> String {
    match (element, arity) {
        (Element::F32, 1) => unary(expression),
        (Element::F32, _) => binary(expression),
        (Element::I32, 1) => unary_i32(expression),
        (Element::I32, _) => binary_i32(expression),
        (Element::PackedBool, _) => bool_elementwise(expression, arity),
    }
}

/// [`unary`] over i32: the op's own expression, over integers (which
/// wrap, as the CPU's integer kernels do).
pub(crate) fn unary_i32(expression: &str) -> String {
    format!(
        r#"{INT_PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<i32>;
@group(0) @binding(1) var<storage, read_write> output: array<i32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

fn op(x: i32) -> i32 {{ return {expression}; }}

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{ output[i] = op(input[i]); }}
}}
"#
    )
}

/// `fn offsets(i: u32) -> array<u32, inputs>`: the offset of output
/// element `i` in each of `inputs` broadcast operands, from the launch's
/// `params`: `[count, row_width, rank, 0, dims[MAX_RANK], then MAX_RANK
/// strides per operand]`.
fn broadcast_offsets(inputs: usize) -> String {
    format!(
        r#"
fn offsets(i: u32) -> array<u32, {inputs}> {{
    var rest = i;
    var at = array<u32, {inputs}>();
    let rank = params[2];
    for (var d = 0u; d < rank; d = d + 1u) {{
        let axis = rank - 1u - d;
        let dim = params[4u + axis];
        let coordinate = rest % dim;
        rest = rest / dim;
        for (var k = 0u; k < {inputs}u; k = k + 1u) {{
            at[k] = at[k] + coordinate * params[4u + (k + 1u) * {MAX_RANK}u + axis];
        }}
    }}
    return at;
}}
"#
    )
}

/// `y = f(a, b)` with broadcasting: each input is read through its own
/// strides (0 along broadcast dimensions) over the output's dimensions.
/// `params`: `[count, row_width, rank, 0, dims[MAX_RANK],
/// a_strides[MAX_RANK], b_strides[MAX_RANK]]`.
pub(crate) fn binary(expression: &str) -> String {
    binary_over(PRELUDE, "f32", expression)
}

/// [`binary`] over i32: the op's own expression, over integers.
pub(crate) fn binary_i32(expression: &str) -> String {
    binary_over(INT_PRELUDE, "i32", expression)
}

fn binary_over(prelude: &str, ty: &str, expression: &str) -> String {
    format!(
        r#"{prelude}
@group(0) @binding(0) var<storage, read> lhs: array<{ty}>;
@group(0) @binding(1) var<storage, read> rhs: array<{ty}>;
@group(0) @binding(2) var<storage, read_write> output: array<{ty}>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

fn op(a: {ty}, b: {ty}) -> {ty} {{ return {expression}; }}
{offsets}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    let at = offsets(i);
    output[i] = op(lhs[at[0]], rhs[at[1]]);
}}
"#,
        offsets = broadcast_offsets(2)
    )
}

/// How a reduction combines values.
pub(crate) struct Combine {
    /// The element type, `f32` or `i32`.
    pub(crate) ty: &'static str,
    /// The identity, a WGSL expression of the element type.
    pub(crate) init: &'static str,
    /// `fn combine(acc: T, x: T) -> T`'s body.
    pub(crate) step: &'static str,
    /// The result from the combined value `acc` and the count `n` (an f32).
    pub(crate) finish: &'static str,
}

/// The index arithmetic both reduction shaders share: `params` is
/// `[outputs, count, kept_rank, reduced_rank, row_width, 0, 0, 0,
/// kept_dims[MAX_RANK], kept_strides[MAX_RANK], reduced_dims[MAX_RANK],
/// reduced_strides[MAX_RANK]]`.
fn reduce_prelude(combine: &Combine) -> String {
    let (ty, init, step) = (combine.ty, combine.init, combine.step);
    let prelude = prelude_of(ty);
    let r = MAX_RANK;
    format!(
        r#"{prelude}
@group(0) @binding(0) var<storage, read> input: array<{ty}>;
@group(0) @binding(1) var<storage, read_write> output: array<{ty}>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

fn combine(acc: {ty}, x: {ty}) -> {ty} {{ {step} }}
fn identity() -> {ty} {{ return {init}; }}

// The input offset of output element `o` (its kept coordinates).
fn kept_offset(o: u32) -> u32 {{
    var rest = o;
    var offset = 0u;
    let rank = params[2];
    for (var d = 0u; d < rank; d = d + 1u) {{
        let axis = rank - 1u - d;
        let dim = params[8u + axis];
        offset = offset + (rest % dim) * params[8u + {r}u + axis];
        rest = rest / dim;
    }}
    return offset;
}}

// The input offset of the `r`-th reduced element, from the kept offset.
fn reduced_offset(r: u32) -> u32 {{
    var rest = r;
    var offset = 0u;
    let rank = params[3];
    for (var d = 0u; d < rank; d = d + 1u) {{
        let axis = rank - 1u - d;
        let dim = params[8u + {r2}u + axis];
        offset = offset + (rest % dim) * params[8u + {r3}u + axis];
        rest = rest / dim;
    }}
    return offset;
}}
"#,
        r2 = 2 * r,
        r3 = 3 * r
    )
}

/// One thread per output element, for short reductions.
pub(crate) fn reduce_per_thread(combine: &Combine) -> String {
    let finish = combine.finish;
    format!(
        r#"{prelude}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let o = id.x + id.y * params[4];
    if (o >= params[0]) {{ return; }}
    let base = kept_offset(o);
    var acc = identity();
    let count = params[1];
    for (var r = 0u; r < count; r = r + 1u) {{
        acc = combine(acc, input[base + reduced_offset(r)]);
    }}
    let n = f32(count);
    output[o] = {finish};
}}
"#,
        prelude = reduce_prelude(combine)
    )
}

/// Threads of one workgroup share the reduction of one output element
/// (strided partial results, then a tree in workgroup memory), for long
/// reductions. `params[4]` is the grid's row width in workgroups.
pub(crate) fn reduce_per_workgroup(combine: &Combine) -> String {
    let finish = combine.finish;
    format!(
        r#"{prelude}
const LANES: u32 = 64u;
var<workgroup> partial: array<{ty}, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {{
    let o = group.x + group.y * params[4];
    let live = o < params[0];
    var acc = identity();
    let count = params[1];
    if (live) {{
        let base = kept_offset(o);
        for (var r = lane; r < count; r = r + LANES) {{
            acc = combine(acc, input[base + reduced_offset(r)]);
        }}
    }}
    partial[lane] = acc;
    workgroupBarrier();
    for (var width = LANES / 2u; width > 0u; width = width / 2u) {{
        if (lane < width) {{
            partial[lane] = combine(partial[lane], partial[lane + width]);
        }}
        workgroupBarrier();
    }}
    if (live && lane == 0u) {{
        let acc = partial[0];
        let n = f32(count);
        output[o] = {finish};
    }}
}}
"#,
        prelude = reduce_prelude(combine),
        ty = combine.ty
    )
}

/// The row statistics softmax and cross-entropy share: the 64 lanes of a
/// workgroup find the maximum of `input[base .. base + width]` (a NaN
/// wins), then the sum of `exp(x − max)` over it. Called in uniform
/// control flow (it has barriers); `live` is false in a workgroup past
/// the last row.
const ROW_MAX_AND_EXP_SUM: &str = r#"
const LANES: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

fn max_nan(a: f32, b: f32) -> f32 { return select(select(b, a, a > b), sc_nan(), sc_isnan(a) || sc_isnan(b)); }

fn row_max_and_exp_sum(base: u32, width: u32, live: bool, lane: u32) -> vec2<f32> {
    var top = -sc_inf();
    if (live) {
        for (var c = lane; c < width; c = c + LANES) { top = max_nan(top, input[base + c]); }
    }
    partial[lane] = top;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w = w / 2u) {
        if (lane < w) { partial[lane] = max_nan(partial[lane], partial[lane + w]); }
        workgroupBarrier();
    }
    top = partial[0];
    workgroupBarrier();
    var sum = 0.0;
    if (live) {
        for (var c = lane; c < width; c = c + LANES) { sum = sum + exp(input[base + c] - top); }
    }
    partial[lane] = sum;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w = w / 2u) {
        if (lane < w) { partial[lane] = partial[lane] + partial[lane + w]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return vec2<f32>(top, total);
}
"#;

/// The head of a `main` that gives each row a workgroup of 64 lanes, for
/// `params` that start `[rows, width, row_width_in_groups]`. Lanes of a
/// workgroup past the last row run on (not `live`): every lane must reach
/// the barriers of the row sums.
pub(crate) const ROW_MAIN: &str = r#"
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let row = group.x + group.y * params[2];
    let live = row < params[0];
    let width = params[1];
    let base = row * width;"#;

/// Softmax or log-softmax over the last axis: one workgroup per row.
/// `params`: `[rows, width, row_width_in_groups]`.
pub(crate) fn softmax(log: bool) -> String {
    let write = if log {
        "output[base + c] = input[base + c] - top - log(total);"
    } else {
        "output[base + c] = exp(input[base + c] - top) / total;"
    };
    format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{ROW_MAX_AND_EXP_SUM}{ROW_MAIN}
    let stats = row_max_and_exp_sum(base, width, live, lane);
    let top = stats.x;
    let total = stats.y;
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{ {write} }}
    }}
}}
"#
    )
}

/// The side of a matmul tile.
pub(crate) const TILE: u32 = 16;

/// Batched `C = op(A) · op(B)`, tiled through workgroup memory: each
/// workgroup computes a [`TILE`]² block of C, loading one tile of A and
/// one of B per step along k. `params`: `[m, n, k, transpose_a,
/// transpose_b, a_batch_stride, b_batch_stride, 0]`; the batch is the
/// grid's z.
pub(crate) fn matmul() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

const T: u32 = {TILE}u;
var<workgroup> tile_a: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tile_b: array<array<f32, {TILE}>, {TILE}>;

fn load_a(batch: u32, row: u32, col: u32) -> f32 {{
    let m = params[0];
    let k = params[2];
    if (row >= m || col >= k) {{ return 0.0; }}
    let base = batch * params[5];
    if (params[3] != 0u) {{ return a[base + col * m + row]; }}
    return a[base + row * k + col];
}}

fn load_b(batch: u32, row: u32, col: u32) -> f32 {{
    let n = params[1];
    let k = params[2];
    if (row >= k || col >= n) {{ return 0.0; }}
    let base = batch * params[6];
    if (params[4] != 0u) {{ return b[base + col * k + row]; }}
    return b[base + row * n + col];
}}

@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_id) local: vec3<u32>) {{
    let m = params[0];
    let n = params[1];
    let k = params[2];
    let row = group.y * T + local.y;
    let col = group.x * T + local.x;
    let batch = group.z;
    var acc = 0.0;
    let steps = (k + T - 1u) / T;
    for (var s = 0u; s < steps; s = s + 1u) {{
        tile_a[local.y][local.x] = load_a(batch, row, s * T + local.x);
        tile_b[local.y][local.x] = load_b(batch, s * T + local.y, col);
        workgroupBarrier();
        for (var j = 0u; j < T; j = j + 1u) {{
            acc = fma(tile_a[local.y][j], tile_b[j][local.x], acc);
        }}
        workgroupBarrier();
    }}
    if (row < m && col < n) {{
        c[batch * m * n + row * n + col] = acc;
    }}
}}
"#
    )
}

/// `out[i] = Σ_k partial[k·stride + offset + i]`, the parts in order: the
/// last pass of sums split into parts (WGSL has no float atomics), whose
/// fixed order makes every run's result the same. `params`: `[count,
/// row_width, parts, stride, offset]`.
pub(crate) fn part_sums() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> partial: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    var acc = 0.0;
    for (var k = 0u; k < params[2]; k = k + 1u) {{
        acc = acc + partial[k * params[3] + params[4] + i];
    }}
    out[i] = acc;
}}
"#
    )
}

/// Copies elements of `words` 4-byte words each, reading the input through
/// strides from an offset (all in elements) over the output's dimensions:
/// transposes, broadcasts and slices. `params`: `[words, row_width, rank,
/// offset, words_per_element, 0, 0, 0, dims[MAX_RANK], strides[MAX_RANK]]`.
pub(crate) fn strided_copy() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    let width = params[4];
    var rest = i / width;
    var source = params[3];
    let rank = params[2];
    for (var d = 0u; d < rank; d = d + 1u) {{
        let axis = rank - 1u - d;
        let dim = params[8u + axis];
        source = source + (rest % dim) * params[8u + {MAX_RANK}u + axis];
        rest = rest / dim;
    }}
    output[i] = input[source * width + i % width];
}}
"#
    )
}

/// Reads element `e` of a bool tensor (one byte each, four to a word).
const READ_BOOL: &str = r#"
fn bool_at(e: u32) -> bool { return ((cond[e >> 2u] >> ((e & 3u) * 8u)) & 0xffu) != 0u; }
"#;

/// A comparison of two broadcast f32 tensors into a bool tensor: each
/// thread writes one word, four results. `params` as [`binary`]'s.
pub(crate) fn compare(expression: &str) -> String {
    compare_over(PRELUDE, "f32", expression)
}

/// [`compare`] of i32s.
pub(crate) fn compare_i32(expression: &str) -> String {
    compare_over(INT_PRELUDE, "i32", expression)
}

fn compare_over(prelude: &str, ty: &str, expression: &str) -> String {
    format!(
        r#"{prelude}
@group(0) @binding(0) var<storage, read> lhs: array<{ty}>;
@group(0) @binding(1) var<storage, read> rhs: array<{ty}>;
@group(0) @binding(2) var<storage, read_write> output: array<u32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

fn op(a: {ty}, b: {ty}) -> bool {{ return {expression}; }}
{offsets}
fn holds(i: u32) -> bool {{
    let at = offsets(i);
    return op(lhs[at[0]], rhs[at[1]]);
}}

{packed_main}"#,
        packed_main = packed_main(),
        offsets = broadcast_offsets(2)
    )
}

/// The `main` of a kernel writing bools packed four per word (one byte
/// each, 0 or 1) from `fn holds(i: u32) -> bool`: each thread writes one
/// output word. `params`: `[count, row_width, ...]`.
fn packed_main() -> String {
    format!(
        r#"
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let w = id.x + id.y * params[1];
    let count = params[0];
    if (w * 4u >= count) {{ return; }}
    var word = 0u;
    for (var j = 0u; j < 4u; j = j + 1u) {{
        let i = w * 4u + j;
        if (i < count && holds(i)) {{ word = word | (1u << (8u * j)); }}
    }}
    output[w] = word;
}}
"#
    )
}
/// A logical op over bools packed four per word (one byte each, 0 or 1),
/// with `arity` broadcast inputs: each thread writes one output word. The
/// op's expression reads its operands (`x`, or `a` and `b`) as `i32` 0/1
/// and gives 0 or 1. `params` as [`binary`]'s.
pub(crate) fn bool_elementwise(expression: &str, arity: usize) -> String {
    let (signature, call) = match arity {
        1 => ("x: i32", "op(byte(0u, at[0]))"),
        _ => ("a: i32, b: i32", "op(byte(0u, at[0]), byte(1u, at[1]))"),
    };
    let inputs: String = (0..arity)
        .map(|k| format!("@group(0) @binding({k}) var<storage, read> in{k}: array<u32>;\n"))
        .collect();
    let reads: String = (0..arity)
        .map(|k| format!("    if (k == {k}u) {{ word = in{k}[at >> 2u]; }}\n"))
        .collect();
    format!(
        r#"{INT_PRELUDE}
{inputs}@group(0) @binding({arity}) var<storage, read_write> output: array<u32>;
@group(0) @binding({params}) var<storage, read> params: array<u32>;

fn op({signature}) -> i32 {{ return {expression}; }}
{offsets}
fn byte(k: u32, at: u32) -> i32 {{
    var word = 0u;
{reads}    return i32((word >> ((at & 3u) * 8u)) & 0xffu);
}}

fn holds(i: u32) -> bool {{
    let at = offsets(i);
    return {call} != 0;
}}
{packed_main}"#,
        packed_main = packed_main(),
        params = arity + 1,
        offsets = broadcast_offsets(arity)
    )
}

/// `cond ? a : b` over three broadcast tensors (a bool condition, 4-byte
/// values). `params`: `[count, row_width, rank, 0, dims[MAX_RANK],
/// cond_strides, a_strides, b_strides]`.
pub(crate) fn select() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> cond: array<u32>;
@group(0) @binding(1) var<storage, read> a: array<u32>;
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read_write> output: array<u32>;
@group(0) @binding(4) var<storage, read> params: array<u32>;
{READ_BOOL}{offsets}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    let at = offsets(i);
    output[i] = select(b[at[2]], a[at[1]], bool_at(at[0]));
}}
"#,
        offsets = broadcast_offsets(3)
    )
}

/// The element types [`cast`] converts between.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum CastType {
    F32,
    I32,
    Bool,
    /// Held as (low, high) word pairs: WGSL has no 64-bit integers.
    I64,
}

/// Converts contiguous elements as the CPU's `Cast` does: floats to
/// integers truncate and saturate, NaN to 0; nonzero (NaN too) to `true`.
/// A bool output is written a word (four results) per thread. `params`:
/// `[count, row_width]`.
pub(crate) fn cast(from: CastType, to: CastType) -> String {
    let (input_type, read) = match from {
        CastType::F32 => ("f32", "input[i]"),
        CastType::I32 => ("i32", "input[i]"),
        CastType::Bool => ("u32", "f32((input[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu)"),
        CastType::I64 => return cast_i64(from, to),
    };
    // Every source converts through an f32 value `v`, exact for bool and
    // for i32 below 2^24.
    let head = format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<{input_type}>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
"#
    );
    let convert = if from == CastType::I32 {
        "f32(input[i])"
    } else {
        read
    };
    match to {
        CastType::Bool => {
            let nonzero = if from == CastType::I32 {
                "input[i] != 0"
            } else {
                "v != 0.0 || sc_isnan(v)"
            };
            cast_to_bool(&head, convert, nonzero)
        }
        CastType::F32 => format!(
            r#"{head}
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{ output[i] = {convert}; }}
}}
"#
        ),
        CastType::I64 => cast_i64(from, to),
        CastType::I32 => {
            let value = if from == CastType::F32 {
                "select(select(select(i32(v), 2147483647, v >= 2147483648.0), \
                 i32(-2147483648), v <= -2147483648.0), 0, sc_isnan(v))"
            } else {
                "i32(v)"
            };
            format!(
                r#"{head}
@group(0) @binding(1) var<storage, read_write> output: array<i32>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{
        let v = {read};
        output[i] = {value};
    }}
}}
"#
            )
        }
    }
}

/// A cast into bools, a word (four results) per thread: `value` is
/// element `i`'s source value, bound to `v` for the `nonzero` test.
fn cast_to_bool(head: &str, value: &str, nonzero: &str) -> String {
    format!(
        r#"{head}
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let w = id.x + id.y * params[1];
    if (w * 4u >= params[0]) {{ return; }}
    var word = 0u;
    for (var j = 0u; j < 4u; j = j + 1u) {{
        let i = w * 4u + j;
        if (i < params[0]) {{
            let v = {value};
            if ({nonzero}) {{ word = word | (1u << (8u * j)); }}
        }}
    }}
    output[w] = word;
}}
"#
    )
}

/// i64 as words: the conversions between a (low, high) pair and the
/// other cast types, as Rust's `as` converts. An f32 is truncated and
/// saturated (NaN to 0) into a pair; a pair rounds to the nearest f32,
/// ties to even, on the bits (WGSL lets an inexact integer-to-float
/// conversion round either way).
const I64_WORDS: &str = r#"
fn negate64(w: vec2<u32>) -> vec2<u32> {
    return vec2<u32>(~w.x + 1u, ~w.y + select(0u, 1u, w.x == 0u));
}

fn f32_to_i64(v: f32) -> vec2<u32> {
    if (sc_isnan(v)) { return vec2<u32>(0u, 0u); }
    if (v >= 9223372036854775808.0) { return vec2<u32>(0xffffffffu, 0x7fffffffu); }
    if (v <= -9223372036854775808.0) { return vec2<u32>(0u, 0x80000000u); }
    // Exact: an integral f32 below 2^63 splits into its words exactly.
    let m = trunc(abs(v));
    let high = floor(m / 4294967296.0);
    let w = vec2<u32>(u32(m - high * 4294967296.0), u32(high));
    return select(w, negate64(w), v < 0.0);
}

// Bit k of the word pair.
fn bit64(w: vec2<u32>, k: u32) -> bool {
    if (k >= 32u) { return ((w.y >> (k - 32u)) & 1u) != 0u; }
    return ((w.x >> k) & 1u) != 0u;
}

// Whether any of bits 0..k is set.
fn any_below64(w: vec2<u32>, k: u32) -> bool {
    if (k == 0u) { return false; }
    if (k > 32u) { return w.x != 0u || (w.y & ((1u << (k - 32u)) - 1u)) != 0u; }
    if (k == 32u) { return w.x != 0u; }
    return (w.x & ((1u << k) - 1u)) != 0u;
}

fn i64_to_f32(w: vec2<u32>) -> f32 {
    let negative = (w.y & 0x80000000u) != 0u;
    let m = select(w, negate64(w), negative);
    let sign = select(0u, 0x80000000u, negative);
    if (m.y == 0u && m.x < 16777216u) {
        return bitcast<f32>(bitcast<u32>(f32(m.x)) | sign);
    }
    // The leading bit and the 24 bits from it, rounded to nearest even.
    let top = select(31u - countLeadingZeros(m.x), 63u - countLeadingZeros(m.y), m.y != 0u);
    let shift = top - 23u;
    var mantissa = select((m.x >> shift) | (m.y << (32u - shift)), m.y >> (shift - 32u), shift >= 32u);
    let half = bit64(m, shift - 1u);
    if (half && (any_below64(m, shift - 1u) || (mantissa & 1u) == 1u)) {
        mantissa = mantissa + 1u;
    }
    var exponent = top + 127u;
    if (mantissa == 16777216u) {
        mantissa = 8388608u;
        exponent = exponent + 1u;
    }
    return bitcast<f32>(sign | (exponent << 23u) | (mantissa & 0x7fffffu));
}
"#;

/// [`cast`] where either side is i64. `params`: `[count, row_width]`.
fn cast_i64(from: CastType, to: CastType) -> String {
    let (input_type, pair) = match from {
        CastType::F32 => ("f32", "f32_to_i64(input[i])"),
        CastType::I32 => (
            "i32",
            "vec2<u32>(bitcast<u32>(input[i]), select(0u, 0xffffffffu, input[i] < 0))",
        ),
        CastType::Bool => (
            "u32",
            "vec2<u32>((input[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu, 0u)",
        ),
        CastType::I64 => ("u32", "vec2<u32>(input[2u * i], input[2u * i + 1u])"),
    };
    let head = format!(
        r#"{PRELUDE}{I64_WORDS}
@group(0) @binding(0) var<storage, read> input: array<{input_type}>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
fn pair(i: u32) -> vec2<u32> {{ return {pair}; }}
"#
    );
    let (output_type, store) = match to {
        CastType::I64 => (
            "u32",
            "let w = pair(i); output[2u * i] = w.x; output[2u * i + 1u] = w.y;",
        ),
        CastType::I32 => ("i32", "output[i] = bitcast<i32>(pair(i).x);"),
        CastType::F32 => ("f32", "output[i] = i64_to_f32(pair(i));"),
        CastType::Bool => return cast_to_bool(&head, "pair(i)", "(v.x | v.y) != 0u"),
    };
    format!(
        r#"{head}
@group(0) @binding(1) var<storage, read_write> output: array<{output_type}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{ {store} }}
}}
"#
    )
}

/// `start + i·step` in i32, written as `ty`. `params`: `[count,
/// row_width, start, step]` (i32 bits).
pub(crate) fn arange(ty: &str) -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read_write> output: array<{ty}>;
@group(0) @binding(1) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{
        output[i] = {ty}(bitcast<i32>(params[2]) + i32(i) * bitcast<i32>(params[3]));
    }}
}}
"#
    )
}

/// Fills words with one bit pattern. `params`: `[words, row_width, bits]`.
pub(crate) fn fill() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read_write> output: array<u32>;
@group(0) @binding(1) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i < params[0]) {{ output[i] = params[2]; }}
}}
"#
    )
}

/// Cross-entropy's rows: one workgroup per row computes `lse = log Σ
/// exp(logits)` (after the row's maximum) and the row's loss `(lse −
/// logits[target]) · scale`, 0 for an ignored row. Targets were checked on
/// the host. `params`: `[rows, classes, row_width_in_groups, has_ignore,
/// ignore (i32 bits), scale (f32 bits)]`.
pub(crate) fn cross_entropy_rows() -> String {
    format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read> targets: array<i32>;
@group(0) @binding(2) var<storage, read_write> row_loss: array<f32>;
@group(0) @binding(3) var<storage, read_write> lse: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32>;
{ROW_MAX_AND_EXP_SUM}{ROW_MAIN}
    let stats = row_max_and_exp_sum(base, width, live, lane);
    if (live && lane == 0u) {{
        let l = stats.x + log(stats.y);
        lse[row] = l;
        let t = targets[row];
        let ignored = params[3] != 0u && t == bitcast<i32>(params[4]);
        row_loss[row] = select((l - input[base + u32(t)]) * bitcast<f32>(params[5]), 0.0, ignored);
    }}
}}
"#
    )
}

/// Cross-entropy's gradient, one thread per logit: `(softmax − one_hot) ·
/// s`, `s` the row's share of `g` (`g[row]`, or `g[0]` for a scalar loss)
/// times `scale`; 0 in an ignored row. `params`: `[count, row_width,
/// classes, has_ignore, ignore (i32 bits), subtract_target, scalar_g,
/// scale (f32 bits)]`.
pub(crate) fn cross_entropy_grad() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> targets: array<i32>;
@group(0) @binding(2) var<storage, read> lse: array<f32>;
@group(0) @binding(3) var<storage, read> g: array<f32>;
@group(0) @binding(4) var<storage, read_write> output: array<f32>;
@group(0) @binding(5) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    let classes = params[2];
    let row = i / classes;
    let c = i % classes;
    let t = targets[row];
    if (params[3] != 0u && t == bitcast<i32>(params[4])) {{
        output[i] = 0.0;
        return;
    }}
    let s = select(g[row], g[0], params[6] != 0u) * bitcast<f32>(params[7]);
    var p = exp(logits[i] - lse[row]);
    if (params[5] != 0u && i32(c) == t) {{ p = p - 1.0; }}
    output[i] = p * s;
}}
"#
    )
}

/// Layer norm over the last axis, one workgroup per row: the mean, then
/// the population variance around it (two passes, as the CPU's kernel),
/// `rstd = 1/sqrt(var + eps)`, and `y = (x − mean)·rstd·weight + bias`
/// with the parameters that are present. `params`: `[rows, width,
/// row_width_in_groups, eps (f32 bits)]`.
pub(crate) fn layer_norm(has_weight: bool, has_bias: bool) -> String {
    let mut bindings = String::from("@group(0) @binding(0) var<storage, read> x: array<f32>;\n");
    let mut next = 1;
    let mut scale = String::new();
    if has_weight {
        bindings += &format!("@group(0) @binding({next}) var<storage, read> weight: array<f32>;\n");
        next += 1;
        scale += " * weight[c]";
    }
    if has_bias {
        bindings += &format!("@group(0) @binding({next}) var<storage, read> bias: array<f32>;\n");
        next += 1;
        scale += " + bias[c]";
    }
    let (y, mean, rstd, params) = (next, next + 1, next + 2, next + 3);
    format!(
        r#"
{bindings}@group(0) @binding({y}) var<storage, read_write> y: array<f32>;
@group(0) @binding({mean}) var<storage, read_write> mean_out: array<f32>;
@group(0) @binding({rstd}) var<storage, read_write> rstd_out: array<f32>;
@group(0) @binding({params}) var<storage, read> params: array<u32>;

const LANES: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

fn row_sum(value: f32, lane: u32) -> f32 {{
    partial[lane] = value;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w = w / 2u) {{
        if (lane < w) {{ partial[lane] = partial[lane] + partial[lane + w]; }}
        workgroupBarrier();
    }}
    let total = partial[0];
    workgroupBarrier();
    return total;
}}
{ROW_MAIN}
    var sum = 0.0;
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{ sum = sum + x[base + c]; }}
    }}
    let mean = row_sum(sum, lane) / f32(width);
    var squares = 0.0;
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            let d = x[base + c] - mean;
            squares = squares + d * d;
        }}
    }}
    let rstd = 1.0 / sqrt(row_sum(squares, lane) / f32(width) + bitcast<f32>(params[3]));
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            y[base + c] = (x[base + c] - mean) * rstd{scale};
        }}
        if (lane == 0u) {{
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }}
    }}
}}
"#
    )
}

/// Rows of a table picked by ids (checked on the host): `out[i] =
/// table[ids[i / width]·width + i % width]`. `params`: `[count,
/// row_width, width, words per id]`.
pub(crate) fn embedding() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> table: array<u32>;
@group(0) @binding(1) var<storage, read> ids: array<i32>;
@group(0) @binding(2) var<storage, read_write> output: array<u32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    let width = params[2];
    // params[3]: words per id (1 for i32, 2 for i64, read by its low word).
    output[i] = table[u32(ids[(i / width) * params[3]]) * width + i % width];
}}
"#
    )
}

/// Pads 4-byte elements with a constant: output coordinate `c` reads input
/// coordinate `c − before` when that lies inside the input. `params`:
/// `[count, row_width, rank, value (bits), out_dims[MAX_RANK],
/// before[MAX_RANK], in_dims[MAX_RANK], in_strides[MAX_RANK]]`.
pub(crate) fn pad() -> String {
    let r = MAX_RANK;
    format!(
        r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    {FLAT_INDEX}
    if (i >= params[0]) {{ return; }}
    var rest = i;
    var source = 0u;
    var inside = true;
    let rank = params[2];
    for (var d = 0u; d < rank; d = d + 1u) {{
        let axis = rank - 1u - d;
        let dim = params[4u + axis];
        let c = rest % dim;
        rest = rest / dim;
        let before = params[4u + {r}u + axis];
        let in_dim = params[4u + {r2}u + axis];
        if (c < before || c - before >= in_dim) {{
            inside = false;
        }} else {{
            source = source + (c - before) * params[4u + {r3}u + axis];
        }}
    }}
    if (inside) {{ output[i] = input[source]; }} else {{ output[i] = params[3]; }}
}}
"#,
        r2 = 2 * r,
        r3 = 3 * r
    )
}
