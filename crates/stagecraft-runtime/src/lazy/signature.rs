//! Op signatures: every distinct (op, attributes, output dtypes and
//! shapes) that a recording uses gets a number once, when it is recorded.
//! A trace's cache key can then be a flat list of numbers (signatures,
//! wiring, argument metadata) that a step writes, hashes and compares word
//! by word, instead of a tree of attribute maps and shapes rebuilt,
//! hashed and compared in full on every step (see `collect::Structure`).
//!
//! Numbers are process-wide, so two threads recording the same step share
//! its cache entry. Each thread keeps a front table of the signatures it
//! has seen; only a signature new to the thread takes the process-wide
//! lock.

use smallvec::SmallVec;
use stagecraft_ops::{FrozenOpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{FxBuild, FxHasher};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// What a signature number stands for.
#[derive(Clone)]
struct Signature {
    def: usize,
    attrs: FrozenOpAttrs,
    outputs: OutputMetas,
}

impl Signature {
    fn is(&self, def: usize, attrs: &FrozenOpAttrs, outputs: &OutputMetas) -> bool {
        self.def == def && self.attrs == *attrs && self.outputs == *outputs
    }
}

/// Signatures by hash; the few under one hash are told apart in full.
type Table = HashMap<u64, SmallVec<[(Signature, u32); 1]>, FxBuild>;

/// Every signature numbered so far, with the next number.
static NUMBERED: Mutex<Option<(Table, u32)>> = Mutex::new(None);

thread_local! {
    static SEEN: RefCell<Table> = RefCell::new(Table::default());
}

fn find(
    table: &Table,
    hash: u64,
    def: usize,
    attrs: &FrozenOpAttrs,
    outputs: &OutputMetas,
) -> Option<u32> {
    table
        .get(&hash)?
        .iter()
        .find(|(s, _)| s.is(def, attrs, outputs))
        .map(|(_, n)| *n)
}

/// The number of `def` with `attrs` producing `outputs`: equal numbers
/// mean equal ops, attributes and output metadata.
pub(super) fn signature(def: &'static OpDef, attrs: &FrozenOpAttrs, outputs: &OutputMetas) -> u32 {
    let def = def as *const OpDef as usize;
    let mut h = FxHasher::default();
    def.hash(&mut h);
    attrs.hash(&mut h);
    outputs.hash(&mut h);
    let hash = h.finish();
    SEEN.with(|seen| {
        if let Some(n) = find(&seen.borrow(), hash, def, attrs, outputs) {
            return n;
        }
        let entry = Signature {
            def,
            attrs: attrs.clone(),
            outputs: outputs.clone(),
        };
        let n = {
            let mut numbered = NUMBERED.lock().unwrap_or_else(|p| p.into_inner());
            let (table, next) = numbered.get_or_insert_with(|| (Table::default(), 0));
            match find(table, hash, def, attrs, outputs) {
                Some(n) => n,
                None => {
                    let n = *next;
                    *next = next.checked_add(1).expect("fewer than 2^32 op signatures");
                    table.entry(hash).or_default().push((entry.clone(), n));
                    n
                }
            }
        };
        seen.borrow_mut().entry(hash).or_default().push((entry, n));
        n
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::{DType, TensorMetadata};

    fn metas(dims: &[usize]) -> OutputMetas {
        smallvec::smallvec![TensorMetadata::new(DType::F32, dims.to_vec())]
    }

    fn axis(a: i64) -> FrozenOpAttrs {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", a);
        attrs.freeze()
    }

    #[test]
    fn equal_signatures_get_one_number_on_every_thread() {
        let none = OpAttrs::new().freeze();
        let add = signature(&stagecraft_ops::ADD, &none, &metas(&[3]));
        assert_eq!(add, signature(&stagecraft_ops::ADD, &none, &metas(&[3])));
        assert_ne!(add, signature(&stagecraft_ops::MUL, &none, &metas(&[3])));
        assert_ne!(add, signature(&stagecraft_ops::ADD, &none, &metas(&[4])));
        let sum = signature(&stagecraft_ops::SUM, &axis(0), &metas(&[3]));
        assert_ne!(sum, signature(&stagecraft_ops::SUM, &axis(1), &metas(&[3])));
        // A fresh thread sees none of this thread's front table, and still
        // gets the same numbers.
        let theirs = std::thread::spawn(move || {
            let none = OpAttrs::new().freeze();
            (
                signature(&stagecraft_ops::ADD, &none, &metas(&[3])),
                signature(&stagecraft_ops::SUM, &axis(0), &metas(&[3])),
            )
        })
        .join()
        .unwrap();
        assert_eq!(theirs, (add, sum));
    }
}
