//! Element types: the runtime [`DType`] tag, the compile-time [`Element`]
//! trait that ties a Rust type to its tag, and [`Scalar`] values.

use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor, known at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// `bool`, stored as one byte holding 0 or 1.
    Bool,
    /// 8-bit unsigned integer (images, quantized data).
    U8,
    /// 8-bit signed integer.
    I8,
    /// 16-bit unsigned integer.
    U16,
    /// 16-bit signed integer.
    I16,
    /// 32-bit unsigned integer.
    U32,
    /// 32-bit signed integer.
    I32,
    /// 64-bit unsigned integer.
    U64,
    /// 64-bit signed integer.
    I64,
    /// IEEE half precision (storage and casts; arithmetic runs in f32).
    F16,
    /// bfloat16 (storage and casts; arithmetic runs in f32).
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// A list of tensors, always of rank 0 (the stacks in which a While's
    /// gradient keeps per-iteration values). Only the list ops accept it;
    /// it has no [`Element`] type, so typed code never sees one.
    List,
}

impl DType {
    /// Every dtype but [`DType::List`], in declaration order (so a dtype's
    /// discriminant is its index here): bool, the integers by width, the
    /// floats by width.
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
            // A list owns its items; a list tensor itself holds no elements.
            DType::List => 0,
        }
    }

    /// True for the floating-point dtypes.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// True for the integer dtypes.
    pub const fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8
                | DType::I8
                | DType::U16
                | DType::I16
                | DType::U32
                | DType::I32
                | DType::U64
                | DType::I64
        )
    }

    /// True for the unsigned integer dtypes.
    pub const fn is_unsigned(self) -> bool {
        matches!(self, DType::U8 | DType::U16 | DType::U32 | DType::U64)
    }

    /// True for the dtypes that index tensors (i32, i64).
    pub const fn is_index(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// True for numbers (everything but bool and list).
    pub const fn is_numeric(self) -> bool {
        !matches!(self, DType::Bool | DType::List)
    }

    /// The short name used in messages and in the text form of traces.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::List => "list",
        }
    }

    /// Parses a short name such as `"f32"`.
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .chain([DType::List])
            .find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A single value of any dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// A bool value.
    Bool(bool),
    /// A u8 value.
    U8(u8),
    /// An i8 value.
    I8(i8),
    /// A u16 value.
    U16(u16),
    /// An i16 value.
    I16(i16),
    /// A u32 value.
    U32(u32),
    /// An i32 value.
    I32(i32),
    /// A u64 value.
    U64(u64),
    /// An i64 value.
    I64(i64),
    /// An f16 value.
    F16(f16),
    /// A bf16 value.
    BF16(bf16),
    /// An f32 value.
    F32(f32),
    /// An f64 value.
    F64(f64),
}

impl Scalar {
    /// The dtype of the value.
    pub fn dtype(self) -> DType {
        match self {
            Scalar::Bool(_) => DType::Bool,
            Scalar::U8(_) => DType::U8,
            Scalar::I8(_) => DType::I8,
            Scalar::U16(_) => DType::U16,
            Scalar::I16(_) => DType::I16,
            Scalar::U32(_) => DType::U32,
            Scalar::U64(_) => DType::U64,
            Scalar::I32(_) => DType::I32,
            Scalar::I64(_) => DType::I64,
            Scalar::F16(_) => DType::F16,
            Scalar::BF16(_) => DType::BF16,
            Scalar::F32(_) => DType::F32,
            Scalar::F64(_) => DType::F64,
        }
    }

