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
