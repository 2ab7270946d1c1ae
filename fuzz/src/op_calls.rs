//! Random op calls driven by bytes: the generator shared by the
//! `eager_ops`/`lazy_ops` fuzz targets and the proptest in
//! `crates/stagecraft/tests/fuzz_ops.rs` (which includes this file with
//! `#[path]`).
//!
//! The bytes decode into a short program: tensors of every dtype with
//! random shapes (empty and zero-size dimensions included, and the odd
//! dimension of `usize::MAX`), built from a palette of awkward values (NaN,
//! infinities, `-0.0`, integer extremes), then op calls on them with random
//! attributes (out-of-range axes, bad reshapes, mismatched matmuls,
//! out-of-range gather indices, zero strides...). Every value the program
//! makes is checked and read back at the end.
//!
//! The invariant: each call either succeeds or yields an error that names
//! an op this program called and the line of this file it was called from
//! (errors pass from input to output unchanged, so a later op may hold an
//! earlier op's error: the check only asks that the op and line are ones
//! the program really used). A panic is a failure too; the callers turn it
//! into one (libFuzzer reports it, the proptest catches it).

use stagecraft::layers::tensor::{Buffer, Scalar};
use stagecraft::{
    bf16, f16, lazy, where_, BinaryOp, Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions,
    CrossEntropyOptions, CumsumOptions, Device, Element, Error, ExecutionMode, FloatElement,
    IndexElement, NumElement, Pool2dOptions, Reduction, Rng, Tensor, UnaryOp,
};

/// Most op calls one program makes; keeps a case fast.
const MAX_CALLS: usize = 24;
/// Most values a program keeps; a new one replaces the oldest.
const MAX_VALUES: usize = 12;
/// Live host bytes a program may hold (see `run`).
const MEMORY_LIMIT: u64 = 1 << 30;

