//! Op attributes: an inline map for the common case, and a frozen,
//! reference-counted form for asynchronous execution.
//!
//! Up to six entries and 128 bytes of values live inline, so building the
//! attributes of a typical op allocates nothing; larger sets spill to the heap.

use crate::func::FuncId;
use smallvec::SmallVec;
use stagecraft_tensor::{DType, Scalar};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

/// The type of an attribute value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttrKind {
    /// `bool`.
    Bool,
    /// `i64`.
    Int,
    /// `f64`.
    Float,
    /// A [`DType`].
    DType,
    /// A [`Scalar`] of any dtype.
    Scalar,
    /// A list of `i64`.
    Ints,
    /// A list of `f64`.
    Floats,
    /// A UTF-8 string.
    Str,
    /// A function of the function library (the branches of `If`, the
    /// condition and body of `While`).
    Func,
}

impl AttrKind {
    /// The name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            AttrKind::Bool => "bool",
            AttrKind::Int => "int",
            AttrKind::Float => "float",
            AttrKind::DType => "dtype",
            AttrKind::Scalar => "scalar",
            AttrKind::Ints => "int list",
            AttrKind::Floats => "float list",
            AttrKind::Str => "string",
            AttrKind::Func => "function",
        }
    }
}

/// A borrowed attribute value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttrValue<'a> {
    /// A bool.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A dtype.
    DType(DType),
    /// A scalar of any dtype.
    Scalar(Scalar),
    /// A list of integers.
    Ints(&'a [i64]),
    /// A list of floats.
    Floats(&'a [f64]),
    /// A string.
    Str(&'a str),
    /// A function of the library.
    Func(FuncId),
}

impl AttrValue<'_> {
    /// The type of the value.
    pub fn kind(&self) -> AttrKind {
        match self {
            AttrValue::Bool(_) => AttrKind::Bool,
            AttrValue::Int(_) => AttrKind::Int,
            AttrValue::Float(_) => AttrKind::Float,
            AttrValue::DType(_) => AttrKind::DType,
            AttrValue::Scalar(_) => AttrKind::Scalar,
            AttrValue::Ints(_) => AttrKind::Ints,
            AttrValue::Floats(_) => AttrKind::Floats,
            AttrValue::Str(_) => AttrKind::Str,
            AttrValue::Func(_) => AttrKind::Func,
        }
    }
}

impl fmt::Display for AttrValue<'_> {
    /// The text form used in traces: `2.0`, `[0, 1]`, `f32`, `"name"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn list<T: fmt::Debug>(f: &mut fmt::Formatter<'_>, xs: &[T]) -> fmt::Result {
            f.write_str("[")?;
            for (i, x) in xs.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{x:?}")?;
            }
            f.write_str("]")
        }
        match self {
            AttrValue::Bool(v) => write!(f, "{v}"),
            AttrValue::Int(v) => write!(f, "{v}"),
            AttrValue::Float(v) => write!(f, "{v:?}"),
            AttrValue::DType(v) => write!(f, "{v}"),
            AttrValue::Scalar(v) => write!(f, "{v}:{}", v.dtype()),
            AttrValue::Ints(v) => list(f, v),
            AttrValue::Floats(v) => list(f, v),
            AttrValue::Str(v) => write!(f, "{v:?}"),
            AttrValue::Func(v) => write!(f, "@{}", crate::func::function_name(*v)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Entry {
    name: &'static str,
    kind: AttrKind,
    /// First word of the value in `words`.
    offset: u16,
    /// Elements for lists, bytes for strings, words otherwise.
    len: u16,
}

/// A name → value map of op attributes, stored inline for up to six entries
/// and 128 bytes of values.
///
/// Names are `&'static str` because they are the attribute names an op
/// declares; setting a name twice replaces the value.
#[derive(Clone, Default)]
pub struct OpAttrs {
    entries: SmallVec<[Entry; 6]>,
    words: SmallVec<[u64; 16]>,
}

impl OpAttrs {
    /// An empty attribute map.
    pub fn new() -> OpAttrs {
        OpAttrs::default()
    }

    /// The number of attributes set.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no attribute is set.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when the values spilled out of the inline buffers.
    pub fn spilled(&self) -> bool {
        self.entries.spilled() || self.words.spilled()
    }

    fn push(&mut self, name: &'static str, kind: AttrKind, len: usize, words: &[u64]) {
        self.remove(name);
        let offset = u16::try_from(self.words.len()).expect("attribute storage exceeds 64K words");
        let len = u16::try_from(len).expect("attribute list longer than 64K");
        self.words.extend_from_slice(words);
        self.entries.push(Entry {
            name,
            kind,
            offset,
            len,
        });
    }

    fn remove(&mut self, name: &str) {
        // Values of a replaced entry stay in `words`; replacing is rare and
        // the waste is bounded by what the caller wrote.
        self.entries.retain(|e| e.name != name);
    }

    /// Sets a bool attribute.
    pub fn set_bool(&mut self, name: &'static str, value: bool) -> &mut Self {
        self.push(name, AttrKind::Bool, 1, &[value as u64]);
        self
    }

    /// Sets an integer attribute.
    pub fn set_int(&mut self, name: &'static str, value: i64) -> &mut Self {
        self.push(name, AttrKind::Int, 1, &[value as u64]);
        self
    }

    /// Sets a float attribute.
    pub fn set_float(&mut self, name: &'static str, value: f64) -> &mut Self {
        self.push(name, AttrKind::Float, 1, &[value.to_bits()]);
        self
    }

    /// Sets a dtype attribute.
    pub fn set_dtype(&mut self, name: &'static str, value: DType) -> &mut Self {
        self.push(name, AttrKind::DType, 1, &[value as u8 as u64]);
        self
    }

    /// Sets a scalar attribute (value and dtype).
    pub fn set_scalar(&mut self, name: &'static str, value: Scalar) -> &mut Self {
        self.push(
            name,
            AttrKind::Scalar,
            2,
            &[value.dtype() as u8 as u64, value.to_bits()],
        );
        self
    }

    /// Sets an integer-list attribute.
    pub fn set_ints(&mut self, name: &'static str, values: &[i64]) -> &mut Self {
        let words: SmallVec<[u64; 8]> = values.iter().map(|&v| v as u64).collect();
        self.push(name, AttrKind::Ints, values.len(), &words);
        self
    }

    /// Sets an integer-list attribute from dimensions.
    pub fn set_dims(&mut self, name: &'static str, values: &[usize]) -> &mut Self {
        let words: SmallVec<[u64; 8]> = values.iter().map(|&v| v as u64).collect();
        self.push(name, AttrKind::Ints, values.len(), &words);
        self
    }

    /// Sets a float-list attribute.
    pub fn set_floats(&mut self, name: &'static str, values: &[f64]) -> &mut Self {
        let words: SmallVec<[u64; 8]> = values.iter().map(|v| v.to_bits()).collect();
        self.push(name, AttrKind::Floats, values.len(), &words);
        self
    }

    /// Sets a function attribute.
    pub fn set_func(&mut self, name: &'static str, value: FuncId) -> &mut Self {
        self.push(name, AttrKind::Func, 1, &[value.0 as u64]);
        self
    }

    /// Sets a string attribute.
    pub fn set_str(&mut self, name: &'static str, value: &str) -> &mut Self {
        let mut words: SmallVec<[u64; 8]> = SmallVec::new();
        le_words(value.as_bytes(), |word| words.push(word));
        self.push(name, AttrKind::Str, value.len(), &words);
        self
    }

    /// Sets an attribute from a borrowed value of any kind.
    pub fn set(&mut self, name: &'static str, value: AttrValue<'_>) -> &mut Self {
        match value {
            AttrValue::Bool(v) => self.set_bool(name, v),
            AttrValue::Int(v) => self.set_int(name, v),
            AttrValue::Float(v) => self.set_float(name, v),
            AttrValue::DType(v) => self.set_dtype(name, v),
            AttrValue::Scalar(v) => self.set_scalar(name, v),
            AttrValue::Ints(v) => self.set_ints(name, v),
            AttrValue::Floats(v) => self.set_floats(name, v),
            AttrValue::Str(v) => self.set_str(name, v),
            AttrValue::Func(v) => self.set_func(name, v),
        }
    }

    fn value_of(&self, e: &Entry) -> AttrValue<'_> {
        let start = e.offset as usize;
        // Empty lists and strings own no words.
        let word = self.words.get(start).copied().unwrap_or(0);
        match e.kind {
            AttrKind::Bool => AttrValue::Bool(word != 0),
            AttrKind::Int => AttrValue::Int(word as i64),
            AttrKind::Float => AttrValue::Float(f64::from_bits(word)),
            AttrKind::DType => AttrValue::DType(DType::ALL[word as usize]),
            AttrKind::Func => AttrValue::Func(FuncId(word as u32)),
            AttrKind::Scalar => AttrValue::Scalar(Scalar::from_bits(
                DType::ALL[word as usize],
                self.words[start + 1],
            )),
            AttrKind::Ints => {
                let words = &self.words[start..start + e.len as usize];
                // SAFETY: u64 and i64 have the same size, alignment and
                // every bit pattern is valid for both.
                AttrValue::Ints(unsafe {
                    std::slice::from_raw_parts(words.as_ptr() as *const i64, words.len())
                })
            }
            AttrKind::Floats => {
                let words = &self.words[start..start + e.len as usize];
                // SAFETY: u64 and f64 have the same size and alignment, and
                // every bit pattern is a valid f64.
                AttrValue::Floats(unsafe {
                    std::slice::from_raw_parts(words.as_ptr() as *const f64, words.len())
                })
            }
            AttrKind::Str => {
                let n_words = (e.len as usize).div_ceil(8);
                let words = &self.words[start..start + n_words];
                // SAFETY: a u64 slice is readable as bytes (u8 has alignment
                // 1 and no invalid bit patterns); we read `len` of them.
                let bytes = unsafe {
                    std::slice::from_raw_parts(words.as_ptr() as *const u8, e.len as usize)
                };
                // The bytes were copied from a `&str` in `set_str` on a
                // little-endian word layout, so they are valid UTF-8.
                AttrValue::Str(std::str::from_utf8(bytes).unwrap_or(""))
            }
        }
    }

    /// The value of attribute `name`, if set.
    pub fn get(&self, name: &str) -> Option<AttrValue<'_>> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| self.value_of(e))
    }

    /// All attributes, in the order they were set.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, AttrValue<'_>)> + '_ {
        self.entries.iter().map(|e| (e.name, self.value_of(e)))
    }

    /// A reference-counted, immutable copy that can outlive this map
    /// (needed when a kernel runs asynchronously).
    pub fn freeze(&self) -> FrozenOpAttrs {
        FrozenOpAttrs((!self.is_empty()).then(|| Arc::new(self.clone())))
    }
}