    /// The value as f64 (exact for every dtype but i64 and u64 beyond
    /// 2^53).
    // Inline: `Element::to_f64` goes through here, and kernels call it per
    // element (average pooling's f64 sums); inlined, the match folds away.
    #[inline]
    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Bool(v) => v as u8 as f64,
            Scalar::U8(v) => v as f64,
            Scalar::I8(v) => v as f64,
            Scalar::U16(v) => v as f64,
            Scalar::I16(v) => v as f64,
            Scalar::U32(v) => v as f64,
            Scalar::U64(v) => v as f64,
            Scalar::I32(v) => v as f64,
            Scalar::I64(v) => v as f64,
            Scalar::F16(v) => v.to_f64(),
            Scalar::BF16(v) => v.to_f64(),
            Scalar::F32(v) => v as f64,
            Scalar::F64(v) => v,
        }
    }

    /// The value as i64, truncating floats toward zero (saturating); a u64
    /// above `i64::MAX` wraps (as Rust's `as`).
    pub fn to_i64(self) -> i64 {
        match self {
            Scalar::Bool(v) => v as i64,
            Scalar::U8(v) => v as i64,
            Scalar::I8(v) => v as i64,
            Scalar::U16(v) => v as i64,
            Scalar::I16(v) => v as i64,
            Scalar::U32(v) => v as i64,
            Scalar::U64(v) => v as i64,
            Scalar::I32(v) => v as i64,
            Scalar::I64(v) => v,
            other => other.to_f64() as i64,
        }
    }

    /// Converts the value to `dtype` with the same rules as the `Cast` op.
    pub fn cast(self, dtype: DType) -> Scalar {
        match dtype {
            DType::Bool => Scalar::Bool(match self {
                Scalar::I64(v) => v != 0,
                other => other.to_f64() != 0.0,
            }),
            // Integers wrap to a narrower integer type (as Rust's `as`);
            // floats truncate toward zero and saturate.
            DType::U8 => Scalar::U8(self.int_cast(|v| v as u8, |f| f as u8)),
            DType::I8 => Scalar::I8(self.int_cast(|v| v as i8, |f| f as i8)),
            DType::U16 => Scalar::U16(self.int_cast(|v| v as u16, |f| f as u16)),
            DType::I16 => Scalar::I16(self.int_cast(|v| v as i16, |f| f as i16)),
            DType::U32 => Scalar::U32(self.int_cast(|v| v as u32, |f| f as u32)),
            DType::I32 => Scalar::I32(self.int_cast(|v| v as i32, |f| f as i32)),
            DType::U64 => Scalar::U64(self.int_cast(|v| v as u64, |f| f as u64)),
            DType::I64 => Scalar::I64(self.int_cast(|v| v, |f| f as i64)),
            DType::F16 => Scalar::F16(f16::from_f64(self.to_f64())),
            DType::BF16 => Scalar::BF16(bf16::from_f64(self.to_f64())),
            DType::F32 => Scalar::F32(match self {
                Scalar::F64(v) => v as f32,
                Scalar::I64(v) => v as f32,
                Scalar::U64(v) => v as f32,
                other => other.to_f64() as f32,
            }),
            // No scalar has the list dtype: a value cast to it keeps its own
            // dtype, and the ops that would use it reject a list operand.
            DType::F64 | DType::List => Scalar::F64(self.to_f64()),
        }
    }

    /// An integer conversion: from an integer through `int` on its bits as
    /// an i64 (two's complement, so narrowing wraps), from a float (or
    /// bool) through `float` (Rust's `as`: truncating, saturating, NaN to
    /// 0).
    fn int_cast<T>(self, int: impl Fn(i64) -> T, float: impl Fn(f64) -> T) -> T {
        if self.dtype().is_int() {
            int(self.to_i64())
        } else {
            float(self.to_f64())
        }
    }

    /// The little-endian bytes of the value in its own dtype.
    pub fn to_bits(self) -> u64 {
        match self {
            Scalar::Bool(v) => v as u64,
            Scalar::U8(v) => v as u64,
            Scalar::I8(v) => v as u8 as u64,
            Scalar::U16(v) => v as u64,
            Scalar::I16(v) => v as u16 as u64,
            Scalar::U32(v) => v as u64,
            Scalar::U64(v) => v,
            Scalar::I32(v) => v as u32 as u64,
            Scalar::I64(v) => v as u64,
            Scalar::F16(v) => v.to_bits() as u64,
            Scalar::BF16(v) => v.to_bits() as u64,
            Scalar::F32(v) => v.to_bits() as u64,
            Scalar::F64(v) => v.to_bits(),
        }
    }

    /// Rebuilds a value from [`Scalar::to_bits`].
    pub fn from_bits(dtype: DType, bits: u64) -> Scalar {
        match dtype {
            DType::Bool => Scalar::Bool(bits != 0),
            DType::U8 => Scalar::U8(bits as u8),
            DType::I8 => Scalar::I8(bits as u8 as i8),
            DType::U16 => Scalar::U16(bits as u16),
            DType::I16 => Scalar::I16(bits as u16 as i16),
            DType::U32 => Scalar::U32(bits as u32),
            DType::U64 => Scalar::U64(bits),
            DType::I32 => Scalar::I32(bits as u32 as i32),
            DType::I64 => Scalar::I64(bits as i64),
            DType::F16 => Scalar::F16(f16::from_bits(bits as u16)),
            DType::BF16 => Scalar::BF16(bf16::from_bits(bits as u16)),
            DType::F32 => Scalar::F32(f32::from_bits(bits as u32)),
            DType::F64 | DType::List => Scalar::F64(f64::from_bits(bits)),
        }
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Bool(v) => write!(f, "{v}"),
            Scalar::U8(v) => write!(f, "{v}"),
            Scalar::I8(v) => write!(f, "{v}"),
            Scalar::U16(v) => write!(f, "{v}"),
            Scalar::I16(v) => write!(f, "{v}"),
            Scalar::U32(v) => write!(f, "{v}"),
            Scalar::U64(v) => write!(f, "{v}"),
            Scalar::I32(v) => write!(f, "{v}"),
            Scalar::I64(v) => write!(f, "{v}"),
            Scalar::F16(v) => write!(f, "{v:?}"),
            Scalar::BF16(v) => write!(f, "{v:?}"),
            Scalar::F32(v) => write!(f, "{v:?}"),
            Scalar::F64(v) => write!(f, "{v:?}"),
        }
    }
}

