//! Reverse mode as a transformation of the IR: the gradient function of
//! `f(params) -> results` is `f'(params, result grads) -> param grads`. It
//! recomputes `f`'s forward nodes, then walks them in reverse calling each
//! op's gradient rule through a [`GradBuilder`] that appends nodes. Control
//! flow inside `f` differentiates through the `If`/`Call` rules, which ask
//! for the gradient functions of their branches in turn.

use crate::{Function, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::func::FuncId;
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
        let scalar = ScalarHostTensor::new(Scalar::F64(value).cast(meta.dtype), meta.shape.clone());
        let node = self.f.add_const(HostTensor::Scalar(scalar), self.location);
        Ok(self.push(Value::node(node)))
    }
}

/// The gradient function of `f`: parameters `f.params ++ (one gradient per
/// result)`, results one gradient per parameter (zeros where none flows).
pub fn gradient_function(f: &Function) -> Result<Function> {
    let np = f.params.len();
    let mut params = f.params.clone();
    params.extend(f.result_metas());
    let mut g = Function::new(format!("{}_grad", f.name), params);
    // Recompute the forward values.
    let mut map: Vec<u32> = Vec::with_capacity(f.nodes.len());
    let remap = |v: Value, map: &[u32]| match v {
        Value::Param(i) => Value::Param(i),
        Value::Output { node, output } => Value::Output {
            node: map[node as usize],
            output,
        },
    };
    for node in &f.nodes {
        let mut copy = node.clone();
        copy.inputs = node.inputs.iter().map(|v| remap(*v, &map)).collect();
        map.push(g.push(copy) as u32);
    }
    let location = f
        .nodes
        .first()
        .map_or_else(Location::caller, |n| n.location);
    let mut grads: HashMap<Value, Value> = HashMap::new();
    let add = |g: &mut Function, a: Value, b: Value, loc: Location| -> Result<Value> {
        Ok(Value::node(g.add_op(
            &stagecraft_ops::ADD,
            &OpAttrs::new(),
            &[a, b],
            loc,
        )?))
    };
    for (j, r) in f.results.iter().enumerate() {
        let seed = Value::Param((np + j) as u32);
        let total = match grads.remove(r) {
            Some(prev) => add(&mut g, prev, seed, location)?,
            None => seed,
        };
        grads.insert(*r, total);
    }
    for (i, node) in f.nodes.iter().enumerate().rev() {
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
        let rule = def.grad.ok_or_else(|| {
            Error::invalid(format!("{} has no gradient rule", def.name))
                .with_op(def.name)
                .at(node.location)
        })?;
        let mut b = IrBuilder {
            f: &mut g,
            values: Vec::new(),
            location: node.location,
        };
        let inputs: SmallVec<[G; 4]> = node
            .inputs
            .iter()
            .map(|v| b.push(remap(*v, &map)))
            .collect();
        let outputs: SmallVec<[G; 1]> = (0..node.outputs.len() as u32)
            .map(|o| {
                b.push(Value::Output {
                    node: map[i],
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
            attrs: Attrs::new(attrs, def),
        };
        let input_grads = rule(&mut b, &ctx).map_err(|e| e.with_op(def.name).at(node.location))?;
        let produced: Vec<Option<Value>> = input_grads
            .iter()
            .map(|g| g.map(|g| b.values[g.0 as usize]))
            .collect();
        for (input, gv) in node.inputs.iter().zip(produced) {
            let Some(gv) = gv else { continue };
            let total = match grads.remove(input) {
                Some(prev) => add(&mut g, prev, gv, node.location)?,
                None => gv,
            };
            grads.insert(*input, total);
        }
    }
    let mut results = Vec::with_capacity(np);
    for (p, meta) in f.params.iter().enumerate() {
        let v = match grads.get(&Value::Param(p as u32)) {
            Some(v) => *v,
            None => {
                let zeros =
                    ScalarHostTensor::new(Scalar::F64(0.0).cast(meta.dtype), meta.shape.clone());
                Value::node(g.add_const(HostTensor::Scalar(zeros), location))
            }
        };
        results.push(v);
    }
    g.results = results;
    Ok(g)
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
    use stagecraft_ops::{CALL, GREATER, LESS, SUB, WHILE};
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
    let location = b
        .nodes
        .first()
        .map_or_else(Location::caller, |node| node.location);
    let params = |extra: &[TensorMetadata], more: &[TensorMetadata]| -> Vec<TensorMetadata> {
        all.iter().chain(extra).chain(more).cloned().collect()
    };
    let state =
        |from: usize| -> Vec<Value> { (from..from + n).map(|i| Value::Param(i as u32)).collect() };
    let call = |f: &mut Function, id: FuncId, args: &[Value]| -> Result<Vec<Value>> {
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", id);
        let node = f.add_op(&CALL, &attrs, args, location)?;
        Ok((0..f.nodes[node].outputs.len() as u32)
            .map(|output| Value::Output {
                node: node as u32,
                output,
            })
            .collect())
    };
    let int = |f: &mut Function, v: i64| -> Value {
        Value::node(f.add_const(
            HostTensor::Scalar(ScalarHostTensor::new(
                Scalar::I64(v),
                stagecraft_tensor::Shape::scalar(),
            )),
            location,
        ))
    };
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
