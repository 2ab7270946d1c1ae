//! Reverse mode as a transformation of the IR: the gradient function of
//! `f(params) -> results` is `f'(params, result grads) -> param grads`. It
//! recomputes `f`'s forward nodes, then walks them in reverse calling each
//! op's gradient rule through a [`GradBuilder`] that appends nodes. Control
//! flow inside `f` differentiates through the `If`/`Call` rules, which ask
//! for the gradient functions of their branches in turn.

use crate::{Function, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::func::FuncId;
use stagecraft_ops::grad::{
    residual_form, IfResiduals, ResidualForm, ResidualHooks, WhileResiduals,
};
use stagecraft_ops::{Attrs, GradBuilder, GradContext, OpAttrs, OpDef, G};
use stagecraft_tensor::{
    Error, HostTensor, Location, Result, Scalar, ScalarHostTensor, TensorMetadata,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Appends the nodes a gradient rule emits to a function.
struct IrBuilder<'f> {
    f: &'f mut Function,
    values: Vec<Value>,
    location: Location,
}

impl IrBuilder<'_> {
    fn push(&mut self, v: Value) -> G {
        self.values.push(v);
        G((self.values.len() - 1) as u32)
    }
}

impl GradBuilder for IrBuilder<'_> {
    fn op(&mut self, def: &'static OpDef, inputs: &[G], attrs: &OpAttrs) -> Result<G> {
        Ok(self.op_multi(def, inputs, attrs)?[0])
    }

    fn op_multi(
        &mut self,
        def: &'static OpDef,
        inputs: &[G],
        attrs: &OpAttrs,
    ) -> Result<SmallVec<[G; 4]>> {
        let args: Vec<Value> = inputs.iter().map(|g| self.values[g.0 as usize]).collect();
        let node = self.f.add_op(def, attrs, &args, self.location)?;
        let outputs = self.f.nodes[node].outputs.len() as u32;
        Ok((0..outputs)
            .map(|output| {
                self.push(Value::Output {
                    node: node as u32,
                    output,
                })
            })
            .collect())
    }

    fn meta(&self, value: G) -> TensorMetadata {
        self.f.meta(self.values[value.0 as usize]).clone()
    }

    fn fill(&mut self, value: f64, meta: &TensorMetadata) -> Result<G> {
        let node = self
            .f
            .add_const(HostTensor::filled(Scalar::F64(value), meta), self.location);
        Ok(self.push(Value::node(node)))
    }
}

/// `f` differentiated: `g(f.params ++ result grads) -> param grads`, whose
/// first `forward_nodes` nodes recompute `f` (control flow in its
/// residual form) and whose other nodes are the backward pass.
struct Differentiated {
    g: Function,
    forward_nodes: usize,
    /// `f`'s results as values of `g`.
    results: Vec<Value>,
}

/// The residual form of a node's op, if it has one.
/// One whose form cannot be built (a branch with an op that has no
/// gradient rule) stays as it is: its gradient reports the problem.
fn residual_form_of(node: &crate::Node) -> Option<ResidualForm> {
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    residual_form(def, attrs).ok().flatten()
}