/// A cursor over the fuzzer's bytes; once they run out it reads zeros, so
/// every byte string decodes to some program.
pub struct Input<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Input<'a> {
        Input { bytes, pos: 0 }
    }

    fn byte(&mut self) -> u8 {
        let b = self.bytes.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    fn exhausted(&self) -> bool {
        self.pos >= self.bytes.len()
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        self.byte() as usize % n
    }

    fn flag(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// A dimension: mostly small, zero-size often, and rarely `usize::MAX`
    /// (a shape holding it overflows the element count, can never be
    /// allocated, or is empty: each must work or be an error, never a
    /// panic or an abort).
    fn dim(&mut self) -> usize {
        match self.byte() {
            0..=59 => 1,
            60..=119 => 2,
            120..=169 => 3,
            170..=209 => 0,
            210..=251 => 4,
            _ => usize::MAX,
        }
    }

    fn dims(&mut self) -> Vec<usize> {
        let rank = self.below(5);
        (0..rank).map(|_| self.dim()).collect()
    }

    /// An axis argument: mostly in range for small ranks, sometimes far out.
    fn axis(&mut self) -> isize {
        self.pick(&[0, 1, -1, 2, -2, 3, -3, 4, -5, isize::MAX, isize::MIN])
    }

    fn axes(&mut self) -> Vec<isize> {
        let n = self.below(4);
        (0..n).map(|_| self.axis()).collect()
    }

    /// A slice bound or step.
    fn bound(&mut self) -> i64 {
        self.pick(&[0, 1, 2, -1, -2, 3, 5, i64::MAX, i64::MIN])
    }

    /// A small count for sizes given as attributes (pads, depths, kernels).
    fn count(&mut self) -> usize {
        self.pick(&[0, 1, 2, 3, 1, 2, usize::MAX])
    }

    fn pair(&mut self) -> [usize; 2] {
        [self.count(), self.count()]
    }

    /// An element value from the palette of awkward ones.
    fn scalar(&mut self) -> Scalar {
        match self.below(16) {
            0 => Scalar::F64(0.0),
            1 => Scalar::F64(1.0),
            2 => Scalar::F64(-1.0),
            3 => Scalar::F64(2.5),
            4 => Scalar::F64(-0.0),
            5 => Scalar::F64(f64::NAN),
            6 => Scalar::F64(f64::INFINITY),
            7 => Scalar::F64(f64::NEG_INFINITY),
            8 => Scalar::F64(1e30),
            9 => Scalar::F64(-7.0),
            10 => Scalar::I64(i64::MIN),
            11 => Scalar::I64(i64::MAX),
            12 => Scalar::I64(3),
            13 => Scalar::I64(-2),
            14 => Scalar::F64(1e-40),
            _ => Scalar::I64(i32::MIN as i64),
        }
    }

    fn float(&mut self) -> f64 {
        self.pick(&[
            0.0,
            1.0,
            -1.0,
            0.5,
            2.5,
            -3.0,
            7.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e30,
            -1e30,
        ])
    }
}

/// A value of any dtype; the program's tensors.
#[derive(Clone)]
pub enum Val {
    /// A `bool` tensor.
    Bool(Tensor<bool>),
    /// A `u8` tensor.
    U8(Tensor<u8>),
    /// An `i8` tensor.
    I8(Tensor<i8>),
    /// An `i32` tensor.
    I32(Tensor<i32>),
    /// An `i64` tensor.
    I64(Tensor<i64>),
    /// An `f16` tensor.
    F16(Tensor<f16>),
    /// A `bf16` tensor.
    BF16(Tensor<bf16>),
    /// An `f32` tensor.
    F32(Tensor<f32>),
    /// An `f64` tensor.
    F64(Tensor<f64>),
}

/// Runs `$body` with `$t` bound to the typed tensor inside a [`Val`].
macro_rules! with_val {
    ($val:expr, $t:ident => $body:expr) => {
        match $val {
            Val::Bool($t) => $body,
            Val::U8($t) => $body,
            Val::I8($t) => $body,
            Val::I32($t) => $body,
            Val::I64($t) => $body,
            Val::F16($t) => $body,
            Val::BF16($t) => $body,
            Val::F32($t) => $body,
            Val::F64($t) => $body,
        }
    };
}

/// The element types, with the ops each dtype class has.
pub trait Kind: Element {
    /// Wraps a tensor of this type.
    fn wrap(t: Tensor<Self>) -> Val;
    /// The tensor inside `v` if it has this type.
    fn get(v: &Val) -> Option<&Tensor<Self>>;
    /// An op of the numeric types (`None` for `bool`).
    fn numeric_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val>;
    /// An op of the float types (`None` for the others).
    fn float_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val>;
    /// An op of the index types (`None` for the others).
    fn index_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val>;
    /// A fresh tensor from a creation op only this class has.
    fn create(c: &mut Case, inp: &mut Input, dims: &[usize]) -> Option<Val>;
}

macro_rules! kind {
    ($t:ty, $variant:ident, numeric: $num:tt, float: $float:tt, index: $index:tt,
     create: $create:tt) => {
        impl Kind for $t {
            fn wrap(t: Tensor<Self>) -> Val {
                Val::$variant(t)
            }
            fn get(v: &Val) -> Option<&Tensor<Self>> {
                match v {
                    Val::$variant(t) => Some(t),
                    _ => None,
                }
            }
            fn numeric_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val> {
                kind!(@if $num, numeric_op::<$t>(c, inp, a))
            }
            fn float_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val> {
                kind!(@if $float, float_op::<$t>(c, inp, a))
            }
            fn index_op(c: &mut Case, inp: &mut Input, a: &Tensor<Self>) -> Option<Val> {
                kind!(@if $index, index_op::<$t>(c, inp, a))
            }
            fn create(c: &mut Case, inp: &mut Input, dims: &[usize]) -> Option<Val> {
                kind!(@create $create, $t, c, inp, dims)
            }
        }
    };
    (@if yes, $f:ident::<$t:ty>($($arg:ident),*)) => {
        Some($f::<$t>($($arg),*))
    };
    (@if no, $f:ident::<$t:ty>($($arg:ident),*)) => {{
        let _ = ($($arg),*);
        None
    }};
    (@create float, $t:ty, $c:ident, $inp:ident, $dims:ident) => {
        Some(if $inp.flag() {
            create_float::<$t>($c, $inp, $dims)
        } else {
            create_numeric::<$t>($c, $inp)
        })
    };
    (@create numeric, $t:ty, $c:ident, $inp:ident, $dims:ident) => {{
        let _ = $dims;
        Some(create_numeric::<$t>($c, $inp))
    }};
    (@create none, $t:ty, $c:ident, $inp:ident, $dims:ident) => {{
        let _ = ($c, $inp, $dims);
        None
    }};
}

kind!(bool, Bool, numeric: no, float: no, index: no, create: none);
kind!(u8, U8, numeric: yes, float: no, index: no, create: numeric);
kind!(i8, I8, numeric: yes, float: no, index: no, create: numeric);
kind!(i32, I32, numeric: yes, float: no, index: yes, create: numeric);
kind!(i64, I64, numeric: yes, float: no, index: yes, create: numeric);
kind!(f16, F16, numeric: yes, float: yes, index: no, create: float);
kind!(bf16, BF16, numeric: yes, float: yes, index: no, create: float);
kind!(f32, F32, numeric: yes, float: yes, index: no, create: float);
kind!(f64, F64, numeric: yes, float: yes, index: no, create: float);

/// Notes the op names a call may raise and the line it is on, then makes
/// the call. `line!()` here is the line of the `call!`; the call itself
/// starts on that line or, when rustfmt wraps it, a few lines below.
macro_rules! call {
    ($c:expr, [$($op:literal),+], $e:expr) => {{
        $c.site(&[$($op),+], line!());
        $e
    }};
}

/// One program's state: its device, values and the op calls it made.
pub struct Case {
    device: Device,
    /// The other device (eager for a lazy program and the reverse), for
    /// the occasional cross-device argument, which must be an error.
    other: Device,
    vals: Vec<Val>,
    sites: Vec<(&'static [&'static str], u32)>,
    rng: Rng,
    lazy: bool,
}

