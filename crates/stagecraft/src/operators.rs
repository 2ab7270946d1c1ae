//! Arithmetic operators on tensors, borrowed tensors and Rust scalars.
//! Both operands must have the same element type: `Tensor<f32> +
//! Tensor<f64>` does not compile.

use crate::ops::scalar_like;
use crate::Tensor;
use stagecraft_ops as ops;
use stagecraft_runtime::Args;
use stagecraft_tensor::{Location, NumElement};
use std::ops::{Add, Div, Mul, Neg, Sub};

fn binary_owned<T: NumElement>(
    op: &'static stagecraft_ops::OpDef,
    a: Tensor<T>,
    b: Tensor<T>,
    location: Location,
) -> Tensor<T> {
    // Moving the handles in lets the kernel reuse a buffer nobody else holds.
    let args: Args = smallvec::smallvec![a.handle, b.handle];
    crate::tensor::run(op, args, &stagecraft_ops::OpAttrs::new(), location)
}

macro_rules! tensor_operator {
    ($trait:ident, $method:ident, $op:ident) => {
        impl<T: NumElement> $trait<Tensor<T>> for Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: Tensor<T>) -> Tensor<T> {
                binary_owned(&ops::$op, self, rhs, Location::caller())
            }
        }
        impl<T: NumElement> $trait<&Tensor<T>> for Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<T>) -> Tensor<T> {
                binary_owned(&ops::$op, self, rhs.clone(), Location::caller())
            }
        }
        impl<T: NumElement> $trait<Tensor<T>> for &Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: Tensor<T>) -> Tensor<T> {
                binary_owned(&ops::$op, self.clone(), rhs, Location::caller())
            }
        }
        impl<T: NumElement> $trait<&Tensor<T>> for &Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<T>) -> Tensor<T> {
                self.binary(&ops::$op, rhs, Location::caller())
            }
        }
        impl<T: NumElement> $trait<T> for Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: T) -> Tensor<T> {
                let rhs = scalar_like(rhs, &self);
                binary_owned(&ops::$op, self, rhs, Location::caller())
            }
        }
        impl<T: NumElement> $trait<T> for &Tensor<T> {
            type Output = Tensor<T>;
            #[track_caller]
            fn $method(self, rhs: T) -> Tensor<T> {
                binary_owned(
                    &ops::$op,
                    self.clone(),
                    scalar_like(rhs, self),
                    Location::caller(),
                )
            }
        }
    };
}

tensor_operator!(Add, add, ADD);
tensor_operator!(Sub, sub, SUB);
tensor_operator!(Mul, mul, MUL);
tensor_operator!(Div, div, DIV);

macro_rules! scalar_lhs_operator {
    ($($t:ty),*) => {$(
        impl Add<Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn add(self, rhs: Tensor<$t>) -> Tensor<$t> {
                let lhs = scalar_like(self, &rhs);
                binary_owned(&ops::ADD, lhs, rhs, Location::caller())
            }
        }
        impl Add<&Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn add(self, rhs: &Tensor<$t>) -> Tensor<$t> {
                binary_owned(&ops::ADD, scalar_like(self, rhs), rhs.clone(), Location::caller())
            }
        }
        impl Sub<Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn sub(self, rhs: Tensor<$t>) -> Tensor<$t> {
                let lhs = scalar_like(self, &rhs);
                binary_owned(&ops::SUB, lhs, rhs, Location::caller())
            }
        }
        impl Sub<&Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn sub(self, rhs: &Tensor<$t>) -> Tensor<$t> {
                binary_owned(&ops::SUB, scalar_like(self, rhs), rhs.clone(), Location::caller())
            }
        }
        impl Mul<Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn mul(self, rhs: Tensor<$t>) -> Tensor<$t> {
                let lhs = scalar_like(self, &rhs);
                binary_owned(&ops::MUL, lhs, rhs, Location::caller())
            }
        }
        impl Mul<&Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn mul(self, rhs: &Tensor<$t>) -> Tensor<$t> {
                binary_owned(&ops::MUL, scalar_like(self, rhs), rhs.clone(), Location::caller())
            }
        }
        impl Div<Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn div(self, rhs: Tensor<$t>) -> Tensor<$t> {
                let lhs = scalar_like(self, &rhs);
                binary_owned(&ops::DIV, lhs, rhs, Location::caller())
            }
        }
        impl Div<&Tensor<$t>> for $t {
            type Output = Tensor<$t>;
            #[track_caller]
            fn div(self, rhs: &Tensor<$t>) -> Tensor<$t> {
                binary_owned(&ops::DIV, scalar_like(self, rhs), rhs.clone(), Location::caller())
            }
        }
    )*};
}

scalar_lhs_operator!(f32, f64, i32, i64);

impl<T: NumElement> Neg for Tensor<T> {
    type Output = Tensor<T>;
    #[track_caller]
    fn neg(self) -> Tensor<T> {
        let args: Args = smallvec::smallvec![self.handle];
        crate::tensor::run(
            &ops::NEG,
            args,
            &stagecraft_ops::OpAttrs::new(),
            Location::caller(),
        )
    }
}

impl<T: NumElement> Neg for &Tensor<T> {
    type Output = Tensor<T>;
    #[track_caller]
    fn neg(self) -> Tensor<T> {
        self.unary(
            &ops::NEG,
            &stagecraft_ops::OpAttrs::new(),
            Location::caller(),
        )
    }
}