fn differentiate(f: &Function) -> Result<Differentiated> {
    let np = f.params.len();
    let mut params = f.params.clone();
    params.extend(f.result_metas());
    let mut g = Function::new(format!("{}_grad", f.name), params);
    // The forward pass, with If and While in the form that keeps what
    // their gradients need.
    let mut map: Vec<u32> = Vec::with_capacity(f.nodes.len());
    let remap = |v: Value, map: &[u32]| match v {
        Value::Param(i) => Value::Param(i),
        Value::Output { node, output } => Value::Output {
            node: map[node as usize],
            output,
        },
    };
    for node in &f.nodes {
        let inputs: SmallVec<[Value; 4]> = node.inputs.iter().map(|v| remap(*v, &map)).collect();
        if let Some(form) = residual_form_of(node) {
            let mut inputs = inputs.into_vec();
            for meta in &form.extra_inputs {
                let zero = HostTensor::filled(Scalar::F64(0.0), meta);
                inputs.push(Value::node(g.add_const(zero, node.location)));
            }
            let index = g.add_op(form.op, &form.attrs, &inputs, node.location)?;
            g.nodes[index].device = node.device.clone();
            map.push(index as u32);
            continue;
        }
        let mut copy = node.clone();
        copy.inputs = inputs;
        map.push(g.push(copy) as u32);
    }
    let forward_nodes = g.nodes.len();
    let results: Vec<Value> = f.results.iter().map(|r| remap(*r, &map)).collect();
    let location = first_location(f);
    let mut grads: HashMap<Value, Value> = HashMap::new();
    let add = |g: &mut Function, a: Value, b: Value, loc: Location| -> Result<Value> {
        Ok(Value::node(g.add_op(
            &stagecraft_ops::ADD,
            &OpAttrs::new(),
            &[a, b],
            loc,
        )?))
    };
    for (j, r) in results.iter().enumerate() {
        let seed = Value::Param((np + j) as u32);
        let total = match grads.remove(r) {
            Some(prev) => add(&mut g, prev, seed, location)?,
            None => seed,
        };
        grads.insert(*r, total);
    }
    for i in (0..forward_nodes).rev() {
        let node = &g.nodes[i];
        let incoming: SmallVec<[Option<Value>; 1]> = (0..node.outputs.len() as u32)
            .map(|o| {
                grads
                    .get(&Value::Output {
                        node: i as u32,
                        output: o,
                    })
                    .copied()
            })
            .collect();
        if incoming.iter().all(Option::is_none) {
            continue;
        }
        let NodeOp::Op(def, attrs) = &node.op else {
            continue;
        };
        let (def, attrs, location) = (*def, attrs.clone(), node.location);
        let node_inputs = node.inputs.clone();
        let output_count = node.outputs.len() as u32;
        let rule = def.grad.ok_or_else(|| {
            Error::invalid(format!("{} has no gradient rule", def.name))
                .with_op(def.name)
                .at(location)
        })?;
        let mut b = IrBuilder {
            f: &mut g,
            values: Vec::new(),
            location,
        };
        let inputs: SmallVec<[G; 4]> = node_inputs.iter().map(|v| b.push(*v)).collect();
        let outputs: SmallVec<[G; 1]> = (0..output_count)
            .map(|o| {
                b.push(Value::Output {
                    node: i as u32,
                    output: o,
                })
            })
            .collect();
        let flowing: SmallVec<[Option<G>; 1]> =
            incoming.iter().map(|v| v.map(|v| b.push(v))).collect();
        let ctx = GradContext {
            inputs: &inputs,
            outputs: &outputs,
            grads: &flowing,
            attrs: Attrs::new(&attrs, def),
        };
        let input_grads = rule(&mut b, &ctx).map_err(|e| e.with_op(def.name).at(location))?;
        let produced: Vec<Option<Value>> = input_grads
            .iter()
            .map(|g| g.map(|g| b.values[g.0 as usize]))
            .collect();
        for (input, gv) in node_inputs.iter().zip(produced) {
            let Some(gv) = gv else { continue };
            let total = match grads.remove(input) {
                Some(prev) => add(&mut g, prev, gv, location)?,
                None => gv,
            };
            grads.insert(*input, total);
        }
    }
    let mut param_grads = Vec::with_capacity(np);
    for (p, meta) in f.params.iter().enumerate() {
        let v = match grads.get(&Value::Param(p as u32)) {
            Some(v) => *v,
            None => {
                let zeros = HostTensor::filled(Scalar::F64(0.0), meta);
                Value::node(g.add_const(zeros, location))
            }
        };
        param_grads.push(v);
    }
    g.results = param_grads;
    Ok(Differentiated {
        g,
        forward_nodes,
        results,
    })
}

/// The gradient function of `f`: parameters `f.params ++ (one gradient per
/// result)`, results one gradient per parameter (zeros where none flows).
/// It recomputes `f`'s forward values, then runs the backward pass.
pub fn gradient_function(f: &Function) -> Result<Function> {
    Ok(differentiate(f)?.g)
}

/// `f` split into a forward half that also returns the intermediates the
/// gradient needs, and a backward half that takes them instead of
/// recomputing them.
pub struct SplitGradient {
    /// `f.params -> f.results ++ residuals`.
    pub forward: Function,
    /// `f.params ++ residuals ++ result grads -> param grads`.
    pub backward: Function,
    /// The residuals' types.
    pub residuals: Vec<TensorMetadata>,
    /// Which of `f`'s parameters the backward half reads.
    pub reads_param: Vec<bool>,
}