impl PartialEq for OpAttrs {
    fn eq(&self, other: &OpAttrs) -> bool {
        // Maps built by the same code are laid out alike: equal entries and
        // words are equal maps (floats compared by bits, as below).
        let same_layout = |a: &Entry, b: &Entry| {
            std::ptr::eq(a.name, b.name) && (a.kind, a.offset, a.len) == (b.kind, b.offset, b.len)
        };
        if self.words == other.words
            && self.len() == other.len()
            && self
                .entries
                .iter()
                .zip(&other.entries)
                .all(|(a, b)| same_layout(a, b))
        {
            return true;
        }
        self.len() == other.len()
            && self.iter().all(|(name, v)| match other.get(name) {
                // Compare floats by bits so that NaN attributes are equal to
                // themselves (a cache key must be reflexive).
                Some(w) => attr_bits_eq(&v, &w),
                None => false,
            })
    }
}

impl Eq for OpAttrs {}

fn attr_bits_eq(a: &AttrValue<'_>, b: &AttrValue<'_>) -> bool {
    match (a, b) {
        (AttrValue::Float(x), AttrValue::Float(y)) => x.to_bits() == y.to_bits(),
        (AttrValue::Floats(x), AttrValue::Floats(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|(p, q)| p.to_bits() == q.to_bits())
        }
        (AttrValue::Scalar(x), AttrValue::Scalar(y)) => {
            x.dtype() == y.dtype() && x.to_bits() == y.to_bits()
        }
        _ => a == b,
    }
}

