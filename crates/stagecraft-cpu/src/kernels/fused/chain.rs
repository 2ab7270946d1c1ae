//! Chains: runs of a fused program's instructions in which each reads the
//! one before it and is that value's only reader (B3's eight steps are
//! one chain). The block interpreter writes every instruction's values to a
//! register slot in L1 and reads them back for the next; a chain instead
//! keeps them in vector registers, a few vectors at a time, and stores only
//! its last value. On AMD Zen 4, whose cores store one 256-bit half of a
//! vector per cycle, those slot stores bounded the interpreter: B3 spent
//! about 0.7 ns per element on one core, three times a plain copy's time.
//!
//! Each link is the same IEEE operation, on the same operands in the same
//! order, as the instruction it replaces (relu included: it selects, and
//! quiets a NaN as the f64 path does), so chained and unchained programs
//! give the same bits. Chains are formed for f32 programs on CPUs with
//! AVX2 or AVX-512, the vector paths written here.

use super::{Isa, Operand, Src};
use crate::kernels::elementwise::{relu, Arith, Real};
use smallvec::SmallVec;
use stagecraft_ops::{BinaryOp, FusedInstr, UnaryOp};

/// What a link does to the chain's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum LinkOp {
    Relu,
    /// With `chain_left`, `value op other`; otherwise `other op value`.
    Binary(BinaryOp),
}

/// A link's second operand.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Other<O> {
    /// A unary link has none.
    None,
    /// The chain's value itself (`t * t`).
    Itself,
    Value(O),
}

/// One instruction of a chain; `O` names operands (program values while
/// chains are formed, then register slots and inputs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Link<O> {
    pub op: LinkOp,
    pub other: Other<O>,
    /// The chain's value is the left operand.
    pub chain_left: bool,
}

/// A chain over operands named by `O`: `first`, then each link in turn.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Chain<O> {
    pub first: O,
    pub links: SmallVec<[Link<O>; 8]>,
}

impl<O: Copy> Chain<O> {
    /// The operands the chain reads: `first` and every other operand.
    pub fn reads(&self) -> impl Iterator<Item = O> + '_ {
        std::iter::once(self.first).chain(self.links.iter().filter_map(|l| match l.other {
            Other::Value(v) => Some(v),
            Other::None | Other::Itself => None,
        }))
    }

    pub fn map<P>(&self, f: impl Fn(O) -> P) -> Chain<P> {
        Chain {
            first: f(self.first),
            links: self
                .links
                .iter()
                .map(|l| Link {
                    op: l.op,
                    chain_left: l.chain_left,
                    other: match l.other {
                        Other::None => Other::None,
                        Other::Itself => Other::Itself,
                        Other::Value(v) => Other::Value(f(v)),
                    },
                })
                .collect(),
        }
    }
}

/// A unit of a planned program: one instruction, or a chain of them.
/// Operands are program values: inputs first, then instruction results.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Node {
    Single(FusedInstr),
    Chain(Chain<usize>),
}