impl Case {
    fn site(&mut self, ops: &'static [&'static str], line: u32) {
        if !self.sites.iter().any(|&(o, l)| l == line && o == ops) {
            self.sites.push((ops, line));
        }
    }

    fn push(&mut self, v: Val) {
        if self.vals.len() >= MAX_VALUES {
            self.vals.remove(0);
        }
        self.vals.push(v);
    }

    /// A value of type `T` from the pool (or a fresh one) to pair with
    /// another operand.
    fn operand<T: Kind>(&mut self, inp: &mut Input) -> Tensor<T> {
        let same: Vec<Tensor<T>> = self.vals.iter().filter_map(T::get).cloned().collect();
        if !same.is_empty() && inp.below(4) != 0 {
            return same[inp.below(same.len())].clone();
        }
        let dims = inp.dims();
        dense::<T>(self, inp, &dims)
    }

    /// An index tensor (i32 or i64 from the pool, else fresh).
    fn indices(&mut self, inp: &mut Input) -> Val {
        if inp.flag() {
            Val::I64(self.operand::<i64>(inp))
        } else {
            Val::I32(self.operand::<i32>(inp))
        }
    }

    fn place(&mut self, inp: &mut Input) -> Device {
        if inp.below(16) == 0 {
            self.other
        } else {
            self.device
        }
    }

    /// Checks that `err` names an op this program called, at the line it
    /// was called from.
    fn check_error(&self, err: &Error, what: &str) -> Result<(), String> {
        let op = err
            .op()
            .ok_or_else(|| format!("{what}: the error names no op: {err}"))?;
        let loc = err
            .location()
            .ok_or_else(|| format!("{what}: the error has no source location: {err}"))?;
        if loc.file() != file!() {
            return Err(format!(
                "{what}: the error points at {loc}, not at the call in {}: {err}",
                file!()
            ));
        }
        // Only this program's calls: a lazy trace served from the cache
        // (compiled for another program with the same structure) must name
        // the line of this program's call, not that program's.
        let known = self
            .sites
            .iter()
            .any(|&(ops, line)| ops.contains(&op) && loc.line() >= line && loc.line() <= line + 8);
        if !known {
            return Err(format!(
                "{what}: the error names op {op} at line {}, which is not a call this \
                 program made ({:?}): {err}",
                loc.line(),
                self.sites
            ));
        }
        Ok(())
    }

    /// Checks a value without reading it: an error it already holds must
    /// name its op and line.
    fn check_val(&self, v: &Val, what: &str) -> Result<(), String> {
        with_val!(v, t => match t.check() {
            Ok(()) => Ok(()),
            Err(e) => self.check_error(&e, what),
        })
    }

    /// Reads a value back: an error must name its op and line, and a value
    /// must have as many elements as its shape says.
    fn read_val(&self, v: &Val, what: &str) -> Result<(), String> {
        with_val!(v, t => {
            let read_line = line!() + 1;
            match t.to_vec() {
                Ok(values) => {
                    if values.len() != t.numel() {
                        return Err(format!(
                            "{what}: read {} values from a tensor of shape {:?}",
                            values.len(),
                            t.dims()
                        ));
                    }
                    Ok(())
                }
                // The read itself may fail (a broadcast value standing
                // for more elements than fit in memory): then it names
                // `to_vec` at this line.
                Err(e) if e.op() == Some("to_vec") => {
                    match e.location().map(|l| (l.file(), l.line())) {
                        Some((file, line)) if file == file!() && line == read_line => Ok(()),
                        _ => Err(format!("{what}: a failed read names another line: {e}")),
                    }
                }
                Err(e) => self.check_error(&e, what),
            }
        })
    }
}

/// A dense tensor of `T` from palette values, or (rarely) one whose data
/// does not fit its shape, which must be an error of `from_slice`.
fn dense<T: Kind>(c: &mut Case, inp: &mut Input, dims: &[usize]) -> Tensor<T> {
    let device = c.place(inp);
    let numel = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= 256);
    let wrong = inp.below(12) == 0;
    let len = match (numel, wrong) {
        (Some(n), false) => n,
        (Some(n), true) => n + 1,
        // The shape is too big to fill: the data cannot match it.
        (None, _) => inp.below(3),
    };
    let values: Vec<T> = (0..len).map(|_| T::from_scalar(inp.scalar())).collect();
    match call!(
        c,
        ["from_slice"],
        Tensor::from_slice(&values, dims, &device)
    ) {
        Ok(t) => t,
        Err(e) => {
            // `from_slice` returns its error instead of an error tensor;
            // keep the program going with a valid tensor after checking it.
            if let Err(msg) = c.check_error(&e, "from_slice") {
                panic!("{msg}");
            }
            Tensor::scalar(T::from_scalar(inp.scalar()), &device)
        }
    }
}

