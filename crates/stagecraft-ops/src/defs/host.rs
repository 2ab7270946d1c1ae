//! `HostCall`: runs a Rust closure of the host program on a tensor's
//! values. Staged code places it on the host device, so partitioning puts a
//! `Send` before it and a `Recv` after it, and graph work that does not
//! need its result runs while the closure runs. The closure itself lives in
//! a process-wide registry under the `callback` attribute.

use super::one;
use crate::attrs::AttrKind;
use crate::op::*;
use stagecraft_tensor::{DenseHostTensor, Error, Result, Shape, TensorMetadata};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

/// A host closure over dense values; its result must have the metadata the
/// op promised.
pub type HostCallback = Arc<dyn Fn(DenseHostTensor) -> Result<DenseHostTensor> + Send + Sync>;

fn callbacks() -> &'static RwLock<HashMap<i64, HostCallback>> {
    static CALLBACKS: OnceLock<RwLock<HashMap<i64, HostCallback>>> = OnceLock::new();
    CALLBACKS.get_or_init(Default::default)
}

/// Registers `callback` and returns the id a `HostCall` names it by. Ids
/// are never reused: a graph function keeps naming the closure it was
/// traced with for the process lifetime, like library functions.
pub fn register_host_callback(callback: HostCallback) -> i64 {
    static NEXT: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    callbacks()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, callback);
    id
}

/// The closure registered under `id`.
pub fn host_callback(id: i64) -> Result<HostCallback> {
    callbacks()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .cloned()
        .ok_or_else(|| Error::attribute(format!("no host closure is registered as {id}")))
}

fn host_call_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    host_callback(attrs.int("callback")?)?;
    let shape = Shape::new(&attrs.dims("shape")?);
    shape.checked_numel()?;
    one(TensorMetadata::new(attrs.dtype("dtype")?, shape))
}

/// Runs the host closure `callback` on `x`; the output has `dtype` and
/// `shape`. Side-effecting: host code may observe the world, so it is
/// never folded, merged or dropped.
pub static HOST_CALL: OpDef = OpDef {
    name: "HostCall",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("callback", AttrKind::Int),
        AttrSpec::required("dtype", AttrKind::DType),
        AttrSpec::required("shape", AttrKind::Ints),
    ],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: host_call_meta,
    grad: None,
};
