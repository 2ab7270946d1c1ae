//! How gradients go through `If` and `While`: a differentiated `If`
//! returns the intermediates its gradient needs as extra outputs (cond_v2),
//! a differentiated `While` stacks them per iteration, and ops that are not
//! differentiated keep their original form. Also: an error raised while
//! building the backward pass names the forward op's source line.

use smallvec::smallvec;
use stagecraft::layers::graph::{self, Function, NodeOp, Value};
use stagecraft::layers::ops::{
    self as ops, func, Attrs, Effect, GradBuilder, GradContext, InputGrads, OpAttrs, OpDef, OpKind,
    OutputMetas, ShapeKind,
};
use stagecraft::layers::tensor::TensorMetadata;
use stagecraft::{lazy, Device, Location, Tensor};

type T = Tensor<f64>;

/// The library functions a text names (`@name`), most recent first.
fn functions_named_in(text: &str) -> Vec<(String, std::sync::Arc<Function>)> {
    text.split('@')
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let id = func::find_function(&name)?;
            Some((name, Function::lookup(id)?))
        })
        .collect()
}

/// The library functions a function calls, directly and through the
/// functions it calls, printed.
fn printed_closure(f: &Function) -> String {
    let mut out = graph::text::print(f);
    let mut seen = std::collections::HashSet::new();
    let mut work: Vec<ops::FuncId> = f.nodes.iter().flat_map(|n| n.op.functions()).collect();
    while let Some(id) = work.pop() {
        if !seen.insert(id) {
            continue;
        }
        if let Some(g) = Function::lookup(id) {
            out.push_str(&graph::text::print(&g));
            work.extend(g.nodes.iter().flat_map(|n| n.op.functions()));
        }
    }
    out
}

fn lazy_device() -> Device {
    Device::lazy(&Device::cpu())
}

/// Tests that read the process-wide lazy metrics run one at a time.
static LAZY: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_lazy_training_step_through_cond_and_while_is_one_cached_trace() {
    fn train(d: &Device, steps: usize) -> (Vec<f64>, Vec<u64>) {
        // More than 16 elements, so the parameters are arguments from the
        // first step (smaller ones are baked in until they change).
        let n = 20;
        let x = T::from_vec((0..n).map(|i| (i as f64 - 8.0) / 10.0).collect(), &[n], d).unwrap();
        let mut w = T::from_vec((0..n).map(|i| 0.05 * (i % 5) as f64).collect(), &[n], d).unwrap();
        lazy::mark_step();
        let (mut losses, mut compiled) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let wv = w.requires_grad();
            let h = &x * &wv;
            let p = h.sum(&[0], false).gt(&Tensor::scalar(0.0, d));
            let y = stagecraft::cond(&p, || h.tanh() + 1.0, || &h * 0.5 + 1.0);
            let three = Tensor::scalar(30.0, d);
            let z =
                stagecraft::while_loop(y, |y| y.sum(&[0], false).lt(&three), |y| &y * 1.5 + 0.1);
            let loss = z.sum(&[0], false);
            let g = loss.backward().unwrap().get(&wv).unwrap();
            w = &wv - &(&g * 0.01);
            lazy::mark_step();
            losses.push(loss);
            compiled.push(lazy::metrics().traces_compiled);
        }
        (losses.iter().map(|l| l.item().unwrap()).collect(), compiled)
    }
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let (eager, _) = train(&Device::cpu(), 6);
    lazy::reset_metrics();
    let (lazy_losses, compiled) = train(&lazy_device(), 6);
    assert_eq!(lazy_losses, eager);
    assert!(
        compiled[1..].iter().all(|&c| c == compiled[0]),
        "recompiled: {compiled:?} ({})",
        lazy::metrics().last_miss_reason.unwrap_or_default()
    );
}