/// A fresh tensor of `T`.
fn create<T: Kind>(c: &mut Case, inp: &mut Input) -> Val {
    let dims = inp.dims();
    let device = c.place(inp);
    match inp.below(6) {
        0 | 1 => T::wrap(dense::<T>(c, inp, &dims)),
        2 => {
            let v = T::from_scalar(inp.scalar());
            T::wrap(call!(c, ["full"], Tensor::full(&dims, v, &device)))
        }
        3 => T::wrap(Tensor::scalar(T::from_scalar(inp.scalar()), &device)),
        4 => T::wrap(call!(c, ["zeros"], Tensor::<T>::zeros(&dims, &device))),
        _ => T::create(c, inp, &dims).unwrap_or_else(|| T::wrap(dense::<T>(c, inp, &dims))),
    }
}

fn create_numeric<T: Kind + NumElement>(c: &mut Case, inp: &mut Input) -> Val {
    let device = c.place(inp);
    let (start, stop, step) = (inp.float(), inp.float(), inp.float());
    T::wrap(call!(
        c,
        ["Arange"],
        Tensor::<T>::arange(start, stop, step, &device)
    ))
}

fn create_float<T: Kind + FloatElement>(c: &mut Case, inp: &mut Input, dims: &[usize]) -> Val {
    let device = c.place(inp);
    let (p, q) = (inp.float(), inp.float());
    let t = if inp.flag() {
        call!(
            c,
            ["RandomUniform"],
            Tensor::<T>::rand_uniform(dims, p, q, &mut c.rng, &device)
        )
    } else {
        call!(
            c,
            ["RandomNormal"],
            Tensor::<T>::rand_normal(dims, p, q, &mut c.rng, &device)
        )
    };
    T::wrap(t)
}

/// A fresh value of a random dtype.
fn create_any(c: &mut Case, inp: &mut Input) -> Val {
    match inp.below(7) {
        0 => create::<bool>(c, inp),
        1 => create::<i32>(c, inp),
        2 => create::<i64>(c, inp),
        3 => create::<f16>(c, inp),
        4 => create::<bf16>(c, inp),
        5 => create::<f32>(c, inp),
        _ => create::<f64>(c, inp),
    }
}

