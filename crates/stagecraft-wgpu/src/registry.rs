//! The GPU kernel table: every kernel of this crate declared once, as the
//! op it runs, the input dtypes it accepts and its launch.
//!
//! [`lookup`] answers "does the GPU have a kernel for this op at these
//! dtypes?" without launching anything; [`run`](crate::run) applies the
//! rules common to every op, then launches what [`lookup`] finds. What the
//! dtypes cannot say (sizes past 2^32 elements, attributes a kernel does
//! not cover, an index out of range) each launch checks itself, answering
//! `Ok(None)` for the CPU to run the op.

use crate::context::Gpu;
use crate::kernels::Outputs;
use stagecraft_ops::{Attrs, OpDef};
use stagecraft_tensor::{DType, DeviceTensor, Result, TensorMetadata};
use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;

/// A launch: runs `op` on the GPU; `Ok(None)` only for a case the table
/// cannot see from dtypes (a size past 2^32 elements, an attribute the
/// kernel does not cover), which the runtime then runs on the CPU.
///
/// It is called with inputs whose dtypes its entry accepts, after
/// [`run`](crate::run)'s common rules (no empty input, a pure op).
pub type Launch = fn(
    &'static Gpu,
    &'static OpDef,
    &Attrs<'_>,
    &[&DeviceTensor],
    &[TensorMetadata],
) -> Result<Option<Outputs>>;

/// The input dtypes a GPU kernel accepts.
#[derive(Clone, Copy, Debug)]
pub enum Accepts {
    /// Every input is f32 (and, where the launch requires, the output too).
    AllF32,
    /// Exactly these input dtypes, in order.
    Exactly(&'static [DType]),
    /// A rule over the input dtypes (for "any 4-byte dtype", etc.).
    Rule(fn(&[DType]) -> bool),
}

impl Accepts {
    /// Whether a kernel of these accepted dtypes takes inputs of `dtypes`.
    pub fn matches(&self, dtypes: &[DType]) -> bool {
        match self {
            Accepts::AllF32 => dtypes.iter().all(|&d| d == DType::F32),
            Accepts::Exactly(list) => *list == dtypes,
            Accepts::Rule(rule) => rule(dtypes),
        }
    }
}

/// One GPU kernel: the op it runs, the dtypes it takes, its launch.
#[derive(Clone, Copy)]
pub struct GpuKernel {
    /// The op the kernel runs.
    pub op: &'static OpDef,
    /// The input dtypes it takes.
    pub accepts: Accepts,
    /// Runs it.
    pub launch: Launch,
}

impl fmt::Debug for GpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuKernel")
            .field("op", &self.op.name)
            .field("accepts", &self.accepts)
            .finish_non_exhaustive()
    }
}

/// An entry of the table (for the families' `register` functions).
pub(crate) fn kernel(op: &'static OpDef, accepts: Accepts, launch: Launch) -> GpuKernel {
    GpuKernel {
        op,
        accepts,
        launch,
    }
}

/// Every GPU kernel of this crate, built once. Several entries may name
/// one op with different `accepts`; lookups take the first that matches.
pub fn kernels() -> &'static [GpuKernel] {
    static TABLE: OnceLock<Vec<GpuKernel>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = Vec::new();
        crate::kernels::register(&mut table);
        crate::conv::register(&mut table);
        crate::transformer::register(&mut table);
        crate::indexing::register(&mut table);
        crate::random::register(&mut table);
        crate::sort::register(&mut table);
        table
    })
}

/// The address of an op's one definition: its key in the table.
fn key(op: &OpDef) -> usize {
    op as *const OpDef as usize
}

/// The kernel for `op` at `dtypes`, if the GPU has one (a hash map from
/// the op's address to its entries, built once).
pub fn lookup(op: &OpDef, dtypes: &[DType]) -> Option<&'static GpuKernel> {
    static BY_OP: OnceLock<HashMap<usize, Vec<&'static GpuKernel>>> = OnceLock::new();
    let by_op = BY_OP.get_or_init(|| {
        let mut by_op: HashMap<usize, Vec<&'static GpuKernel>> = HashMap::new();
        for entry in kernels() {
            by_op.entry(key(entry.op)).or_default().push(entry);
        }
        by_op
    });
    by_op
        .get(&key(op))?
        .iter()
        .copied()
        .find(|entry| entry.accepts.matches(dtypes))
}

