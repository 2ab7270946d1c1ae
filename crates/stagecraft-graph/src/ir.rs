//! The IR data structures.

use smallvec::SmallVec;
use stagecraft_ops::func::{self, FuncId, FunctionSignature};
use stagecraft_ops::{AttrValue, FrozenOpAttrs, OpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{Error, HostTensor, Location, Result, TensorMetadata};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// A value in a function: a parameter, or one output of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Value {
    /// The function's parameter with this index.
    Param(u32),
    /// Output `output` of node `node` (an index into [`Function::nodes`]).
    Output {
        /// The producing node.
        node: u32,
        /// Which of its outputs.
        output: u32,
    },
}

impl Value {
    /// The first output of `node`.
    pub fn node(node: usize) -> Value {
        Value::Output {
            node: node as u32,
            output: 0,
        }
    }
}

/// What a node computes.
#[derive(Clone, Debug)]
pub enum NodeOp {
    /// A registered op with its attributes.
    Op(&'static OpDef, FrozenOpAttrs),
    /// A constant value baked into the function.
    Const(HostTensor),
}

impl NodeOp {
    /// The op definition, or `None` for a constant.
    pub fn def(&self) -> Option<&'static OpDef> {
        match self {
            NodeOp::Op(def, _) => Some(def),
            NodeOp::Const(_) => None,
        }
    }

    /// The printed name: the op's name, or `Const`.
    pub fn name(&self) -> &'static str {
        match self {
            NodeOp::Op(def, _) => def.name,
            NodeOp::Const(_) => "Const",
        }
    }

    /// The library functions this node refers to (branches, bodies,
    /// callees).
    pub fn functions(&self) -> SmallVec<[FuncId; 2]> {
        match self {
            NodeOp::Op(_, attrs) => attrs
                .iter()
                .filter_map(|(_, v)| match v {
                    AttrValue::Func(id) => Some(id),
                    _ => None,
                })
                .collect(),
            NodeOp::Const(_) => SmallVec::new(),
        }
    }
}

/// One node: an op applied to values, with the metadata of its outputs.
#[derive(Clone, Debug)]
pub struct Node {
    /// The op or constant.
    pub op: NodeOp,
    /// The inputs, in the op's order.
    pub inputs: SmallVec<[Value; 4]>,
    /// Metadata of each output, as the op's metadata function computed it.
    pub outputs: OutputMetas,
    /// An explicit device placement (`"cpu:1"`), if the user asked for one.
    pub device: Option<String>,
    /// The user's source line that created the node.
    pub location: Location,
    /// For a node of a lazy trace: the index of the recorded op (the trace
    /// entry) it computes. A compiled trace is cached by structure and run
    /// again for later recordings made from other source lines, so
    /// `location` is only the line of the recording it was compiled from;
    /// a run resolves the current recording's line through this index
    /// (see `Executable::run_recorded` in the runtime). Passes carry it
    /// along with `location`, so that a rewritten node (a fused kernel, a
    /// merged duplicate) names the same op the unoptimized trace would.
    /// `None` for nodes of ordinary functions.
    pub origin: Option<u32>,
}

/// Registered functions by [`structural_hash`].
static INTERNED: std::sync::OnceLock<
    std::sync::Mutex<std::collections::HashMap<u64, SmallVec<[FuncId; 1]>>>,
> = std::sync::OnceLock::new();

fn hash_const(value: &HostTensor, h: &mut impl Hasher) {
    value.metadata().hash(h);
    match value {
        HostTensor::Dense(t) => t.buffer().bytes().hash(h),
        HostTensor::Scalar(t) => t.value().to_bits().hash(h),
        HostTensor::List(l) => l.len().hash(h),
    }
}

