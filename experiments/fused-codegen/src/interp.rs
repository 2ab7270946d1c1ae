//! stagecraft's own `FusedElementwise` kernel, instantiated and called the
//! way the executor does it: factory from the CPU kernel registry (once per
//! op, attributes and input types), then one call per execution with owned
//! inputs and the output metadata the op's metadata function promised.

use stagecraft_cpu::{Inputs, Kernel, KernelContext};
use stagecraft_ops::{Attrs, OpAttrs, FUSED_ELEMENTWISE};
use stagecraft_tensor::{DType, DenseHostTensor, Error, Result, TensorMetadata};

/// An instantiated interpreter kernel.
pub struct Interpreter {
    kernel: Kernel,
    attrs: OpAttrs,
    output: TensorMetadata,
}

impl Interpreter {
    /// Instantiates the kernel for `program` over inputs of `metas`. This
    /// is the interpreter's whole "compile" step: decoding the program and
    /// assigning register slots.
    pub fn new(program: &[i64], metas: &[TensorMetadata]) -> Result<Interpreter> {
        let mut attrs = OpAttrs::new();
        attrs.set_ints("program", program);
        let factory = stagecraft_cpu::registry()
            .get(&FUSED_ELEMENTWISE)
            .ok_or_else(|| Error::internal("no CPU FusedElementwise kernel"))?;
        let kernel = factory(&Attrs::new(&attrs, &FUSED_ELEMENTWISE), metas)?;
        let shape = metas
            .iter()
            .map(|m| m.shape.clone())
            .find(|s| s.rank() > 0)
            .unwrap_or_default();
        Ok(Interpreter {
            kernel,
            attrs,
            output: TensorMetadata::new(DType::F32, shape),
        })
    }

    /// Runs the kernel once. The inputs are cloned the way the executor
    /// hands them over: reference-counted buffers, no element copies.
    pub fn run(&self, inputs: &[DenseHostTensor]) -> Result<DenseHostTensor> {
        let ctx = KernelContext {
            attrs: Attrs::new(&self.attrs, &FUSED_ELEMENTWISE),
            outputs: std::slice::from_ref(&self.output),
        };
        let owned: Inputs = inputs.iter().cloned().collect();
        let mut outs = (self.kernel)(owned, &ctx)?;
        outs.pop()
            .ok_or_else(|| Error::internal("the fused kernel returned no output"))
    }
}