/// A Rust type that is the element of a tensor.
///
/// # Safety
/// Buffers are reinterpreted as slices of `Self`, so implementors must be
/// plain data: no padding, no drop glue, alignment at most 16 (a small
/// buffer's), `DTYPE.size_in_bytes() == size_of::<Self>()`, valid when all
/// bytes are zero, and valid for *any* bytes unless `DTYPE` is
/// [`DType::Bool`]: bool is the one dtype whose bytes are checked (0 or 1)
/// where bytes from outside become typed values.
pub unsafe trait Element:
    Copy + Send + Sync + PartialEq + PartialOrd + fmt::Debug + fmt::Display + Default + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Wraps the value as a [`Scalar`].
    fn to_scalar(self) -> Scalar;
    /// Converts a [`Scalar`] of any dtype to this type (the `Cast` rules).
    fn from_scalar(value: Scalar) -> Self;
    /// The value as f64, for reference implementations and display.
    fn to_f64(self) -> f64 {
        self.to_scalar().to_f64()
    }
}

/// Numeric element types: every element type but `bool`.
pub trait NumElement: Element {}

/// Floating-point element types (f16, bf16, f32, f64).
pub trait FloatElement: NumElement {}

/// Integer element types usable as indices (i32, i64).
pub trait IndexElement: IntElement {}

/// Integer element types, signed and unsigned (what the bitwise ops take).
pub trait IntElement: NumElement {}

macro_rules! impl_element {
    ($t:ty, $dtype:ident, $variant:ident) => {
        // SAFETY: primitive numeric types (and half's repr(transparent) u16
        // wrappers) are plain data; the zero bit pattern is valid for each,
        // and their sizes match `DType::size_in_bytes`.
        unsafe impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            #[inline]
            fn to_scalar(self) -> Scalar {
                Scalar::$variant(self)
            }
            #[inline]
            fn from_scalar(value: Scalar) -> Self {
                match value.cast(DType::$dtype) {
                    Scalar::$variant(v) => v,
                    _ => unreachable!("Scalar::cast returns the requested dtype"),
                }
            }
        }
    };
}

impl_element!(bool, Bool, Bool);
impl_element!(u8, U8, U8);
impl_element!(i8, I8, I8);
impl_element!(u16, U16, U16);
impl_element!(i16, I16, I16);
impl_element!(u32, U32, U32);
impl_element!(u64, U64, U64);
impl_element!(i32, I32, I32);
impl_element!(i64, I64, I64);
impl_element!(f16, F16, F16);
impl_element!(bf16, BF16, BF16);
impl_element!(f32, F32, F32);
impl_element!(f64, F64, F64);