/// The ops every dtype has: shape ops, comparisons, casts, gathers.
fn element_op<T: Kind>(c: &mut Case, inp: &mut Input, a: &Tensor<T>) -> Val {
    // Cases 16 to 19 go on to the ops of narrower dtype classes; the
    // everyday shape ops came later and took 20 to 23, so the committed
    // byte strings keep decoding to the programs they were written for.
    match inp.below(24) {
        0 => {
            let dims = inp.dims();
            T::wrap(call!(c, ["Reshape"], a.reshape(&dims)))
        }
        1 => {
            let (x, y) = (inp.axis(), inp.axis());
            T::wrap(call!(c, ["Transpose"], a.transpose(x, y)))
        }
        2 => {
            let perm = inp.axes();
            T::wrap(call!(c, ["Transpose"], a.permute(&perm)))
        }
        3 => {
            let dims = inp.dims();
            T::wrap(call!(c, ["BroadcastTo"], a.broadcast_to(&dims)))
        }
        4 => {
            let axes = inp.axes();
            T::wrap(call!(c, ["Squeeze", "Reshape"], a.squeeze(&axes)))
        }
        5 => {
            let axis = inp.axis();
            T::wrap(call!(c, ["Unsqueeze", "Reshape"], a.unsqueeze(axis)))
        }
        6 => {
            let b = c.operand::<T>(inp);
            let axis = inp.axis();
            let parts: Vec<&Tensor<T>> = match inp.below(4) {
                0 => vec![],
                1 => vec![a],
                _ => vec![a, &b],
            };
            T::wrap(call!(c, ["Concat"], Tensor::concat(&parts, axis)))
        }
        7 => {
            let n = inp.below(4);
            let starts: Vec<i64> = (0..n).map(|_| inp.bound()).collect();
            let m = if inp.below(4) == 0 { inp.below(4) } else { n };
            let ends: Vec<i64> = (0..m).map(|_| inp.bound()).collect();
            let other = inp.below(4);
            let k = inp.pick(&[0, n, n, other]);
            let steps: Vec<i64> = (0..k).map(|_| inp.bound()).collect();
            T::wrap(call!(c, ["Slice"], a.slice(&starts, &ends, &steps)))
        }
        8 => {
            let (axis, start, len) = (inp.axis(), inp.count(), inp.count());
            T::wrap(call!(c, ["Slice"], a.narrow(axis, start, len)))
        }
        9 => {
            let axis = inp.axis();
            T::wrap(match c.indices(inp) {
                Val::I32(i) => call!(c, ["Gather"], a.index_select(axis, &i)),
                Val::I64(i) => call!(c, ["Gather"], a.gather(axis, &i)),
                _ => unreachable!("indices are i32 or i64"),
            })
        }
        10 => {
            let n = inp.below(5);
            let pads: Vec<(usize, usize)> = (0..n).map(|_| (inp.count(), inp.count())).collect();
            let value = inp.float();
            T::wrap(call!(c, ["Pad"], a.pad(&pads, value)))
        }
        11 => Val::I64(call!(c, ["Nonzero"], a.nonzero())),
        12 => {
            let b = c.operand::<T>(inp);
            Val::Bool(match inp.below(6) {
                0 => call!(c, ["Equal"], a.eq(&b)),
                1 => call!(c, ["NotEqual"], a.ne(&b)),
                2 => call!(c, ["Less"], a.lt(&b)),
                3 => call!(c, ["LessEqual"], a.le(&b)),
                4 => call!(c, ["Greater"], a.gt(&b)),
                _ => call!(c, ["GreaterEqual"], a.ge(&b)),
            })
        }
        13 => {
            let cond = c.operand::<bool>(inp);
            let b = c.operand::<T>(inp);
            T::wrap(if inp.flag() {
                call!(c, ["Select"], cond.select(a, &b))
            } else {
                call!(c, ["Select"], where_(&cond, &b, a))
            })
        }
        14 => match inp.below(9) {
            0 => Val::Bool(call!(c, ["Cast"], a.cast::<bool>())),
            7 => Val::U8(call!(c, ["Cast"], a.cast::<u8>())),
            8 => Val::I8(call!(c, ["Cast"], a.cast::<i8>())),
            1 => Val::I32(call!(c, ["Cast"], a.cast::<i32>())),
            2 => Val::I64(call!(c, ["Cast"], a.cast::<i64>())),
            3 => Val::F16(call!(c, ["Cast"], a.cast::<f16>())),
            4 => Val::BF16(call!(c, ["Cast"], a.cast::<bf16>())),
            5 => Val::F32(call!(c, ["Cast"], a.cast::<f32>())),
            _ => Val::F64(call!(c, ["Cast"], a.cast::<f64>())),
        },
        15 => {
            // A one-element read in the middle of the program (a lazy
            // device materializes here).
            if let Err(e) = call!(c, ["item"], a.item()) {
                if let Err(msg) = c.check_error(&e, "item") {
                    panic!("{msg}");
                }
            }
            T::wrap(a.clone())
        }
        20 => {
            let axis = inp.axis();
            match inp.below(4) {
                0 => {
                    let b = c.operand::<T>(inp);
                    let parts: Vec<&Tensor<T>> = match inp.below(3) {
                        0 => vec![],
                        1 => vec![a],
                        _ => vec![a, &b],
                    };
                    let stacked = call!(
                        c,
                        ["Stack", "Reshape", "Concat"],
                        Tensor::stack(&parts, axis)
                    );
                    T::wrap(stacked)
                }
                1 => {
                    let n = inp.below(4);
                    let sizes: Vec<usize> = (0..n).map(|_| inp.count()).collect();
                    let parts = call!(c, ["Split", "Slice"], a.split(&sizes, axis));
                    T::wrap(one_of(inp, parts, a))
                }
                2 => {
                    let chunks = inp.count();
                    let parts = call!(c, ["Chunk", "Slice"], a.chunk(chunks, axis));
                    T::wrap(one_of(inp, parts, a))
                }
                _ => {
                    let end = inp.axis();
                    T::wrap(call!(c, ["Flatten", "Reshape"], a.flatten(axis, end)))
                }
            }
        }
        21 => {
            let n = inp.below(5);
            let counts: Vec<usize> = (0..n).map(|_| inp.count()).collect();
            T::wrap(match inp.below(3) {
                0 => call!(c, ["Repeat", "Reshape", "BroadcastTo"], a.repeat(&counts)),
                1 => call!(c, ["Tile", "Reshape", "BroadcastTo"], a.tile(&counts)),
                _ => {
                    let sizes: Vec<isize> = counts
                        .iter()
                        .map(|&k| if k == 3 { -1 } else { k as isize })
                        .collect();
                    call!(c, ["Expand", "BroadcastTo"], a.expand(&sizes))
                }
            })
        }
        22 => {
            let k = inp.bound();
            T::wrap(if inp.flag() {
                call!(c, ["Trilu"], a.tril(k))
            } else {
                call!(c, ["Trilu"], a.triu(k))
            })
        }
        23 => {
            let axis = inp.axis();
            T::wrap(match c.indices(inp) {
                Val::I32(i) => call!(c, ["GatherElements"], a.take_along_axis(axis, &i)),
                Val::I64(i) => call!(c, ["GatherElements"], a.take_along_axis(axis, &i)),
                _ => unreachable!("indices are i32 or i64"),
            })
        }
        _ => T::numeric_op(c, inp, a)
            .or_else(|| T::float_op(c, inp, a))
            .unwrap_or_else(|| bool_op(c, inp, a)),
    }
}