impl Hash for OpAttrs {
    /// Order-independent, so that equal maps hash equally however they were
    /// built. Each entry is mixed by [`EntryHash`], not SipHash: the hash
    /// only keys in-process caches, which compare the maps on a hit, and an
    /// op's kernel lookup hashes its attributes on every call.
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut acc = 0u64;
        for e in &self.entries {
            let mut h = EntryHash(e.kind as u64);
            h.bytes(e.name.as_bytes());
            let start = e.offset as usize;
            let n_words = match e.kind {
                AttrKind::Str => (e.len as usize).div_ceil(8),
                AttrKind::Ints | AttrKind::Floats => e.len as usize,
                AttrKind::Scalar => 2,
                _ => 1,
            };
            for &word in &self.words[start..start + n_words] {
                h.word(word);
            }
            h.word(e.len as u64);
            acc = acc.wrapping_add(h.finish());
        }
        state.write_u64(acc);
        state.write_usize(self.entries.len());
    }
}

/// `bytes` as little-endian words, the last one padded with zeros. The
/// tail is gathered byte by byte: a `copy_from_slice` of a length known
/// only at run time is a call to `memcpy`, which cost more than the rest
/// of hashing an attribute's name.
fn le_words(bytes: &[u8], mut each: impl FnMut(u64)) {
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        each(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        each(
            tail.iter()
                .rev()
                .fold(0u64, |word, &byte| (word << 8) | u64::from(byte)),
        );
    }
}