#[test]
fn if_gradient_reads_the_forward_intermediates_instead_of_recomputing() {
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let d = lazy_device();
    let x = T::from_vec(vec![0.3, -0.7], &[2], &d)
        .unwrap()
        .requires_grad();
    let p = Tensor::scalar(true, &d);
    let y = stagecraft::cond(&p, || (&x * &x).tanh(), || x.sin() * 3.0);
    let g = y.sum(&[0], false).backward().unwrap().get(&x).unwrap();
    let text = lazy::trace_text(&g).unwrap();
    let named = functions_named_in(&text);
    let (forward, backward): (Vec<_>, Vec<_>) = named
        .iter()
        .filter(|(name, _)| name.ends_with("_fwd") || name.ends_with("_bwd_if"))
        .partition(|(name, _)| name.ends_with("_fwd"));
    assert!(
        !forward.is_empty() && !backward.is_empty(),
        "expected augmented forward branches and backward branches in\n{text}"
    );
    // The forward branch computes tanh; the gradient branch only reads it.
    assert!(forward
        .iter()
        .any(|(_, f)| printed_closure(f).contains("Tanh")));
    for (name, f) in &backward {
        let body = printed_closure(f);
        assert!(
            !body.contains("Tanh") && !body.contains("Sin"),
            "{name} recomputes a forward op:\n{body}"
        );
    }
    // The forward If has two extra outputs here (tanh(x²) for the
    // gradient of tanh, and x for the gradient of x², unless x is read as a
    // parameter), and the values are right.
    let xs = [0.3f64, -0.7];
    let want: Vec<f64> = xs
        .iter()
        .map(|x| 2.0 * x * (1.0 - (x * x).tanh().powi(2)))
        .collect();
    let got = g.to_vec().unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12, "{got:?} vs {want:?}");
    }
}

#[test]
fn the_branch_that_did_not_run_gives_placeholders() {
    // The else branch runs: the then branch's residuals are placeholders,
    // and the gradient is that of the else branch.
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    for d in [Device::cpu(), lazy_device()] {
        let x = T::from_vec(vec![0.3, -0.7], &[2], &d)
            .unwrap()
            .requires_grad();
        let p = Tensor::scalar(false, &d);
        let y = stagecraft::cond(&p, || (&x * &x).tanh(), || x.sin() * 3.0);
        let g = y.sum(&[0], false).backward().unwrap().get(&x).unwrap();
        let want: Vec<f64> = [0.3f64, -0.7].iter().map(|x| 3.0 * x.cos()).collect();
        let got = g.to_vec().unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }
}

#[test]
fn ops_that_are_not_differentiated_keep_their_original_outputs() {
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let d = lazy_device();
    let x = T::from_vec(vec![0.3, -0.7], &[2], &d).unwrap();
    let p = Tensor::scalar(true, &d);
    let y = stagecraft::cond(&p, || (&x * &x).tanh(), || x.sin() * 3.0);
    let text = lazy::trace_text(&y).unwrap();
    assert!(
        !text.contains("_fwd") && !text.contains("_stacking"),
        "an If nobody differentiates was augmented:\n{text}"
    );
    let z = stagecraft::while_loop(
        x.clone(),
        |x| x.sum(&[0], false).lt(&Tensor::scalar(5.0, &d)),
        |x| &x * 2.0 + 1.0,
    );
    let text = lazy::trace_text(&z).unwrap();
    assert!(!text.contains("_stacking"), "{text}");
    assert_eq!(z.dims(), &[2]);
}

#[test]
fn while_gradient_pops_stacks_and_does_not_stack_invariants() {
    let _serial = LAZY.lock().unwrap_or_else(|p| p.into_inner());
    let d = lazy_device();
    let x0 = T::from_vec(vec![0.5, 0.8, 0.9], &[3], &d).unwrap();
    let w = T::from_vec(vec![1.2, 1.3, 1.4], &[3], &d)
        .unwrap()
        .requires_grad();
    let ten = Tensor::scalar(10.0, &d);
    let y = stagecraft::while_loop(
        x0.clone(),
        |x| x.sum(&[0], false).lt(&ten),
        |x| &x * &w + 0.2,
    );
    let g = y.sum(&[0], false).backward().unwrap().get(&w).unwrap();
    let text = lazy::trace_text(&g).unwrap();
    let named = functions_named_in(&text);
    let stacking: Vec<_> = named
        .iter()
        .filter(|(n, _)| n.ends_with("_stacking"))
        .collect();
    let reverse: Vec<_> = named
        .iter()
        .filter(|(n, _)| n.ends_with("_reverse"))
        .collect();
    assert!(!stacking.is_empty() && !reverse.is_empty(), "{text}");
    // One value is stacked per iteration: x (the gradient of x * w needs
    // it); w never changes, so it is passed once, not stacked.
    let stacked = graph::text::print(&stacking[0].1);
    assert_eq!(stacked.matches("ListPush").count(), 1, "{stacked}");
    let back = printed_closure(&reverse[0].1);
    assert!(back.contains("ListPop"), "{back}");
    assert!(
        !back.contains("While"),
        "the reverse loop recomputes with a nested loop:\n{back}"
    );
    // The same gradient as finite differences.
    let run = |w: &[f64]| -> f64 {
        let cpu = Device::cpu();
        let w = T::from_vec(w.to_vec(), &[3], &cpu).unwrap();
        let x0 = T::from_vec(vec![0.5, 0.8, 0.9], &[3], &cpu).unwrap();
        let ten = Tensor::scalar(10.0, &cpu);
        stagecraft::while_loop(x0, |x| x.sum(&[0], false).lt(&ten), |x| &x * &w + 0.2)
            .sum(&[0], false)
            .item()
            .unwrap()
    };
    let got = g.to_vec().unwrap();
    let base = [1.2, 1.3, 1.4];
    for i in 0..3 {
        let (mut up, mut down) = (base, base);
        up[i] += 1e-6;
        down[i] -= 1e-6;
        let numeric = (run(&up) - run(&down)) / 2e-6;
        assert!(
            (got[i] - numeric).abs() < 1e-5 * (1.0 + numeric.abs()),
            "{got:?} vs {numeric}"
        );
    }
}