/// Splits `f`'s gradient at the boundary between its forward and backward
/// passes: every forward value the backward pass reads becomes a residual
/// (constants are copied instead).
pub fn split_gradient(f: &Function) -> Result<SplitGradient> {
    let Differentiated {
        g,
        forward_nodes,
        results,
    } = differentiate(f)?;
    let np = f.params.len();
    let is_forward_op = |v: &Value| match v {
        Value::Output { node, .. } => {
            (*node as usize) < forward_nodes
                && !matches!(g.nodes[*node as usize].op, NodeOp::Const(_))
        }
        Value::Param(_) => false,
    };
    // The residuals, in first-use order.
    let mut residual_index: HashMap<Value, usize> = HashMap::new();
    let mut residual_values: Vec<Value> = Vec::new();
    let backward_reads = g.nodes[forward_nodes..]
        .iter()
        .flat_map(|n| n.inputs.iter())
        .chain(g.results.iter());
    for v in backward_reads {
        if is_forward_op(v) && !residual_index.contains_key(v) {
            residual_index.insert(*v, residual_values.len());
            residual_values.push(*v);
        }
    }
    let residuals: Vec<TensorMetadata> =
        residual_values.iter().map(|v| g.meta(*v).clone()).collect();
    let nr = residuals.len();

    let mut forward = Function::new(format!("{}_fwd", f.name), f.params.clone());
    forward.nodes = g.nodes[..forward_nodes].to_vec();
    forward.results = results.iter().chain(&residual_values).copied().collect();

    let mut params = f.params.clone();
    params.extend(residuals.iter().cloned());
    params.extend(f.result_metas());
    let mut backward = Function::new(format!("{}_bwd", f.name), params);
    let mut reads_param = vec![false; np];
    // Nodes of `g` already placed in `backward`: backward nodes, and the
    // forward constants they read (copied rather than passed).
    let mut moved: HashMap<u32, u32> = HashMap::new();
    let mut translate = |v: Value, backward: &mut Function, moved: &mut HashMap<u32, u32>| match v {
        Value::Param(p) if (p as usize) < np => {
            reads_param[p as usize] = true;
            v
        }
        Value::Param(p) => Value::Param(p + nr as u32),
        Value::Output { node, output } => {
            if let Some(i) = residual_index.get(&v) {
                return Value::Param((np + i) as u32);
            }
            let copy = *moved
                .entry(node)
                .or_insert_with(|| backward.push(g.nodes[node as usize].clone()) as u32);
            Value::Output { node: copy, output }
        }
    };
    for (i, node) in g.nodes.iter().enumerate().skip(forward_nodes) {
        let mut copy = node.clone();
        copy.inputs = node
            .inputs
            .iter()
            .map(|v| translate(*v, &mut backward, &mut moved))
            .collect();
        let index = backward.push(copy) as u32;
        moved.insert(i as u32, index);
    }
    backward.results = g
        .results
        .iter()
        .map(|v| translate(*v, &mut backward, &mut moved))
        .collect();
    Ok(SplitGradient {
        forward,
        backward,
        residuals,
        reads_param,
    })
}

/// The gradient function of library function `id`, built once and
/// registered in the library.
pub fn gradient_of_library_function(id: FuncId) -> Result<FuncId> {
    static CACHE: OnceLock<Mutex<HashMap<FuncId, FuncId>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(found) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
        return Ok(*found);
    }
    let f: Arc<Function> = Function::lookup(id)
        .ok_or_else(|| Error::internal(format!("function {} is not a graph function", id.0)))?;
    let grad = gradient_function(&f)?.register();
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, grad);
    Ok(grad)
}