/// One of the pieces a split made (`a` itself when there are none: an
/// empty axis split into no sizes).
fn one_of<T: Kind>(inp: &mut Input, pieces: Vec<Tensor<T>>, a: &Tensor<T>) -> Tensor<T> {
    if pieces.is_empty() {
        return a.clone();
    }
    let k = inp.below(pieces.len());
    pieces[k].clone()
}

/// The logical ops, on bool values (other dtypes are cast first).
fn bool_op<T: Kind>(c: &mut Case, inp: &mut Input, a: &Tensor<T>) -> Val {
    let a = call!(c, ["Cast"], a.cast::<bool>());
    let b = c.operand::<bool>(inp);
    Val::Bool(match inp.below(3) {
        0 => call!(c, ["LogicalAnd"], a.and(&b)),
        1 => call!(c, ["LogicalOr"], a.or(&b)),
        _ => call!(c, ["LogicalNot"], a.not()),
    })
}

fn numeric_op<T: Kind + NumElement>(c: &mut Case, inp: &mut Input, a: &Tensor<T>) -> Val {
    // 15 to 17 go on to narrower classes; sorting took 13 and 14, the
    // scans and adds 18 to 20 (see `element_op`).
    match inp.below(21) {
        0 => T::wrap(match inp.below(5) {
            0 => call!(c, ["Relu"], a.relu()),
            1 => call!(c, ["Abs"], a.abs()),
            2 => call!(c, ["Neg"], a.neg()),
            3 => call!(c, ["Sign"], a.sign()),
            // Any op of the unary table, whether or not it takes this
            // dtype (then its error must name it and this line).
            _ => {
                let op = UnaryOp::ALL[inp.below(UnaryOp::ALL.len())];
                c.site(std::slice::from_ref(&op.def().name), line!());
                a.apply_unary(op)
            }
        }),
        1..=3 => {
            let b = c.operand::<T>(inp);
            T::wrap(match inp.below(7) {
                0 => call!(c, ["Add"], a.add(&b)),
                1 => call!(c, ["Sub"], a.sub(&b)),
                2 => call!(c, ["Mul"], a.mul(&b)),
                3 => call!(c, ["Div"], a.div(&b)),
                4 => call!(c, ["Maximum"], a.maximum(&b)),
                5 => call!(c, ["Minimum"], a.minimum(&b)),
                _ => {
                    let op = BinaryOp::ALL[inp.below(BinaryOp::ALL.len())];
                    c.site(std::slice::from_ref(&op.def().name), line!());
                    a.apply_binary(op, &b)
                }
            })
        }
        4 => {
            let s = T::from_scalar(inp.scalar());
            T::wrap(match inp.below(4) {
                0 => call!(c, ["Add"], a + s),
                1 => call!(c, ["Sub"], a - s),
                2 => call!(c, ["Mul"], a * s),
                _ => call!(c, ["Div"], a / s),
            })
        }
        5..=7 => {
            let (axes, keep) = (inp.axes(), inp.flag());
            T::wrap(match inp.below(4) {
                0 => call!(c, ["Sum"], a.sum(&axes, keep)),
                1 => call!(c, ["Max"], a.max(&axes, keep)),
                2 => call!(c, ["Min"], a.min(&axes, keep)),
                _ => call!(c, ["Prod"], a.prod(&axes, keep)),
            })
        }
        8 => {
            let (axis, keep) = (inp.axis(), inp.flag());
            Val::I64(if inp.flag() {
                call!(c, ["ArgMax"], a.argmax(axis, keep))
            } else {
                call!(c, ["ArgMin"], a.argmin(axis, keep))
            })
        }
        9..=11 => {
            let b = c.operand::<T>(inp);
            T::wrap(call!(c, ["MatMul"], a.matmul(&b)))
        }
        12 => {
            // Division by an integer zero is an error the kernel finds.
            let zero = T::from_scalar(Scalar::I64(0));
            T::wrap(call!(c, ["Div"], a / zero))
        }
        13 | 14 => {
            let (axis, flag) = (inp.axis(), inp.flag());
            match inp.below(3) {
                0 => T::wrap(call!(c, ["Sort"], a.sort(axis, flag).0)),
                1 => Val::I64(call!(c, ["Sort"], a.argsort(axis, flag))),
                _ => {
                    let (k, sorted) = (inp.count(), inp.flag());
                    let (values, indices) = call!(c, ["TopK"], a.topk(k, axis, flag, sorted));
                    if inp.flag() {
                        T::wrap(values)
                    } else {
                        Val::I64(indices)
                    }
                }
            }
        }
        18 => {
            let axis = inp.axis();
            let options = CumsumOptions {
                exclusive: inp.flag(),
                reverse: inp.flag(),
            };
            T::wrap(call!(c, ["Cumsum"], a.cumsum_with(axis, options)))
        }
        19 | 20 => {
            let axis = inp.axis();
            let src = c.operand::<T>(inp);
            let scatter = inp.flag();
            T::wrap(match (c.indices(inp), scatter) {
                (Val::I32(i), true) => call!(c, ["ScatterAdd"], a.scatter_add(axis, &i, &src)),
                (Val::I64(i), true) => call!(c, ["ScatterAdd"], a.scatter_add(axis, &i, &src)),
                (Val::I32(i), false) => call!(c, ["IndexAdd"], a.index_add(axis, &i, &src)),
                (Val::I64(i), false) => call!(c, ["IndexAdd"], a.index_add(axis, &i, &src)),
                _ => unreachable!("indices are i32 or i64"),
            })
        }
        _ => T::index_op(c, inp, a)
            .or_else(|| T::float_op(c, inp, a))
            .unwrap_or_else(|| element_op(c, inp, a)),
    }
}