/// A hash of everything that makes two functions the same: name,
/// signature, nodes (ops, attributes, wiring, constants, devices and source
/// locations) and results.
fn structural_hash(f: &Function) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    f.name.hash(&mut h);
    f.params.hash(&mut h);
    f.results.hash(&mut h);
    for node in &f.nodes {
        match &node.op {
            NodeOp::Op(def, attrs) => {
                (*def as *const OpDef as usize).hash(&mut h);
                attrs.hash(&mut h);
            }
            NodeOp::Const(value) => hash_const(value, &mut h),
        }
        node.inputs.hash(&mut h);
        node.outputs.hash(&mut h);
        node.device.hash(&mut h);
        node.location.hash(&mut h);
        node.origin.hash(&mut h);
    }
    h.finish()
}

fn same_structure(a: &Function, b: &Function) -> bool {
    a.name == b.name
        && a.params == b.params
        && a.results == b.results
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(|(x, y)| {
            let same_op = match (&x.op, &y.op) {
                (NodeOp::Op(d1, a1), NodeOp::Op(d2, a2)) => std::ptr::eq(*d1, *d2) && a1 == a2,
                (NodeOp::Const(c1), NodeOp::Const(c2)) => c1.same_value(c2),
                _ => false,
            };
            same_op
                && x.inputs == y.inputs
                && x.outputs == y.outputs
                && x.device == y.device
                && x.location == y.location
                && x.origin == y.origin
        })
}

/// A graph function: parameters, nodes in a topological order (every input
/// of a node is a parameter or an output of an earlier node), and results.
#[derive(Clone, Debug)]
pub struct Function {
    /// The printed name (`@name`).
    pub name: String,
    /// Parameter metadata.
    pub params: Vec<TensorMetadata>,
    /// The nodes, in topological order.
    pub nodes: Vec<Node>,
    /// The values the function returns.
    pub results: Vec<Value>,
}

impl Function {
    /// An empty function with the given parameters.
    pub fn new(name: impl Into<String>, params: Vec<TensorMetadata>) -> Function {
        Function {
            name: name.into(),
            params,
            nodes: Vec::new(),
            results: Vec::new(),
        }
    }

    /// The metadata of a value.
    ///
    /// # Panics
    /// If the value does not exist in this function (run [`crate::verify()`]
    /// on functions of unknown origin first).
    pub fn meta(&self, value: Value) -> &TensorMetadata {
        match value {
            Value::Param(i) => &self.params[i as usize],
            Value::Output { node, output } => &self.nodes[node as usize].outputs[output as usize],
        }
    }

    /// The metadata of a value, or an error if it does not exist.
    pub fn try_meta(&self, value: Value) -> Result<&TensorMetadata> {
        let found = match value {
            Value::Param(i) => self.params.get(i as usize),
            Value::Output { node, output } => self
                .nodes
                .get(node as usize)
                .and_then(|n| n.outputs.get(output as usize)),
        };
        found.ok_or_else(|| Error::internal(format!("{value:?} does not exist in @{}", self.name)))
    }

    /// Appends an op node after checking it with the op's metadata function;
    /// returns the node's index.
    pub fn add_op(
        &mut self,
        def: &'static OpDef,
        attrs: &OpAttrs,
        inputs: &[Value],
        location: Location,
    ) -> Result<usize> {
        let metas: SmallVec<[TensorMetadata; 4]> = inputs
            .iter()
            .map(|v| self.try_meta(*v).cloned())
            .collect::<Result<_>>()?;
        let outputs = def
            .infer(&metas, attrs)
            .map_err(|e| e.with_op(def.name).at(location))?;
        Ok(self.push(Node {
            op: NodeOp::Op(def, attrs.freeze()),
            inputs: inputs.iter().copied().collect(),
            outputs,
            device: None,
            location,
            origin: None,
        }))
    }

    /// Appends a constant node; returns its index.
    pub fn add_const(&mut self, value: HostTensor, location: Location) -> usize {
        let meta = value.metadata().clone();
        self.push(Node {
            op: NodeOp::Const(value),
            inputs: SmallVec::new(),
            outputs: smallvec::smallvec![meta],
            device: None,
            location,
            origin: None,
        })
    }

    /// Appends a node as is (the caller guarantees its metadata).
    pub fn push(&mut self, node: Node) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The metadata of the results.
    pub fn result_metas(&self) -> Vec<TensorMetadata> {
        self.results.iter().map(|v| self.meta(*v).clone()).collect()
    }

