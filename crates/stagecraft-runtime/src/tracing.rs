//! Tracing closures into graph functions (the FuncGraph of cond_v2 and
//! tf.function).
//!
//! While a frame is open on a thread, every op placed on that thread goes to
//! the tracer device, whose handler appends a node to the frame's function
//! and returns symbolic handles instead of running anything. Tensors from
//! outside the frame (eager tensors, lazy tensors, values of an enclosing
//! frame) are captured: small concrete ones become constants, the rest
//! become extra parameters that the caller passes in.

use crate::device::Device;
use crate::handle::{TensorHandle, TracedValue};
use crate::op_handler::{OpHandler, OpInvocation, Results};
use smallvec::SmallVec;
use stagecraft_graph::{Function, Node, NodeOp, Value};
use stagecraft_ops::ShapeKind;
use stagecraft_tensor::{Error, HostTensor, Location, Result, TensorMetadata};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Concrete captured tensors with at most this many elements are baked into
/// the function as constants (Rust numbers turned into scalars); larger ones
/// become parameters.
pub const CONST_CAPTURE_LIMIT: usize = 16;

struct Frame {
    id: u64,
    function: Function,
    /// Handles from outside the frame, one per parameter beyond the
    /// declared ones.
    captures: Vec<TensorHandle>,
    declared: usize,
    /// Outside tensors that must stay parameters even when small (the
    /// caller's autodiff tracks them, so their identity matters).
    keep_as_param: Option<fn(&TensorHandle) -> bool>,
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

static NEXT_FRAME: AtomicU64 = AtomicU64::new(1);

/// A traced function and the outside tensors its extra parameters capture
/// (parameters `declared..` in order).
pub struct Traced {
    /// The function.
    pub function: Function,
    /// The captured tensors.
    pub captures: Vec<TensorHandle>,
}

/// Gives several traced functions one parameter list, as an `If`'s
/// branches or a `While`'s condition and body need: the first `fixed`
/// parameters stay as they are, then comes the union of all captures (in
/// order of first appearance), which the op receives as extra inputs.
/// Returns that union; each function's `captures` becomes it.
pub fn unify_captures(fixed: usize, traced: &mut [&mut Traced]) -> Vec<TensorHandle> {
    let mut union: Vec<TensorHandle> = Vec::new();
    for t in traced.iter() {
        for c in &t.captures {
            if !union.iter().any(|u| u.ptr_eq(c)) {
                union.push(c.clone());
            }
        }
    }
    for t in traced.iter_mut() {
        let mut params: Vec<TensorMetadata> = t.function.params[..fixed].to_vec();
        params.extend(union.iter().map(|u| u.metadata().clone()));
        let positions: Vec<u32> = t
            .captures
            .iter()
            .map(|c| (fixed + union.iter().position(|u| u.ptr_eq(c)).unwrap_or(0)) as u32)
            .collect();
        t.function.rebind_params(params, |i| {
            if (i as usize) < fixed {
                i
            } else {
                positions[i as usize - fixed]
            }
        });
        t.captures = union.clone();
    }
    union
}

/// True while this thread is tracing a function.
pub fn is_tracing() -> bool {
    FRAMES.with(|f| !f.borrow().is_empty())
}

/// The device whose handler records ops into the innermost open frame.
pub fn tracer_device() -> Device {
    static TRACER: OnceLock<Device> = OnceLock::new();
    *TRACER.get_or_init(|| {
        Device::register("trace", Arc::new(TracerHandler))
            .expect("the tracer device is registered once")
    })
}

/// Opens a frame for a function named `name` with declared parameters
/// `params`; returns one symbolic handle per parameter. Every op this thread
/// places until [`end`] is recorded into the frame.
pub fn begin(name: &str, params: &[TensorMetadata]) -> Vec<TensorHandle> {
    begin_with(name, params, None)
}

/// [`begin`], with a predicate naming outside tensors that must become
/// parameters rather than baked constants.
pub fn begin_with(
    name: &str,
    params: &[TensorMetadata],
    keep_as_param: Option<fn(&TensorHandle) -> bool>,
) -> Vec<TensorHandle> {
    let id = NEXT_FRAME.fetch_add(1, Ordering::Relaxed);
    let device = tracer_device();
    let handles = params
        .iter()
        .enumerate()
        .map(|(i, m)| {
            TensorHandle::traced(
                device,
                m.clone(),
                TracedValue {
                    frame: id,
                    value: Value::Param(i as u32),
                },
            )
        })
        .collect();
    FRAMES.with(|f| {
        f.borrow_mut().push(Frame {
            id,
            function: Function::new(name, params.to_vec()),
            captures: Vec::new(),
            declared: params.len(),
            keep_as_param,
        })
    });
    handles
}

/// Closes the innermost frame with `results` as the function's results.
/// A result that holds an error (an op inside failed) returns that error.
pub fn end(results: &[TensorHandle], location: Location) -> Result<Traced> {
    let mut frame = FRAMES
        .with(|f| f.borrow_mut().pop())
        .ok_or_else(|| Error::internal("tracing::end without a matching begin"))?;
    for handle in results {
        if let Some(e) = handle.resolved_error() {
            return Err(e.clone());
        }
    }
    let values = results
        .iter()
        .map(|h| value_of(&mut frame, h, location))
        .collect::<Result<Vec<_>>>()?;
    frame.function.results = values;
    debug_assert_eq!(
        frame.function.params.len(),
        frame.declared + frame.captures.len()
    );
    Ok(Traced {
        function: frame.function,
        captures: frame.captures,
    })
}

/// Closes the innermost frame without a result (the closure panicked or the
/// caller gave up).
pub fn abandon() {
    FRAMES.with(|f| f.borrow_mut().pop());
}

/// The value of `handle` inside `frame`, capturing it if it comes from
/// outside.
fn value_of(frame: &mut Frame, handle: &TensorHandle, location: Location) -> Result<Value> {
    if let Some(t) = handle.traced_value() {
        if t.frame == frame.id {
            return Ok(t.value);
        }
    }
    if let Some(i) = frame.captures.iter().position(|c| c.ptr_eq(handle)) {
        return Ok(Value::Param((frame.declared + i) as u32));
    }
    let meta = handle.metadata().clone();
    let concrete = handle.traced_value().is_none() && handle.is_resolved();
    // A concrete value on the tracer device was made inside the closure
    // (`Tensor::from_vec(.., &x.device())`): it is part of the function
    // whatever its size. As a parameter, the caller would have to pass a
    // handle that lives on no device it can run on.
    let made_inside = concrete && handle.device() == tracer_device();
    // A value in device memory (on a GPU, or a lazy GPU value read early)
    // stays a parameter: baking it would read it back while tracing.
    let in_device_memory = concrete
        && matches!(
            handle.wait_value(),
            Ok(stagecraft_tensor::TensorValue::Device(_))
        );
    let small_concrete = concrete
        && !in_device_memory
        && meta.shape.numel() <= CONST_CAPTURE_LIMIT
        && !frame.keep_as_param.is_some_and(|keep| keep(handle));
    if made_inside || small_concrete {
        let value: HostTensor = handle.wait()?.clone();
        let node = frame.function.add_const(value, location);
        return Ok(Value::node(node));
    }
    frame.function.params.push(meta);
    frame.captures.push(handle.clone());
    Ok(Value::Param((frame.function.params.len() - 1) as u32))
}

struct TracerHandler;

impl OpHandler for TracerHandler {
    fn name(&self) -> &str {
        "trace"
    }