/// Builds the loops of a While's gradient (see the `While` rule in
/// `stagecraft-ops`): over `n` loop values `s` with condition `C` and body
/// `B`,
/// - count: `(s, i)` while `C(s)`: `(B(s), i + 1)`, giving the trip count;
/// - reverse: `(s0, k, g)` while `k > 0`: recompute `s` entering iteration
///   `k - 1` by running `B` `k - 1` times from `s0`, then
///   `g = B'(s, g)`, `k = k - 1`.
pub fn while_gradient_loops(
    cond: FuncId,
    body: FuncId,
) -> Result<stagecraft_ops::grad::WhileGradient> {
    use stagecraft_ops::grad::WhileGradient;
    use stagecraft_ops::{GREATER, LESS, SUB, WHILE};
    static CACHE: OnceLock<Mutex<HashMap<(FuncId, FuncId), WhileGradient>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(found) = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(cond, body))
    {
        return Ok(*found);
    }
    let b = Function::lookup(body)
        .ok_or_else(|| Error::internal("a While body is not a graph function"))?;
    let body_grad = gradient_of_library_function(body)?;
    let all = b.params.clone();
    let n = all.len();
    let index = TensorMetadata::new(
        stagecraft_tensor::DType::I64,
        stagecraft_tensor::Shape::scalar(),
    );
    let location = first_location(&b);
    let params = |extra: &[TensorMetadata], more: &[TensorMetadata]| -> Vec<TensorMetadata> {
        all.iter().chain(extra).chain(more).cloned().collect()
    };
    let state =
        |from: usize| -> Vec<Value> { (from..from + n).map(|i| Value::Param(i as u32)).collect() };
    let call = |f: &mut Function, id: FuncId, args: &[Value]| call_node(f, id, args, location);
    let int = |f: &mut Function, v: i64| int_const(f, v, location);
    let binary = |f: &mut Function, def: &'static OpDef, a: Value, c: Value| -> Result<Value> {
        Ok(Value::node(f.add_op(
            def,
            &OpAttrs::new(),
            &[a, c],
            location,
        )?))
    };

    // Counting loop.
    let mut count_cond = Function::new(
        "while_count_cond",
        params(std::slice::from_ref(&index), &[]),
    );
    count_cond.results = call(&mut count_cond, cond, &state(0))?;
    let mut count_body = Function::new(
        "while_count_body",
        params(std::slice::from_ref(&index), &[]),
    );
    let mut next = call(&mut count_body, body, &state(0))?;
    let one = int(&mut count_body, 1);
    next.push(binary(
        &mut count_body,
        &stagecraft_ops::ADD,
        Value::Param(n as u32),
        one,
    )?);
    count_body.results = next;

    // Recomputation loop: (s, j, limit) while j < limit: (B(s), j + 1, limit).
    let pair = [index.clone(), index.clone()];
    let mut again_cond = Function::new("while_recompute_cond", params(&pair, &[]));
    again_cond.results = vec![binary(
        &mut again_cond,
        &LESS,
        Value::Param(n as u32),
        Value::Param(n as u32 + 1),
    )?];
    let mut again_body = Function::new("while_recompute_body", params(&pair, &[]));
    let mut next = call(&mut again_body, body, &state(0))?;
    let one = int(&mut again_body, 1);
    next.push(binary(
        &mut again_body,
        &stagecraft_ops::ADD,
        Value::Param(n as u32),
        one,
    )?);
    next.push(Value::Param(n as u32 + 1));
    again_body.results = next;
    let (again_cond, again_body) = (again_cond.register(), again_body.register());

    // Reverse loop over (s0, k, g).
    let mut reverse_cond = Function::new(
        "while_reverse_cond",
        params(std::slice::from_ref(&index), &all),
    );
    let zero = int(&mut reverse_cond, 0);
    reverse_cond.results = vec![binary(
        &mut reverse_cond,
        &GREATER,
        Value::Param(n as u32),
        zero,
    )?];
    let mut reverse_body = Function::new(
        "while_reverse_body",
        params(std::slice::from_ref(&index), &all),
    );
    let k = Value::Param(n as u32);
    let one = int(&mut reverse_body, 1);
    let k_before = binary(&mut reverse_body, &SUB, k, one)?;
    let start = int(&mut reverse_body, 0);
    let mut loop_in = state(0);
    loop_in.push(start);
    loop_in.push(k_before);
    let mut attrs = OpAttrs::new();
    attrs
        .set_func("cond", again_cond)
        .set_func("body", again_body);
    let node = reverse_body.add_op(&WHILE, &attrs, &loop_in, location)?;
    let entering: Vec<Value> = (0..n as u32)
        .map(|output| Value::Output {
            node: node as u32,
            output,
        })
        .collect();
    let mut grad_in = entering;
    grad_in.extend(state(n + 1));
    let grads = call(&mut reverse_body, body_grad, &grad_in)?;
    let mut results = state(0);
    results.push(k_before);
    results.extend(grads);
    reverse_body.results = results;

    let plan = WhileGradient {
        count_cond: count_cond.register(),
        count_body: count_body.register(),
        reverse_cond: reverse_cond.register(),
        reverse_body: reverse_body.register(),
    };
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((cond, body), plan);
    Ok(plan)
}