    /// Parameter and result metadata.
    pub fn signature(&self) -> FunctionSignature {
        FunctionSignature {
            inputs: self.params.clone(),
            outputs: self.result_metas(),
        }
    }

    /// Adds the function to the process-wide library so that ops can name
    /// it in attributes.
    pub fn register(self) -> FuncId {
        // Functions named by If/Call ops can be differentiated from here on.
        stagecraft_ops::grad::set_gradient_transform(crate::autodiff::gradient_of_library_function);
        stagecraft_ops::grad::set_while_transform(crate::autodiff::while_gradient_loops);
        stagecraft_ops::grad::set_residual_hooks(crate::autodiff::residual_hooks());
        // An identical function registered before is reused: a `cond` in a
        // loop traces the same branches every iteration, and one id keeps
        // the library from growing and lazy traces and executables cached.
        let key = structural_hash(&self);
        let mut interned = INTERNED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let same = interned.get(&key).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|id| Function::lookup(*id).is_some_and(|f| same_structure(&f, &self)))
        });
        if let Some(id) = same {
            return id;
        }
        let signature = self.signature();
        let name = self.name.clone();
        let id = func::register_function(name, signature, Arc::new(Arc::new(self)));
        interned.entry(key).or_default().push(id);
        id
    }

    /// A library function, if `id` names a graph function.
    pub fn lookup(id: FuncId) -> Option<Arc<Function>> {
        let body = func::function_body(id)?;
        body.downcast_ref::<Arc<Function>>().cloned()
    }

    /// Replaces the parameter list, renumbering every use of parameter `i`
    /// to `map(i)` (used to give two branch functions one shared
    /// signature).
    pub fn rebind_params(&mut self, params: Vec<TensorMetadata>, map: impl Fn(u32) -> u32) {
        let rebind = |v: &mut Value| {
            if let Value::Param(i) = v {
                *i = map(*i);
            }
        };
        for node in &mut self.nodes {
            node.inputs.iter_mut().for_each(rebind);
        }
        self.results.iter_mut().for_each(rebind);
        self.params = params;
    }

    /// The number of uses of each value (results count as uses).
    pub fn use_counts(&self) -> (Vec<u32>, Vec<SmallVec<[u32; 1]>>) {
        let mut params = vec![0u32; self.params.len()];
        let mut outputs: Vec<SmallVec<[u32; 1]>> = self
            .nodes
            .iter()
            .map(|n| smallvec::smallvec![0; n.outputs.len()])
            .collect();
        let mut count = |v: &Value| match *v {
            Value::Param(i) => params[i as usize] += 1,
            Value::Output { node, output } => outputs[node as usize][output as usize] += 1,
        };
        for node in &self.nodes {
            node.inputs.iter().for_each(&mut count);
        }
        self.results.iter().for_each(&mut count);
        (params, outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_tensor::{DType, Scalar, ScalarHostTensor};

    fn scaled(by: f32) -> Function {
        let meta = TensorMetadata::new(DType::F32, [2]);
        let mut f = Function::new("scaled_for_interning", vec![meta]);
        let at = Location::new("src/ir_test.rs", 1, 1);
        let k = f.add_const(
            HostTensor::Scalar(ScalarHostTensor::new(Scalar::F32(by), [])),
            at,
        );
        let y = f
            .add_op(
                &stagecraft_ops::MUL,
                &OpAttrs::new(),
                &[Value::Param(0), Value::node(k)],
                at,
            )
            .unwrap();
        f.results = vec![Value::node(y)];
        f
    }

    #[test]
    fn registering_an_identical_function_reuses_its_id() {
        let a = scaled(2.0).register();
        assert_eq!(scaled(2.0).register(), a);
        assert_ne!(scaled(3.0).register(), a);
        let mut renamed = scaled(2.0);
        renamed.name = "another_name".into();
        assert_ne!(renamed.register(), a);
    }
}