/// Rules shared by several families' entries.
pub(crate) mod rules {
    use stagecraft_tensor::DType;

    /// Any dtypes at all.
    pub(crate) fn any(_: &[DType]) -> bool {
        true
    }

    /// Elements a kernel moves as one or two 32-bit words.
    pub(crate) fn words(dtype: DType) -> bool {
        matches!(dtype.size_in_bytes(), 4 | 8)
    }

    /// One input of 4 or 8 bytes (the strided copies).
    pub(crate) fn one_of_words(dtypes: &[DType]) -> bool {
        matches!(dtypes, [x] if words(*x))
    }

    /// Indices the indexing kernels read: i32, or i64 by its low word.
    pub(crate) fn index(dtype: DType) -> bool {
        matches!(dtype, DType::I32 | DType::I64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shader::Element;
    use stagecraft_ops::{defs, OpKind};
    use DType::{F32, I32};

    /// The dtypes the tests try against rules: every dtype, alone and in
    /// pairs and triples (List included).
    fn samples() -> Vec<Vec<DType>> {
        let mut all: Vec<DType> = DType::ALL.to_vec();
        all.push(DType::List);
        let mut out = vec![Vec::new()];
        for &a in &all {
            out.push(vec![a]);
            for &b in &all {
                out.push(vec![a, b]);
                for &c in &all {
                    out.push(vec![a, b, c]);
                }
            }
        }
        out
    }

    /// No `Exactly` list of an op is also taken by another of its entries
    /// (another `Exactly`, all-f32 or a rule): which entry runs never
    /// depends on the table's order.
    #[test]
    fn no_two_entries_of_an_op_overlap_on_an_exact_list() {
        let table = kernels();
        for (i, a) in table.iter().enumerate() {
            let Accepts::Exactly(list) = a.accepts else {
                continue;
            };
            for (j, b) in table.iter().enumerate() {
                if i != j && std::ptr::eq(a.op, b.op) {
                    assert!(
                        !b.accepts.matches(list),
                        "{a:?} and {b:?} both take {list:?}"
                    );
                }
            }
        }
        // And all-f32 entries never share an op with a rule that takes
        // f32s (sampled up to three inputs).
        for a in table
            .iter()
            .filter(|k| matches!(k.accepts, Accepts::AllF32))
        {
            for b in table.iter().filter(|b| std::ptr::eq(a.op, b.op)) {
                if let Accepts::Rule(rule) = b.accepts {
                    for n in 0..4 {
                        assert!(!rule(&vec![F32; n]), "{a:?} and {b:?} both take {n} f32s");
                    }
                }
            }
            let all_f32 = table
                .iter()
                .filter(|b| std::ptr::eq(a.op, b.op))
                .filter(|b| matches!(b.accepts, Accepts::AllF32))
                .count();
            assert_eq!(all_f32, 1, "{a:?} is listed more than once");
        }
    }

    #[test]
    fn every_elementwise_op_with_wgsl_runs_on_f32() {
        let mut covered = 0;
        for &op in stagecraft_ops::all_ops() {
            let float = |c| Element::of(c) == Element::F32;
            let (wgsl, arity) = match op.kind {
                OpKind::Unary(u) => (u.wgsl().is_some() && float(u.class()), 1),
                OpKind::Binary(b) => (b.wgsl().is_some() && float(b.class()), 2),
                _ => continue,
            };
            let found = lookup(op, &vec![F32; arity]);
            assert_eq!(found.is_some(), wgsl, "{}", op.name);
            if let Some(kernel) = found {
                assert!(matches!(kernel.accepts, Accepts::AllF32), "{kernel:?}");
                covered += 1;
            }
        }
        assert!(covered > 10, "only {covered} elementwise ops on the GPU");
        // Integer and bool ops run on their own dtypes.
        let dtype_of = |class| match Element::of(class) {
            Element::F32 => F32,
            Element::I32 => I32,
            Element::PackedBool => DType::Bool,
        };
        for op in stagecraft_ops::UnaryOp::ALL
            .iter()
            .filter(|o| o.wgsl().is_some())
        {
            let dtype = dtype_of(op.class());
            assert!(lookup(op.def(), &[dtype]).is_some(), "{:?}", op);
        }
        for op in stagecraft_ops::BinaryOp::ALL
            .iter()
            .filter(|o| o.wgsl().is_some())
        {
            let dtype = dtype_of(op.class());
            assert!(lookup(op.def(), &[dtype, dtype]).is_some(), "{:?}", op);
        }
    }

    #[test]
    fn lookups_follow_the_dtypes() {
        assert!(lookup(&defs::MATMUL, &[F32, F32]).is_some());
        assert!(lookup(&defs::MATMUL, &[I32, I32]).is_none());
        assert!(lookup(&defs::CROSS_ENTROPY, &[F32, I32]).is_some());
        assert!(lookup(&defs::CROSS_ENTROPY, &[F32, F32]).is_none());
        assert!(lookup(&defs::CROSS_ENTROPY_GRAD, &[F32, I32, F32, F32]).is_some());
        assert!(lookup(&defs::EQUAL, &[F32, F32]).is_some());
        assert!(lookup(&defs::EQUAL, &[I32, I32]).is_some());
        assert!(lookup(&defs::EQUAL, &[DType::I64, DType::I64]).is_none());
        assert!(lookup(&defs::ADD, &[I32, I32]).is_some());
        assert!(lookup(&defs::NEG, &[I32]).is_some());
        // Every numeric op over i32 (Div's launch checks its divisors),
        // and the shifts.
        assert!(lookup(&defs::DIV, &[I32, I32]).is_some());
        assert!(lookup(&defs::SIGN, &[I32]).is_some());
        assert!(lookup(&defs::ROUND, &[I32]).is_some());
        assert!(lookup(&defs::SHIFT_RIGHT, &[I32, I32]).is_some());
        assert!(lookup(&defs::SHIFT_RIGHT, &[DType::I64, DType::I64]).is_none());
        assert!(lookup(&defs::SUM, &[F32]).is_some());
        assert!(lookup(&defs::SUM, &[I32]).is_some());
        assert!(lookup(&defs::MEAN, &[I32]).is_none());
        assert!(lookup(&defs::EMBEDDING, &[F32, I32]).is_some());
        assert!(lookup(&defs::EMBEDDING, &[F32, DType::I64]).is_some());
        assert!(lookup(&defs::EMBEDDING, &[F32, F32]).is_none());
        assert!(lookup(&defs::SELECT, &[DType::Bool, I32, I32]).is_some());
        assert!(lookup(&defs::SELECT, &[DType::Bool, DType::F64, DType::F64]).is_none());
        assert!(lookup(&defs::FILL, &[]).is_some());
        assert!(lookup(&defs::CAST, &[DType::Bool]).is_some());
        assert!(lookup(&defs::CAST, &[DType::F64]).is_none());
        assert!(lookup(&defs::RESHAPE, &[DType::U8]).is_some());
        assert!(lookup(&defs::GATHER, &[DType::F64, DType::I64]).is_some());
        assert!(lookup(&defs::GATHER, &[DType::U8, I32]).is_none());
        assert!(lookup(&defs::ARGMAX, &[I32]).is_some());
        assert!(lookup(&defs::ARGMAX, &[DType::I64]).is_none());
        assert!(lookup(&defs::TRILU, &[DType::Bool]).is_some());
        assert!(lookup(&defs::CONV2D, &[F32, F32]).is_some());
        assert!(lookup(&defs::RMS_NORM, &[DType::F64]).is_none());
        assert!(lookup(&defs::DROPOUT, &[F32, DType::I64]).is_some());
        assert!(lookup(&defs::DROPOUT, &[DType::F64, DType::I64]).is_none());
        // An op no kernel runs.
        assert!(lookup(&defs::PRINT, &[F32]).is_none());
    }

    /// Rules answer for any dtypes without panicking, and a lookup finds
    /// an entry of the op asked about.
    #[test]
    fn rules_take_any_dtypes() {
        let samples = samples();
        for entry in kernels() {
            for dtypes in &samples {
                let found = entry.accepts.matches(dtypes);
                if let (true, Some(k)) = (found, lookup(entry.op, dtypes)) {
                    assert!(std::ptr::eq(k.op, entry.op), "{entry:?}");
                }
            }
        }
        let text = format!("{:?}", lookup(&defs::MATMUL, &[F32, F32]).unwrap());
        assert!(text.contains("MatMul") && text.contains("AllF32"), "{text}");
    }
}