fn index_op<T: Kind + IndexElement>(c: &mut Case, inp: &mut Input, a: &Tensor<T>) -> Val {
    let depth = inp.count();
    match inp.below(3) {
        0 => Val::F32(call!(c, ["OneHot"], a.one_hot::<f32>(depth))),
        1 => Val::I64(call!(c, ["OneHot"], a.one_hot::<i64>(depth))),
        _ => Val::Bool(call!(c, ["OneHot"], a.one_hot::<bool>(depth))),
    }
}

fn float_op<T: Kind + FloatElement>(c: &mut Case, inp: &mut Input, a: &Tensor<T>) -> Val {
    // The training ops took 13, the transformer ops 14 to 16, attention 17
    // (8 and 9 are the pools, under `_`).
    match inp.below(18) {
        0..=2 => T::wrap(match inp.below(10) {
            0 => call!(c, ["Exp"], a.exp()),
            1 => call!(c, ["Log"], a.log()),
            2 => call!(c, ["Sqrt"], a.sqrt()),
            3 => call!(c, ["Rsqrt"], a.rsqrt()),
            4 => call!(c, ["Tanh"], a.tanh()),
            5 => call!(c, ["Sigmoid"], a.sigmoid()),
            6 => call!(c, ["Gelu"], a.gelu()),
            7 => call!(c, ["Sin"], a.sin()),
            8 => call!(c, ["Cos"], a.cos()),
            _ => match inp.below(5) {
                0 => call!(
                    c,
                    ["Maximum", "Minimum"],
                    a.clamp(T::from_scalar(inp.scalar()), T::from_scalar(inp.scalar()))
                ),
                1 => call!(c, ["Maximum", "Minimum", "Mul", "Add"], a.leaky_relu(0.01)),
                2 => call!(c, ["Maximum", "Minimum", "Expm1", "Mul", "Add"], a.elu(1.0)),
                3 => call!(c, ["GeluTanh"], a.gelu_tanh()),
                _ => call!(c, ["Silu"], a.silu()),
            },
        }),
        3 => {
            let b = c.operand::<T>(inp);
            T::wrap(call!(c, ["Pow"], a.pow(&b)))
        }
        4 => {
            let (axes, keep) = (inp.axes(), inp.flag());
            T::wrap(call!(c, ["Mean"], a.mean(&axes, keep)))
        }
        5 => {
            let axis = inp.axis();
            T::wrap(if inp.flag() {
                call!(c, ["Softmax"], a.softmax(axis))
            } else {
                call!(c, ["LogSoftmax"], a.log_softmax(axis))
            })
        }
        6 | 7 => {
            let w = c.operand::<T>(inp);
            let options = Conv2dOptions {
                stride: inp.pair(),
                padding: inp.pair(),
                dilation: inp.pair(),
                groups: inp.count(),
            };
            T::wrap(call!(c, ["Conv2d"], a.conv2d(&w, options)))
        }
        10 => {
            let (axes, keep, correction) = (inp.axes(), inp.flag(), inp.count());
            // Composites: an error (say, running out of memory) may come
            // from one of their ops.
            T::wrap(if inp.flag() {
                call!(
                    c,
                    ["Var", "Mean", "Sub", "Mul", "Maximum"],
                    a.var(&axes, keep, correction)
                )
            } else {
                call!(
                    c,
                    ["Std", "Mean", "Sub", "Mul", "Maximum", "Sqrt"],
                    a.std(&axes, keep, correction)
                )
            })
        }
        11 => {
            let w = c.operand::<T>(inp);
            let options = Conv1dOptions {
                stride: inp.count(),
                padding: inp.count(),
                dilation: inp.count(),
                groups: inp.count(),
            };
            T::wrap(call!(
                c,
                ["Conv1d", "Reshape", "Conv2d"],
                a.conv1d(&w, options)
            ))
        }
        12 => {
            let w = c.operand::<T>(inp);
            let options = ConvTranspose2dOptions {
                stride: inp.pair(),
                padding: inp.pair(),
                output_padding: inp.pair(),
                dilation: inp.pair(),
                groups: inp.count(),
            };
            T::wrap(call!(
                c,
                ["ConvTranspose2d"],
                a.conv_transpose2d(&w, options)
            ))
        }
        13 => {
            if inp.flag() {
                // Probabilities outside [0, 1] too: an error of Dropout.
                let p = inp.float() * 0.25;
                T::wrap(call!(c, ["Dropout"], a.dropout(p, &mut c.rng)))
            } else {
                let b = c.operand::<T>(inp);
                T::wrap(call!(c, ["SquaredNorm"], Tensor::squared_norm(&[a, &b])))
            }
        }
        14 => {
            // Parameters from the pool: mostly the wrong shape.
            let (w, b) = (c.operand::<T>(inp), c.operand::<T>(inp));
            let (w, b) = (inp.flag().then_some(&w), inp.flag().then_some(&b));
            let eps = if inp.flag() { 1e-5 } else { inp.float() };
            T::wrap(if inp.flag() {
                call!(c, ["LayerNorm"], a.layer_norm(w, b, eps))
            } else {
                call!(c, ["RmsNorm"], a.rms_norm(w, eps))
            })
        }
        15 => {
            let options = CrossEntropyOptions {
                ignore_index: inp.flag().then(|| inp.bound()),
                reduction: inp.pick(&[Reduction::None, Reduction::Mean, Reduction::Sum]),
            };
            T::wrap(match c.indices(inp) {
                Val::I32(t) => call!(c, ["CrossEntropy"], a.cross_entropy(&t, options)),
                Val::I64(t) => call!(c, ["CrossEntropy"], a.cross_entropy(&t, options)),
                _ => unreachable!("indices are i32 or i64"),
            })
        }
        16 => T::wrap(match c.indices(inp) {
            Val::I32(i) => call!(c, ["Embedding"], a.embedding(&i)),
            Val::I64(i) => call!(c, ["Embedding"], a.embedding(&i)),
            _ => unreachable!("indices are i32 or i64"),
        }),
        17 => {
            // Keys and values from the pool or fresh (any ranks and
            // shapes), a scale that may be the default, negative, NaN or
            // infinite.
            let (k, v) = (c.operand::<T>(inp), c.operand::<T>(inp));
            let causal = inp.flag();
            let scale = inp.pick(&[
                None,
                Some(0.5),
                Some(-2.0),
                Some(f64::NAN),
                Some(f64::INFINITY),
            ]);
            T::wrap(if inp.flag() {
                call!(
                    c,
                    ["ScaledDotProductAttention"],
                    a.scaled_dot_product_attention_bthd(&k, &v, causal, scale)
                )
            } else {
                call!(
                    c,
                    ["ScaledDotProductAttention"],
                    a.scaled_dot_product_attention(&k, &v, causal, scale)
                )
            })
        }
        _ => {
            let options = Pool2dOptions {
                kernel: inp.pair(),
                stride: if inp.flag() { Some(inp.pair()) } else { None },
                padding: inp.pair(),
            };
            T::wrap(if inp.flag() {
                call!(c, ["MaxPool2d"], a.max_pool2d(options))
            } else {
                let include = inp.flag();
                call!(c, ["AvgPool2d"], a.avg_pool2d(options, include))
            })
        }
    }
}