/// A multiply-rotate mix of one attribute's words (as FxHash), finished
/// with a 64-bit avalanche so that the entries' sum stays well spread.
struct EntryHash(u64);

impl EntryHash {
    fn word(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn bytes(&mut self, bytes: &[u8]) {
        le_words(bytes, |word| self.word(word));
        self.word(bytes.len() as u64);
    }

    fn finish(self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x
    }
}

impl fmt::Display for OpAttrs {
    /// `name: value, name: value`, the form used inside `Op[...]` in traces.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, value)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}: {value}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for OpAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{{self}}}")
    }
}

/// An immutable, reference-counted attribute map; cloning is one atomic
/// increment. The empty map (most elementwise ops) is held by no pointer:
/// freezing, cloning and dropping it touch no shared counter, which every
/// thread recording or scheduling such ops would otherwise contend on.
#[derive(Clone, Debug)]
pub struct FrozenOpAttrs(Option<Arc<OpAttrs>>);

impl Deref for FrozenOpAttrs {
    type Target = OpAttrs;
    fn deref(&self) -> &OpAttrs {
        static EMPTY: OnceLock<OpAttrs> = OnceLock::new();
        match &self.0 {
            Some(attrs) => attrs,
            None => EMPTY.get_or_init(OpAttrs::new),
        }
    }
}

impl PartialEq for FrozenOpAttrs {
    fn eq(&self, other: &FrozenOpAttrs) -> bool {
        **self == **other
    }
}

impl Eq for FrozenOpAttrs {}

impl Hash for FrozenOpAttrs {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (**self).hash(state)
    }
}

/// Either a borrowed [`OpAttrs`] (synchronous execution, no allocation) or a
/// [`FrozenOpAttrs`] that lives as long as it is needed.
#[derive(Clone, Debug)]
pub enum OpAttrsRef<'a> {
    /// Borrowed from the caller's stack.
    Borrowed(&'a OpAttrs),
    /// Shared, heap-allocated and immutable.
    Frozen(FrozenOpAttrs),
}

impl OpAttrsRef<'_> {
    /// Extends the lifetime: copies a borrowed map once to the heap, or
    /// shares an already frozen one.
    pub fn freeze(&self) -> FrozenOpAttrs {
        match self {
            OpAttrsRef::Borrowed(attrs) => attrs.freeze(),
            OpAttrsRef::Frozen(frozen) => frozen.clone(),
        }
    }
}

impl Deref for OpAttrsRef<'_> {
    type Target = OpAttrs;
    fn deref(&self) -> &OpAttrs {
        match self {
            OpAttrsRef::Borrowed(attrs) => attrs,
            OpAttrsRef::Frozen(frozen) => frozen,
        }
    }
}

impl<'a> From<&'a OpAttrs> for OpAttrsRef<'a> {
    fn from(attrs: &'a OpAttrs) -> OpAttrsRef<'a> {
        OpAttrsRef::Borrowed(attrs)
    }
}

