//! `#[stage]`: staged results equal the same code run eagerly without the
//! macro, for nested `if`/`while`, `break`/`continue`, early `return`,
//! calls, host loops and structs of tensors; the cache and the graphs.
//!
//! Every program is written once, in `programs!`, and compiled twice: in
//! `staged` each function carries `#[stage]` and `t(c)` passes the
//! `Tensor<bool>` on (so the `if`/`while` is staged), in `eager` there is
//! no macro and `t(c)` reads the condition on the host (plain Rust).

use stagecraft::{Device, Tensor};

fn cpu() -> Device {
    Device::cpu()
}

fn f32s(values: &[f32]) -> Tensor<f32> {
    Tensor::from_vec(values.to_vec(), &[values.len()], &cpu()).unwrap()
}

fn i64s(v: i64) -> Tensor<i64> {
    Tensor::scalar(v, &cpu())
}

fn total(x: &Tensor<f32>) -> Tensor<f32> {
    x.sum(&[0], false)
}

/// A struct of tensors as staged state.
#[derive(Clone, stagecraft::TensorGroup)]
pub struct Particle {
    pub pos: Tensor<f32>,
    pub vel: Tensor<f32>,
    pub bounces: Tensor<i64>,
}

impl Particle {
    fn step(&self, dt: f32) -> Particle {
        Particle {
            pos: &self.pos + &(&self.vel * dt),
            vel: self.vel.clone(),
            bounces: self.bounces.clone(),
        }
    }
}