/// The augmented branches of an `If` and its backward plan.
#[derive(Clone, Copy)]
struct IfForm {
    then_forward: FuncId,
    else_forward: FuncId,
    plan: IfResiduals,
}

/// The augmented loop of a `While` and its backward plan.
#[derive(Clone)]
struct WhileForm {
    cond: FuncId,
    body: FuncId,
    extra_inputs: Vec<TensorMetadata>,
    plan: Arc<WhileResiduals>,
}

#[derive(Default)]
struct ResidualCache {
    /// By the original branches / loop functions.
    ifs: HashMap<(FuncId, FuncId), IfForm>,
    whiles: HashMap<(FuncId, FuncId), WhileForm>,
    /// By the augmented ones, for the gradient rules.
    if_plans: HashMap<(FuncId, FuncId), IfResiduals>,
    while_plans: HashMap<(FuncId, FuncId), Arc<WhileResiduals>>,
}

fn residual_cache() -> std::sync::MutexGuard<'static, ResidualCache> {
    static CACHE: OnceLock<Mutex<ResidualCache>> = OnceLock::new();
    CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn library_function(id: FuncId) -> Result<Arc<Function>> {
    Function::lookup(id)
        .ok_or_else(|| Error::internal(format!("function {} is not a graph function", id.0)))
}

fn call_node(
    f: &mut Function,
    id: FuncId,
    args: &[Value],
    location: Location,
) -> Result<Vec<Value>> {
    let mut attrs = OpAttrs::new();
    attrs.set_func("f", id);
    let node = f.add_op(&stagecraft_ops::CALL, &attrs, args, location)?;
    Ok((0..f.nodes[node].outputs.len() as u32)
        .map(|output| Value::Output {
            node: node as u32,
            output,
        })
        .collect())
}

/// An i64 scalar constant (loop counters).
fn int_const(f: &mut Function, value: i64, location: Location) -> Value {
    let scalar = ScalarHostTensor::new(Scalar::I64(value), stagecraft_tensor::Shape::scalar());
    Value::node(f.add_const(HostTensor::Scalar(scalar), location))
}

fn first_location(f: &Function) -> Location {
    f.nodes
        .first()
        .map_or_else(Location::caller, |node| node.location)
}

/// Placeholders for the residuals of the branch that did not run: they own
/// no memory (a broadcast zero, or the empty list).
fn placeholders(f: &mut Function, metas: &[TensorMetadata], location: Location) -> Vec<Value> {
    metas
        .iter()
        .map(|meta| Value::node(f.add_const(HostTensor::filled(Scalar::F64(0.0), meta), location)))
        .collect()
}

fn if_form(then_id: FuncId, else_id: FuncId) -> Result<IfForm> {
    if let Some(found) = residual_cache().ifs.get(&(then_id, else_id)) {
        return Ok(*found);
    }
    let (then_f, else_f) = (library_function(then_id)?, library_function(else_id)?);
    let (then_split, else_split) = (split_gradient(&then_f)?, split_gradient(&else_f)?);
    let results = then_f.results.len();
    let location = first_location(&then_f);
    // Forward branches: results ++ then residuals ++ else residuals.
    let mut then_forward = then_split.forward;
    let none = placeholders(&mut then_forward, &else_split.residuals, location);
    then_forward.results.extend(none);
    let mut else_forward = else_split.forward;
    let own = else_forward.results.split_off(results);
    let none = placeholders(&mut else_forward, &then_split.residuals, location);
    else_forward.results.extend(none);
    else_forward.results.extend(own);
    // Backward branches over (args, then residuals, else residuals, grads).
    let args = then_f.params.len();
    let (nt, ne) = (then_split.residuals.len(), else_split.residuals.len());
    let mut params = then_f.params.clone();
    params.extend(then_split.residuals.iter().cloned());
    params.extend(else_split.residuals.iter().cloned());
    params.extend(then_f.result_metas());
    let param = |i: usize| Value::Param(i as u32);
    let backward =
        |name: String, id: FuncId, residuals: std::ops::Range<usize>| -> Result<FuncId> {
            let mut f = Function::new(name, params.clone());
            let mut call_args: Vec<Value> = (0..args).map(param).collect();
            call_args.extend(residuals.map(param));
            call_args.extend((args + nt + ne..params.len()).map(param));
            f.results = call_node(&mut f, id, &call_args, location)?;
            Ok(f.register())
        };
    let then_bwd = then_split.backward.register();
    let else_bwd = else_split.backward.register();
    let plan = IfResiduals {
        results,
        then_backward: backward(format!("{}_bwd_if", then_f.name), then_bwd, args..args + nt)?,
        else_backward: backward(
            format!("{}_bwd_if", else_f.name),
            else_bwd,
            args + nt..args + nt + ne,
        )?,
    };
    let form = IfForm {
        then_forward: then_forward.register(),
        else_forward: else_forward.register(),
        plan,
    };
    let mut cache = residual_cache();
    cache
        .if_plans
        .insert((form.then_forward, form.else_forward), plan);
    Ok(*cache.ifs.entry((then_id, else_id)).or_insert(form))
}