impl From<FrozenOpAttrs> for OpAttrsRef<'_> {
    fn from(attrs: FrozenOpAttrs) -> Self {
        OpAttrsRef::Frozen(attrs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;

    fn hash_of<T: Hash + ?Sized>(a: &T) -> u64 {
        let mut h = DefaultHasher::new();
        a.hash(&mut h);
        h.finish()
    }

    #[test]
    fn typical_attributes_stay_inline() {
        let mut a = OpAttrs::new();
        a.set_float("f32_attr", 2.0)
            .set_ints("array_attr", &[2, 3, 4])
            .set_str("str_attr", "str")
            .set_bool("keepdim", true)
            .set_dtype("dtype", DType::F16)
            .set_scalar("value", Scalar::I32(-3));
        assert!(!a.spilled());
        assert!(std::mem::size_of::<OpAttrs>() <= 6 * 24 + 128 + 32);
        assert_eq!(a.get("f32_attr"), Some(AttrValue::Float(2.0)));
        assert_eq!(a.get("array_attr"), Some(AttrValue::Ints(&[2, 3, 4])));
        assert_eq!(a.get("str_attr"), Some(AttrValue::Str("str")));
        assert_eq!(a.get("keepdim"), Some(AttrValue::Bool(true)));
        assert_eq!(a.get("dtype"), Some(AttrValue::DType(DType::F16)));
        assert_eq!(a.get("value"), Some(AttrValue::Scalar(Scalar::I32(-3))));
        assert_eq!(a.get("missing"), None);
    }

    #[test]
    fn empty_lists_and_strings() {
        let mut a = OpAttrs::new();
        a.set_ints("axes", &[])
            .set_str("label", "")
            .set_floats("f", &[]);
        assert_eq!(a.get("axes"), Some(AttrValue::Ints(&[])));
        assert_eq!(a.get("label"), Some(AttrValue::Str("")));
        assert_eq!(a.get("f"), Some(AttrValue::Floats(&[])));
        assert_eq!(a.iter().count(), 3);
    }

    #[test]
    fn large_sets_spill_and_still_work() {
        let mut a = OpAttrs::new();
        let long: Vec<i64> = (0..40).collect();
        a.set_ints("long", &long)
            .set_str("s", "a string longer than eight bytes");
        assert!(a.spilled());
        assert_eq!(a.get("long"), Some(AttrValue::Ints(&long)));
        assert_eq!(
            a.get("s"),
            Some(AttrValue::Str("a string longer than eight bytes"))
        );
    }

    #[test]
    fn equality_and_hash_ignore_insertion_order_and_replacement() {
        let mut a = OpAttrs::new();
        a.set_int("axis", 1).set_bool("keepdim", false);
        let mut b = OpAttrs::new();
        b.set_bool("keepdim", true)
            .set_int("axis", 1)
            .set_bool("keepdim", false);
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        b.set_int("axis", 2);
        assert_ne!(a, b);
        let mut n = OpAttrs::new();
        n.set_float("x", f64::NAN);
        assert_eq!(n, n.clone());
        // Laid out alike, with another value.
        let mut e = OpAttrs::new();
        e.set_int("axis", 1).set_bool("keepdim", true);
        assert_ne!(a, e);
        // The same words, of another length.
        let (mut short, mut long) = (OpAttrs::new(), OpAttrs::new());
        short.set_str("s", "a");
        long.set_str("s", "a\0");
        assert_ne!(short, long);
        assert_ne!(hash_of(&short), hash_of(&long));
    }

    /// Strings are stored, and names hashed, as little-endian words padded
    /// with zeros: every length from empty to past two words round-trips,
    /// and the words are the padded bytes read in order.
    #[test]
    fn strings_become_zero_padded_little_endian_words() {
        let text = "abcdefghijklmnopqrstu";
        for len in 0..=text.len() {
            let s = &text[..len];
            let mut words = Vec::new();
            le_words(s.as_bytes(), |w| words.push(w));
            let mut padded = s.as_bytes().to_vec();
            padded.resize(len.div_ceil(8) * 8, 0);
            let want: Vec<u64> = padded
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(words, want, "{s:?}");
            let mut a = OpAttrs::new();
            a.set_str("label", s);
            assert_eq!(a.get("label"), Some(AttrValue::Str(s)));
        }
    }

    #[test]
    fn freeze_shares_and_borrowed_copies() {
        let mut a = OpAttrs::new();
        a.set_int("k", 7);
        let r = OpAttrsRef::from(&a);
        let frozen = r.freeze();
        assert_eq!(frozen.get("k"), Some(AttrValue::Int(7)));
        let again = OpAttrsRef::from(frozen.clone()).freeze();
        assert!(Arc::ptr_eq(
            frozen.0.as_ref().unwrap(),
            again.0.as_ref().unwrap()
        ));
        assert_eq!(format!("{a}"), "k: 7");
        // The empty map is held by no pointer, and equals (and hashes as)
        // any other empty map.
        let empty = OpAttrs::new().freeze();
        assert!(empty.0.is_none() && empty.is_empty());
        let mut emptied = OpAttrs::new();
        emptied.set_int("k", 1);
        emptied.entries.clear();
        let emptied = FrozenOpAttrs(Some(Arc::new(emptied)));
        assert_eq!(empty, emptied);
        assert_eq!(hash_of(&empty), hash_of(&emptied));
    }
}
