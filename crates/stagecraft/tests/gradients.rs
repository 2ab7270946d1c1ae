//! Gradient checks: every differentiable op against central finite
//! differences in f64, second derivatives, the tape API on the eager and
//! lazy devices, and errors.

mod common;
use common::values;
use stagecraft::{grad, lazy, value_and_grad, where_, Device, Rng, Tensor};

type T = Tensor<f64>;

/// Tests that read the process-wide lazy metrics run one at a time.
static LAZY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cpu() -> Device {
    Device::cpu()
}

fn tensor(dims: &[usize], seed: u64, lo: f64, hi: f64) -> T {
    let n = dims.iter().product();
    Tensor::from_vec(values(n, seed, lo, hi), dims, &cpu()).unwrap()
}

/// Compares `grad(f)` with central differences at `x`.
fn check(name: &str, f: impl Fn(&T) -> T + Clone, x: &T) {
    let analytic = grad(f.clone())(x)
        .to_vec()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let base = x.to_vec().unwrap();
    let h = 1e-6;
    for i in 0..base.len() {
        let at = |d: f64| {
            let mut v = base.clone();
            v[i] += d;
            f(&Tensor::from_vec(v, x.dims(), &cpu()).unwrap())
                .item()
                .unwrap()
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        let tol = 1e-6 * (1.0 + numeric.abs());
        assert!(
            (analytic[i] - numeric).abs() <= tol,
            "{name}: d/dx[{i}] analytic {} vs numeric {numeric}",
            analytic[i]
        );
    }
}

/// Weights the output so every element's gradient differs.
fn weighted(y: T) -> T {
    let w = tensor(y.dims(), 99, 0.5, 1.5);
    (y * w).sum(&[], false)
}

#[test]
fn unary_ops() {
    let x = tensor(&[2, 3], 1, 0.2, 1.5);
    let mixed = tensor(&[2, 3], 2, -1.5, 1.5);
    check("exp", |x| weighted(x.exp()), &x);
    check("log", |x| weighted(x.log()), &x);
    check("sqrt", |x| weighted(x.sqrt()), &x);
    check("rsqrt", |x| weighted(x.rsqrt()), &x);
    check("tanh", |x| weighted(x.tanh()), &mixed);
    check("sigmoid", |x| weighted(x.sigmoid()), &mixed);
    check("gelu", |x| weighted(x.gelu()), &mixed);
    check("sin", |x| weighted(x.sin()), &mixed);
    check("cos", |x| weighted(x.cos()), &mixed);
    check("neg", |x| weighted(-x), &mixed);
    // Away from the kinks at 0.
    let away = tensor(&[2, 3], 3, 0.3, 1.0);
    let signs =
        Tensor::<f64>::from_vec(vec![1.0, -1.0, 1.0, -1.0, 1.0, -1.0], &[2, 3], &cpu()).unwrap();
    let kinked = away * signs;
    check("relu", |x| weighted(x.relu()), &kinked);
    check("abs", |x| weighted(x.abs()), &kinked);
}

#[test]
fn binary_ops_with_broadcasting() {
    let x = tensor(&[2, 3], 4, 0.5, 2.0);
    let row = tensor(&[3], 5, 0.5, 2.0);
    let col = tensor(&[2, 1], 6, 0.5, 2.0);
    for (name, other) in [("row", &row), ("col", &col)] {
        let o = other.clone();
        let o2 = other.clone();
        check(&format!("add {name}"), |x| weighted(x + &o), &x);
        check(&format!("sub {name}"), |x| weighted(x - &o), &x);
        check(&format!("mul {name}"), |x| weighted(x * &o), &x);
        check(&format!("div {name}"), |x| weighted(x / &o), &x);
        check(&format!("pow {name}"), |x| weighted(x.pow(&o)), &x);
        check(&format!("maximum {name}"), |x| weighted(x.maximum(&o)), &x);
        check(&format!("minimum {name}"), |x| weighted(x.minimum(&o)), &x);
        // The gradient reaching the broadcast operand is summed back.
        let xx = x.clone();
        check(&format!("mul into {name}"), move |o| weighted(&xx * o), &o2);
        let xx = x.clone();
        check(
            &format!("div into {name}"),
            move |o| weighted(&xx / o),
            other,
        );
        let xx = x.clone();
        check(
            &format!("pow into {name}"),
            move |o| weighted(xx.pow(o)),
            other,
        );
    }
}

#[test]
fn reductions_and_softmax() {
    let x = tensor(&[2, 3, 4], 7, -1.0, 1.0);
    check("sum all", |x| weighted(x.sum(&[], false)), &x);
    check("sum axis", |x| weighted(x.sum(&[1], false)), &x);
    check("sum keep", |x| weighted(x.sum(&[0, -1], true)), &x);
    check("mean", |x| weighted(x.mean(&[2], false)), &x);
    check("max", |x| weighted(x.max(&[1], false)), &x);
    check("min", |x| weighted(x.min(&[0, 2], true)), &x);
    let pos = tensor(&[2, 3], 8, 0.5, 1.5);
    check("prod", |x| weighted(x.prod(&[1], false)), &pos);
    check("softmax", |x| weighted(x.softmax(-1)), &x);
    check("softmax axis 1", |x| weighted(x.softmax(1)), &x);
    check("log_softmax", |x| weighted(x.log_softmax(-1)), &x);
}

#[test]
fn matmul_variants() {
    let a = tensor(&[3, 4], 9, -1.0, 1.0);
    let b = tensor(&[4, 2], 10, -1.0, 1.0);
    let bb = b.clone();
    check("matmul a", move |a| weighted(a.matmul(&bb)), &a);
    let aa = a.clone();
    check("matmul b", move |b| weighted(aa.matmul(b)), &b);
    let batched = tensor(&[2, 3, 4], 11, -1.0, 1.0);
    let bb = b.clone();
    check(
        "batched @ shared",
        move |x| weighted(x.matmul(&bb)),
        &batched,
    );
    let bt = batched.clone();
    check("shared weight", move |w| weighted(bt.matmul(w)), &b);
    let v = tensor(&[4], 12, -1.0, 1.0);
    let aa = a.clone();
    check("matrix @ vector", move |v| weighted(aa.matmul(v)), &v);
    let bb = b.clone();
    check("vector @ matrix", move |v| weighted(v.matmul(&bb)), &v);
}

#[test]
fn shape_ops() {
    let x = tensor(&[2, 3, 4], 13, -1.0, 1.0);
    check("reshape", |x| weighted(x.reshape(&[6, 4]).tanh()), &x);
    check("transpose", |x| weighted(x.transpose(0, 2)), &x);
    check("permute", |x| weighted(x.permute(&[1, 2, 0])), &x);
    let small = tensor(&[3, 1], 14, -1.0, 1.0);
    check(
        "broadcast_to",
        |x| weighted(x.broadcast_to(&[2, 3, 4])),
        &small,
    );
    let other = tensor(&[2, 2, 4], 15, -1.0, 1.0);
    check(
        "concat",
        move |x| weighted(Tensor::concat(&[x, &other, x], 1)),
        &x,
    );
    check(
        "slice",
        |x| weighted(x.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 1])),
        &x,
    );
    check(
        "strided slice",
        |x| weighted(x.slice(&[1, 0, 1], &[2, 3, 4], &[1, 2, 2])),
        &x,
    );
    let idx = Tensor::<i64>::from_vec(vec![2, 0, 2, 1], &[2, 2], &cpu()).unwrap();
    check("gather", move |x| weighted(x.gather(1, &idx)), &x);
    check(
        "pad",
        |x| weighted(x.pad(&[(1, 0), (0, 2), (1, 1)], 0.5)),
        &x,
    );
    let cond = Tensor::<bool>::from_vec((0..24).map(|i| i % 3 == 0).collect(), &[2, 3, 4], &cpu())
        .unwrap();
    let other = tensor(&[4], 16, -1.0, 1.0);
    check("where", move |x| weighted(where_(&cond, x, &other)), &x);
    // Through f32 finite differences are too coarse: the gradient of a
    // round trip of casts is the weights themselves, rounded to f32.
    let g = grad(|x: &T| weighted(x.cast::<f32>().cast::<f64>()))(&x)
        .to_vec()
        .unwrap();
    let w = tensor(&[2, 3, 4], 99, 0.5, 1.5).to_vec().unwrap();
    for (a, b) in g.iter().zip(&w) {
        assert_eq!(*a, *b as f32 as f64);
    }
}