    fn captures_foreign_args(&self) -> bool {
        true
    }

    fn execute(&self, mut inv: OpInvocation<'_>) -> Results {
        // Staged side effects are ordered by the function's own execution.
        inv.release_chain();
        let OpInvocation {
            op,
            device,
            location,
            args,
            attrs,
            outputs,
            ..
        } = inv;
        let recorded = FRAMES.with(|frames| -> Result<Results> {
            let mut frames = frames.borrow_mut();
            let frame = frames
                .last_mut()
                .ok_or_else(|| Error::internal("an op reached the tracer outside a trace"))?;
            if op.shape_kind == ShapeKind::DataDependent {
                return Err(Error::invalid(format!(
                    "{} has a data-dependent output shape and cannot be staged into a function",
                    op.name
                )));
            }
            let inputs = args
                .iter()
                .map(|a| value_of(frame, a, location))
                .collect::<Result<SmallVec<[Value; 4]>>>()?;
            let placed = crate::context::scoped_device().filter(|d| *d != device);
            let index = frame.function.push(Node {
                op: NodeOp::Op(op, attrs.freeze()),
                inputs,
                outputs: outputs.clone(),
                device: placed.map(|d| d.name().to_string()),
                location,
                origin: None,
            });
            Ok(outputs
                .iter()
                .enumerate()
                .map(|(o, meta)| {
                    TensorHandle::traced(
                        device,
                        meta.clone(),
                        TracedValue {
                            frame: frame.id,
                            value: Value::Output {
                                node: index as u32,
                                output: o as u32,
                            },
                        },
                    )
                })
                .collect())
        });
        recorded.unwrap_or_else(|e| {
            let e = e.with_op(op.name).at(location);
            crate::runtime::report_error(&e);
            outputs
                .iter()
                .map(|m| TensorHandle::error(device, m.clone(), e.clone()))
                .collect()
        })
    }
}