impl NumElement for u8 {}
impl NumElement for i8 {}
impl NumElement for u16 {}
impl NumElement for i16 {}
impl NumElement for u32 {}
impl NumElement for u64 {}
impl NumElement for i32 {}
impl NumElement for i64 {}
impl NumElement for f16 {}
impl NumElement for bf16 {}
impl NumElement for f32 {}
impl NumElement for f64 {}
impl IntElement for u8 {}
impl IntElement for i8 {}
impl IntElement for u16 {}
impl IntElement for i16 {}
impl IntElement for u32 {}
impl IntElement for i32 {}
impl IntElement for u64 {}
impl IntElement for i64 {}
impl IndexElement for i32 {}
impl IndexElement for i64 {}
impl FloatElement for f16 {}
impl FloatElement for bf16 {}
impl FloatElement for f32 {}
impl FloatElement for f64 {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::Bool.size_in_bytes(), std::mem::size_of::<bool>());
        assert_eq!(DType::F16.size_in_bytes(), std::mem::size_of::<f16>());
        assert_eq!(DType::BF16.size_in_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::I64.size_in_bytes(), std::mem::size_of::<i64>());
        assert_eq!(DType::U16.size_in_bytes(), std::mem::size_of::<u16>());
        assert_eq!(DType::I16.size_in_bytes(), std::mem::size_of::<i16>());
        assert_eq!(DType::U32.size_in_bytes(), std::mem::size_of::<u32>());
        assert_eq!(DType::U64.size_in_bytes(), std::mem::size_of::<u64>());
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::parse("f128"), None);
        // `ALL` is in declaration order: a dtype's discriminant indexes it.
        for (i, d) in DType::ALL.into_iter().enumerate() {
            assert_eq!(d as usize, i);
        }
    }

    #[test]
    fn casts_follow_rust_as_semantics() {
        assert_eq!(Scalar::F32(-2.7).cast(DType::I32), Scalar::I32(-2));
        assert_eq!(Scalar::F32(f32::NAN).cast(DType::I64), Scalar::I64(0));
        assert_eq!(Scalar::I32(3).cast(DType::Bool), Scalar::Bool(true));
        assert_eq!(Scalar::F64(0.1).cast(DType::F32), Scalar::F32(0.1f32));
        assert_eq!(
            Scalar::I64(i64::MAX).cast(DType::I64),
            Scalar::I64(i64::MAX)
        );
        assert_eq!(f16::from_scalar(Scalar::F32(1.5)), f16::from_f32(1.5));
        // Integers wrap into a narrower integer; floats saturate.
        assert_eq!(Scalar::I32(300).cast(DType::U8), Scalar::U8(44));
        assert_eq!(Scalar::I32(-1).cast(DType::U8), Scalar::U8(255));
        assert_eq!(Scalar::F32(300.0).cast(DType::U8), Scalar::U8(255));
        assert_eq!(Scalar::F64(-3.9).cast(DType::I8), Scalar::I8(-3));
        assert_eq!(Scalar::U8(200).cast(DType::I8), Scalar::I8(-56));
        assert_eq!(Scalar::I8(-2).cast(DType::I64), Scalar::I64(-2));
    }

    #[test]
    fn wide_unsigned_and_16_bit_casts_at_range_edges() {
        // Integers wrap, whatever the widths and signs.
        assert_eq!(Scalar::I32(-1).cast(DType::U16), Scalar::U16(u16::MAX));
        assert_eq!(Scalar::I32(70_000).cast(DType::U16), Scalar::U16(4464));
        assert_eq!(Scalar::U16(40_000).cast(DType::I16), Scalar::I16(-25_536));
        assert_eq!(
            Scalar::I16(i16::MIN).cast(DType::U32),
            Scalar::U32(4_294_934_528)
        );
        assert_eq!(Scalar::I64(-1).cast(DType::U64), Scalar::U64(u64::MAX));
        assert_eq!(Scalar::U64(u64::MAX).cast(DType::I64), Scalar::I64(-1));
        assert_eq!(
            Scalar::U64(u64::MAX).cast(DType::U32),
            Scalar::U32(u32::MAX)
        );
        assert_eq!(Scalar::U32(u32::MAX).cast(DType::I32), Scalar::I32(-1));
        assert_eq!(
            Scalar::U32(u32::MAX).cast(DType::I64),
            Scalar::I64(4_294_967_295)
        );
        // Floats truncate and saturate; NaN is 0.
        assert_eq!(Scalar::F32(-5.5).cast(DType::U16), Scalar::U16(0));
        assert_eq!(Scalar::F64(1e30).cast(DType::U64), Scalar::U64(u64::MAX));
        assert_eq!(Scalar::F64(-1e30).cast(DType::I16), Scalar::I16(i16::MIN));
        assert_eq!(Scalar::F32(f32::NAN).cast(DType::U32), Scalar::U32(0));
        assert_eq!(Scalar::F64(65_535.9).cast(DType::U16), Scalar::U16(65_535));
        // To floats: u64 beyond 2^63 keeps its value.
        assert_eq!(
            Scalar::U64(u64::MAX).cast(DType::F64),
            Scalar::F64(1.8446744073709552e19)
        );
        assert_eq!(
            Scalar::U64(1 << 63).cast(DType::F32),
            Scalar::F32(9.223372e18)
        );
        assert_eq!(Scalar::U16(7).cast(DType::Bool), Scalar::Bool(true));
        assert_eq!(Scalar::Bool(true).cast(DType::U64), Scalar::U64(1));
        assert_eq!(u32::from_scalar(Scalar::I8(-1)), u32::MAX);
    }

    #[test]
    fn bits_round_trip() {
        for v in [
            Scalar::F32(-0.0),
            Scalar::I32(-7),
            Scalar::BF16(bf16::from_f32(3.0)),
            Scalar::Bool(true),
            Scalar::U16(65_000),
            Scalar::I16(-300),
            Scalar::U32(4_000_000_000),
            Scalar::U64(u64::MAX - 3),
        ] {
            assert_eq!(Scalar::from_bits(v.dtype(), v.to_bits()), v);
        }
    }
}