#[test]
fn convolution_and_pooling() {
    use stagecraft::{Conv2dOptions, Pool2dOptions};
    let x = tensor(&[2, 4, 6, 5], 26, -1.0, 1.0);
    let w = tensor(&[6, 2, 3, 2], 27, -0.5, 0.5);
    let opts = Conv2dOptions {
        stride: [2, 1],
        padding: [1, 1],
        dilation: [1, 2],
        groups: 2,
    };
    let ww = w.clone();
    check("conv2d input", move |x| weighted(x.conv2d(&ww, opts)), &x);
    let xx = x.clone();
    check("conv2d filter", move |w| weighted(xx.conv2d(w, opts)), &w);
    let plain = Conv2dOptions::default();
    let w1 = tensor(&[3, 4, 3, 3], 28, -0.5, 0.5);
    let xx = x.clone();
    check(
        "conv2d filter, plain",
        move |w| weighted(xx.conv2d(w, plain)),
        &w1,
    );
    let pool = Pool2dOptions {
        kernel: [2, 3],
        stride: Some([2, 2]),
        padding: [1, 1],
    };
    check("max_pool2d", move |x| weighted(x.max_pool2d(pool)), &x);
    check(
        "avg_pool2d with pad",
        move |x| weighted(x.avg_pool2d(pool, true)),
        &x,
    );
    check(
        "avg_pool2d without pad",
        move |x| weighted(x.avg_pool2d(pool, false)),
        &x,
    );
}