fn while_form(cond_id: FuncId, body_id: FuncId) -> Result<WhileForm> {
    use stagecraft_ops::{GREATER, LIST_POP, LIST_PUSH, SUB};
    if let Some(found) = residual_cache().whiles.get(&(cond_id, body_id)) {
        return Ok(found.clone());
    }
    let body = library_function(body_id)?;
    let split = split_gradient(&body)?;
    let n = body.params.len();
    let location = first_location(&body);
    let list = stagecraft_tensor::TensorList::metadata().clone();
    let count = TensorMetadata::new(
        stagecraft_tensor::DType::I64,
        stagecraft_tensor::Shape::scalar(),
    );
    let unchanged = |j: usize| body.results[j] == Value::Param(j as u32);
    // What each iteration pushes: the entering values of the state the
    // backward half reads (unless they never change), then the residuals.
    let stacked: Vec<usize> = (0..n)
        .filter(|&j| split.reads_param[j] && !unchanged(j))
        .collect();
    let invariants: Vec<usize> = (0..n)
        .filter(|&j| split.reads_param[j] && unchanged(j))
        .collect();
    let m = split.residuals.len();
    let q = stacked.len() + m;
    let int = |f: &mut Function, v: i64| int_const(f, v, location);
    let param = |i: usize| Value::Param(i as u32);

    // Forward loop over (state.., lists.., count).
    let mut state = body.params.clone();
    state.extend(std::iter::repeat_n(list.clone(), q));
    state.push(count.clone());
    let mut cond = Function::new(format!("{}_stacking_cond", body.name), state.clone());
    cond.results = call_node(
        &mut cond,
        cond_id,
        &(0..n).map(param).collect::<Vec<_>>(),
        location,
    )?;
    let mut fwd = Function::new(format!("{}_stacking", body.name), state.clone());
    let out = call_node(
        &mut fwd,
        split.forward.clone().register(),
        &(0..n).map(param).collect::<Vec<_>>(),
        location,
    )?;
    let mut results: Vec<Value> = out[..n].to_vec();
    let pushed = stacked
        .iter()
        .map(|&j| param(j))
        .chain(out[n..].iter().copied());
    for (t, value) in pushed.enumerate() {
        let node = fwd.add_op(
            &LIST_PUSH,
            &OpAttrs::new(),
            &[param(n + t), value],
            location,
        )?;
        results.push(Value::node(node));
    }
    let one = int(&mut fwd, 1);
    let next = fwd.add_op(
        &stagecraft_ops::ADD,
        &OpAttrs::new(),
        &[param(n + q), one],
        location,
    )?;
    results.push(Value::node(next));
    fwd.results = results;

    // Reverse loop over (lists.., k, grads.., invariants..).
    let mut rstate: Vec<TensorMetadata> = std::iter::repeat_n(list.clone(), q).collect();
    rstate.push(count.clone());
    rstate.extend(body.params.iter().cloned());
    rstate.extend(invariants.iter().map(|&j| body.params[j].clone()));
    let mut rcond = Function::new(format!("{}_reverse_cond", body.name), rstate.clone());
    let zero = int(&mut rcond, 0);
    rcond.results = vec![Value::node(rcond.add_op(
        &GREATER,
        &OpAttrs::new(),
        &[param(q), zero],
        location,
    )?)];
    let mut rbody = Function::new(format!("{}_reverse", body.name), rstate);
    let item_metas = stacked
        .iter()
        .map(|&j| body.params[j].clone())
        .chain(split.residuals.iter().cloned());
    let mut rest = Vec::with_capacity(q);
    let mut items = Vec::with_capacity(q);
    for (t, meta) in item_metas.enumerate() {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dtype("item_dtype", meta.dtype)
            .set_dims("item_shape", meta.shape.dims());
        let node = rbody.add_op(&LIST_POP, &attrs, &[param(t)], location)?;
        rest.push(Value::Output {
            node: node as u32,
            output: 0,
        });
        items.push(Value::Output {
            node: node as u32,
            output: 1,
        });
    }
    let mut args: Vec<Value> = Vec::with_capacity(n + m + n);
    for j in 0..n {
        let v = if let Some(t) = stacked.iter().position(|&s| s == j) {
            items[t]
        } else if let Some(i) = invariants.iter().position(|&s| s == j) {
            param(q + 1 + n + i)
        } else {
            // Not read by the backward half: any value of the type will do.
            placeholders(&mut rbody, &body.params[j..=j], location)[0]
        };
        args.push(v);
    }
    args.extend_from_slice(&items[stacked.len()..]);
    args.extend((q + 1..q + 1 + n).map(param));
    let grads = call_node(
        &mut rbody,
        split.backward.clone().register(),
        &args,
        location,
    )?;
    let one = int(&mut rbody, 1);
    let k = rbody.add_op(&SUB, &OpAttrs::new(), &[param(q), one], location)?;
    let mut results = rest;
    results.push(Value::node(k));
    results.extend(grads);
    results.extend((0..invariants.len()).map(|i| param(q + 1 + n + i)));
    rbody.results = results;

    let plan = Arc::new(WhileResiduals {
        state: n,
        lists: q,
        invariants,
        reverse_cond: rcond.register(),
        reverse_body: rbody.register(),
    });
    let mut extra_inputs: Vec<TensorMetadata> = std::iter::repeat_n(list, q).collect();
    extra_inputs.push(count);
    let form = WhileForm {
        cond: cond.register(),
        body: fwd.register(),
        extra_inputs,
        plan: plan.clone(),
    };
    let mut cache = residual_cache();
    cache.while_plans.insert((form.cond, form.body), plan);
    Ok(cache
        .whiles
        .entry((cond_id, body_id))
        .or_insert(form)
        .clone())
}