macro_rules! programs {
    ($($item:item)*) => {
        mod staged {
            use super::*;
            fn t(c: Tensor<bool>) -> Tensor<bool> {
                c
            }
            $(#[stagecraft::stage] $item)*
        }
        mod eager {
            use super::*;
            fn t(c: Tensor<bool>) -> bool {
                c.item().unwrap()
            }
            $($item)*
        }
    };
}

programs! {
    /// The seed's `conditionalCode`.
    pub fn conditional_code(a: Tensor<f32>, b: Tensor<f32>, c: Tensor<f32>, d: Tensor<f32>) -> Tensor<f32> {
        let mut result = &a * &b;
        if t(total(&result).gt(&Tensor::scalar(0.0, &cpu()))) {
            result = &result + &c;
        } else {
            result = &result - &d;
        }
        result
    }

    /// Collatz steps: an `if` nested in a `while`, over `Tensor<i64>`.
    pub fn collatz(start: Tensor<i64>) -> Tensor<i64> {
        let mut n = start;
        let mut steps = i64s(0);
        while t(n.gt(&i64s(1))) {
            let half = &n / 2;
            if t((&n - &(&half * 2)).eq(&i64s(0))) {
                n = half;
            } else {
                n = &n * 3 + 1;
            }
            steps = steps + 1;
        }
        steps
    }

    /// `else if` chains, a variable only one branch assigns, a `while`
    /// inside an `if` inside a `while`, and a call of another staged
    /// function.
    pub fn nested(x: Tensor<f32>, limit: Tensor<f32>) -> (Tensor<f32>, Tensor<i64>) {
        let mut y = x.clone();
        let mut rounds = i64s(0);
        let mut extra = i64s(0);
        while t(rounds.lt(&i64s(4))) {
            if t(total(&y).gt(&limit)) {
                while t(total(&y).gt(&limit)) {
                    y = &y * 0.5;
                }
                extra = extra + 10;
            } else if t(total(&y).lt(&(-&limit))) {
                y = -&y;
            } else {
                y = conditional_code(y.clone(), x.clone(), x.clone(), x.clone());
            }
            rounds = rounds + 1;
        }
        (y, &rounds + &extra)
    }

    /// `break` and `continue` in a staged loop.
    pub fn skip_and_stop(x: Tensor<f32>, limit: Tensor<f32>) -> (Tensor<f32>, Tensor<i64>) {
        let mut acc = &x * 0.0;
        let mut i = i64s(0);
        while t(i.lt(&i64s(50))) {
            i = i + 1;
            let half = &i / 2;
            if t((&i - &(&half * 2)).eq(&i64s(1))) {
                continue;
            }
            acc = &acc + &(&x * &i.cast::<f32>());
            if t(total(&acc).gt(&limit)) {
                break;
            }
            acc = &acc + 0.5;
        }
        (acc, i)
    }

    /// Early `return`s inside (nested) `if`s.
    pub fn early_return(x: Tensor<f32>) -> Tensor<f32> {
        let s = total(&x);
        if t(s.lt(&Tensor::scalar(0.0, &cpu()))) {
            return -&x;
        }
        let y = &x * 2.0;
        if t(total(&y).gt(&Tensor::scalar(10.0, &cpu()))) {
            if t(total(&y).gt(&Tensor::scalar(100.0, &cpu()))) {
                return &y * 0.0;
            }
            let z = &y - 1.0;
            return z;
        }
        y + 1.0
    }

    /// A struct of tensors as loop state, methods, a host `for` loop
    /// (unrolled) and a host `if` on a host argument.
    pub fn bounce(p: Particle, steps: usize, damp: bool) -> Particle {
        let mut p = p;
        for _ in 0..steps {
            p = p.step(0.5);
            if t(total(&p.pos).gt(&Tensor::scalar(4.0, &cpu()))) {
                p.vel = -&p.vel;
                p.bounces = &p.bounces + 1;
            }
            if damp {
                p.vel = &p.vel * 0.9;
            }
        }
        p
    }

    /// `break` out of a host `for` under a staged-free `if`, and a host
    /// `while` on a `bool`.
    pub fn host_loops(x: Tensor<f32>, n: usize) -> Tensor<f32> {
        let mut y = x;
        let mut k = 0usize;
        while k < n {
            y = &y + 1.0;
            k += 1;
        }
        for i in 0..10 {
            if i == n {
                break;
            }
            y = &y * 2.0;
        }
        // A condition with a side effect runs exactly as often as in Rust,
        // also after a `break`.
        let mut polls = 0usize;
        while {
            polls += 1;
            polls < 10
        } {
            if polls == n + 2 {
                break;
            }
            y = &y + 0.5;
        }
        &y + polls as f32
    }
}

fn same(staged: &Tensor<f32>, eager: &Tensor<f32>) {
    assert_eq!(staged.to_vec().unwrap(), eager.to_vec().unwrap());
}

#[test]
fn conditional_code_matches_eager() {
    for sign in [1.0f32, -1.0] {
        let a = f32s(&[1.0, 2.0, 3.0]);
        let b = f32s(&[sign, sign, sign]);
        let c = f32s(&[10.0, 20.0, 30.0]);
        let d = f32s(&[1.0, 1.0, 1.0]);
        same(
            &staged::conditional_code(a.clone(), b.clone(), c.clone(), d.clone()),
            &eager::conditional_code(a, b, c, d),
        );
    }
}

#[test]
fn collatz_matches_eager_and_plain_rust() {
    for start in [1i64, 6, 7, 27, 97] {
        let staged = staged::collatz(i64s(start)).item().unwrap();
        assert_eq!(staged, eager::collatz(i64s(start)).item().unwrap());
        let (mut n, mut steps) = (start, 0);
        while n > 1 {
            n = if n % 2 == 0 { n / 2 } else { 3 * n + 1 };
            steps += 1;
        }
        assert_eq!(staged, steps, "start {start}");
    }
    // One signature, one trace, however many values ran through it.
    assert_eq!(stagecraft::staged_graphs("collatz").len(), 1);
}

#[test]
fn nested_control_flow_matches_eager() {
    for (x, limit) in [
        (vec![1.0f32, 2.0], 2.0f32),
        (vec![-3.0, -4.0], 1.0),
        (vec![0.25, 0.5], 5.0),
        (vec![40.0, 2.0], 3.0),
    ] {
        let (x, limit) = (f32s(&x), Tensor::scalar(limit, &cpu()));
        let (sy, sn) = staged::nested(x.clone(), limit.clone());
        let (ey, en) = eager::nested(x, limit);
        same(&sy, &ey);
        assert_eq!(sn.item().unwrap(), en.item().unwrap());
    }
}

#[test]
fn break_and_continue_match_eager() {
    for limit in [0.5f32, 7.0, 60.0, 1e9] {
        let x = f32s(&[1.0, 0.5]);
        let limit = Tensor::scalar(limit, &cpu());
        let (sa, si) = staged::skip_and_stop(x.clone(), limit.clone());
        let (ea, ei) = eager::skip_and_stop(x, limit);
        same(&sa, &ea);
        assert_eq!(si.item().unwrap(), ei.item().unwrap());
    }
}

#[test]
fn early_return_matches_eager() {
    for x in [
        vec![-1.0f32, -2.0],
        vec![1.0, 2.0],
        vec![3.0, 4.0],
        vec![30.0, 40.0],
    ] {
        same(
            &staged::early_return(f32s(&x)),
            &eager::early_return(f32s(&x)),
        );
    }
}

#[test]
fn structs_of_tensors_and_host_arguments() {
    let p = Particle {
        pos: f32s(&[0.5, 1.0]),
        vel: f32s(&[1.0, 0.5]),
        bounces: i64s(0),
    };
    for (steps, damp) in [(3usize, false), (6, true), (6, false)] {
        let s = staged::bounce(p.clone(), steps, damp);
        let e = eager::bounce(p.clone(), steps, damp);
        same(&s.pos, &e.pos);
        same(&s.vel, &e.vel);
        assert_eq!(s.bounces.item().unwrap(), e.bounces.item().unwrap());
    }
    // Host arguments are part of the signature: three traces, and calling
    // again with known values traces nothing new.
    assert_eq!(stagecraft::staged_graphs("bounce").len(), 3);
    staged::bounce(p, 3, false);
    assert_eq!(stagecraft::staged_graphs("bounce").len(), 3);
}

#[test]
fn host_loops_unroll_into_the_trace() {
    for n in [0usize, 2, 4] {
        same(
            &staged::host_loops(f32s(&[1.0]), n),
            &eager::host_loops(f32s(&[1.0]), n),
        );
    }
    // No If or While: every condition was a host `bool`.
    for text in stagecraft::staged_graphs("host_loops") {
        assert!(!text.contains("If") && !text.contains("While"), "{text}");
    }
}

#[test]
fn tensor_conditions_become_one_if_and_one_while() {
    staged::collatz(i64s(7));
    let text = stagecraft::staged_graphs("collatz").join("\n");
    assert_eq!(text.matches("= While").count(), 1, "{text}");
    assert_eq!(text.matches("= If").count(), 1, "{text}");
}

#[test]
fn errors_inside_staged_code_name_the_op_and_the_line() {
    #[stagecraft::stage]
    fn bad(x: Tensor<f32>) -> Tensor<f32> {
        let mut y = x.clone();
        if total(&x).gt(&Tensor::scalar(0.0, &cpu())) {
            y = x.reshape(&[7]);
        }
        y
    }
    let line = line!() - 4;
    let err = bad(f32s(&[1.0, 2.0])).to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Reshape"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

#[test]
fn staged_functions_run_on_lazy_devices_and_differentiate() {
    let lazy = Device::lazy(&cpu());
    let x = Tensor::<i64>::scalar(27, &lazy);
    assert_eq!(staged::collatz(x).item().unwrap(), 111);

    // The gradient flows through the Call, If and While the macro built.
    let x = f32s(&[0.5, 1.5]);
    let limit = Tensor::scalar(3.0f32, &cpu());
    let g = stagecraft::grad(|x: &Tensor<f32>| {
        let (y, _) = staged::nested(x.clone(), limit.clone());
        total(&y)
    })(&x);
    let e = stagecraft::grad(|x: &Tensor<f32>| {
        let (y, _) = eager::nested(x.clone(), limit.clone());
        total(&y)
    })(&x);
    same(&g, &e);
}