/// The gradient of an If is an If over the branches' gradient functions;
/// checked against finite differences on both branches, nested, and inside
/// a staged function.
#[test]
fn gradients_through_cond_and_functions() {
    let f = |x: &T| {
        let p = x.sum(&[0], false).gt(&Tensor::scalar(0.0, &cpu()));
        let y = stagecraft::cond(&p, || (x * x).tanh(), || x.sin() * 3.0);
        weighted(y)
    };
    check("cond, then branch", f, &tensor(&[3], 30, 0.1, 1.0));
    check("cond, else branch", f, &tensor(&[3], 31, -1.0, -0.1));
    let nested = |x: &T| {
        let s = x.sum(&[0], false);
        let outer = s.gt(&Tensor::scalar(0.0, &cpu()));
        let y = stagecraft::cond(
            &outer,
            || {
                let inner = s.gt(&Tensor::scalar(1.0, &cpu()));
                stagecraft::cond(&inner, || x.exp(), || x * x * x)
            },
            || -x,
        );
        weighted(y)
    };
    check("nested cond, big", nested, &tensor(&[3], 32, 0.5, 1.0));
    check("nested cond, small", nested, &tensor(&[3], 33, 0.01, 0.1));
    let staged = std::sync::Arc::new(stagecraft::function(|x: T| {
        (x.matmul(&x.transpose(0, 1)) + 1.0).log()
    }));
    let through_function = move |x: &T| weighted(staged.call(x.clone()));
    check("function", through_function, &tensor(&[2, 3], 34, 0.1, 1.0));
    // Second order through a cond.
    let d = |x: &T| {
        grad(|x: &T| {
            stagecraft::cond(&Tensor::scalar(true, &cpu()), || x.tanh(), || x.clone())
                .sum(&[0], false)
        })(x)
    };
    check(
        "cond, second order",
        move |x| weighted(d(x)),
        &tensor(&[2], 35, -1.0, 1.0),
    );
}

/// Reverse mode through While loops whose trip count depends on the data,
/// with a cond inside the body and a captured (loop-invariant) variable.
#[test]
fn gradients_through_while_loops() {
    let ten = || Tensor::scalar(10.0, &cpu());
    let grow = |x: &T| {
        let (y, _) = stagecraft::while_loop(
            (x.clone(), Tensor::<i64>::scalar(0, &cpu())),
            |(x, _)| x.sum(&[0], false).lt(&ten()),
            |(x, i)| (x * 1.5 + 0.1, i + 1),
        );
        weighted(y)
    };
    check("while", grow, &tensor(&[3], 40, 0.5, 1.0));
    let branchy = |x: &T| {
        let y = stagecraft::while_loop(
            x.clone(),
            |x| x.sum(&[0], false).lt(&ten()),
            |x| {
                let big = x.sum(&[0], false).gt(&Tensor::scalar(3.0, &cpu()));
                stagecraft::cond(&big, || x.tanh() * 2.0 + 1.5, || &x * 1.7)
            },
        );
        weighted(y)
    };
    check("cond inside while", branchy, &tensor(&[3], 41, 0.3, 0.6));
    let x0 = tensor(&[3], 42, 0.5, 1.0);
    let through_invariant = move |w: &T| {
        let y = stagecraft::while_loop(
            x0.clone(),
            |x| x.sum(&[0], false).lt(&ten()),
            |x| &x * w + 0.2,
        );
        weighted(y)
    };
    check(
        "captured variable",
        through_invariant,
        &tensor(&[3], 43, 1.2, 1.5),
    );
}