#[test]
fn graph_functions_differentiate_if_and_while_through_residuals() {
    // A traced function holding a cond inside a while: its gradient
    // function (an IR → IR transform) uses the residual forms too.
    let f = stagecraft::function(|x: T| {
        let ten = Tensor::scalar(6.0, &x.device());
        let y = stagecraft::while_loop(
            x.clone(),
            |x| x.sum(&[0], false).lt(&ten),
            |x| {
                let big = x.sum(&[0], false).gt(&Tensor::scalar(2.0, &x.device()));
                stagecraft::cond(&big, || x.tanh() * 2.0 + 1.5, || &x * 1.7)
            },
        );
        y.sum(&[0], false)
    });
    let x = T::from_vec(vec![0.3, 0.4], &[2], &Device::cpu()).unwrap();
    let d = stagecraft::grad(|x: &T| f.call(x.clone()))(&x)
        .to_vec()
        .unwrap();
    let h = 1e-6;
    for i in 0..2 {
        let at = |delta: f64| {
            let mut v = vec![0.3, 0.4];
            v[i] += delta;
            f.call(T::from_vec(v, &[2], &Device::cpu()).unwrap())
                .item()
                .unwrap()
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        assert!(
            (d[i] - numeric).abs() < 1e-5 * (1.0 + numeric.abs()),
            "{d:?} vs {numeric}"
        );
    }
}

/// An op whose gradient rule builds a shape-inconsistent backward pass.
static BROKEN_GRADIENT: OpDef = OpDef {
    name: "BrokenGradient",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: same_as_input,
    grad: Some(broken_rule),
};

fn same_as_input(inputs: &[TensorMetadata], _: &Attrs<'_>) -> stagecraft::Result<OutputMetas> {
    Ok(smallvec![inputs[0].clone()])
}

fn broken_rule(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> stagecraft::Result<InputGrads> {
    // A reshape to a size the gradient does not have.
    let wrong = b.reshape(ctx.grad()?, &[7])?;
    Ok(smallvec![Some(wrong)])
}

#[test]
fn a_shape_error_in_the_backward_pass_names_the_forward_line() {
    let meta = TensorMetadata::new(stagecraft::DType::F32, [3]);
    let mut f = Function::new("model", vec![meta]);
    let at = Location::new("src/model.rs", 42, 9);
    let tanh = f
        .add_op(
            &ops::TANH,
            &OpAttrs::new(),
            &[Value::Param(0)],
            Location::new("src/model.rs", 41, 5),
        )
        .unwrap();
    let node = f
        .add_op(&BROKEN_GRADIENT, &OpAttrs::new(), &[Value::node(tanh)], at)
        .unwrap();
    f.results = vec![Value::node(node)];
    assert!(matches!(f.nodes[node].op, NodeOp::Op(..)));
    let err = match graph::autodiff::gradient_function(&f) {
        Ok(_) => panic!("the backward pass built without the shape error"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(text.contains("src/model.rs:42:9"), "{text}");
    assert!(
        text.contains("Reshape") || text.contains("BrokenGradient"),
        "{text}"
    );
    assert_eq!(err.kind(), stagecraft::ErrorKind::Shape, "{text}");
}