fn form(op: &'static OpDef, attrs: &OpAttrs) -> Result<Option<ResidualForm>> {
    let attrs_of = Attrs::new(attrs, op);
    if std::ptr::eq(op, &stagecraft_ops::IF) {
        let form = if_form(attrs_of.func("then_branch")?, attrs_of.func("else_branch")?)?;
        let mut attrs = attrs.clone();
        attrs
            .set_func("then_branch", form.then_forward)
            .set_func("else_branch", form.else_forward);
        return Ok(Some(ResidualForm {
            op,
            attrs,
            results: form.plan.results,
            extra_inputs: Vec::new(),
        }));
    }
    if std::ptr::eq(op, &stagecraft_ops::WHILE) {
        let form = while_form(attrs_of.func("cond")?, attrs_of.func("body")?)?;
        let mut attrs = attrs.clone();
        attrs
            .set_func("cond", form.cond)
            .set_func("body", form.body);
        return Ok(Some(ResidualForm {
            op,
            attrs,
            results: form.plan.state,
            extra_inputs: form.extra_inputs,
        }));
    }
    Ok(None)
}

/// The residual transforms this layer provides to gradient rules and to
/// the autodiff tape.
pub(crate) fn residual_hooks() -> ResidualHooks {
    ResidualHooks {
        form,
        if_plan: |then_branch, else_branch| {
            residual_cache()
                .if_plans
                .get(&(then_branch, else_branch))
                .copied()
        },
        while_plan: |cond, body| residual_cache().while_plans.get(&(cond, body)).cloned(),
    }
}