#[test]
fn second_derivatives() {
    let x = tensor(&[3], 17, -1.0, 1.0);
    let xs = x.to_vec().unwrap();
    let dd = |f: fn(&T) -> T| {
        grad(move |x: &T| grad(f)(x).sum(&[0], false))(&x)
            .to_vec()
            .unwrap()
    };
    let tanh2 = dd(|x| x.tanh().sum(&[0], false));
    let sig2 = dd(|x| x.sigmoid().sum(&[0], false));
    for (i, &v) in xs.iter().enumerate() {
        let t = v.tanh();
        assert!(
            (tanh2[i] - (-2.0 * t * (1.0 - t * t))).abs() < 1e-12,
            "tanh''"
        );
        let s = 1.0 / (1.0 + (-v).exp());
        assert!(
            (sig2[i] - s * (1.0 - s) * (1.0 - 2.0 * s)).abs() < 1e-12,
            "sigmoid''"
        );
    }
    // The softmax Hessian-vector product against finite differences of
    // the gradient.
    let w = tensor(&[3], 18, 0.5, 1.5);
    let g = move |x: &T| grad(|x: &T| (x.softmax(0) * &w).sum(&[0], false))(x);
    check("softmax second order", move |x| weighted(g(x)), &x);
}

#[test]
fn second_derivative_of_a_small_mlp_loss() {
    let w1 = tensor(&[3, 4], 19, -0.5, 0.5);
    let w2 = tensor(&[4, 2], 20, -0.5, 0.5);
    let x = tensor(&[2, 3], 21, -1.0, 1.0);
    let loss = move |w1: &T| {
        let h = x.matmul(w1).tanh();
        h.matmul(&w2).log_softmax(-1).sum(&[], false)
    };
    let l = loss.clone();
    check("mlp loss", l, &w1);
    check(
        "mlp loss, second order",
        move |w| weighted(grad(loss.clone())(w)),
        &w1,
    );
}

#[test]
fn tape_api_on_eager_and_lazy_agree() {
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let run = |d: &Device| {
        let mut rng = Rng::new(3);
        let w = Tensor::<f32>::rand_normal(&[4, 3], 0.0, 0.5, &mut rng, d).requires_grad();
        let b = Tensor::<f32>::zeros(&[3], d).requires_grad();
        let x =
            Tensor::<f32>::from_vec((0..8).map(|i| i as f32 * 0.1).collect(), &[2, 4], d).unwrap();
        let loss = (x.matmul(&w) + &b).tanh().sum(&[], false);
        let grads = loss.backward().unwrap();
        (
            grads.get(&w).unwrap().to_vec().unwrap(),
            grads.get(&b).unwrap().to_vec().unwrap(),
        )
    };
    let eager = run(&Device::cpu());
    let lazy_dev = Device::lazy(&Device::cpu());
    let lazy = run(&lazy_dev);
    assert_eq!(eager, lazy);
}

#[test]
fn value_and_grad_returns_both() {
    let x = tensor(&[2], 22, -1.0, 1.0);
    let (v, g) = value_and_grad(|x: &T| (x * x).sum(&[0], false))(&x);
    let xs = x.to_vec().unwrap();
    assert_eq!(v.item().unwrap(), xs[0] * xs[0] + xs[1] * xs[1]);
    assert_eq!(g.to_vec().unwrap(), vec![2.0 * xs[0], 2.0 * xs[1]]);
}