/// Decodes `bytes` into a program and runs it on the eager CPU device
/// (`lazy == false`, in sync or async execution mode as the bytes say) or
/// on the lazy device over it. Returns the number of op calls made, or a
/// description of the first error that named no op or a wrong line.
pub fn run(bytes: &[u8], lazy: bool) -> Result<usize, String> {
    // A program can ask for tensors of tens of gigabytes (a gather by many
    // indices, a broadcast read back): with the cap, those are errors of
    // their ops instead of a fuzzer stopped for running out of memory.
    Buffer::set_memory_limit(Some(MEMORY_LIMIT));
    let mut inp = Input::new(bytes);
    let cpu = Device::cpu();
    let lazy_dev = Device::lazy(&cpu);
    let (device, other) = if lazy {
        (lazy_dev, cpu)
    } else {
        (cpu, lazy_dev)
    };
    let mode = if !lazy && inp.flag() {
        ExecutionMode::Async
    } else {
        ExecutionMode::Sync
    };
    stagecraft::with_execution_mode(mode, || {
        let mut c = Case {
            device,
            other,
            vals: Vec::new(),
            sites: Vec::new(),
            rng: Rng::new(inp.byte() as u64),
            lazy,
        };
        let mut calls = 0;
        let first = create_any(&mut c, &mut inp);
        c.push(first);
        while calls < MAX_CALLS && !inp.exhausted() {
            calls += 1;
            let v = match inp.below(8) {
                0 => create_any(&mut c, &mut inp),
                1 if c.lazy => {
                    // End a "training step": everything pending runs.
                    lazy::mark_step();
                    continue;
                }
                _ => {
                    let a = c.vals[inp.below(c.vals.len())].clone();
                    with_val!(&a, t => element_op(&mut c, &mut inp, t))
                }
            };
            c.check_val(&v, "a value just made")?;
            c.push(v);
        }
        for (i, v) in c.vals.iter().enumerate() {
            c.check_val(v, &format!("value {i}"))?;
            c.read_val(v, &format!("reading value {i}"))?;
        }
        Ok(calls)
    })
}