/// The program as nodes, each with the index of its last instruction (its
/// value is that instruction's result), in program order of those. With
/// `chains` false every instruction is its own node.
pub(super) fn plan_nodes(
    program: &[FusedInstr],
    inputs: usize,
    chains: bool,
) -> Vec<(usize, Node)> {
    if !chains {
        let singles = program.iter().enumerate();
        return singles
            .map(|(i, &instr)| (i, Node::Single(instr)))
            .collect();
    }
    let mut readers = vec![0usize; inputs + program.len()];
    for instr in program {
        match *instr {
            FusedInstr::Unary(_, a) => readers[a] += 1,
            FusedInstr::Binary(_, a, b) | FusedInstr::Compare(_, a, b) => {
                readers[a] += 1;
                readers[b] += 1;
            }
        }
    }
    // Open chains by the value of their last link, with that link's index.
    let mut open: Vec<Option<(usize, Chain<usize>)>> = vec![None; inputs + program.len()];
    let mut nodes: Vec<(usize, Node)> = Vec::new();
    for (i, &instr) in program.iter().enumerate() {
        let value = inputs + i;
        let link = match instr {
            FusedInstr::Unary(UnaryOp::Relu, a) => Some((a, None)),
            FusedInstr::Binary(op, a, b) if chainable(op) => Some((a, Some(b))),
            _ => None,
        };
        let Some((a, b)) = link else {
            nodes.push((i, Node::Single(instr)));
            continue;
        };
        // Both operand slots of this instruction, as read counts.
        let reads_here = |v: usize| usize::from(a == v) + usize::from(b == Some(v));
        let extends = |v: usize| open[v].is_some() && readers[v] == reads_here(v);
        let (chain, chain_left) = if extends(a) {
            (open[a].take().map(|(_, c)| c), true)
        } else if let Some(b) = b.filter(|&b| extends(b)) {
            (open[b].take().map(|(_, c)| c), false)
        } else {
            (None, true)
        };
        // A new chain starts from `a`: its value is `a`, on the left.
        let mut chain = chain.unwrap_or_else(|| Chain {
            first: a,
            links: SmallVec::new(),
        });
        let (own, other) = if chain_left {
            (a, b)
        } else {
            (b.unwrap_or(a), Some(a))
        };
        let other = match other {
            None => Other::None,
            Some(o) if o == own => Other::Itself,
            Some(o) => Other::Value(o),
        };
        chain.links.push(Link {
            op: match instr {
                FusedInstr::Binary(op, ..) => LinkOp::Binary(op),
                _ => LinkOp::Relu,
            },
            other,
            chain_left,
        });
        open[value] = Some((i, chain));
    }
    for (end, chain) in open.into_iter().flatten() {
        let node = match chain.links.as_slice() {
            // One instruction gains nothing from a chain.
            [only] => Node::Single(single(chain.first, only)),
            _ => Node::Chain(chain),
        };
        nodes.push((end, node));
    }
    nodes.sort_by_key(|&(end, _)| end);
    nodes
}

/// The instruction a one-link chain stands for.
fn single(first: usize, link: &Link<usize>) -> FusedInstr {
    let other = match link.other {
        Other::Value(v) => v,
        Other::None | Other::Itself => first,
    };
    match link.op {
        LinkOp::Relu => FusedInstr::Unary(UnaryOp::Relu, first),
        LinkOp::Binary(op) if link.chain_left => FusedInstr::Binary(op, first, other),
        LinkOp::Binary(op) => FusedInstr::Binary(op, other, first),
    }
}

/// Binary ops a chain runs in vector registers.
fn chainable(op: BinaryOp) -> bool {
    matches!(
        op,
        BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Maximum
            | BinaryOp::Minimum
    )
}

/// A link's other operand within one block.
#[derive(Clone, Copy)]
pub(super) enum LinkSrc<'a, T> {
    None,
    Itself,
    Src(Src<'a, T>),
}

/// Runs `links` over `dst.len()` elements: `first`, then each link with its
/// operand from `others` (same order). The block goes in `parts` ranges,
/// with `before_part` called before each (a streamed range moves its memory
/// traffic there).
pub(super) fn run_chain<T: Real + Arith>(
    isa: Isa,
    links: &[Link<Operand>],
    (first, others): (Src<'_, T>, &[LinkSrc<'_, T>]),
    dst: &mut [T],
    parts: usize,
    before_part: &mut dyn FnMut(),
) {
    let n = dst.len();
    for src in std::iter::once(&LinkSrc::Src(first)).chain(others) {
        if let LinkSrc::Src(Src::Slice(values)) = src {
            assert!(values.len() >= n, "a chain operand shorter than its block");
        }
    }
    #[cfg(target_arch = "x86_64")]
    let vectors = ChainF32::new(isa, first, others);
    #[cfg(not(target_arch = "x86_64"))]
    let vectors: Option<ChainPortable> = {
        let _ = isa;
        None
    };
    // Whole groups of vectors on the vector path, the rest one element at
    // a time.
    let (width, whole) = match &vectors {
        Some(v) => (v.width, n / v.width * v.width),
        None => (1, 0),
    };
    let part = n.div_ceil(parts.max(1)).next_multiple_of(width);
    for p in 0..parts.max(1) {
        before_part();
        let range = (p * part).min(n)..((p + 1) * part).min(n);
        let vector_end = range.end.min(whole);
        #[cfg(target_arch = "x86_64")]
        if let Some(vectors) = &vectors {
            if range.start < vector_end {
                vectors.run(links, dst, range.start..vector_end);
            }
        }
        run_chain_portable(
            links,
            first,
            others,
            dst,
            range.start.max(vector_end)..range.end,
        );
    }
}