#[test]
fn errors() {
    let i = Tensor::<i64>::ones(&[2], &cpu());
    let err = i.sum(&[0], false).cast::<f64>().backward().unwrap_err();
    assert!(err.to_string().contains("requires_grad"), "{err}");
    let x = tensor(&[2], 23, 0.0, 1.0);
    let err = (x.clone() * 2.0).sum(&[0], false).backward().unwrap_err();
    assert!(
        err.to_string().contains("nothing to differentiate"),
        "{err}"
    );
    // An op without a gradient rule names itself and its line.
    let w = tensor(&[3], 24, 0.0, 1.0).requires_grad();
    let line = line!() + 1;
    let y = w.argmax(0, false).one_hot::<f64>(3).sum(&[0], false);
    let err = y.backward().unwrap_err();
    assert_eq!(err.op(), Some("OneHot"), "{err}");
    assert_eq!(err.location().unwrap().line(), line);
    let _ = lazy::metrics();
}

/// An MLP trained with `backward` and SGD on the lazy device: forward,
/// backward and update are one trace per step, compiled once and then hit
/// in the cache; the losses equal eager training and go down.
#[test]
fn lazy_training_step_is_one_cached_trace() {
    fn train(d: &Device, steps: usize) -> (Vec<f32>, Vec<u64>) {
        let mut rng = Rng::new(11);
        let mut w1 = Tensor::<f32>::rand_normal(&[8, 16], 0.0, 0.3, &mut rng, d);
        let mut w2 = Tensor::<f32>::rand_normal(&[16, 3], 0.0, 0.3, &mut rng, d);
        lazy::mark_step();
        let x = Tensor::<f32>::from_vec(
            (0..64).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect(),
            &[8, 8],
            d,
        )
        .unwrap();
        let y = Tensor::<f32>::from_vec(
            (0..24)
                .map(|i| if i % 3 == (i / 3) % 3 { 1.0 } else { 0.0 })
                .collect(),
            &[8, 3],
            d,
        )
        .unwrap();
        let mut losses = Vec::new();
        let mut compiled = Vec::new();
        for _ in 0..steps {
            let (a, b) = (w1.requires_grad(), w2.requires_grad());
            let logits = x.matmul(&a).tanh().matmul(&b);
            let loss = -(logits.log_softmax(-1) * &y)
                .sum(&[-1], false)
                .mean(&[0], false);
            let grads = loss.backward().unwrap();
            w1 = &a - &(grads.get(&a).unwrap() * 0.5);
            w2 = &b - &(grads.get(&b).unwrap() * 0.5);
            lazy::mark_step();
            losses.push(loss);
            compiled.push(lazy::metrics().traces_compiled);
        }
        (losses.iter().map(|l| l.item().unwrap()).collect(), compiled)
    }
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let (eager, _) = train(&Device::cpu(), 8);
    lazy::reset_metrics();
    let (lazy_losses, compiled) = train(&Device::lazy(&Device::cpu()), 8);
    assert_eq!(lazy_losses, eager);
    assert!(eager.last() < eager.first(), "{eager:?}");
    assert!(
        compiled[1..].iter().all(|&c| c == compiled[0]),
        "recompiled: {compiled:?}"
    );
    let m = lazy::metrics();
    assert!(m.cache_hits >= 7, "{m:?}");
}

/// The same gradient computed eagerly, on the lazy device, and through a
/// staged function (whose Call is differentiated at the IR level).
#[test]
fn gradients_agree_across_eager_lazy_and_function() {
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let body = |x: &T, w: &T| {
        let h = x.matmul(w).tanh();
        let p = h.sum(&[], false).gt(&Tensor::scalar(0.0, &x.device()));
        stagecraft::cond(&p, || h.softmax(-1), || h.sigmoid())
            .log()
            .sum(&[], false)
    };
    let grad_on = |d: &Device, staged: bool| {
        let x = Tensor::<f64>::from_vec(values(6, 50, -1.0, 1.0), &[2, 3], d).unwrap();
        let w = Tensor::<f64>::from_vec(values(12, 51, -1.0, 1.0), &[3, 4], d)
            .unwrap()
            .requires_grad();
        let loss = if staged {
            let f = stagecraft::function(move |(x, w): (T, T)| body(&x, &w));
            f.call((x.clone(), w.clone()))
        } else {
            body(&x, &w)
        };
        loss.backward().unwrap().get(&w).unwrap().to_vec().unwrap()
    };
    let eager = grad_on(&cpu(), false);
    assert_eq!(grad_on(&Device::lazy(&cpu()), false), eager, "lazy");
    let staged = grad_on(&cpu(), true);
    for (a, b) in staged.iter().zip(&eager) {
        assert!(
            (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
            "function: {a} vs {b}"
        );
    }
}