/// Where no vector path is compiled, chains run one element at a time.
#[cfg(not(target_arch = "x86_64"))]
struct ChainPortable {
    width: usize,
}

/// A chain's operands as f32, for the vector paths (AVX-512 or AVX2).
#[cfg(target_arch = "x86_64")]
struct ChainF32<'a> {
    isa: Isa,
    first: Src<'a, f32>,
    others: SmallVec<[LinkSrc<'a, f32>; 8]>,
    /// Elements per group of vectors.
    width: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'a> ChainF32<'a> {
    /// `None` for other types than f32 and CPUs without AVX2.
    fn new<T: Real>(
        isa: Isa,
        first: Src<'a, T>,
        others: &[LinkSrc<'a, T>],
    ) -> Option<ChainF32<'a>> {
        fn as_f32<T: Real>(src: Src<'_, T>) -> Option<Src<'_, f32>> {
            Some(match src {
                Src::Slice(values) => Src::Slice(T::as_f32(values)?),
                Src::Scalar(v) => Src::Scalar(T::as_f32(std::slice::from_ref(&v))?[0]),
            })
        }
        let width = match isa {
            Isa::Avx512 => 16 * vectors::GROUP_AVX512,
            Isa::Avx2 => 8 * vectors::GROUP_AVX2,
            Isa::Baseline => return None,
        };
        let others = others
            .iter()
            .map(|&o| match o {
                LinkSrc::None => Some(LinkSrc::None),
                LinkSrc::Itself => Some(LinkSrc::Itself),
                LinkSrc::Src(src) => as_f32(src).map(LinkSrc::Src),
            })
            .collect::<Option<_>>()?;
        Some(ChainF32 {
            isa,
            first: as_f32(first)?,
            others,
            width,
        })
    }

    /// Elements `range` of the block into `dst` (whole groups).
    fn run<T: Real>(&self, links: &[Link<Operand>], dst: &mut [T], range: std::ops::Range<usize>) {
        let Some(dst) = T::as_f32_mut(dst) else {
            return;
        };
        assert!(range.end <= dst.len() && range.len().is_multiple_of(self.width));
        let operands = (self.first, &self.others[..]);
        let dst = dst.as_mut_ptr();
        match self.isa {
            // SAFETY: `Isa::Avx512` is chosen only when the CPU reported
            // AVX-512F; `run_chain` checked that every slice operand holds
            // the block's values, and `range` (whole groups) lies within
            // `dst`, borrowed mutably here.
            Isa::Avx512 => unsafe { vectors::chain_avx512(links, operands, dst, range) },
            // SAFETY: as above, for AVX2.
            Isa::Avx2 => unsafe { vectors::chain_avx2(links, operands, dst, range) },
            Isa::Baseline => {}
        }
    }
}

/// One element at a time, with the element functions of the unfused
/// kernels: elements `range` of the block.
fn run_chain_portable<T: Real + Arith>(
    links: &[Link<Operand>],
    first: Src<'_, T>,
    others: &[LinkSrc<'_, T>],
    dst: &mut [T],
    range: std::ops::Range<usize>,
) {
    let at = |src: Src<'_, T>, i: usize| match src {
        Src::Slice(values) => values[i],
        Src::Scalar(v) => v,
    };
    for i in range {
        let mut value = at(first, i);
        for (link, &other) in links.iter().zip(others) {
            let other = match other {
                LinkSrc::None | LinkSrc::Itself => value,
                LinkSrc::Src(src) => at(src, i),
            };
            let (x, y) = if link.chain_left {
                (value, other)
            } else {
                (other, value)
            };
            value = match link.op {
                LinkOp::Relu => T::narrow(relu(value.wide())),
                LinkOp::Binary(BinaryOp::Add) => x.add(y),
                LinkOp::Binary(BinaryOp::Sub) => x.sub(y),
                LinkOp::Binary(BinaryOp::Mul) => x.mul(y),
                LinkOp::Binary(BinaryOp::Div) => x.div(y),
                LinkOp::Binary(BinaryOp::Maximum) => x.maximum(y),
                LinkOp::Binary(BinaryOp::Minimum) => x.minimum(y),
                LinkOp::Binary(op) => unreachable!("{op:?} is never chained"),
            };
        }
        dst[i] = value;
    }
}

#[cfg(target_arch = "x86_64")]
mod vectors {
    use super::{Link, LinkOp, LinkSrc, Src};
    use crate::kernels::fused::Operand;
    use stagecraft_ops::BinaryOp;
    use std::arch::x86_64::*;

    /// Vectors a group holds in registers at once, with AVX-512's 32
    /// vector registers and AVX2's 16: several chains of dependent
    /// operations in flight hide each operation's latency, and a link's
    /// dispatch is paid once per group (B3 at 1M elements on one Zen 4
    /// core: groups of 2, 4 and 8 vectors took 0.71, 0.50 and 0.46 ms).
    pub(super) const GROUP_AVX512: usize = 8;
    /// See [`GROUP_AVX512`].
    pub(super) const GROUP_AVX2: usize = 4;

    /// One instruction set's f32 vector operations, each the IEEE
    /// operation (or selection) of the scalar element function.
    ///
    /// # Safety
    /// Every method needs the CPU feature its implementation names; `load`
    /// and `store` need `LANES` readable or writable floats at `at`.
    trait Lanes {
        type V: Copy;
        const LANES: usize;
        unsafe fn load(at: *const f32) -> Self::V;
        unsafe fn store(at: *mut f32, v: Self::V);
        unsafe fn splat(v: f32) -> Self::V;
        unsafe fn add(x: Self::V, y: Self::V) -> Self::V;
        unsafe fn sub(x: Self::V, y: Self::V) -> Self::V;
        unsafe fn mul(x: Self::V, y: Self::V) -> Self::V;
        unsafe fn div(x: Self::V, y: Self::V) -> Self::V;
        /// `x` where `x > y` or `x` is NaN, else `y`.
        unsafe fn maximum(x: Self::V, y: Self::V) -> Self::V;
        /// `x` where `x < y` or `x` is NaN, else `y`.
        unsafe fn minimum(x: Self::V, y: Self::V) -> Self::V;
        /// `x + 0` (which quiets a NaN, as the f64 round trip does) where
        /// `x > 0` or `x` is NaN, else `+0`.
        unsafe fn relu(x: Self::V) -> Self::V;
    }

    /// Implements [`Lanes`] for `$name` from its intrinsics.
    macro_rules! lanes {
        ($name:ident, $feature:literal, $v:ty, $lanes:literal,
         load: $load:ident, store: $store:ident, splat: $splat:ident,
         add: $add:ident, sub: $sub:ident, mul: $mul:ident, div: $div:ident,
         keep: $keep:ident, relu: $relu:ident) => {
            #[doc = concat!("f32 vectors of ", $feature, ".")]
            struct $name;

            impl Lanes for $name {
                type V = $v;
                const LANES: usize = $lanes;
                #[inline(always)]
                unsafe fn load(at: *const f32) -> $v {
                    // SAFETY: the caller has the feature and a readable vector at `at`.
                    unsafe { $load(at) }
                }
                #[inline(always)]
                unsafe fn store(at: *mut f32, v: $v) {
                    // SAFETY: the caller has the feature and a writable vector at `at`.
                    unsafe { $store(at, v) }
                }
                #[inline(always)]
                unsafe fn splat(v: f32) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $splat(v) }
                }
                #[inline(always)]
                unsafe fn add(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $add(x, y) }
                }
                #[inline(always)]
                unsafe fn sub(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $sub(x, y) }
                }
                #[inline(always)]
                unsafe fn mul(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $mul(x, y) }
                }
                #[inline(always)]
                unsafe fn div(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $div(x, y) }
                }
                #[inline(always)]
                unsafe fn maximum(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $keep::<_CMP_GT_OQ>(x, y) }
                }
                #[inline(always)]
                unsafe fn minimum(x: $v, y: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $keep::<_CMP_LT_OQ>(x, y) }
                }
                #[inline(always)]
                unsafe fn relu(x: $v) -> $v {
                    // SAFETY: the caller has the feature (the trait's contract).
                    unsafe { $relu(x) }
                }
            }
        };
    }

    lanes!(Avx512, "AVX-512F", __m512, 16,
        load: _mm512_loadu_ps, store: _mm512_storeu_ps, splat: _mm512_set1_ps,
        add: _mm512_add_ps, sub: _mm512_sub_ps, mul: _mm512_mul_ps, div: _mm512_div_ps,
        keep: keep_avx512, relu: relu_avx512);

    lanes!(Avx2, "AVX2", __m256, 8,
        load: _mm256_loadu_ps, store: _mm256_storeu_ps, splat: _mm256_set1_ps,
        add: _mm256_add_ps, sub: _mm256_sub_ps, mul: _mm256_mul_ps, div: _mm256_div_ps,
        keep: keep_avx2, relu: relu_avx2);

    /// `x` where `x PREDICATE y` holds or `x` is NaN, else `y`.
    #[inline(always)]
    unsafe fn keep_avx512<const PREDICATE: i32>(x: __m512, y: __m512) -> __m512 {
        // SAFETY: the caller has AVX-512F (see `Lanes`).
        unsafe {
            let keep =
                _mm512_cmp_ps_mask::<PREDICATE>(x, y) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            _mm512_mask_blend_ps(keep, y, x)
        }
    }

    /// `x + 0` where `x > 0` or `x` is NaN (not `x <= 0`), else `+0`.
    #[inline(always)]
    unsafe fn relu_avx512(x: __m512) -> __m512 {
        // SAFETY: the caller has AVX-512F (see `Lanes`).
        unsafe {
            let zero = _mm512_setzero_ps();
            let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x, zero);
            _mm512_maskz_add_ps(keep, x, zero)
        }
    }

    /// [`keep_avx512`] with AVX2.
    #[inline(always)]
    unsafe fn keep_avx2<const PREDICATE: i32>(x: __m256, y: __m256) -> __m256 {
        // SAFETY: the caller has AVX2 (see `Lanes`).
        unsafe {
            let keep = _mm256_or_ps(
                _mm256_cmp_ps::<PREDICATE>(x, y),
                _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x),
            );
            _mm256_blendv_ps(y, x, keep)
        }
    }

    /// [`relu_avx512`] with AVX2.
    #[inline(always)]
    unsafe fn relu_avx2(x: __m256) -> __m256 {
        // SAFETY: the caller has AVX2 (see `Lanes`).
        unsafe {
            let zero = _mm256_setzero_ps();
            let keep = _mm256_cmp_ps::<_CMP_NLE_UQ>(x, zero);
            _mm256_and_ps(keep, _mm256_add_ps(x, zero))
        }
    }

    /// The chain over elements `range`, whole groups of `G` vectors.
    ///
    /// # Safety
    /// The CPU has `L`'s feature; `dst` and every slice operand hold
    /// `range.end` values, and `range`'s length is a multiple of
    /// `G * L::LANES`.
    #[inline(always)]
    unsafe fn chain<L: Lanes, const G: usize>(
        links: &[Link<Operand>],
        (first, others): (Src<'_, f32>, &[LinkSrc<'_, f32>]),
        dst: *mut f32,
        range: std::ops::Range<usize>,
    ) {
        // SAFETY: (for the whole loop) each group's vectors lie within
        // `range` (whole groups), inside every operand and `dst` by the
        // contract; the CPU has `L`'s feature.
        unsafe {
            let group = |src: Src<'_, f32>, base: usize| -> [L::V; G] {
                match src {
                    Src::Slice(values) => {
                        std::array::from_fn(|g| L::load(values.as_ptr().add(base + g * L::LANES)))
                    }
                    Src::Scalar(v) => [L::splat(v); G],
                }
            };
            for base in range.step_by(G * L::LANES) {
                let mut value = group(first, base);
                for (link, &other) in links.iter().zip(others) {
                    // Each (op, operand kind, side) is its own loop, the
                    // operand loaded where it is used: built as arrays and
                    // swapped by side, the operands cost a register move
                    // per vector per link.
                    macro_rules! link {
                        ($f:path) => {
                            match (other, link.chain_left) {
                                (LinkSrc::Src(Src::Slice(o)), true) => {
                                    for (g, v) in value.iter_mut().enumerate() {
                                        *v = $f(*v, L::load(o.as_ptr().add(base + g * L::LANES)));
                                    }
                                }
                                (LinkSrc::Src(Src::Slice(o)), false) => {
                                    for (g, v) in value.iter_mut().enumerate() {
                                        *v = $f(L::load(o.as_ptr().add(base + g * L::LANES)), *v);
                                    }
                                }
                                (LinkSrc::Src(Src::Scalar(k)), true) => {
                                    let k = L::splat(k);
                                    for v in value.iter_mut() {
                                        *v = $f(*v, k);
                                    }
                                }
                                (LinkSrc::Src(Src::Scalar(k)), false) => {
                                    let k = L::splat(k);
                                    for v in value.iter_mut() {
                                        *v = $f(k, *v);
                                    }
                                }
                                (LinkSrc::None | LinkSrc::Itself, _) => {
                                    for v in value.iter_mut() {
                                        *v = $f(*v, *v);
                                    }
                                }
                            }
                        };
                    }
                    match link.op {
                        LinkOp::Relu => {
                            for v in value.iter_mut() {
                                *v = L::relu(*v);
                            }
                        }
                        LinkOp::Binary(BinaryOp::Add) => link!(L::add),
                        LinkOp::Binary(BinaryOp::Sub) => link!(L::sub),
                        LinkOp::Binary(BinaryOp::Mul) => link!(L::mul),
                        LinkOp::Binary(BinaryOp::Div) => link!(L::div),
                        LinkOp::Binary(BinaryOp::Maximum) => link!(L::maximum),
                        LinkOp::Binary(BinaryOp::Minimum) => link!(L::minimum),
                        LinkOp::Binary(op) => unreachable!("{op:?} is never chained"),
                    }
                }
                for (g, v) in value.into_iter().enumerate() {
                    L::store(dst.add(base + g * L::LANES), v);
                }
            }
        }
    }

    /// [`chain`] with AVX-512.
    ///
    /// # Safety
    /// As [`chain`]'s, with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chain_avx512(
        links: &[Link<Operand>],
        operands: (Src<'_, f32>, &[LinkSrc<'_, f32>]),
        dst: *mut f32,
        range: std::ops::Range<usize>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { chain::<Avx512, GROUP_AVX512>(links, operands, dst, range) }
    }

    /// [`chain`] with AVX2.
    ///
    /// # Safety
    /// As [`chain`]'s, with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn chain_avx2(
        links: &[Link<Operand>],
        operands: (Src<'_, f32>, &[LinkSrc<'_, f32>]),
        dst: *mut f32,
        range: std::ops::Range<usize>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { chain::<Avx2, GROUP_AVX2>(links, operands, dst, range) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{allocate_registers, isa, run_block_on, Input, Scratch, Step};
    use super::*;
    use stagecraft_ops::CompareOp;

    /// The B3 chain over x (input 0) and its four constants (inputs 1–4).
    fn b3() -> Vec<FusedInstr> {
        vec![
            FusedInstr::Binary(BinaryOp::Mul, 0, 1),
            FusedInstr::Binary(BinaryOp::Add, 5, 2),
            FusedInstr::Binary(BinaryOp::Mul, 6, 0),
            FusedInstr::Binary(BinaryOp::Sub, 7, 3),
            FusedInstr::Unary(UnaryOp::Relu, 8),
            FusedInstr::Binary(BinaryOp::Mul, 9, 4),
            FusedInstr::Binary(BinaryOp::Add, 10, 0),
            FusedInstr::Binary(BinaryOp::Mul, 11, 11),
        ]
    }

    #[test]
    fn b3_is_one_chain_of_eight_links() {
        let nodes = plan_nodes(&b3(), 5, true);
        assert_eq!(nodes.len(), 1);
        let (end, Node::Chain(chain)) = &nodes[0] else {
            panic!("not a chain: {nodes:?}");
        };
        assert_eq!(*end, 7);
        assert_eq!(chain.first, 0);
        assert_eq!(chain.links.len(), 8);
        assert_eq!(chain.links[2].other, Other::Value(0));
        assert_eq!(chain.links[4].op, LinkOp::Relu);
        assert_eq!(chain.links[7].other, Other::Itself);
        // Without chains, eight single steps.
        assert_eq!(plan_nodes(&b3(), 5, false).len(), 8);
    }

    #[test]
    fn a_value_with_two_readers_ends_its_chain() {
        // t = x * k (2); u = t + k (3); w = u - t (4); t * w (5): t has
        // three readers, so no chain goes through it.
        let program = vec![
            FusedInstr::Binary(BinaryOp::Mul, 0, 1),
            FusedInstr::Binary(BinaryOp::Add, 2, 1),
            FusedInstr::Binary(BinaryOp::Sub, 3, 2),
            FusedInstr::Binary(BinaryOp::Mul, 2, 4),
        ];
        let nodes = plan_nodes(&program, 2, true);
        // t alone, then one chain from t: + k, - t, t * _.
        assert_eq!(nodes.len(), 2, "{nodes:?}");
        assert_eq!(nodes[0], (0, Node::Single(program[0])));
        let (3, Node::Chain(chain)) = &nodes[1] else {
            panic!("{nodes:?}");
        };
        assert_eq!(chain.first, 2);
        assert_eq!(chain.links[1].other, Other::Value(2));
        assert_eq!(chain.links.len(), 3);
        assert!(
            !chain.links[2].chain_left,
            "t * chain: the chain is on the right"
        );
        // Compares are never chained, and a lone instruction stays single.
        let program = vec![
            FusedInstr::Compare(CompareOp::Gt, 0, 1),
            FusedInstr::Binary(BinaryOp::Mul, 2, 0),
        ];
        let nodes = plan_nodes(&program, 2, true);
        assert!(nodes.iter().all(|(_, n)| matches!(n, Node::Single(_))));
    }

    /// Chained and unchained programs give the same bits on every
    /// instruction set this CPU has: NaNs, signed zeros and infinities,
    /// the chain on either side of a non-commuting op, maximum and
    /// minimum, a value read twice, and blocks that end mid-group.
    #[test]
    fn chains_give_the_unchained_bits() {
        // x: 0, y: 1, k: scalar 2.
        let program = vec![
            FusedInstr::Binary(BinaryOp::Sub, 1, 0),     // 3: y - x
            FusedInstr::Binary(BinaryOp::Div, 2, 3),     // 4: k / (y - x)
            FusedInstr::Binary(BinaryOp::Maximum, 4, 0), // 5: max(_, x)
            FusedInstr::Unary(UnaryOp::Relu, 5),         // 6
            FusedInstr::Binary(BinaryOp::Minimum, 1, 6), // 7: min(y, _)
            FusedInstr::Binary(BinaryOp::Mul, 7, 7),     // 8: _ * _
            FusedInstr::Binary(BinaryOp::Sub, 8, 1),     // 9: _ - y
            FusedInstr::Binary(BinaryOp::Maximum, 0, 9), // 10: max(x, _)
            FusedInstr::Binary(BinaryOp::Add, 10, 2),    // 11: _ + k
        ];
        let special = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -f32::NAN,
        ];
        let x: Vec<f32> = (0..1000)
            .map(|i| match i % 11 {
                0..=5 => special[i % 6],
                _ => (i as f32 - 500.0) / 37.0,
            })
            .collect();
        let y: Vec<f32> = (0..1000)
            .map(|i| match i % 7 {
                0..=5 => special[(i / 7) % 6],
                _ => (i as f32 * 0.37).sin() * 4.0,
            })
            .collect();
        let inputs = [
            Input::Full(&x[..]),
            Input::Full(&y[..]),
            Input::Scalar(-1.5f32),
        ];
        let chained = allocate_registers(&program, 3, true);
        assert!(chained.0.iter().any(|s| matches!(s, Step::Chain(..))));
        let plain = allocate_registers(&program, 3, false);
        let run = |(steps, slots, _): &(Vec<Step>, usize, usize), isa: Isa, n: usize| {
            let mut scratch = Scratch::new(*slots, inputs.len(), n);
            let mut out = vec![0.0f32; n];
            run_block_on(
                isa,
                steps,
                &inputs,
                0,
                &mut out,
                &mut scratch,
                &mut |_, _| {},
            );
            out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let mut isas = vec![Isa::Baseline, isa()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            isas.push(Isa::Avx2);
        }
        for n in [1, 63, 64, 65, 200, 700, 1000] {
            let want = run(&plain, Isa::Baseline, n);
            for &isa in &isas {
                assert_eq!(run(&chained, isa, n), want, "{isa:?}, {n} elements");
            }
        }
    }

    /// A chain's parts each get their call, also for blocks shorter than
    /// the parts.
    #[test]
    fn every_part_is_announced() {
        let links = [Link {
            op: LinkOp::Relu,
            other: Other::None,
            chain_left: true,
        }];
        for n in [0, 5, 300, 700, 1000, 1024] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 - 100.0).collect();
            let mut out = vec![f32::NAN; n];
            let mut calls = 0;
            let others = [LinkSrc::None];
            run_chain(
                isa(),
                &links,
                (Src::Slice(&x), &others),
                &mut out,
                4,
                &mut || calls += 1,
            );
            assert_eq!(calls, 4);
            assert!(out.iter().zip(&x).all(|(o, v)| *o == v.max(0.0)));
        }
    }
}
